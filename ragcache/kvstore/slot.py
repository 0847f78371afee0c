"""One tier as the store holds it: the medium with its capacity, eviction index, availability guard
and counters, and the steps that touch that tier alone (guarded open/delete/contains, counting a
hit, discarding a damaged entry, rebuilding the index from a scan, planning room for a write).

Owns: :class:`TierSlot`. Everything that involves two tiers (placement, lookup order, promotion,
eviction with demotion) is the store's. Imports only the entry, format, guard, policy, stats and
tier modules; must not import vLLM, the store, nor anything above kvstore.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from typing import Callable

from ragcache.kvstore.entry import CorruptEntryError, ForeignEntryError, KVMeta, StoredKV, TierError
from ragcache.kvstore.format import EntryReader, encode_header
from ragcache.kvstore.guard import TierDown, TierGuard
from ragcache.kvstore.policy import EvictionIndex, Victim
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
        counters: what the tier did in this process (see :mod:`~ragcache.kvstore.stats`).
        last_scan: ``time.monotonic()`` of the last :meth:`rescan`.
        full_warned: whether the one "tier full" warning was logged.
        foreign_warned: the kinds of foreign entry (:meth:`found_foreign`) already logged as a warning.
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
        self.full_warned = False
        self.foreign_warned: set[str] = set()
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

    def free_bytes(self) -> int | None:
        """Bytes the medium can still take, or None where it cannot tell (memory, remote, down)."""
        if self.tier.memory or not self.guard.up:
            return None
        try:
            return self.tier.free_bytes()
        except (TierError, OSError):
            return None

    def effective_capacity(self, used: int | None = None) -> int | None:
        """Bytes the tier may hold now: its capacity, but no more than what it holds (``used``,
        default: its index) plus what the medium has free. None = unbounded."""
        free = self.free_bytes()
        if free is None:
            return self.capacity
        if used is None:
            with self._lock:
                used = self.index.used_bytes if self.index is not None else 0
        room = used + free
        return room if self.capacity is None else min(self.capacity, room)

    def warn_if_capped(self) -> bool:
        """Warn once when the medium holds less than the tier's setting (a disk tier whose filesystem
        is smaller than ``store.ssd_cache_max_gb``): the tier is capped there and evicts beyond it.
        Returns whether it warned."""
        room = self.effective_capacity()
        if self.capacity is None or room is None or room >= self.capacity:
            return False
        with self._lock:
            used = self.index.used_bytes if self.index is not None else 0
        where = getattr(self.tier, "root", None)
        log.warning("%s tier%s: its setting allows %.1f GB but the filesystem holds at most %.1f MB for it "
                    "(%.1f MB held now + %.1f MB free); the tier is capped at %.1f MB and evicts beyond it "
                    "(store.ssd_cache_max_gb; free space or point store.ssd_cache_dir at a larger disk)",
                    self.name, f" in {where}" if where else "", self.capacity / 1e9, room / 1e6, used / 1e6,
                    (room - used) / 1e6, room / 1e6)
        return True

    def plan_room(self, need: int, protect: str) -> list[Victim] | None:
        """Make room for a write of ``need`` bytes (the file/value size): the entries to evict,
        already removed from the index ([] when it fits now), or None when it cannot fit even
        with every other entry evicted (then nothing is evicted). Only the capacity counts where
        the medium cannot tell its free space.
        """
        free = self.free_bytes()
        with self._lock:
            if self.index is None:
                return [] if free is None or need <= free else None
            held = self.index.used_bytes - (self.index.size(protect) or 0)
            if self.capacity is not None and need > self.capacity:
                return None
            if free is not None and need > free + held:
                return None
            short = need - free if free is not None else 0
            if self.capacity is not None:
                short = max(short, held + need - self.capacity)
            return self.index.pop_bytes(short, protect=protect) if short > 0 else []

    def not_stored(self, key: str, need: int, why: str) -> None:
        """Count an entry of ``need`` bytes not stored for lack of room; the first one is logged as a
        warning (later ones only counted: ``not_stored`` in the stats, the ingest summary)."""
        with self._lock:
            self.counters.not_stored += 1
            first, self.full_warned = not self.full_warned, True
        if first:
            log.warning("%s tier %s: entry %r (%.1f MB) not stored; further entries that do not fit are "
                        "only counted (not_stored in `ragcache cache stats`)", self.name, why, key, need / 1e6)

    def stored_size(self, item: StoredKV) -> int:
        """Bytes ``item`` takes in this persistent tier: header and data, rounded up to the
        medium's allocation unit where it has one (a filesystem block)."""
        n = len(encode_header(item.key, item.meta)) + item.nbytes
        block = getattr(self.tier, "block_size", lambda: 1)()
        return -(-n // block) * block

    def write(self, item: StoredKV, drop: Callable[[list[Victim]], None]) -> int | None:
        """Write ``item`` into this persistent tier after making room for it (:meth:`plan_room`;
        ``drop`` evicts the entries chosen, demoting them as the store sees fit).

        Returns:
            bytes written, or None when skipped: tier down; no room (counted as ``not_stored``,
            one warning); another failure (counted as ``write_errors``, logged). A write that
            still fails with ENOSPC (other writers took the space) rescans and retries once.
        """
        need = self.stored_size(item)
        failure: Exception | None = None
        for attempt in (1, 2):
            victims = self.plan_room(need, item.key)
            if victims is None:
                free = self.free_bytes()
                room = "" if free is None else f", {free / 1e6:.1f} MB free on the filesystem"
                self.not_stored(item.key, need, f"full{room}, even with every other entry evicted")
                return None
            drop(victims)
            try:
                return self.guard.call(self.tier.put, item)
            except TierDown:
                return None
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    failure = exc
                    break
                if attempt == 2:
                    self.not_stored(item.key, need, f"full ({exc})")
                    return None
                self.rescan()  # the free space changed under us: look again
            except TierError as exc:
                failure = exc
                break
        self.count(write_errors=1)
        self.guard.warn("write", f"{self.name} tier: write of {item.key!r} failed ({failure}); skipped")
        return None

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

    def open_checked(self, key: str, mismatch: Callable[[KVMeta], str | None]) -> EntryReader | None:
        """A reader over ``key`` when the tier holds a usable entry (``mismatch(meta)`` is None: the
        store's model, layout and stored form); else None (a damaged entry discarded and counted, a
        foreign one counted and left in place, a failed read counted). Lookups are counted by the
        store, not here."""
        try:
            if self.tier.memory:
                with self._lock:
                    reader = self.tier.open(key)
            else:
                reader = self.guard.call(self.tier.open, key)
        except TierDown:
            return None
        except CorruptEntryError as exc:
            self.discard_corrupt(key, exc)
            return None
        except ForeignEntryError as exc:
            self.found_foreign(key, str(exc), "format")
            return None
        except (TierError, OSError) as exc:
            self.read_failed(key, exc)
            return None
        if reader is None:
            return None
        reason = mismatch(reader.meta)
        if reason is not None:
            reader.close()
            self.found_foreign(key, f"entry {key!r} is foreign: {reason}", reason)
            return None
        return reader

    def found_foreign(self, key: str, why: str, kind: str) -> None:
        """Count (``foreign``) an entry under ``key`` this store does not serve, left in place: ``why``
        says what it is. The first entry of each ``kind`` (a format, or one difference from the
        store's spec) in this tier is logged as a warning; later ones at debug level only (a folder
        written under another ``kv_compression`` would otherwise log a line per chunk)."""
        with self._lock:
            self.counters.foreign += 1
            first = kind not in self.foreign_warned
            self.foreign_warned.add(kind)
        if first:
            log.warning("%s tier: %s; left in place, treated as a miss (further entries like it are only "
                        "counted: foreign in `ragcache cache stats`)", self.name, why)
        else:
            log.debug("%s tier: %s; left in place, treated as a miss", self.name, why)

    def read_failed(self, key: str, exc: Exception) -> None:
        """Reading ``key`` failed (I/O error): warn (rate-limited) and count it (``read_errors``)."""
        self.guard.warn("read", f"{self.name} tier: reading {key!r} failed ({exc}); treated as a miss")
        self.count(read_errors=1)

    def record_hit(self, key: str, stored_bytes: int, nbytes_read: int, chunk: bool = True) -> None:
        """Count a hit on ``key`` (``nbytes_read`` bytes read now; ``chunk`` False for the prompt
        head, whose lookups are counted apart) and record the access in the index and the medium;
        an entry another process wrote is added to the index."""
        with self._lock:
            self.counters.hits += int(chunk)
            self.counters.bytes_read += nbytes_read
            if self.index is not None:
                if key in self.index:
                    self.index.touch(key)
                elif not self.tier.memory:
                    self.index.add(key, stored_bytes, 1)  # written by another process
        if not self.tier.memory:
            self.tier.touch(key)

    def discard_corrupt(self, key: str, exc: CorruptEntryError) -> None:
        """Log, count (``corrupt``) and delete a damaged entry."""
        log.warning("%s tier: %s; deleted, treated as a miss", self.name, exc)
        self.count(corrupt=1)
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
