"""The engine's exactness invariants in bfloat16 (the dtype "auto" picks on AMX/AVX512-BF16 CPUs and
on CUDA), on both attention paths of the blend.

In float32, blend at ratio 1.0 gives exactly full prefill's greedy tokens and a chunk at its
canonical position served in reuse mode equals full prefill (tests/test_engine_blend.py).

bfloat16, ``blend.attention = "kernel"``: ragcache's layer-wise forward runs vLLM's own modules,
carries the residual stream as vLLM does (its norms add in float32) and runs attention through
vLLM's CPU kernel over the paged cache, so it does vLLM's arithmetic in vLLM's order. Measured on
SmolLM2-135M, AMD EPYC Zen 4 (avx512_bf16), 3 prompts: first-token KL(full || blend@1.0) = 0.0, the
same greedy tokens, the same NLL of full's answer; canonical reuse KL 0.0. The bound here is that
exactness, up to the float noise of the KL sum itself.

bfloat16, ``blend.attention = "torch"`` (SDPA: a different summation order, so other roundings):
measured KL 0.0028-0.0071 at ratio 1.0 and 0.013 for canonical reuse, NLL of full's 12-token
answer within 2.9% (ratio 1.0) and 6.0% (canonical reuse); bf16's own rounding moves full prefill by
KL 0.0014-0.0027 from float32's. The bound: the same first token, KL <= 0.02 nats and NLL within
10% (about 1.5x the worst measured).

Runs in-process engines in bfloat16 (on CPUs without bf16 instructions it is emulated: slower, same
numbers), one attention path at a time, beside the session's multi-process float32 engine.
"""

from __future__ import annotations

import pytest

from ragcache.bench.metrics import kl_divergence, mean_nll
from ragcache.options import QueryOptions
from tests.test_engine_blend import FACTS, make_chunks

pytestmark = pytest.mark.integration

#: per attention path: (largest first-token KL, largest relative NLL change, greedy tokens must match)
BOUNDS = {"kernel": (1e-6, 1e-3, True), "torch": (0.02, 0.10, False)}


@pytest.fixture(scope="module", params=["kernel", "torch"])
def bf16_engine(request, tmp_path_factory):
    from ragcache.config import Settings
    from ragcache.engine import BlendEngine

    settings = Settings.load(
        store={"ssd_cache_dir": str(tmp_path_factory.mktemp("kv-bf16")), "remote_url": "", "cpu_kv_pool_gb": 1.0},
        engine={"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory_bytes": 256 << 20, "in_process": True},
        blend={"attention": request.param},
    )
    eng = BlendEngine(settings)
    assert eng.dtype.dtype == "bfloat16"
    if eng.worker.attention != request.param:
        eng.close()
        pytest.skip(f"the {request.param} attention path is not available here: {eng.worker.attention_reason}")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def bf16_chunks(bf16_engine):
    chunks = make_chunks(bf16_engine, FACTS)
    bf16_engine.precompute(chunks)
    return chunks


def assert_close_to_full(engine, prompt, mode, **kwargs):
    max_kl, max_nll_rel, same_tokens = BOUNDS[engine.worker.attention]
    full = engine.generate(prompt, QueryOptions(mode="full", max_tokens=12), logprobs=-1)
    got = engine.generate(prompt, QueryOptions(mode=mode, max_tokens=12, **kwargs), logprobs=-1)
    assert got.token_ids[0] == full.token_ids[0], (full.text, got.text)
    if same_tokens:
        assert got.token_ids == full.token_ids, (full.text, got.text)
    kl = kl_divergence(full.first_token_logprobs, got.first_token_logprobs)
    assert kl <= max_kl, (kl, full.text, got.text)
    exact = mean_nll(engine.continuation_logprobs(prompt, full.token_ids, QueryOptions(mode="prefix")))
    served = mean_nll(engine.continuation_logprobs(prompt, full.token_ids, QueryOptions(mode=mode, **kwargs)))
    assert abs(served / exact - 1) <= max_nll_rel, (served, exact)


@pytest.mark.parametrize("selection", ["deviation", "question"])
def test_ratio_one_matches_full_prefill_in_bf16(bf16_engine, bf16_chunks, selection):
    for question, chunks in (("What is the capital of Zorbia?", bf16_chunks),
                             ("Who founded Velmora and when?", bf16_chunks[::-1]),
                             ("What is kelmet made of?", bf16_chunks[1:3])):
        prompt = bf16_engine.prompts.build(question, chunks)
        assert_close_to_full(bf16_engine, prompt, "blend", recompute_ratio=1.0, selection=selection)


def test_canonical_reuse_matches_full_prefill_in_bf16(bf16_engine, bf16_chunks):
    for chunk in bf16_chunks[:2]:
        prompt = bf16_engine.prompts.build("Summarize the document in one sentence.", [chunk])
        assert_close_to_full(bf16_engine, prompt, "reuse")
