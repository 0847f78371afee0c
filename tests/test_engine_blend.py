"""BlendEngine on the real SmolLM2 through vLLM: modes, exactness limits, quality, misses, isolation."""

from __future__ import annotations

import json
import math

import pytest

from ragcache.chunks import Chunk, chunk_id_for
from ragcache.engine.messages import TRANSFER_KEY
from ragcache.models import encode
from ragcache.options import QueryOptions
from tests.conftest import shared_data

pytestmark = pytest.mark.integration


def make_chunks(engine, texts: list[str], title: str = "") -> list[Chunk]:
    chunks = []
    for i, text in enumerate(texts):
        ids = encode(engine.tokenizer, text)
        chunks.append(Chunk(chunk_id_for(text), f"doc-{chunk_id_for(text)}", title, i, text, tuple(ids)))
    return chunks


FACTS = [
    "The Zorbian capital is Velmora, a city on the river Aster known for its glass bridges.",
    "Velmora was founded in 1432 by the navigator Idris Kell after a storm wrecked his fleet.",
    "The national dish of Zorbia is a stew of lentils, smoked fish and saffron called kelmet.",
    "Zorbia's parliament meets in the Amber Hall, which has 212 seats and a copper roof.",
]


@pytest.fixture(scope="module")
def fact_chunks(engine):
    chunks = make_chunks(engine, FACTS)
    engine.precompute(chunks)
    return chunks


def kl(p_full: dict[int, float], q_mode: dict[int, float]) -> float:
    """KL(full || mode) over the full vocabulary from two {token: logprob} dicts."""
    return sum(math.exp(lp) * (lp - q_mode.get(t, -1e9)) for t, lp in p_full.items())


def test_ratio_one_reproduces_full_prefill(engine, fact_chunks):
    questions = ["What is the capital of Zorbia?", "Who founded Velmora and when?",
                 "What is kelmet made of?"]
    orders = [fact_chunks, fact_chunks[::-1], fact_chunks[1:3]]
    for q, chunks in zip(questions, orders):
        prompt = engine.prompts.build(q, chunks)
        full = engine.generate(prompt, QueryOptions(mode="full", max_tokens=16))
        blend = engine.generate(prompt, QueryOptions(mode="blend", max_tokens=16, recompute_ratio=1.0))
        assert blend.token_ids == full.token_ids, (q, full.text, blend.text)
        assert blend.metrics.recomputed_tokens == prompt.ctx_len
        assert full.metrics.reused_tokens == 0


def test_single_chunk_at_canonical_position_reuse_is_exact(engine, fact_chunks):
    for chunk in fact_chunks[:2]:
        prompt = engine.prompts.without_kv_context().build("Summarize the document in one sentence.", [chunk])
        full = engine.generate(prompt, QueryOptions(mode="full", max_tokens=20))
        reuse = engine.generate(prompt, QueryOptions(mode="reuse", max_tokens=20))
        assert reuse.token_ids == full.token_ids, (full.text, reuse.text)
        assert reuse.metrics.recomputed_tokens == 0 and reuse.metrics.reused_tokens == prompt.ctx_len


def test_blend_reuses_and_reports_metrics(engine, fact_chunks):
    prompt = engine.prompts.build("What is the capital of Zorbia?", fact_chunks)
    g = engine.generate(prompt, QueryOptions(mode="blend"))
    m = g.metrics
    assert m.mode == "blend" and m.ttft_s > 0 and m.prompt_tokens == len(prompt.token_ids)
    assert m.reused_tokens > 0 and 0 < m.recomputed_tokens < prompt.ctx_len
    assert m.reused_tokens + m.recomputed_tokens == prompt.ctx_len
    assert len(m.chunk_tiers) == len(fact_chunks) and "computed" not in m.chunk_tiers
    assert m.num_cached_tokens >= prompt.ctx_len
    assert g.text.strip()


