"""The Tier protocol: what every storage medium (device, cpu, disk, remote) offers the store.

Owns: :class:`Tier`, :class:`TierUsage`. A tier is a plain medium: it stores, finds and deletes
entries. It knows nothing about capacity, eviction order, promotion or hit rates; that policy lives
in :class:`ragcache.kvstore.store.TieredStore`. Must not import vLLM.

Error contract for every method (the store relies on it):

- a missing entry is ``None`` / ``False``, never an exception;
- :class:`~ragcache.kvstore.entry.CorruptEntryError`: the entry exists but is damaged (the store
  deletes it); :class:`~ragcache.kvstore.entry.ForeignEntryError`: intact but not ours;
- :class:`~ragcache.kvstore.entry.TierUnavailableError`: the medium cannot be reached right now;
- :class:`OSError` from local files (e.g. ENOSPC on ``put``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable

from ragcache.kvstore.entry import KVMeta, StoredKV
from ragcache.kvstore.format import EntryReader


@dataclass(frozen=True)
class TierUsage:
    """What a tier holds right now.

    Attributes:
        entries: number of stored entries (all models).
        bytes: bytes they occupy in the medium (file/value sizes for disk/remote).
    """

    entries: int
    bytes: int


@runtime_checkable
class Tier(Protocol):
    """One storage medium for KV entries.

    Attributes:
        name: "device", "cpu", "disk" or "remote"; used in stats and returned by ``get``.
        memory: True for in-memory tiers (fast, lost at exit), False for persistent ones.
    """

    name: str
    memory: bool

    def contains(self, key: str) -> bool:
        """Whether an entry is stored under ``key`` (not validated)."""
        ...

    def head(self, key: str) -> KVMeta | None:
        """Validated metadata of the entry under ``key`` without reading its tensors; None = absent."""
        ...

    def open(self, key: str) -> EntryReader | None:
        """A reader over the entry (header validated, tensors read lazily); None = absent."""
        ...

    def get(self, key: str) -> StoredKV | None:
        """The whole entry, checksums verified; None = absent."""
        ...

    def put(self, item: StoredKV) -> int:
        """Store ``item`` under ``item.key``, replacing any entry there; return bytes written."""
        ...

    def delete(self, key: str) -> bool:
        """Remove the entry; True when one was there."""
        ...

    def keys(self) -> Iterator[str]:
        """Keys of all stored entries (any model)."""
        ...

    def clear(self) -> None:
        """Remove every entry."""
        ...

    def usage(self) -> TierUsage:
        """Entries and bytes stored now."""
        ...

    def touch(self, key: str) -> None:
        """Record an access where the medium keeps one (disk: file mtime); may do nothing."""
        ...

    def close(self) -> None:
        """Release connections/handles; the tier is not used afterwards."""
        ...
