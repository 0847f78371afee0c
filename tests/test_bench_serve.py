"""`bench serve` without a model: targets, tables, plot, the passages file, flag errors."""

from __future__ import annotations

import json

import pytest

from ragcache.bench.datasets import QAExample
from ragcache.bench.report import render, write_result
from ragcache.bench.serve import serve_targets, write_passages


def _row(c: int, mode: str, rps: float, ttft: float) -> dict:
    return {"concurrency": c, "mode": mode, "requests": 8, "errors": 0, "wall_s": 8 / rps, "requests_per_s": rps,
            "output_tokens_per_s": rps * 16, "ttft_p50_s": ttft, "ttft_p90_s": ttft * 1.5,
            "server_ttft_p50_s": ttft * 0.9, "e2e_p50_s": ttft + 1, "prompt_tokens_mean": 1800.0,
            "cached_tokens_mean": 0.0 if mode == "full" else 1500.0, "first_error": None}


def test_targets_compare_blend_and_full_at_8_clients_and_the_server_with_the_sdk_at_1(tmp_path):
    rows = [_row(1, "full", 0.2, 5.0), _row(1, "blend", 1.0, 0.52), _row(8, "full", 0.25, 30.0),
            _row(8, "blend", 1.0, 4.0)]
    t = serve_targets(rows, sdk_p50=0.5)
    assert t["blend_vs_full_requests_per_s_at_8"]["value"] == 4.0 and t["blend_vs_full_requests_per_s_at_8"]["met"]
    assert t["blend_ttft_p50_speedup_at_8"]["value"] == 7.5 and t["blend_ttft_p50_speedup_at_8"]["met"]
    assert t["server_overhead_ttft_p50_at_1_s"]["value"] == pytest.approx(0.02)
    assert t["server_overhead_ttft_p50_at_1_s"]["met"] is True
    assert serve_targets(rows[:2], 0.5)["blend_ttft_p50_speedup_at_8"]["met"] is None  # C=8 not measured
    assert t["blend_ttft_p50_speedup_at_4"]["met"] is None and t["blend_vs_full_requests_per_s_at_4"]["min"] == 2.0

    result = {"benchmark": "serve", "n": 4, "top_k": 3, "max_tokens": 16, "requests_per_level": 8,
              "sdk": {"ttft_p50_s": 0.5}, "rows": rows, "targets": t,
              "blend_vs_full": [{"concurrency": 8, "requests_per_s": 4.0, "ttft_p50_speedup": 7.5}],
              "machine": {"cpu_count": 2}}
    text = render(result)
    assert "client TTFT p50" in text and "blend over full" in text and "targets" in text
    paths = write_result(result, tmp_path / "serve.json")
    assert paths["png"].stat().st_size > 1000 and "| C | mode |" in paths["md"].read_text()


def test_the_passages_file_is_read_as_one_document_per_distinct_passage(tmp_path):
    from ragcache.ingest.readers import JsonRecordsReader

    examples = [QAExample(0, "q0?", ["a"], [("", "alpha text"), ("", "beta text")]),
                QAExample(1, "q1?", ["b"], [("", "beta text"), ("T", "gamma text")])]
    path = write_passages(examples, tmp_path / "p.json")
    assert json.loads(path.read_text())[1]["ctxs"][1] == {"title": "T", "text": "gamma text"}
    docs = JsonRecordsReader().load_data(path)
    assert sorted(d.text for d in docs) == ["alpha text", "beta text", "gamma text"]


def test_bench_serve_flags_are_checked_before_anything_starts(tmp_path, capsys):
    from app.cli import main

    for bad in (["--concurrency", "0"], ["--requests", "0"], ["--modes", "full,fast"]):
        with pytest.raises(SystemExit):
            main(["bench", "serve", *bad, "--out", str(tmp_path / "r.json")])
        err = capsys.readouterr().err
        assert "expected" in err or "modes must be" in err
    assert main(["bench", "serve", "--dataset", str(tmp_path / "nope.json"), "--out", str(tmp_path / "r.json")]) == 2
    assert "not found" in capsys.readouterr().err and not (tmp_path / "r.json").exists()