def test_the_recompute_floor_sets_the_budget_of_a_short_context(engine, fact_chunks):
    prompt = engine.prompts.build("What is the capital of Zorbia?", fact_chunks)
    base = engine.settings.blend
    try:
        engine.settings.blend = base.model_copy(update={"min_recompute_tokens": 48})
        fixed = QueryOptions(mode="blend", recompute_ratio=0.05, budget="fixed")  # the floor of the ratio's budget
        floored = engine.generate(prompt, fixed).metrics
        assert math.ceil(0.05 * prompt.ctx_len) < 48 == floored.recomputed_tokens  # the ratio alone gives fewer
        assert floored.reused_tokens == prompt.ctx_len - 48
        engine.settings.blend = base.model_copy(update={"min_recompute_tokens": 10 * prompt.ctx_len})
        whole = engine.generate(prompt, fixed).metrics
        assert whole.recomputed_tokens == prompt.ctx_len and whole.reused_tokens == 0
        reuse = engine.generate(prompt, QueryOptions(mode="blend", recompute_ratio=0.0)).metrics
        assert reuse.recomputed_tokens == 0  # ratio 0 stays plain reuse whatever the floor
    finally:
        engine.settings.blend = base


def test_the_adaptive_budget_is_reported_and_is_what_the_worker_recomputed(engine, fact_chunks):
    prompt = engine.prompts.build("What is the capital of Zorbia?", fact_chunks)

    def blend(**kw):
        return engine.generate(prompt, QueryOptions(mode="blend", recompute_ratio=0.15, max_tokens=1, **kw)).metrics

    fixed, loose, tight = blend(budget="fixed"), blend(budget="adaptive", mass_left=0.2), blend(mass_left=0.01)
    # every chunk is stored (nothing forced): the budget is exactly what the worker recomputed
    for m in (fixed, loose, tight):
        assert m.recompute_budget == m.recomputed_tokens > 0 and m.missing_computed_tokens == 0
    assert fixed.recompute_budget == math.ceil(0.15 * prompt.ctx_len) and fixed.budget_reason.startswith("fixed: ")
    assert loose.budget_reason.startswith("adaptive: ") and "target 0.2)" in loose.budget_reason
    assert (fixed.budget_mode, loose.budget_mode, tight.budget_mode) == ("fixed", "adaptive", "adaptive")
    assert "target 0.01)" in tight.budget_reason and "left on reused KV" in tight.budget_reason
    # less of the question's attention left on reused KV takes more tokens, up to max_recompute_ratio
    b = engine.settings.blend
    cap = max(fixed.recompute_budget, min(int(b.max_recompute_ratio * prompt.ctx_len), b.max_recompute_tokens))
    assert loose.recompute_budget < tight.recompute_budget <= cap
    assert loose.recompute_budget >= math.ceil(0.5 * fixed.recompute_budget)  # the floor: half the ratio's budget


def test_recompute_depth_reaches_the_worker_and_leaves_ratio_one_exact(engine, fact_chunks):
    prompt = engine.prompts.build("Who founded Velmora and when?", fact_chunks)
    base = engine.settings.blend
    ask = QueryOptions(mode="blend", recompute_ratio=0.3, max_tokens=1)
    try:
        deep = engine.generate(prompt, ask, logprobs=-1)
        engine.settings.blend = base.model_copy(update={"recompute_depth": 0.5})
        shallow = engine.generate(prompt, ask, logprobs=-1)
        assert shallow.metrics.recomputed_tokens == deep.metrics.recomputed_tokens > 0  # the same selection
        layers = 30  # SmolLM2-135M
        assert (deep.metrics.recomputed_layers, deep.metrics.model_layers) == (layers, layers) and layers > 2
        assert shallow.metrics.recomputed_layers == layers // 2  # what each answer shows
        assert shallow.metrics.partial_depth == f"in {layers // 2} of {layers} layers" and deep.metrics.partial_depth == ""
        # layers 15-29 keep the reused KV: the first token's distribution moves
        assert kl(deep.first_token_logprobs, shallow.first_token_logprobs) > 1e-6
        full = engine.generate(prompt, QueryOptions(mode="full", max_tokens=12))
        one = engine.generate(prompt, QueryOptions(mode="blend", recompute_ratio=1.0, max_tokens=12))
        assert one.token_ids == full.token_ids  # ratio 1.0 recomputes every layer whatever the depth
    finally:
        engine.settings.blend = base


