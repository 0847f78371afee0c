"""Small KV entries for the kvstore tests: one :class:`KVSpec` and seeded random K/V of its shape."""

from __future__ import annotations

import torch

from ragcache.kvstore import KVSpec

#: the spec most kvstore tests store under: 4 layers, 2 KV heads, head dim 8, float32
SPEC = KVSpec(model_fingerprint="b179c9523d0e6a0f", layout_version=1, num_layers=4, num_kv_heads=2,
              head_dim=8, dtype=torch.float32)


def make_kv(seed: int = 0, tokens: int = 6, spec: KVSpec = SPEC) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random ``(k, v)``, each ``[num_layers, tokens, num_kv_heads, head_dim]`` in ``spec.dtype``."""
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, tokens, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=g).to(spec.dtype), torch.randn(shape, generator=g).to(spec.dtype)


def entry_bytes(tokens: int = 6, spec: KVSpec = SPEC) -> int:
    """Bytes of one entry's K and V in memory."""
    return 2 * spec.num_layers * tokens * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
