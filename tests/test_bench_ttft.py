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