@pytest.mark.parametrize("scope,depth", [("chunk", 0.0), ("context", 0.0), ("chunk", 0.5)])
def test_propagation_reaches_the_worker_moves_the_answer_distribution_and_leaves_ratio_one_exact(engine, fact_chunks,
                                                                                                 scope, depth):
    """In the worker the probe then writes ahead only the layers before the first propagating one
    (from there every reused row may be corrected): the same selection, another first-token
    distribution, and ratio 1 still vLLM's own prefill."""
    prompt = engine.prompts.build("Who founded Velmora and when?", fact_chunks)
    base = engine.settings.blend
    ask = QueryOptions(mode="blend", recompute_ratio=0.3, max_tokens=1)
    try:
        engine.settings.blend = base.model_copy(update={"propagate": 0.0})
        plain = engine.generate(prompt, ask, logprobs=-1)
        engine.settings.blend = base.model_copy(update={"propagate": 0.5, "propagate_scope": scope,
                                                        "propagate_from_depth": depth})
        spread = engine.generate(prompt, ask, logprobs=-1)
        assert spread.metrics.recomputed_tokens == plain.metrics.recomputed_tokens > 0
        assert kl(plain.first_token_logprobs, spread.first_token_logprobs) > 1e-6
        full = engine.generate(prompt, QueryOptions(mode="full", max_tokens=12))
        one = engine.generate(prompt, QueryOptions(mode="blend", recompute_ratio=1.0, max_tokens=12))
        assert one.token_ids == full.token_ids
    finally:
        engine.settings.blend = base


