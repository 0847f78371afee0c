"""The worker serves every blend of an engine step in one pass: each answer is the one the request
gets alone, a full prefill in the same step is untouched, and the operators one blend dispatches grow
with neither its passages, nor its recomputed runs, nor the blends beside it."""

from __future__ import annotations

import json

import pytest

from ragcache.bench.metrics import kl_divergence
from ragcache.options import QueryOptions
from tests.conftest import shared_data
from tests.test_engine_blend import FACTS, make_chunks

pytestmark = pytest.mark.integration

QUESTIONS = ["What is the capital of Zorbia?", "Who founded Velmora and when?", "What is kelmet made of?",
             "Where does Zorbia's parliament meet?"]


@pytest.fixture(scope="module")
def engine(engine_settings, tmp_path_factory):
    """An in-process engine (its requests given together are scheduled in one step, as the multi-process
    engine core does only when they arrive before its next step), with no pacing of the loads per step."""
    from ragcache.engine import BlendEngine

    settings = engine_settings.model_copy(update={
        "engine": engine_settings.engine.model_copy(update={"in_process": True, "connector_step_tokens": 0}),
        "store": engine_settings.store.model_copy(update={"ssd_cache_dir": str(tmp_path_factory.mktemp("kv"))})})
    eng = BlendEngine(settings)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def fact_chunks(engine):
    chunks = make_chunks(engine, FACTS)
    engine.precompute(chunks)
    return chunks


@pytest.fixture(scope="module")
def hotpot(engine):
    """Two HotpotQA questions with their passages stored: ``[(question, chunks)]``."""
    data = json.loads(shared_data("hotpotqa/hotpotqa_distractor_100.json").read_text())
    out = []
    for ex in data[:2]:
        chunks = make_chunks(engine, [c["text"] for c in ex["ctxs"][:8]])
        engine.precompute(chunks)
        out.append((ex["question"], chunks))
    return out


def total_ops(engine, prompts, options) -> list[int]:
    """Operators per engine step that loaded contexts."""
    return [step["ops"]["total"] for step in engine.count_load_ops(prompts, options)]


def test_blends_of_one_step_answer_as_each_alone_beside_a_full_prefill(engine, fact_chunks):
    orders = [fact_chunks, fact_chunks[::-1], fact_chunks[1:3], fact_chunks[:3]]
    prompts = [engine.prompts.build(q, chunks) for q, chunks in zip(QUESTIONS, orders)]
    # different lengths and budgets (one adaptive), one question-selected pass and one deviation pass,
    # and a full prefill in the same engine step
    options = [QueryOptions(mode="blend", max_tokens=8, recompute_ratio=0.2),
               QueryOptions(mode="blend", max_tokens=8, recompute_ratio=0.4, budget="adaptive"),
               QueryOptions(mode="blend", max_tokens=8, recompute_ratio=0.3, selection="deviation"),
               QueryOptions(mode="full", max_tokens=8)]
    for size in (2, 4):
        loads = sum(o.mode == "blend" for o in options[:size])
        assert [s["requests"] for s in engine.count_load_ops(prompts[:size], options[:size])] == [loads]
        together = engine.generate_many(prompts[:size], options[:size], logprobs=-1)
        for prompt, opts, got in zip(prompts, options, together):
            alone = engine.generate(prompt, opts, logprobs=-1)
            assert got.token_ids == alone.token_ids, (size, opts.mode, got.text, alone.text)
            assert got.metrics.recomputed_tokens == alone.metrics.recomputed_tokens
            assert kl_divergence(alone.first_token_logprobs, got.first_token_logprobs) < 1e-6
    # the same request four times over, in one step, is each time the request alone
    same = engine.generate_many([prompts[0]] * 4, options[0], logprobs=-1)
    alone = engine.generate(prompts[0], options[0], logprobs=-1)
    assert all(g.token_ids == alone.token_ids for g in same)


def test_a_blend_dispatches_as_many_operators_whatever_its_passages_and_runs(engine, hotpot):
    question, chunks = hotpot[0]
    blend = QueryOptions(mode="blend", recompute_ratio=0.15)
    few, many = (total_ops(engine, [engine.prompts.build(question, chunks[:n])], blend)[0] for n in (3, 8))
    assert abs(many - few) <= 0.01 * few, (few, many)
    token_runs = total_ops(engine, [engine.prompts.build(question, chunks)],
                           QueryOptions(mode="blend", recompute_ratio=0.15, selection="question/1"))[0]  # token by token
    assert abs(token_runs - few) <= 0.01 * few, (few, token_runs)


def test_four_blends_in_one_step_cost_at_most_1_3_times_the_operators_of_one(engine, hotpot, fact_chunks):
    blend = QueryOptions(mode="blend", recompute_ratio=0.15)
    prompts = [engine.prompts.build(q, chunks) for q, chunks in hotpot]
    prompts += [engine.prompts.build(QUESTIONS[0], fact_chunks), engine.prompts.build(QUESTIONS[1], fact_chunks[1:])]
    one = total_ops(engine, prompts[:1], blend)
    steps = engine.count_load_ops(prompts, blend)
    assert [s["requests"] for s in steps] == [4], "the four loads were not in one engine step"
    assert steps[0]["ops"]["total"] <= 1.3 * one[0], (steps[0]["ops"]["total"], one)
