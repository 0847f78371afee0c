"""`ragcache cache stats|clear|verify` on a store in a temporary folder (no ~/.cache, no Redis)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from kv_fixtures import poison

from app.cli import main
from ragcache.kvstore import DiskTier, KVSpec, TieredStore
from ragcache.models import folder_fingerprint


@pytest.fixture
def setup(tmp_path):
    """A fake HF model folder (config.json only), a settings file pointing at it, two models' entries
    (in the default stored form, int8)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32}))
    kv_dir = tmp_path / "kv"
    settings = tmp_path / "settings.toml"
    settings.write_text(
        f'[models]\nmodel = "{model}"\ncache_dir = "{tmp_path / "models"}"\n'
        f'[store]\nssd_cache_dir = "{kv_dir}"\nremote_url = ""\nssd_cache_max_gb = 1.0\n'
    )
    spec = KVSpec.from_hf_config(model, folder_fingerprint(model))
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 8)
    other = KVSpec("someothermodel00", 1, 2, 2, 8)
    for s, keys in ((spec, ("a", "b", "c")), (other, ("x",))):
        store = TieredStore(s, [(DiskTier(kv_dir), 10**9)], kv_compression="int8")
        for key in keys:
            store.put(key, torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8), 0)
    return settings, DiskTier(kv_dir)


def test_cache_stats_json_reports_disk_occupancy_and_capacity(setup, capsys):
    settings, disk = setup
    assert main(["--settings", str(settings), "cache", "stats", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["tiers"]) == ["cpu", "disk"]
    assert out["tiers"]["disk"]["entries"] == 4 and out["tiers"]["disk"]["capacity_bytes"] == 10**9
    assert out["tiers"]["disk"]["occupancy_bytes"] == sum(f.size for f in disk.scan())


def test_cache_stats_table(setup, capsys):
    settings, _ = setup
    assert main(["--settings", str(settings), "cache", "stats"]) == 0
    out = capsys.readouterr().out
    assert "disk" in out and "1.0 GB" in out


def test_cache_verify_removes_corrupt_entries_and_keeps_other_models(setup, capsys):
    settings, disk = setup
    with open(disk.path("b"), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x00\x00\x01")
    assert main(["--settings", str(settings), "cache", "verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["tiers"]["disk"]
    assert (report["checked"], report["ok"], report["foreign"], report["corrupt"]) == (4, 2, 1, 1)
    assert report["removed"] == ["b"] and sorted(disk.keys()) == ["a", "c", "x"]


def test_cache_verify_names_an_entry_whose_scales_are_not_finite_behind_matching_checksums(setup, capsys):
    settings, disk = setup
    disk.path("a").write_bytes(poison(disk.path("a").read_bytes(), "v_scale.1", float("nan")))
    assert main(["--settings", str(settings), "cache", "verify"]) == 0
    out = capsys.readouterr().out
    assert "disk: checked 4, ok 2, other model/layout/form 1, corrupt 1 (removed)" in out
    assert "  removed a: non-finite values in v_scale.1" in out and sorted(disk.keys()) == ["b", "c", "x"]


def test_cache_clear_empties_the_disk_folder(setup, capsys):
    settings, disk = setup
    assert main(["--settings", str(settings), "cache", "clear"]) == 0
    assert "disk: removed 4 entries" in capsys.readouterr().out
    assert list(disk.keys()) == []


def test_cache_without_action_prints_help(capsys):
    assert main(["cache"]) == 2
    assert "stats" in capsys.readouterr().out


def test_cache_stats_sums_the_lookups_of_processes_that_have_ended_and_says_since_when(setup, capsys):
    from ragcache.config import Settings

    settings, disk = setup
    s = Settings.load(settings)
    model = Path(s.models.model)
    spec = KVSpec.from_hf_config(model, folder_fingerprint(model))
    worker = TieredStore.from_settings(s.store, spec=spec)  # as an engine's worker opens it
    assert worker.get("a")[1] == "disk"
    assert worker.get("missing") is None
    worker.close()  # its counts are written beside the disk tier
    assert main(["--settings", str(settings), "cache", "stats", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cumulative"] is True and out["since"] and out["updated"]
    assert (out["lookups"]["lookups"], out["lookups"]["hits"], out["lookups"]["misses"]) == (2, 1, 1)
    assert (out["tiers"]["disk"]["hits"], out["tiers"]["disk"]["misses"], out["tiers"]["cpu"]["hits"]) == (1, 1, 0)
    assert main(["--settings", str(settings), "cache", "stats"]) == 0
    text = capsys.readouterr().out
    assert "chunk lookups: 2 (all processes since" in text and "miss" in text
    assert main(["--settings", str(settings), "cache", "stats", "--reset", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lookups"]["lookups"] == 0


def test_cache_clear_of_one_namespace_keeps_the_others(setup, capsys):
    settings, disk = setup
    store = TieredStore(None, [(disk, 10**9)])
    for key in ("default:n1", "default/acme:n2", "default/other:n3"):
        item = disk.get("a")
        disk.put(type(item)(key, item.meta, item.kv))
    assert main(["--settings", str(settings), "cache", "stats"]) == 0
    assert "disk entries per namespace: (none) 4, default 1, default/acme 1, default/other 1" in capsys.readouterr().out
    assert main(["--settings", str(settings), "cache", "clear", "--namespace", "default/acme"]) == 0
    assert "disk: removed 1 entries of namespace default/acme" in capsys.readouterr().out
    assert sorted(disk.keys()) == ["a", "b", "c", "default/other:n3", "default:n1", "x"]
    assert main(["--settings", str(settings), "cache", "clear", "--namespace", "nobody"]) == 0
    assert "no entries in namespace nobody; namespaces stored: default, default/other" in capsys.readouterr().err
    store.close()


def test_cache_stats_shows_bytes_per_token_per_tier_and_the_compression_in_use(setup, capsys):
    settings, disk = setup
    assert main(["--settings", str(settings), "cache", "stats", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fp = out["footprint"]["disk"]
    assert (fp["entries"], fp["sampled"], fp["tokens"], fp["forms"]) == (4, 4, 20, {"int8": 4})
    assert fp["bytes_per_token"] == pytest.approx(sum(f.size for f in disk.scan()) / 20, abs=0.1)
    assert out["compression"]["form"] == "int8" and out["compression"]["bytes_per_token"] > 0
    assert out["compression"]["bytes_per_token"] < 0.5 * out["compression"]["float32_bytes_per_token"]
    assert main(["--settings", str(settings), "cache", "stats"]) == 0
    text = capsys.readouterr().out
    assert "B/token" in text and "compression: int8 (K per channel, V per token" in text
    assert f"{fp['bytes_per_token']:.0f}" in text
