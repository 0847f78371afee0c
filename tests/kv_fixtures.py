"""Small KV entries for the kvstore tests: one :class:`KVSpec` and seeded random K/V of its shape."""

from __future__ import annotations

import json
import struct
import zlib

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


def poison(data: bytes, tensor: str, value: float = float("nan")) -> bytes:
    """An entry's bytes (a disk file's or a Redis value's) with every element of ``tensor``
    (``"v_scale.1"``, ``"k.0"``...) set to ``value`` and that tensor's crc32 in the header rewritten
    to match: damage the checksums cannot see. The header keeps its length (8 hex digits per crc)."""
    start = 8 + struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:start])
    names = [name for name in header if name != "__metadata__"]  # file order
    info = header[tensor]
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[info["dtype"]]
    a, b = (start + offset for offset in info["data_offsets"])
    filled = torch.full(info["shape"], value, dtype=dtype).view(torch.uint8).numpy().tobytes()
    assert len(filled) == b - a
    listed = header["__metadata__"]["crc32"]
    crcs = listed.split(",")
    crcs[names.index(tensor)] = f"{zlib.crc32(filled):08x}"
    head = data[8:start].replace(f'"crc32":"{listed}"'.encode(), f'"crc32":"{",".join(crcs)}"'.encode())
    assert len(head) == start - 8 and f'"crc32":"{",".join(crcs)}"'.encode() in head
    return data[:8] + head + data[start:a] + filled + data[b:]
