"""ragcache.kvstore: the tiered store of chunk KV caches (device -> cpu -> disk -> remote).

Owns: storing, finding, promoting, evicting and checking per-chunk KV entries (pre-RoPE K and V,
``[num_layers, num_tokens, num_kv_heads, head_dim]``) under their content-addressed keys
(``str(ragcache.chunks.ChunkKey)``). Engine-agnostic: torch tensors in, torch tensors out. Must not
import vLLM, nor anything above it in ragcache (engine, pipeline, app).

    from ragcache.kvstore import KVSpec, TieredStore
    spec = KVSpec(model_fingerprint=fp, layout_version=KV_LAYOUT_VERSION, num_layers=30,
                  num_kv_heads=3, head_dim=64, dtype=torch.float32)
    store = TieredStore.from_settings(settings.store, spec=spec, device=torch.device("cpu"))  # int8 by default
    store.put(key, k, v, start_position=lead_in_len)   # -> names of the tiers that took it
    hit = store.get(key)                      # (KVEntry, tier name) or None
    with store.open(key) as handle:           # per-layer loading (None on a miss)
        k0, v0 = handle.layer(0)

Modules: ``entry`` (KVSpec, KVMeta, KVEntry, errors), ``codec`` (stored forms: int8/int4
quantisation, ``store.kv_compression``), ``format`` (safetensors layout, checksums),
``tier`` (the Tier protocol), ``memory``/``cpu``/``device``/``disk``/``remote`` (one per medium),
``policy`` (LRU/LFU bookkeeping), ``guard`` (back-off of an unreachable tier), ``stats`` (what a
lookup is: counters, hit-rate line and log), ``ledger`` (lookup counts, summed across processes in a
counter file), ``slot`` (one tier's index, counters, room and single-tier steps), ``verify``
(checking the persistent tiers), ``handle`` (KVHandle), ``configure`` (tiers from settings),
``store`` (TieredStore: placement, lookup, promotion, eviction, demotion). The names below are
imported from their submodules at first use, so ``import ragcache.kvstore.stats`` costs no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ragcache.kvstore.cpu import CpuTier
    from ragcache.kvstore.device import DeviceTier
    from ragcache.kvstore.disk import DiskTier
    from ragcache.kvstore.entry import (CorruptEntryError, ForeignEntryError, KVEntry, KVMeta, KVSpec, TierError,
                                        TierUnavailableError)
    from ragcache.kvstore.handle import KVHandle
    from ragcache.kvstore.remote import RedisTier
    from ragcache.kvstore.store import GB, TieredStore
    from ragcache.kvstore.tier import Tier, TierUsage

#: each public name -> the submodule that defines it, imported at first use (PEP 562), so that
#: importing one torch-free submodule (``ragcache.kvstore.stats``) does not import torch
_EXPORTS = {
    "CpuTier": "cpu", "DeviceTier": "device", "DiskTier": "disk", "RedisTier": "remote", "KVHandle": "handle",
    "CorruptEntryError": "entry", "ForeignEntryError": "entry", "KVEntry": "entry", "KVMeta": "entry",
    "KVSpec": "entry", "TierError": "entry", "TierUnavailableError": "entry",
    "GB": "store", "TieredStore": "store", "Tier": "tier", "TierUsage": "tier",
}

__all__ = [
    "KVSpec", "KVEntry", "KVMeta", "TieredStore", "KVHandle", "CorruptEntryError", "ForeignEntryError",
    "TierError", "TierUnavailableError", "Tier", "TierUsage", "CpuTier", "DeviceTier", "DiskTier",
    "RedisTier", "GB",
]


def __getattr__(name: str) -> Any:
    """A public name of the package, imported from its submodule on first use.

    Raises:
        AttributeError: ``name`` is not one of ``__all__``.
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
