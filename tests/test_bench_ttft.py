"""ragcache.bench.ttft on the real SmolLM2 through vLLM: gold-answer scoring and the quality-only eval."""

from __future__ import annotations

import pytest

from ragcache.bench.common import answer_ids
from ragcache.bench.datasets import load_qa, make_chunks
from ragcache.bench.metrics import mean_nll
from ragcache.bench.ttft import run_eval
from ragcache.options import QueryOptions
from tests.conftest import shared_data

pytestmark = pytest.mark.integration


def test_gold_answer_scoring_matches_across_exact_paths_and_eval_reports_quality(engine):
    data = load_qa(shared_data("musique/musique_s.json"), n=1)
    ex = data[0]
    chunks = make_chunks(engine.tokenizer, ex.passages[:2])
    engine.precompute(chunks)
    prompt = engine.prompts.build(ex.question, chunks)
    gold = answer_ids(engine, ex.answers[0])
    full = engine.continuation_logprobs(prompt, gold, QueryOptions(mode="full"))
    blend_all = engine.continuation_logprobs(prompt, gold, QueryOptions(mode="blend", recompute_ratio=1.0))
    reuse = engine.continuation_logprobs(prompt, gold, QueryOptions(mode="reuse"))
    assert len(full) == len(gold) and all(lp <= 0 for lp in full)
    assert blend_all == pytest.approx(full, abs=5e-3)
    assert reuse != pytest.approx(full, abs=1e-3)  # two chunks moved without recompute: not exact

    ex.passages = ex.passages[:2]  # fewer than --passages asks: the result reports what the prompts had
    res = run_eval(engine, data, mode="reuse", passages=3, max_tokens=4)
    assert res["passages"] == 2
    q = res["quality"]
    assert res["benchmark"] == "eval" and q["n"] == 1 and q["kl_mean"] > 0
    assert res["examples"][0]["gold_nll"] == pytest.approx(mean_nll(reuse), rel=1e-3)
    assert res["full"]["kl_mean"] == 0.0 and res["full"]["gold_nll_rel_full"] == 0.0


def test_auto_in_bench_ttft_is_scored_on_the_path_it_took_and_reported_per_length_class(engine):
    from ragcache.bench.ttft import run_ttft

    data = load_qa(shared_data("musique/musique_s.json"), n=1, offset=1)
    res = run_ttft(engine, data, modes=["auto"], ratios=[], default_ratio=0.15, passages=2, max_tokens=4)
    auto, full = res["examples"][0]["results"]["auto"], res["examples"][0]["results"]["full"]
    assert auto["route"] in ("full", "blend") and auto["route_reason"] and auto["route_rule"] != "explicit"
    if auto["route"] == "full":  # scored as full prefill's exact KV, not re-routed for the scoring request
        assert auto["gold_nll"] == full["gold_nll"] and auto["reused_tokens"] == 0
    routes = res["routes"]
    assert routes["all"]["n"] == 1 and sum(routes["all"]["routes"].values()) == 1
    assert routes["all"]["auto_over_full_median"] > 0 and routes["all"]["route_s_max"] < 0.05
    assert {"auto_vs_full_median", "auto_vs_full_p90", "auto_route_cost"} <= set(res["targets"])
