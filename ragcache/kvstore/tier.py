"""The Tier protocol: what every storage medium (device, cpu, disk, remote) offers the store.

Owns: :class:`Tier`, :class:`TierDefaults`, :class:`TierUsage`, :class:`EntryStat`. A tier is a plain medium: it stores,
finds and deletes entries. It knows nothing about capacity, eviction order, promotion or hit rates;
that policy lives in :class:`ragcache.kvstore.store.TieredStore`. Must not import vLLM.

Error contract for every method (the store relies on it):

- a missing entry is ``None`` / ``False``, never an exception;
- :class:`~ragcache.kvstore.entry.CorruptEntryError`: the entry exists but is damaged (the store
  deletes it); :class:`~ragcache.kvstore.entry.ForeignEntryError`: intact but not ours;
- :class:`~ragcache.kvstore.entry.TierUnavailableError`: the medium cannot be reached right now;
- :class:`OSError` from local files (e.g. ENOSPC on ``put``).

``ping``, ``scan`` and ``pop`` exist on every tier, so the store treats all of them alike: a memory
tier answers ``ping`` with True, ``scan`` lists its entries, ``pop`` removes and returns one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, runtime_checkable

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

    @classmethod
    def of(cls, stats: Iterable["EntryStat"]) -> "TierUsage":
        """Usage summed over the entries a :meth:`Tier.scan` listed."""
        sizes = [s.size for s in stats]
        return cls(len(sizes), sum(sizes))


@dataclass(frozen=True)
class EntryStat:
    """One stored entry as :meth:`Tier.scan` lists it (nothing is read or validated).

    Attributes:
        key: entry key.
        size: bytes it occupies in the medium (file or value size; tensor bytes in memory).
        mtime: last access time in seconds since the epoch where the medium keeps one (disk: the
            file's mtime); 0.0 where it does not (memory, remote).
    """

    key: str
    size: int
    mtime: float = 0.0


@runtime_checkable
class Tier(Protocol):
    """One storage medium for KV entries.

    Attributes:
        name: "device", "cpu", "disk" or "remote"; used in stats and returned by ``get``.
        memory: True for in-memory tiers (fast, lost at exit), False for persistent ones.
    """

    name: str
    memory: bool

    def ping(self) -> bool:
        """True when the medium can be reached (always, for memory and disk).

        Raises:
            TierUnavailableError: it cannot (remote).
        """
        ...

    def scan(self) -> list[EntryStat]:
        """Every stored entry (any model) with its size, least recently used first where the
        medium records access times (the order an eviction index is rebuilt in), else in the
        medium's own order."""
        ...

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

    def pop(self, key: str) -> StoredKV | None:
        """Remove the entry and return it (checksums verified); None = absent. On a persistent
        tier a damaged entry raises CorruptEntryError and is left for the caller to delete."""
        ...

    def keys(self) -> Iterator[str]:
        """Keys of all stored entries (any model)."""
        ...

    def clear(self, prefix: str = "") -> None:
        """Remove every entry whose key starts with ``prefix`` (every entry when it is "")."""
        ...

    def usage(self) -> TierUsage:
        """Entries and bytes stored now."""
        ...

    def free_bytes(self) -> int | None:
        """Bytes the medium can still take (disk: what the filesystem has free for us), or None
        where it cannot tell (memory, remote: their limits are set elsewhere)."""
        ...

    def touch(self, key: str) -> None:
        """Record an access where the medium keeps one (disk: file mtime); may do nothing."""
        ...

    def close(self) -> None:
        """Release connections/handles; the tier is not used afterwards."""
        ...


class TierDefaults:
    """The :class:`Tier` methods most media share, for a tier class to inherit and override where
    its medium does more: ``ping`` is always True (memory, a local folder), ``head`` and ``get`` read
    the entry through the tier's own ``open``, ``usage`` sums :meth:`Tier.scan`, ``free_bytes`` cannot
    tell (None), ``touch`` and ``close`` do nothing."""

    def ping(self) -> bool:
        """Always True: the medium is always there (failures show up as errors on use)."""
        return True

    def head(self, key: str) -> KVMeta | None:
        """The entry's validated metadata, from ``self.open(key)`` (closed at once); None = absent.

        Raises:
            as ``self.open``.
        """
        reader = self.open(key)  # type: ignore[attr-defined]
        if reader is None:
            return None
        reader.close()
        return reader.meta

    def get(self, key: str) -> StoredKV | None:
        """The whole entry, read through ``self.open(key)`` (every layer's checksum verified, the
        reader closed); None = absent.

        Raises:
            as ``self.open`` and the reader's ``read_all`` (CorruptEntryError on a checksum mismatch).
        """
        reader = self.open(key)  # type: ignore[attr-defined]
        if reader is None:
            return None
        try:
            return StoredKV(key, reader.meta, reader.read_all())
        finally:
            reader.close()

    def usage(self) -> TierUsage:
        """Entries and bytes stored now, summed over ``self.scan()``."""
        return TierUsage.of(self.scan())  # type: ignore[attr-defined]

    def free_bytes(self) -> int | None:
        """None: the medium's room is set elsewhere (a capacity setting, Redis' ``maxmemory``)."""
        return None

    def touch(self, key: str) -> None:
        """Nothing: the medium keeps no access times."""

    def close(self) -> None:
        """Nothing: no connections or handles to release."""


def get_then_delete(tier: Tier, key: str) -> StoredKV | None:
    """``pop`` for a medium without an atomic remove-and-return: ``get``, then ``delete`` when found.

    Raises:
        as ``tier.get`` / ``tier.delete``; nothing is deleted when ``get`` raises.
    """
    item = tier.get(key)
    if item is not None:
        tier.delete(key)
    return item
