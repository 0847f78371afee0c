"""One tier as the store holds it: the medium with its capacity, eviction index, availability guard
and counters, and the steps that touch that tier alone (guarded open/delete/contains, counting a
hit, discarding a damaged entry, rebuilding the index from a scan).

Owns: :class:`TierSlot`. Everything that involves two tiers (placement, lookup order, promotion,
eviction with demotion) is the store's. Imports only the entry, format, guard, policy, stats and
tier modules; must not import vLLM, the store, nor anything above kvstore.
"""

from __future__ import annotations

import logging
import threading
import time

from ragcache.kvstore.entry import CorruptEntryError, ForeignEntryError, KVSpec, TierError
from ragcache.kvstore.format import EntryReader
from ragcache.kvstore.guard import TierDown, TierGuard
from ragcache.kvstore.policy import EvictionIndex
from ragcache.kvstore.stats import TierCounters
from ragcache.kvstore.tier import Tier, TierUsage

log = logging.getLogger("ragcache.kvstore")


class TierSlot:
    """A tier with the store's state for it.

    Args:
        tier: the medium.
        capacity: bytes it may hold; None = unbounded (remote: sized by Redis itself).
        policy: eviction policy of its index, "lru" or "lfu".
        guard: its availability state.
        lock: the store's re-entrant lock, shared by every slot: it guards the index, the counters
            and the memory tiers' contents; persistent tiers' I/O runs outside it.

    Attributes:
        tier, capacity, guard: as given.
        index: sizes and access order of its entries (bytes), kept for bounded and memory tiers;
            None for an unbounded persistent tier.
        counters: what the tier did in this process.
        last_scan: ``time.monotonic()`` of the last :meth:`rescan`.
    """

    def __init__(self, tier: Tier, capacity: int | None, policy: str, guard: TierGuard,
                 lock: threading.RLock) -> None:
        self.tier = tier
        self.capacity = capacity
        self.policy = policy
        self.index = EvictionIndex(policy) if capacity is not None or tier.memory else None
        self.guard = guard
        self.counters = TierCounters()
        self.last_scan = 0.0
        self._lock = lock

    @property
    def name(self) -> str:
        return self.tier.name

    def count(self, **deltas: int) -> None:
        """Add to the counters by name (see :class:`~ragcache.kvstore.stats.TierCounters`)."""
        with self._lock:
            self.counters.add(**deltas)

    def probe(self) -> None:
        """Ping the tier so that an unreachable one is marked down now, not at the first lookup."""
        try:
            self.guard.call(self.tier.ping)
        except (TierDown, TierError, OSError):
            pass

    def rescan(self) -> None:
        """Rebuild a bounded persistent tier's index from ``scan`` (disk: LRU order = file mtime),
        keeping the recorded access counts of entries still present. Other processes may have
        added or removed entries since the last scan. No-op for an unbounded tier."""
        if self.index is None:
            return
        try:
            found = self.guard.call(self.tier.scan)
        except TierDown:
            return
        except (TierError, OSError) as exc:
            self.guard.warn("scan", f"{self.name} tier: cannot scan ({exc})")
            return
        with self._lock:
            old = self.index
            fresh = EvictionIndex(self.policy)
            for f in found:
                fresh.add(f.key, f.size, max(1, old.freq(f.key)))
            self.index = fresh
            self.last_scan = time.monotonic()

    def usage(self) -> TierUsage:
        """What the tier holds now; zero when it is down (or fails to say)."""
        if self.tier.memory:
            with self._lock:
                return self.tier.usage()
        if self.guard.up or self.guard.available():
            try:
                return self.guard.call(self.tier.usage)
            except (TierDown, TierError, OSError):
                pass
        return TierUsage(0, 0)

    def open_checked(self, key: str, spec: KVSpec) -> EntryReader | None:
        """A reader over ``key`` when the tier holds a usable entry of ``spec``; else None, with the
        miss counted (and a damaged entry discarded, a foreign one counted and left in place)."""
        try:
            if self.tier.memory:
                with self._lock:
                    reader = self.tier.open(key)
            else:
                reader = self.guard.call(self.tier.open, key)
        except TierDown:
            return None
        except CorruptEntryError as exc:
            self.discard_corrupt(key, exc, count_miss=True)
            return None
        except ForeignEntryError:
            self.count(misses=1, foreign=1)
            return None
        except (TierError, OSError) as exc:
            self.read_failed(key, exc)
            return None
        if reader is None:
            self.count(misses=1)
            return None
        reason = spec.mismatch(reader.meta)
        if reason is not None:
            reader.close()
            log.debug("%s tier: entry %r is foreign (%s)", self.name, key, reason)
            self.count(misses=1, foreign=1)
            return None
        return reader

    def read_failed(self, key: str, exc: Exception) -> None:
        """Reading ``key`` failed (I/O error): warn (rate-limited) and count a miss."""
        self.guard.warn("read", f"{self.name} tier: reading {key!r} failed ({exc}); treated as a miss")
        self.count(misses=1)

    def record_hit(self, key: str, stored_bytes: int, nbytes_read: int) -> None:
        """Count a hit on ``key`` (``nbytes_read`` bytes read now) and record the access in the
        index and the medium; an entry another process wrote is added to the index."""
        with self._lock:
            self.counters.hits += 1
            self.counters.bytes_read += nbytes_read
            if self.index is not None:
                if key in self.index:
                    self.index.touch(key)
                elif not self.tier.memory:
                    self.index.add(key, stored_bytes, 1)  # written by another process
        if not self.tier.memory:
            self.tier.touch(key)

    def discard_corrupt(self, key: str, exc: CorruptEntryError, count_miss: bool = False) -> None:
        """Log, count (``corrupt``, and a miss when ``count_miss``) and delete a damaged entry."""
        log.warning("%s tier: %s; deleted, treated as a miss", self.name, exc)
        self.count(corrupt=1, misses=1 if count_miss else 0)
        self.delete(key)

    def delete(self, key: str) -> bool:
        """Remove ``key`` from the index and the tier; True when the tier held it. A tier that is
        down or fails is skipped (False)."""
        if self.tier.memory:
            with self._lock:
                if self.index is not None:
                    self.index.remove(key)
                return self.tier.delete(key)
        with self._lock:
            if self.index is not None:
                self.index.remove(key)
        if not self.guard.available():
            return False
        try:
            return bool(self.guard.call(self.tier.delete, key))
        except TierDown:
            return False
        except (TierError, OSError) as exc:
            self.guard.warn("delete", f"{self.name} tier: deleting {key!r} failed ({exc})")
            return False

    def holds(self, key: str) -> bool:
        """Whether an entry is stored under ``key``; True when the tier cannot tell (so nothing is
        written into it)."""
        if self.tier.memory:
            with self._lock:
                return self.tier.contains(key)
        try:
            return bool(self.guard.call(self.tier.contains, key))
        except (TierDown, TierError, OSError):
            return True
