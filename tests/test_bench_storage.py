"""ragcache.bench.storage without an engine: bytes of real entries, codec rates, the summary against
uncompressed KV, the targets and the tables."""

from __future__ import annotations

import pytest
import torch

from ragcache.bench.report import render
from ragcache.bench.storage import _codec_rates, _footprint, _summary, _targets, cost_table
from ragcache.kvstore import DiskTier, KVSpec, TieredStore

SPEC = KVSpec("5t0rage000000000", 1, num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)


def _fill(folder, form: str, tokens=(30, 50)) -> list[str]:
    store = TieredStore(SPEC, [(DiskTier(folder), 10**9)], kv_compression=form)
    keys = []
    for i, n in enumerate(tokens):
        g = torch.Generator().manual_seed(i)
        shape = (4, n, 2, 16)
        store.put(f"c{i}", torch.randn(shape, generator=g), torch.randn(shape, generator=g), 0)
        keys.append(f"c{i}")
    store.close()
    return keys


def test_footprint_counts_real_file_bytes_against_float32_and_16_bit_of_the_same_chunks(tmp_path):
    sizes = {form: _footprint(tmp_path / form, form, _fill(tmp_path / form, form)) for form in ("none", "int8")}
    none, int8 = sizes["none"], sizes["int8"]
    assert none["tokens"] == int8["tokens"] == 80 and none["entries"] == 2
    assert none["stored_bytes"] == sum(f.size for f in DiskTier(tmp_path / "none").scan())
    assert none["vs_16bit"] == pytest.approx(1.0)  # stored in the spec's bfloat16
    assert 0.45 < none["vs_fp32"] < 0.55
    assert 0.25 < int8["vs_fp32"] < 0.32  # a tiny head size: the scales and the header weigh more


def test_codec_rates_run_each_quantised_form_over_the_uncompressed_entries(tmp_path):
    keys = _fill(tmp_path, "none")
    rows = _codec_rates(tmp_path, keys, SPEC, ["none", "int8", "int4"], reads=1)
    assert [r["form"] for r in rows] == ["int8", "int4"]
    for r in rows:
        assert r["compress_mb_s"] > 0 and r["decompress_mb_s"] > 0 and 0 < r["zlib_size_vs_quantised"] < 1.1
        assert r["model_dtype_mb"] == pytest.approx(2 * 4 * 80 * 2 * 16 * 2 / 1e6, abs=1e-3)


def _q(example, blend, reuse, nll):
    return {"example": example, "blend_kl": blend, "reuse_kl": reuse, "blend_gold_nll": nll, "reuse_gold_nll": nll,
            "full_gold_nll": 1.0}


def _r(form, tier, ttft, example=0):
    return {"form": form, "tier": tier, "example": example, "repeat": 0, "ttft_s": ttft}


def test_summary_and_targets_compare_each_form_with_uncompressed():
    forms = ["none", "int8", "int4"]
    quality = {"none": [_q(0, 0.2, 0.4, 2.0), _q(1, 0.4, 0.6, 2.0)],
               "int8": [_q(0, 0.21, 0.41, 2.01), _q(1, 0.42, 0.62, 2.01)],
               "int4": [_q(0, 0.3, 0.7, 2.2), _q(1, 0.6, 0.9, 2.2)]}
    rows = [_r(f, t, x) for f, xs in (("none", (1.0, 2.0, 3.0)), ("int8", (1.02, 1.6, 1.8)), ("int4", (1.1, 1.1, 1.5)))
            for t, x in zip(("cpu", "disk-cold", "remote"), xs)]
    sizes = [{"form": "none", "bytes_per_token": 23050.0, "vs_fp32": 0.5001},
             {"form": "int8", "bytes_per_token": 11743.0, "vs_fp32": 0.2548},
             {"form": "int4", "bytes_per_token": 5983.0, "vs_fp32": 0.1298}]
    summary = _summary(forms, rows, quality, sizes)
    int8 = summary[1]
    assert int8["blend_kl_vs_none"] == pytest.approx(0.315 / 0.3, abs=1e-4)
    assert int8["cpu_ttft_vs_none"] == pytest.approx(1.02) and int8["remote_ttft_vs_none"] == pytest.approx(0.6)
    targets = _targets(summary, sizes)
    assert targets["stored_bytes_vs_fp32"]["value"] == 0.2548 and targets["stored_bytes_vs_fp32"]["met"] is False
    assert targets["blend_kl_vs_uncompressed"]["met"] is True and targets["cpu_ttft_vs_uncompressed"]["met"] is True
    assert targets["remote_ttft_vs_uncompressed"]["met"] is True  # 0.6 <= 1/1.5
    assert targets["disk_cold_ttft_vs_uncompressed"]["met"] is False  # 1.6 / 2.0 = 0.8 > 1/1.5
    assert targets["strong_bytes_vs_fp32"]["met"] is False
    result = {"benchmark": "storage", "n": 2, "passages": 10, "repeats": 1, "dtype": "bfloat16",
              "summary": summary, "targets": targets, "codec": [],
              "cost_table": cost_table("smollm2", SPEC)}
    text = render(result)
    assert "stored forms of chunk KV" in text and "what a corpus costs" in text
    assert "remote_ttft_vs_uncompressed" in text


def test_cost_table_gives_a_quarter_and_an_eighth_of_float32_plus_the_scales():
    rows = {(r["model"], r["form"]): r for r in cost_table("smollm2", KVSpec("x" * 16, 1, 30, 3, 64))}
    assert rows["smollm2", "none (float32)"]["vs_fp32"] == 1.0
    assert 0.25 < rows["smollm2", "int8"]["vs_fp32"] < 0.256 and 0.125 < rows["smollm2", "int4"]["vs_fp32"] < 0.131
    eight_b = [r for r in rows.values() if r["model"].startswith("8B")]
    assert {r["form"]: r["bytes_per_token"] for r in eight_b}["none (bfloat16)"] == pytest.approx(131072, rel=0.001)
