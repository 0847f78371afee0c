"""In-memory tiers' shared mechanics: a dict of entries kept as tensors on one torch device.

Owns: :class:`MemoryTier` (the base of the ``cpu`` and ``device`` tiers) and its reader. No
capacity or eviction here (see TieredStore). Must not import vLLM.
"""

from __future__ import annotations

import threading
from typing import Iterator

import torch

from ragcache.kvstore.entry import KVMeta, StoredKV
from ragcache.kvstore.tier import EntryStat, TierDefaults


class MemoryReader:
    """Reader over an entry held in memory; layers are views of the stored tensor (no copy).

    Attributes:
        key, meta, stored_bytes: as in :class:`~ragcache.kvstore.format.EntryReader`.
    """

    def __init__(self, item: StoredKV) -> None:
        self.key = item.key
        self.meta = item.meta
        self.stored_bytes = item.nbytes
        self._kv = item.kv

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``layer`` as ``[2, T, H, D]`` on the tier's device; a view unless ``out`` is given.

        Raises:
            IndexError: ``layer`` out of range.
        """
        if not 0 <= layer < self.meta.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.meta.num_layers} layers")
        if out is None:
            return self._kv[layer]
        return out.copy_(self._kv[layer])

    def read_all(self) -> torch.Tensor:
        """``[L, 2, T, H, D]``: the stored tensor itself; callers must not modify it."""
        return self._kv

    def close(self) -> None:
        self._kv = None  # type: ignore[assignment]


class MemoryTier(TierDefaults):
    """Entries as tensors on ``device`` in a dict. Thread-safe.

    Args:
        name: tier name ("cpu" or "device").
        device: where the tensors live.
        pin_memory: pin CPU tensors (page-locked) for fast asynchronous copies to an accelerator.
    """

    memory = True

    def __init__(self, name: str, device: torch.device, pin_memory: bool = False) -> None:
        self.name = name
        self.device = torch.device(device)
        self.pin_memory = pin_memory and self.device.type == "cpu"
        self._items: dict[str, StoredKV] = {}
        self._lock = threading.Lock()

    def _place(self, kv: torch.Tensor) -> torch.Tensor:
        kv = kv.to(self.device)
        if self.pin_memory and not kv.is_pinned():
            try:
                kv = kv.pin_memory()
            except RuntimeError:  # no accelerator runtime to pin with: keep pageable memory
                self.pin_memory = False
        return kv

    def scan(self) -> list[EntryStat]:
        """Every entry with its tensor bytes, in insertion order (no access times kept here)."""
        with self._lock:
            return [EntryStat(key, item.nbytes) for key, item in self._items.items()]

    def contains(self, key: str) -> bool:
        return key in self._items

    def head(self, key: str) -> KVMeta | None:
        item = self._items.get(key)
        return item.meta if item is not None else None

    def open(self, key: str) -> MemoryReader | None:
        item = self._items.get(key)
        return MemoryReader(item) if item is not None else None

    def get(self, key: str) -> StoredKV | None:
        return self._items.get(key)

    def put(self, item: StoredKV) -> int:
        """Keep ``item`` (moved to this tier's device/pinned memory when needed); returns its bytes."""
        kv = self._place(item.kv)
        stored = item if kv is item.kv else StoredKV(item.key, item.meta, kv)
        with self._lock:
            self._items[item.key] = stored
        return item.nbytes

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._items.pop(key, None) is not None

    def pop(self, key: str) -> StoredKV | None:
        """Remove and return the entry (used by the store to demote an evicted one)."""
        with self._lock:
            return self._items.pop(key, None)

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._items))

    def clear(self, prefix: str = "") -> None:
        with self._lock:
            for key in [k for k in self._items if k.startswith(prefix)]:
                del self._items[key]

    def close(self) -> None:
        self.clear()
