"""Compressed chunk KV through the real engine (SmolLM2 on vLLM, float32, the default int8 form): the
self-check passes, an answer is the same whether its chunks were computed for it or hit, quality
stays close to uncompressed, and an entry of another stored form planted under a chunk's key is
refused, recomputed and replaced.

One in-process engine with the disk tier alone (no cpu tier), so every hit is read from a file.
"""

from __future__ import annotations

import pytest
import torch

from ragcache.kvstore import DiskTier, KVSpec, TieredStore
from ragcache.options import QueryOptions
from ragcache.quality.measures import kl_divergence
from tests.test_engine_blend import FACTS, make_chunks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def int8_engine(tmp_path_factory):
    from ragcache.config import Settings
    from ragcache.engine import BlendEngine

    kv = tmp_path_factory.mktemp("kv-int8")
    settings = Settings.load(
        store={"ssd_cache_dir": str(kv), "remote_url": "", "cpu_kv_pool_gb": 0.0},
        engine={"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_bytes": 256 << 20, "in_process": True,
                "max_tokens": 12},
        blend={"min_recompute_tokens": 0},
    )
    assert settings.store.kv_compression == "int8"  # the default
    eng = BlendEngine(settings)
    yield eng
    eng.close()


def test_compressed_kv_serves_the_same_answer_computed_or_hit_and_close_to_uncompressed(int8_engine):
    eng = int8_engine
    assert eng.blend_support.available and eng.blend_support.check.passed
    chunks = make_chunks(eng, FACTS[:3])
    prompt = eng.prompts.build("Who founded Velmora and when?", chunks)
    blend = QueryOptions(mode="blend", recompute_ratio=0.15)
    first = eng.generate(prompt, blend, logprobs=-1)  # every chunk missing: computed for this request
    assert set(first.metrics.chunk_tiers) == {"computed"}
    again = eng.generate(prompt, blend, logprobs=-1)  # now read from the int8 files
    assert set(again.metrics.chunk_tiers) == {"disk"}
    assert again.token_ids == first.token_ids
    assert kl_divergence(first.first_token_logprobs, again.first_token_logprobs) < 1e-6
    # reuse at the canonical place (chunk KV after the head alone: computed for this request and served
    # as stored): exact uncompressed, off by int8's rounding only here
    single = eng.prompts.without_kv_context().build("Summarize the document in one sentence.", chunks[:1])
    full = eng.generate(single, QueryOptions(mode="full"), logprobs=-1)
    reuse = eng.generate(single, QueryOptions(mode="reuse"), logprobs=-1)
    assert reuse.metrics.chunk_tiers[-1] == "computed" and reuse.token_ids[0] == full.token_ids[0]
    kl = kl_divergence(full.first_token_logprobs, reuse.first_token_logprobs)
    assert 0 < kl < 0.01, kl


def test_an_entry_of_another_stored_form_is_refused_recomputed_and_replaced(int8_engine):
    eng = int8_engine
    chunks = make_chunks(eng, FACTS[1:4])
    eng.precompute(chunks)
    prompt = eng.prompts.build("What is kelmet made of?", chunks)
    blend = QueryOptions(mode="blend", recompute_ratio=0.15)
    honest = eng.generate(prompt, blend)
    assert "computed" not in honest.metrics.chunk_tiers
    # an uncompressed entry with wrong values under the second chunk's (int8) key
    disk = DiskTier(eng.settings.store.ssd_cache_dir)
    key = eng.prompts.key(chunks[1])
    path = disk.path(key)
    spec = KVSpec.from_hf_config(eng.llm_info.path, eng.llm_info.fingerprint)
    planted = TieredStore(spec, [(disk, None)], kv_compression="none")
    n = len(eng.prompts.unit_ids(chunks[1]))
    shape = (spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
    planted.put(key, 5 * torch.randn(shape), 5 * torch.randn(shape), len(eng.prompts.head_ids))
    assert path.stat().st_size > 3.5 * n * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim  # floats
    got = eng.generate(prompt, blend)
    assert got.metrics.chunk_tiers == ["disk", "computed", "disk"]  # refused, recomputed
    assert got.token_ids == honest.token_ids  # never served as if it were int8
    checker = TieredStore(spec, [(DiskTier(disk.root), None)], kv_compression="int8")
    entry, _ = checker.get(key)
    assert entry.meta.compression == "int8"  # replaced by the recomputed entry in the served form
