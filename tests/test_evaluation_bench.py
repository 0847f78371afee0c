"""Benchmarks on the real SmolLM2 through vLLM: a tiny `bench ttft` run and the quality helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ragcache import evaluation as ev
from tests.conftest import REPO, shared_data

pytestmark = pytest.mark.integration

SUMMARY_FIELDS = {
    "variant", "mode", "recompute_ratio", "n", "ttft_median_s", "ttft_p90_s", "ttft_mean_s", "speedup_median",
    "load_s_median", "worker_s_median", "kl_mean", "kl_median", "gold_nll_mean", "gold_nll_rel_full", "f1_mean",
    "rouge_l_mean", "em_mean", "agree_em_mean", "agree_rouge_l_mean", "agree_tokens_mean", "recomputed_frac_mean",
    "prompt_tokens_mean",
}
RECORD_FIELDS = {
    "ttft_s", "total_s", "load_s", "worker_s", "prompt_tokens", "ctx_tokens", "reused_tokens", "recomputed_tokens",
    "missing_computed_tokens", "num_cached_tokens", "output_tokens", "chunk_tiers", "answer", "recompute_ratio",
    "first_token", "kl_from_full", "gold_nll", "f1", "rouge_l", "em", "agree_em", "agree_rouge_l", "agree_tokens",
    "speedup",
}


def test_bench_ttft_cli_writes_every_mode_and_field(tmp_path):
    shared_data("musique/musique_s.json")
    out = tmp_path / "ttft.json"
    env = dict(os.environ, RAGCACHE_ENGINE__KV_CACHE_MEMORY_BYTES=str(1 << 30))
    cmd = [sys.executable, "-m", "app.cli", "bench", "ttft", "--dataset", "musique", "--n", "2", "--passages", "3",
           "--max-tokens", "4", "--ratios", "0", "--out", str(out), "--kv-dir", str(tmp_path / "kv")]
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TTFT and quality by mode" in r.stdout and "recompute-ratio sweep" in r.stdout

    res = json.loads(out.read_text())
    assert res["benchmark"] == "ttft" and res["n"] == 2 and res["machine"]["cpu_count"] >= 1
    assert set(res["modes"]) == {"full", "prefix", "reuse", "blend"}
    assert [s["recompute_ratio"] for s in res["sweep"]] == [0.0, 0.15]
    for s in [*res["modes"].values(), *res["sweep"]]:
        assert SUMMARY_FIELDS <= set(s), SUMMARY_FIELDS - set(s)
        assert s["n"] == 2 and s["ttft_median_s"] > 0 and s["gold_nll_mean"] > 0
    assert set(res["targets"]) == {"blend_ttft_speedup", "blend_nll_within", "blend_kl_vs_reuse"}
    for ex in res["examples"]:
        assert set(ex["results"]) == {"full", "prefix", "reuse", "blend@0", "blend@0.15"}
        assert sorted(ex["order"]) == sorted(ex["results"])
        for rec in ex["results"].values():
            assert RECORD_FIELDS <= set(rec), RECORD_FIELDS - set(rec)
        full, prefix = ex["results"]["full"], ex["results"]["prefix"]
        assert full["kl_from_full"] == 0.0 and prefix["kl_from_full"] < 1e-3  # prefix caching is exact
        assert ex["results"]["blend@0.15"]["recomputed_tokens"] > 0
        assert ex["results"]["reuse"]["kl_from_full"] > 0 and ex["results"]["reuse"]["recomputed_tokens"] == 0
        assert ex["results"]["prefix"]["num_cached_tokens"] > 0  # the warm-up filled vLLM's prefix cache
    assert res["examples"][0]["order"] != res["examples"][1]["order"]  # rotated
    assert (tmp_path / "ttft.png").stat().st_size > 1000 and (tmp_path / "ttft.md").exists()


def test_gold_answer_scoring_matches_across_exact_paths_and_eval_reports_quality(engine):
    data = ev.load_qa(shared_data("musique/musique_s.json"), n=1)
    ex = data[0]
    chunks = ev.make_chunks(engine.tokenizer, ex.passages[:2])
    engine.precompute(chunks)
    prompt = engine.prompts.build(ex.question, chunks)
    gold = ev.answer_ids(engine, ex.answers[0])
    full = ev.continuation_logprobs(engine, prompt, gold, "full")
    blend_all = ev.continuation_logprobs(engine, prompt, gold, "blend", recompute_ratio=1.0)
    reuse = ev.continuation_logprobs(engine, prompt, gold, "reuse")
    assert len(full) == len(gold) and all(lp <= 0 for lp in full)
    assert blend_all == pytest.approx(full, abs=5e-3)
    assert reuse != pytest.approx(full, abs=1e-3)  # two chunks moved without recompute: not exact

    res = ev.run_eval(engine, data, mode="reuse", passages=2, max_tokens=4)
    q = res["quality"]
    assert res["benchmark"] == "eval" and q["n"] == 1 and q["kl_mean"] > 0
    assert res["examples"][0]["gold_nll"] == pytest.approx(ev.mean_nll(reuse), rel=1e-3)
    assert res["full"]["kl_mean"] == 0.0 and res["full"]["gold_nll_rel_full"] == 0.0
