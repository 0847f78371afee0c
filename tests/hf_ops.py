"""Test helper: ``DecoderOps`` over transformers' Llama modules, and a tiny random Llama.

The blend tests run ragcache.blend on real models without vLLM: ``HFLlamaOps`` implements the
per-layer callables with the model's own ``embed_tokens``, norms, projections, rotary embedding and
MLP, so whatever blend/ computes can be compared with transformers' own forward.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from ragcache.bench.reference import HFDecoderOps
from ragcache.blend import compute_kv


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised 4-layer Llama (hidden 64, 4 heads, 2 KV heads, head_dim 16, theta 1e5), float32, eval."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(torch.float32).eval()


#: ``ragcache.blend.DecoderOps`` over a transformers ``LlamaForCausalLM``: the reference the benchmarks use too
HFLlamaOps = HFDecoderOps


def hf_layer_kv(model: LlamaForCausalLM, token_ids: torch.LongTensor, positions: torch.LongTensor) -> list:
    """transformers' own forward of one sequence: per layer ``(k [T, Hkv, D] post-RoPE, v [T, Hkv, D])``."""
    with torch.inference_mode():
        out = model(input_ids=token_ids[None], position_ids=positions[None], use_cache=True)
    cache = out.past_key_values
    return [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))  # [1, Hkv, T, D] -> [T, Hkv, D]
        for layer in cache.layers
    ]


def next_token_logits(
    model: LlamaForCausalLM,
    context_k: list[torch.Tensor],
    context_v: list[torch.Tensor],
    question_ids: torch.LongTensor,
) -> torch.Tensor:
    """Logits ``[vocab]`` after ``question_ids``, prefilled by transformers over a given context KV.

    Args:
        context_k: per layer ``[N, Hkv, D]`` post-RoPE K of the context at positions ``0..N-1``.
        context_v: per layer ``[N, Hkv, D]`` V of the context.
        question_ids: ``[Q]`` token ids placed at positions ``N..N+Q-1``.
    """
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        for layer, (k, v) in enumerate(zip(context_k, context_v)):
            cache.update(k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous(), layer)
        num_context = context_k[0].shape[0]
        positions = torch.arange(num_context, num_context + question_ids.shape[0])
        out = model(input_ids=question_ids[None], position_ids=positions[None], past_key_values=cache, use_cache=True)
    return out.logits[0, -1]


# --- the real small model and multi-chunk contexts --------------------------------------------

SMOLLM2 = "smollm2-135m-instruct"
HOTPOTQA = Path(os.environ.get("RAGCACHE_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data") \
    / "hotpotqa" / "hotpotqa_distractor_100.json"


@functools.lru_cache(maxsize=1)
def _load_smollm2() -> tuple[LlamaForCausalLM, object] | str:
    from ragcache.models import ModelNotFoundError, resolve_llm

    try:
        path = resolve_llm(SMOLLM2, Path.home() / ".cache" / "ragcache" / "models").path
    except (ModelNotFoundError, ImportError, OSError) as exc:
        return f"SmolLM2-135M-Instruct HF folder not available ({exc}); run `python -m ragcache.models`"
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def smollm2() -> tuple[LlamaForCausalLM, object]:
    """The converted SmolLM2-135M-Instruct (float32, eval) and its tokenizer, loaded once per session.

    Skips the calling test when the model folder cannot be provided.
    """
    loaded = _load_smollm2()
    if isinstance(loaded, str):
        pytest.skip(loaded)
    return loaded


def hotpotqa_examples() -> list[dict]:
    """The 100 HotpotQA distractor examples from ../shared/data; skips the test when absent."""
    if not HOTPOTQA.is_file():
        pytest.skip(f"{HOTPOTQA} is absent (the shared data folder next to the repository)")
    return json.loads(HOTPOTQA.read_text())


@dataclass
class CachedContext:
    """A context assembled from separately precomputed chunks, as the engine would see it.

    Attributes:
        token_ids: ``[N]`` the context tokens: the lead-in followed by every chunk.
        positions: ``[N]`` ``arange(N)``.
        k_pre: ``[L, N, Hkv, D]`` cached pre-RoPE K: the lead-in's exact, each chunk's computed alone
            after the lead-in (at the canonical start ``len(lead_in)``).
        v: ``[L, N, Hkv, D]`` cached V, likewise.
        chunk_starts: index of each chunk's first token in the context.
    """

    token_ids: torch.LongTensor
    positions: torch.LongTensor
    k_pre: torch.Tensor
    v: torch.Tensor
    chunk_starts: list[int]

    def load_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies (the blend writes recomputed rows into what it loads)."""
        return self.k_pre[layer].clone(), self.v[layer].clone()


def cached_context(ops: HFLlamaOps, lead_in: list[int], chunks: list[list[int]]) -> CachedContext:
    """Precompute each chunk's KV after ``lead_in`` with ``compute_kv`` and place the chunks one after another."""
    lead = torch.tensor(lead_in)
    k_parts, v_parts = list(compute_kv(ops, lead, torch.arange(len(lead_in))))
    k_parts, v_parts = [k_parts], [v_parts]
    starts, offset = [], len(lead_in)
    for chunk in chunks:
        ids = torch.tensor(lead_in + chunk)
        k_pre, v = compute_kv(ops, ids, torch.arange(len(ids)), keep_from=len(lead_in))
        k_parts.append(k_pre)
        v_parts.append(v)
        starts.append(offset)
        offset += len(chunk)
    token_ids = torch.tensor(lead_in + [t for chunk in chunks for t in chunk])
    return CachedContext(
        token_ids=token_ids,
        positions=torch.arange(len(token_ids)),
        k_pre=torch.cat(k_parts, dim=1),
        v=torch.cat(v_parts, dim=1),
        chunk_starts=starts,
    )


class LayerCollector:
    """An ``on_layer`` callback that keeps every layer's K and V."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer] = k.clone()
        self.v[layer] = v.clone()


#: a question tail after :func:`tiny_context`
TINY_TAIL = torch.tensor([5, 77, 130, 9, 201])


def tiny_context(ops: HFLlamaOps) -> CachedContext:
    """A 6-token lead-in and three chunks of 40, 25 and 33 random ids (seed 11) for the tiny model,
    each chunk's KV computed alone after the lead-in (:func:`cached_context`) on ``ops.device``."""
    g = torch.Generator().manual_seed(11)
    lead_in = torch.randint(0, 256, (6,), generator=g).tolist()
    chunks = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 25, 33)]
    return cached_context(ops, lead_in, chunks)


def context_layout(context: CachedContext) -> tuple[list[int], torch.Tensor]:
    """``segment_starts`` and the ``exact`` mask ``[N]`` bool (the lead-in and the first chunk, which
    sit where their KV was computed) of a :class:`CachedContext`."""
    starts = [0] + list(context.chunk_starts)
    exact = torch.zeros(context.token_ids.shape[0], dtype=torch.bool)
    exact[:context.chunk_starts[1]] = True
    return starts, exact
