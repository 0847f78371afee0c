"""Engines whose reuse/blend the start-up self-check refuses, or passes in bfloat16 (tiny random models).

A deliberately wrong adapter (Qwen3 served by the Llama adapter) fails the self-check and gates
reuse/blend/precompute with one named error while full and prefix keep working; an architecture
with no adapter (Gemma) gives the named error; the self-check passes in bfloat16. Apart from
test_engine_families.py because each test starts its own in-process engine (one per process).
"""

from __future__ import annotations

import pytest
from tiny_models import ALMANAC, FACTS, start_engine

from ragcache.engine import ops as engine_ops
from ragcache.engine.selfcheck import TOLERANCES, BlendUnavailableError, probe_chunks
from ragcache.options import QueryOptions

pytestmark = pytest.mark.integration


def test_qwen3_served_by_the_llama_adapter_fails_the_self_check(tmp_path_factory, monkeypatch):
    monkeypatch.setitem(engine_ops.ADAPTERS, "Qwen3ForCausalLM", engine_ops.VLLMLlamaOps)  # no q/k norms
    _, engine = start_engine(tmp_path_factory, "qwen3")
    try:
        support = engine.blend_support
        assert not support.available and support.adapter == "VLLMLlamaOps"
        assert support.check is not None and support.check.error > 0.1 > TOLERANCES["float32"]
        prompt = engine.prompts.build("What is the capital of Zorbia?", probe_chunks(engine.tokenizer, FACTS))
        for mode in ("blend", "reuse"):
            with pytest.raises(BlendUnavailableError, match=r"Qwen3ForCausalLM.*self-check.*--mode full") as err:
                engine.generate(prompt, QueryOptions(mode=mode))
            assert str(err.value) == support.reason
        with pytest.raises(BlendUnavailableError):
            engine.precompute(probe_chunks(engine.tokenizer, FACTS))
        assert len(engine.generate(prompt, QueryOptions(mode="full")).token_ids) == 8
        prefix, full = QueryOptions(mode="prefix"), QueryOptions(mode="full")
        assert engine.generate(prompt, prefix).token_ids == engine.generate(prompt, full).token_ids
    finally:
        engine.close()


def test_unsupported_architecture_gives_the_named_error_and_full_and_prefix_work(tmp_path_factory):
    _, engine = start_engine(tmp_path_factory, "gemma")
    try:
        support = engine.blend_support
        assert not support.available and support.adapter is None and support.check is None
        message = support.reason
        assert "GemmaForCausalLM" in message and "--mode full" in message and "ADAPTERS" in message
        assert all(name in message for name in engine_ops.ADAPTERS)
        prompt = engine.prompts.build("What is the capital of Zorbia?", probe_chunks(engine.tokenizer, ALMANAC))
        for mode in ("blend", "reuse"):
            with pytest.raises(BlendUnavailableError, match="no DecoderOps adapter is registered"):
                engine.generate(prompt, QueryOptions(mode=mode))
        with pytest.raises(BlendUnavailableError):
            engine.precompute(probe_chunks(engine.tokenizer, FACTS))
        full = engine.generate(prompt, QueryOptions(mode="full"))
        prefix = QueryOptions(mode="prefix")
        first, second = engine.generate(prompt, prefix), engine.generate(prompt, prefix)
        assert len(full.token_ids) == 8 and first.token_ids == second.token_ids == full.token_ids
        assert second.metrics.num_cached_tokens >= 128  # vLLM's own prefix cache serves whole blocks
    finally:
        engine.close()


def test_self_check_passes_in_bfloat16(tmp_path_factory):
    _, engine = start_engine(tmp_path_factory, "qwen3", dtype="bfloat16")
    try:
        support = engine.blend_support
        assert support.available, support.reason
        assert support.dtype == "bfloat16" and support.check.error < TOLERANCES["bfloat16"]
    finally:
        engine.close()
