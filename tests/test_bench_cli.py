"""`ragcache bench` / `ragcache eval` from the command line: flag errors and help without an engine, and a
tiny real `bench ttft` run on SmolLM2 through vLLM."""

from __future__ import annotations

import json
import os
import shutil
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
    assert args.ratios == [0.0, 0.05, 0.1, 0.15, 0.3, 1.0] and args.modes == ["full", "prefix", "reuse", "blend", "auto", "plain", "floor"]
    assert args.selections is None  # blend.selection
    args = parser.parse_args(["bench", "ttft", "--selections", "question/1, question/16,deviation"])
    assert args.selections == ["question/1", "question/16", "deviation"]
    for bad, why in (("question/0", "the granule '0' must be a whole number in [1, "),
                     ("deviation,question/x", "'question/x': the granule 'x'"),
                     ("attention", "unknown strategy 'attention'"), (",", "no selection given")):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "ttft", "--selections", bad])
        err = capsys.readouterr().err
        assert "selections must be some of" in err and why in err, err
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "tiers", "--help"])
    assert ".png" not in capsys.readouterr().out


# ---- a tiny real run ----------------------------------------------------------------------

SUMMARY_FIELDS = {
    "variant", "mode", "recompute_ratio", "n", "ttft_median_s", "ttft_p90_s", "ttft_mean_s", "speedup_median",
    "load_s_median", "worker_s_median", "kl_mean", "kl_median", "gold_nll_mean", "gold_nll_rel_full", "f1_mean",
    "rouge_l_mean", "em_mean", "agree_em_mean", "agree_rouge_l_mean", "agree_tokens_mean", "agree_prefix_mean",
    "f1_full_mean", "recomputed_frac_mean",
    "prompt_tokens_mean", "loop_share",
}
RECORD_FIELDS = {
    "ttft_s", "total_s", "load_s", "worker_s", "prompt_tokens", "ctx_tokens", "reused_tokens", "recomputed_tokens",
    "missing_computed_tokens", "num_cached_tokens", "output_tokens", "chunk_tiers", "answer", "recompute_ratio",
    "first_token", "kl_from_full", "gold_nll", "f1", "rouge_l", "em", "agree_em", "agree_rouge_l", "agree_tokens",
    "agree_prefix",
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
    assert set(res["modes"]) == {"full", "plain", "floor", "prefix", "reuse", "blend", "auto"}
    assert res["floor_dtype"] in ("float32", "bfloat16") and res["floor_dtype"] != res["engine"]["dtype"]
    assert [s["recompute_ratio"] for s in res["sweep"]] == [0.0, 0.15]
    # blends on the settings' own budget say which one they used; reuse and full set none
    assert res["modes"]["blend"]["budget"] == "adaptive" and res["modes"]["full"]["budget"] is None
    assert {ex["results"]["blend@0.15"]["budget"] for ex in res["examples"]} == {"adaptive"}
    assert res["modes"]["reuse"]["budget"] is None
    for name, s in [*res["modes"].items(), *((s["variant"], s) for s in res["sweep"])]:
        assert SUMMARY_FIELDS <= set(s), SUMMARY_FIELDS - set(s)
        assert s["n"] == 2 and s["ttft_median_s"] > 0
        # plain vLLM (and the floor, plain vLLM in the other dtype) is timed and its answer scored, but it
        # has no teacher-forced scores (another engine)
        assert (s["gold_nll_mean"] is None) if name in ("plain", "floor") else (s["gold_nll_mean"] > 0)
    # short prompts (3 passages): judged by their answers (gold F1 against full's only where full's is above
    # 0); ratio-1 vs plain needs a ratio-1 sweep point (not asked for here)
    f1 = {"blend_f1_vs_full"} if res["modes"]["full"]["f1_mean"] else set()
    assert set(res["targets"]) == {"blend_ttft_speedup", "blend_ttft_speedup_vs_best", "blend_gold_nll_vs_full",
                                   "blend_agree_em", "blend_agree_rouge_l", "blend_loops", "full_vs_plain",
                                   "blend_aten_ops", "auto_vs_full_median", "auto_vs_full_p90",
                                   "auto_blended_gold_nll", "auto_route_cost"} | f1
    assert res["routes"]["all"]["n"] == 2 and "long" not in res["routes"]  # 3 passages: short prompts only
    assert res["blend_ops"]["n"] == 2 and res["targets"]["blend_aten_ops"]["value"] == res["blend_ops"]["total_median"]
    # put down to ragcache's code (selection, the adapter's glue, decoding) and to vLLM's modules (linear layers,
    # norms): both called some
    assert 0 < res["blend_ops"]["own_median"] < res["blend_ops"]["total_median"]
    assert "called by ragcache's code" in res["targets"]["blend_aten_ops"]["note"]
    assert "ratio_one_vs_plain" not in res["targets"]
    for ex in res["examples"]:
        assert set(ex["results"]) == {"full", "plain", "floor", "prefix", "reuse", "blend@0", "blend@0.15", "auto"}
        assert ex["results"]["auto"]["route"] in ("full", "blend")
        assert sorted(ex["order"]) == sorted(ex["results"])
        for rec in ex["results"].values():
            assert RECORD_FIELDS <= set(rec), RECORD_FIELDS - set(rec)
        full, prefix, plain = ex["results"]["full"], ex["results"]["prefix"], ex["results"]["plain"]
        assert plain["ttft_s"] > 0 and plain["answer"] and plain["kl_from_full"] is None
        floor = ex["results"]["floor"]  # full prefill in the other dtype: its agreement is the noise floor
        assert floor["ttft_s"] > 0 and floor["answer"] and floor["agree_em"] in (0.0, 1.0, True, False)
        assert full["kl_from_full"] == 0.0 and prefix["kl_from_full"] < 1e-3  # prefix caching is exact
        assert ex["results"]["blend@0.15"]["recomputed_tokens"] > 0
        assert ex["results"]["reuse"]["kl_from_full"] > 0 and ex["results"]["reuse"]["recomputed_tokens"] == 0
        assert ex["results"]["prefix"]["num_cached_tokens"] > 0  # the warm-up filled vLLM's prefix cache
    assert res["examples"][0]["order"] != res["examples"][1]["order"]  # rotated
    assert (tmp_path / "ttft.png").stat().st_size > 1000 and (tmp_path / "ttft.md").exists()


# ---- the measurements that were scripts (scripts/bench_tiers.py, bench_retrieval.py, cold_start.py,
# plain_vllm_prefill.py), now `ragcache bench` kinds ------------------------------------------------


def test_bench_bandwidth_reads_one_entry_from_every_tier_without_a_model(tmp_path, capsys):
    from app.cli import main

    redis = shutil.which("redis-server") is not None  # make test installs it (scripts/test_deps.sh)
    out = tmp_path / "bandwidth.json"
    assert main(["bench", "bandwidth", "--tokens", "8", "--layers", "2", "--reads", "1", "--dir", str(tmp_path),
                 "--out", str(out)] + ([] if redis else ["--no-remote"])) == 0
    assert "KV entry read bandwidth" in capsys.readouterr().out
    res = json.loads(out.read_text())
    tiers = {"cpu", "disk cold", "disk warm"} | ({"remote"} if redis else set())
    for dtype in ("float32", "float16"):
        rows = [t for t in res["tiers"] if t["dtype"] == dtype]
        assert {t["tier"] for t in rows} == tiers and all(t["get_mb_s"] > 0 and t["layers_mb_s"] > 0 for t in rows)
    assert res["tiers"][0]["entry_bytes"] == 2 * 2 * 8 * 3 * 64 * 4  # K and V, 2 layers, 8 tokens, fp32
    assert set(res["raw_disk"]) >= {"bytes", "dd_cold_mb_s", "dd_direct_mb_s", "dd_page_cache_mb_s"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ragcache-bench-")] == []  # cleaned up
    assert (tmp_path / "bandwidth.md").exists() and res["machine"]["cpu_count"] >= 1


def test_bench_retrieval_times_every_search_path_on_synthetic_indexes(tmp_path, capsys):
    from app.cli import main

    shared_data("hotpotqa/hotpotqa_distractor_100.json")
    out = tmp_path / "retrieval.json"
    assert main(["bench", "retrieval", "--sizes", "20,200", "--queries", "5", "--e2e-queries", "3", "--top-k", "3",
                 "--out", str(out)]) == 0
    assert "retrieval latency" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [r["chunks"] for r in res["results"]] == [20, 200] and res["e2e_queries"] == 3
    for r in res["results"]:
        for path in ("faiss", "faiss1", "search", "e2e"):
            assert 0 < r[f"{path}_p50_ms"] <= r[f"{path}_p99_ms"], (path, r)
    assert res["query_embedding_p50_ms"] > 0


@pytest.mark.integration
def test_bench_coldstart_and_plain_time_the_first_requests_and_a_plain_vllm(tmp_path):
    shared_data("musique/musique_s.json")
    env = dict(os.environ, RAGCACHE_ENGINE__KV_CACHE_MEMORY_BYTES=str(1 << 30))
    cold = tmp_path / "coldstart.json"
    r = subprocess.run([sys.executable, "-m", "app.cli", "bench", "coldstart", "--passages", "2", "--repeats", "2",
                        "--modes", "blend,full", "--out", str(cold)], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(cold.read_text())
    assert set(res["modes"]) == {"blend", "full"} and res["startup_s"] > 0
    assert all(len(m["ttft_s"]) == 2 and m["first_vs_steady"] > 0 for m in res["modes"].values())
    plain = tmp_path / "plain.json"
    r = subprocess.run([sys.executable, "-m", "app.cli", "bench", "plain", "--dtype", "float32", "--passages", "2",
                        "--runs", "1", "--out", str(plain)], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(plain.read_text())
    assert res["dtype"] == "float32" and len(res["ttft_s"]) == 1 and res["ttft_median_s"] > 0