def test_scoring_the_same_continuation_twice_in_prefix_mode_reads_no_cached_block(engine, fact_chunks):
    # The first scoring request leaves full blocks of prompt + continuation in vLLM's prefix cache; a
    # second one over the same tokens must not read them (they cover the positions it scores).
    prompt = engine.prompts.build("Who founded Velmora and when?", fact_chunks)
    block = 128  # vLLM's CPU block size
    filler = encode(engine.tokenizer, " Velmora was founded by Idris Kell in 1432 after a storm.")
    continuation = (filler * 40)[: (len(prompt.token_ids) // block + 2) * block - len(prompt.token_ids) + 3]
    exact = QueryOptions(mode="prefix")
    first = engine.continuation_logprobs(prompt, continuation, exact)
    again = engine.continuation_logprobs(prompt, continuation, exact)  # raised "cached tokens cover ..." before
    assert len(first) == len(again) == len(continuation)
    assert again == pytest.approx(first, abs=1e-4)


def test_missing_chunk_is_computed_during_request_then_hits(engine, fact_chunks):
    new = make_chunks(engine, ["Zorbian children learn the seven-string harp from the age of five."])
    engine.forget(new)
    assert engine.stored_tiers(new) == [None]
    prompt = engine.prompts.build("What instrument do Zorbian children learn?", fact_chunks[:1] + new)
    first = engine.generate(prompt, QueryOptions(mode="blend"))
    assert first.metrics.chunk_tiers[-1] == "computed" and first.text.strip()
    assert engine.stored_tiers(new)[0] is not None
    second = engine.generate(prompt, QueryOptions(mode="blend"))
    assert "computed" not in second.metrics.chunk_tiers
    assert second.token_ids == first.token_ids


def test_a_context_load_that_fails_is_answered_by_full_prefill_and_the_engine_goes_on(engine, fact_chunks):
    """An exception in the connector's load used to escape vLLM's step and leave the engine hung for
    every later request; now the request's context is prefilled by vLLM instead (its metrics say why).
    The failure here is a request whose blend parameters the worker refuses (a check layer past the
    model's 30 layers, which the settings would never let through: a client bug, or a stale client)."""
    prompt = engine.prompts.build("Who founded Velmora?", fact_chunks)
    full = engine.generate(prompt, QueryOptions(mode="full", max_tokens=8))
    req = engine._request(prompt, QueryOptions(mode="blend", max_tokens=8))
    req.sampling.extra_args["kv_transfer_params"][TRANSFER_KEY]["blend"]["check_layer"] = 99
    [out] = engine.llm.generate([req.inputs], [req.sampling], use_tqdm=False)
    failed = engine._generation(req, out, 0.0)
    assert failed.metrics.load_error == "ValueError: check_layer must be in [0, 30), got 99"
    assert failed.token_ids == full.token_ids  # vLLM's own prefill of the same prompt (float32: exact)
    assert failed.metrics.reused_tokens == 0 and failed.metrics.num_cached_tokens == 0
    after = engine.generate(prompt, QueryOptions(mode="blend", max_tokens=8))  # the engine goes on
    assert after.metrics.load_error == "" and after.metrics.reused_tokens > 0


def test_blended_kv_is_not_a_prefix_hit_for_full(engine, fact_chunks):
    prompt = engine.prompts.build("Where does the parliament meet?", fact_chunks)
    engine.generate(prompt, QueryOptions(mode="blend"))
    full = engine.generate(prompt, QueryOptions(mode="full"))
    assert full.metrics.num_cached_tokens == 0
    prefix1 = engine.generate(prompt, QueryOptions(mode="prefix"))
    prefix2 = engine.generate(prompt, QueryOptions(mode="prefix"))
    assert prefix2.metrics.num_cached_tokens > 0  # prefix mode does use vLLM's exact prefix cache
    assert prefix2.token_ids == prefix1.token_ids == full.token_ids


def test_blend_first_token_closer_to_full_than_reuse_on_musique(engine):
    data = json.loads(shared_data("musique/musique_s.json").read_text())
    kl_blend, kl_reuse = [], []
    for ex in data[:3]:
        texts = [c["text"] for c in ex["ctxs"][:6]]
        chunks = make_chunks(engine, texts)
        engine.precompute(chunks)
        prompt = engine.prompts.build(ex["question"], chunks)
        dists = {mode: engine.generate(prompt, QueryOptions(mode=mode, max_tokens=1), logprobs=-1).first_token_logprobs
                 for mode in ("full", "reuse", "blend")}
        kl_blend.append(kl(dists["full"], dists["blend"]))
        kl_reuse.append(kl(dists["full"], dists["reuse"]))
    assert sum(kl_blend) < sum(kl_reuse), (kl_blend, kl_reuse)


def test_stream_yields_text_then_generation(engine, fact_chunks):
    prompt = engine.prompts.build("What is the capital of Zorbia?", fact_chunks)
    pieces = list(engine.stream(prompt, QueryOptions(mode="blend", max_tokens=12)))
    final = pieces[-1]
    assert not isinstance(final, str) and all(isinstance(p, str) for p in pieces[:-1])
    assert "".join(pieces[:-1]) == final.text and final.metrics.reused_tokens > 0
    batch = engine.generate(prompt, QueryOptions(mode="blend", max_tokens=12))
    assert batch.token_ids == final.token_ids


def test_scoring_a_continuation_does_not_show_it_to_the_question_selection(engine, fact_chunks):
    # The question probe reads the tail after the context. When a continuation (a gold answer) is
    # scored teacher-forced, it must not take part: two different continuations get the same blend,
    # so the same log-probability for their shared first token, and the one a plain request gets.
    prompt = engine.prompts.build("What is the capital of Zorbia?", fact_chunks)
    blend = QueryOptions(mode="blend", recompute_ratio=0.3, selection="question")
    g = engine.generate(prompt, blend.model_copy(update={"max_tokens": 1}), logprobs=-1)
    first = g.token_ids[0]
    a = engine.continuation_logprobs(prompt, [first, 13], blend)
    b = engine.continuation_logprobs(prompt, [first] + encode(engine.tokenizer, " Velmora, on the Aster."), blend)
    assert a[0] == b[0]
    assert a[0] == pytest.approx(g.first_token_logprobs[first], abs=1e-4)
