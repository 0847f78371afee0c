"""`ragcache bench` / `ragcache eval` from the command line: flag errors and help without an engine, and a
tiny real `bench ttft` run on SmolLM2 through vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, shared_data

# ---- CLI errors and help (no engine is started) ------------------------------------------


def test_cli_missing_dataset_and_bad_flags_fail_with_one_line(tmp_path, capsys):
    from app.cli import main

    assert main(["bench", "ttft", "--dataset", str(tmp_path / "nope.json"), "--out", str(tmp_path / "r.json")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["eval", "--dataset", str(tmp_path / "nope.json")]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "ttft", "--modes", "full,fast"])
    for bad in (["bench", "ttft", "--n", "0"], ["bench", "hotset", "--passages", "0"],
                ["eval", "--max-tokens", "-1"], ["bench", "ttft", "--offset", "-1"],
                ["bench", "tiers", "--repeats", "x"]):
        with pytest.raises(SystemExit):  # rejected by the parser, before any engine starts
            main(bad + ["--out", str(tmp_path / "r.json")])
        assert "expected" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_bench_help_shows_list_defaults_as_typed_and_no_empty_defaults(capsys):
    from app.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "ttft", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 0,0.05,0.1,0.15,0.3,1)" in text and "[0.0" not in text
    assert "(default: None)" not in text and ".png" in text
    args = parser.parse_args(["bench", "ttft"])
    assert args.ratios == [0.0, 0.05, 0.1, 0.15, 0.3, 1.0] and args.modes == ["full", "prefix", "reuse", "blend", "plain"]
    assert args.selections is None  # blend.selection
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "tiers", "--help"])
    assert ".png" not in capsys.readouterr().out


# ---- a tiny real run ----------------------------------------------------------------------

SUMMARY_FIELDS = {
    "variant", "mode", "recompute_ratio", "n", "ttft_median_s", "ttft_p90_s", "ttft_mean_s", "speedup_median",
    "load_s_median", "worker_s_median", "kl_mean", "kl_median", "gold_nll_mean", "gold_nll_rel_full", "f1_mean",
    "rouge_l_mean", "em_mean", "agree_em_mean", "agree_rouge_l_mean", "agree_tokens_mean", "recomputed_frac_mean",
    "prompt_tokens_mean", "loop_share",
}
RECORD_FIELDS = {
    "ttft_s", "total_s", "load_s", "worker_s", "prompt_tokens", "ctx_tokens", "reused_tokens", "recomputed_tokens",
    "missing_computed_tokens", "num_cached_tokens", "output_tokens", "chunk_tiers", "answer", "recompute_ratio",
    "first_token", "kl_from_full", "gold_nll", "f1", "rouge_l", "em", "agree_em", "agree_rouge_l", "agree_tokens",
    "speedup", "repetition_loop",
}


@pytest.mark.integration
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
    assert set(res["modes"]) == {"full", "plain", "prefix", "reuse", "blend"}
    assert [s["recompute_ratio"] for s in res["sweep"]] == [0.0, 0.15]
    for name, s in [*res["modes"].items(), *((s["variant"], s) for s in res["sweep"])]:
        assert SUMMARY_FIELDS <= set(s), SUMMARY_FIELDS - set(s)
        assert s["n"] == 2 and s["ttft_median_s"] > 0
        # plain vLLM is timed and its answer scored, but it has no teacher-forced scores (another engine)
        assert (s["gold_nll_mean"] is None) if name == "plain" else (s["gold_nll_mean"] > 0)
    assert set(res["targets"]) == {"blend_ttft_speedup", "blend_ttft_speedup_vs_best", "blend_nll_within",
                                   "blend_kl_vs_reuse", "blend_agree_rouge_l", "blend_loops", "full_vs_plain"}
    for ex in res["examples"]:
        assert set(ex["results"]) == {"full", "plain", "prefix", "reuse", "blend@0", "blend@0.15"}
        assert sorted(ex["order"]) == sorted(ex["results"])
        for rec in ex["results"].values():
            assert RECORD_FIELDS <= set(rec), RECORD_FIELDS - set(rec)
        full, prefix, plain = ex["results"]["full"], ex["results"]["prefix"], ex["results"]["plain"]
        assert plain["ttft_s"] > 0 and plain["answer"] and plain["kl_from_full"] is None
        assert full["kl_from_full"] == 0.0 and prefix["kl_from_full"] < 1e-3  # prefix caching is exact
        assert ex["results"]["blend@0.15"]["recomputed_tokens"] > 0
        assert ex["results"]["reuse"]["kl_from_full"] > 0 and ex["results"]["reuse"]["recomputed_tokens"] == 0
        assert ex["results"]["prefix"]["num_cached_tokens"] > 0  # the warm-up filled vLLM's prefix cache
    assert res["examples"][0]["order"] != res["examples"][1]["order"]  # rotated
    assert (tmp_path / "ttft.png").stat().st_size > 1000 and (tmp_path / "ttft.md").exists()
