"""Eviction order for one capacity-bounded tier: LRU or LFU over entry sizes in bytes.

Owns: :class:`EvictionIndex`, the bookkeeping the store keeps per tier (which entries, how big,
how recently and how often used). Holds no tensors and does no I/O; not thread-safe on its own
(TieredStore's lock guards it). Must not import vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Literal

Policy = Literal["lru", "lfu"]


@dataclass
class Victim:
    """An entry chosen for eviction.

    Attributes:
        key: its key.
        size: bytes it occupied.
        freq: accesses recorded (carried along when it is demoted, for LFU).
    """

    key: str
    size: int
    freq: int


@dataclass
class _Rec:
    size: int
    freq: int


class EvictionIndex:
    """Entries of one tier in access order, with sizes (bytes) and access counts.

    ``lru`` evicts the least recently used entry first; ``lfu`` the least frequently used one,
    the least recently used among equals.
    """

    def __init__(self, policy: Policy = "lru") -> None:
        if policy not in ("lru", "lfu"):
            raise ValueError(f"eviction policy must be 'lru' or 'lfu', got {policy!r}")
        self.policy = policy
        self._recs: OrderedDict[str, _Rec] = OrderedDict()  # least recently used first
        self.used_bytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._recs

    def __len__(self) -> int:
        return len(self._recs)

    def add(self, key: str, size: int, freq: int = 1) -> None:
        """Insert (or replace) ``key`` as the most recently used entry, with ``freq`` accesses."""
        old = self._recs.pop(key, None)
        if old is not None:
            self.used_bytes -= old.size
            freq = max(freq, old.freq)
        self._recs[key] = _Rec(int(size), int(freq))
        self.used_bytes += int(size)

    def touch(self, key: str) -> None:
        """Record an access: most recently used, one more use."""
        rec = self._recs.get(key)
        if rec is not None:
            rec.freq += 1
            self._recs.move_to_end(key)

    def size(self, key: str) -> int | None:
        """Bytes recorded for ``key``, or None when unknown."""
        rec = self._recs.get(key)
        return rec.size if rec is not None else None

    def freq(self, key: str) -> int:
        rec = self._recs.get(key)
        return rec.freq if rec is not None else 0

    def remove(self, key: str) -> int | None:
        """Forget ``key``; return its size, or None when unknown."""
        rec = self._recs.pop(key, None)
        if rec is None:
            return None
        self.used_bytes -= rec.size
        return rec.size

    def clear(self) -> None:
        self._recs.clear()
        self.used_bytes = 0

    def _order(self) -> Iterable[tuple[str, _Rec]]:
        items = list(self._recs.items())  # least recently used first
        if self.policy == "lfu":
            items.sort(key=lambda kv: kv[1].freq)  # stable: ties stay in LRU order
        return items

    def pop_victims(self, capacity: int, protect: str | None = None) -> list[Victim]:
        """Remove and return entries, in eviction order, until at most ``capacity`` bytes are used.

        ``protect`` (the entry just inserted) is never chosen.
        """
        return self._pop(lambda: self.used_bytes > capacity, protect)

    def pop_bytes(self, nbytes: int, protect: str | None = None) -> list[Victim]:
        """Remove and return entries, in eviction order, until at least ``nbytes`` are freed."""
        target = self.used_bytes - nbytes
        return self._pop(lambda: self.used_bytes > target, protect)

    def _pop(self, more, protect: str | None) -> list[Victim]:
        out: list[Victim] = []
        if not more():
            return out
        for key, rec in self._order():
            if key == protect:
                continue
            self.remove(key)
            out.append(Victim(key, rec.size, rec.freq))
            if not more():
                break
        return out
