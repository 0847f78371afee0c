"""Statistics of the store: what a lookup is, the counters, one tier's row of ``TieredStore.stats()``,
the hit-rate line and the thread that logs it periodically.

Owns: :class:`TierCounters`, :class:`LookupCounters`, :func:`stats_row`, :func:`hit_rate_line`,
:class:`HitRateLog`. Does no I/O on the tiers and takes no lock of the store's (the store holds its
lock while it reads the counters). Imports nothing of ragcache at run time (:mod:`ragcache.kvstore.tier`
for type hints only), and so no torch: the driver's :class:`~ragcache.engine.messages.TierStats` takes
its counter fields from :class:`TierCounters`. Must not import vLLM, the store, nor anything above kvstore.

One definition of a lookup, used by the store, the per-request ``tier_hits``, the UI, the CLI and
the log line:

- a *chunk lookup* is one ``open``/``get`` of a retrieved chunk's entry; the prompt head's lookup
  is counted apart (``head_lookups``, ``head_hits``) and in no tier's hits;
- it ends in exactly one outcome: a *hit* of the tier that served it, or a *miss* (no tier served
  it: the chunk was computed during the request);
- an entry that fails a check while it is read (checksum, truncation) does not serve the lookup:
  a miss, counted under that tier's ``corrupt``; a tier that is down when a lookup reaches it
  counts the lookup under ``unavailable``.

Keys in a private namespace (:func:`ragcache.chunks.is_private_key`: the start-up self-check's own
KV) count in none of the lookup, hit, miss, unavailable and byte counters: they are ragcache's
traffic, not the users'.

So for every tier, ``hits + misses == lookups`` (its ``misses`` are the chunk lookups it did not
serve), and the tiers' hits plus the store's misses equal the chunk lookups: hit rates add up.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from ragcache.kvstore.tier import TierUsage

log = logging.getLogger("ragcache.kvstore")


@dataclass
class _Counters:
    """Counters added by name (not thread-safe on their own)."""

    def add(self, **deltas: int) -> None:
        """Add to counters by name, e.g. ``add(hits=1, bytes_read=4096)``.

        Raises:
            AttributeError: a name that is not a counter.
        """
        for name, d in deltas.items():
            if name not in self._names():
                raise AttributeError(f"{type(self).__name__} has no counter {name!r}")
            setattr(self, name, getattr(self, name) + d)

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def minus(self, other: "_Counters") -> dict[str, int]:
        """``self - other`` per counter (the deltas since ``other`` was copied)."""
        return {n: getattr(self, n) - getattr(other, n) for n in self._names()}


@dataclass
class TierCounters(_Counters):
    """What one tier did.

    Attributes:
        hits: chunk lookups served by the tier (never the prompt head's).
        unavailable: chunk lookups that reached the tier while it was down.
        corrupt: damaged entries found (bad header, truncated, checksum mismatch) and deleted.
        foreign: entries of another model/layout/format found (left in place).
        read_errors: reads that failed with an I/O error (the lookup went on below).
        bytes_read: bytes of K/V read from the tier (storage dtype).
        bytes_written: bytes written into the tier (file/value size for disk/remote).
        evictions: entries evicted to stay within the tier's capacity or to make room.
        write_errors: writes that failed for another reason than room (e.g. Redis errors).
        not_stored: entries not stored for lack of room: larger than the tier's capacity, or the
            medium is full and evicting everything would not make room.
    """

    hits: int = 0
    unavailable: int = 0
    corrupt: int = 0
    foreign: int = 0
    read_errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    write_errors: int = 0
    not_stored: int = 0


@dataclass
class LookupCounters(_Counters):
    """The store's lookups (see the module docstring).

    Attributes:
        lookups: chunk lookups (one per retrieved chunk per request, and per ``get``).
        head_lookups: lookups of the prompt head (counted apart).
        head_hits: head lookups served by a tier.
    """

    lookups: int = 0
    head_lookups: int = 0
    head_hits: int = 0


def stats_row(counters: TierCounters, lookups: int, usage: TierUsage, capacity: int | None, up: bool,
              **extra: Any) -> dict[str, Any]:
    """One tier's entry of ``TieredStore.stats()``.

    Args:
        counters: the tier's counters.
        lookups: the store's chunk lookups (every tier's denominator).
        usage: what the tier holds now.
        capacity: bytes it may hold now (None = unbounded).
        up: whether it is reachable.
        extra: more fields (e.g. ``free_bytes``).

    Returns:
        the counters plus ``lookups``, ``misses`` (= lookups - hits: chunk lookups this tier did
        not serve), ``hit_rate`` (= hits / lookups, 0.0 before any), ``entries``,
        ``occupancy_bytes``, ``capacity_bytes`` and ``up``.
    """
    c = counters
    return {
        **c.as_dict(), "lookups": lookups, "misses": max(0, lookups - c.hits),
        "hit_rate": c.hits / lookups if lookups else 0.0,
        "entries": usage.entries, "occupancy_bytes": usage.bytes, "capacity_bytes": capacity, "up": up,
        **extra,
    }


def hit_rate_line(lookups: LookupCounters, tiers: Iterable[tuple[str, TierCounters, bool]]) -> str:
    """One line of hit rates: the share of chunk lookups each tier served, then the misses and the
    head, e.g. ``12 lookups: cpu 50.0% (6) | disk 25.0% (3) | remote 0.0% (0) DOWN | miss 25.0% (3);
    head 4/4``. The percentages add up to 100."""
    n = lookups.lookups

    def share(k: int) -> str:
        return f"{100.0 * k / n:.1f}% ({k})" if n else f"- ({k})"

    parts, served = [], 0
    for name, c, up in tiers:
        served += c.hits
        parts.append(f"{name} {share(c.hits)}" + ("" if up else " DOWN"))
    parts.append(f"miss {share(max(0, n - served))}")
    return f"{n} lookups: " + " | ".join(parts) + f"; head {lookups.head_hits}/{lookups.head_lookups}"


class HitRateLog:
    """A daemon thread that logs ``"kv hit rates: " + line()`` at INFO on the ``ragcache.kvstore``
    logger every ``interval`` seconds until :meth:`stop`. A failing ``line`` is logged at DEBUG and
    never ends the thread.

    Args:
        line: returns the line to log (``TieredStore.hit_rate_line``).
        interval: seconds between lines.
    """

    def __init__(self, line: Callable[[], str], interval: float) -> None:
        self._line = line
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(float(interval),),
                                        name="ragcache-kvstore-hit-rates", daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                log.info("kv hit rates: %s", self._line())
            except Exception:  # the logger thread must never die of a formatting problem
                log.debug("hit-rate logging failed", exc_info=True)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait up to ``timeout`` seconds for it. Idempotent."""
        self._stop.set()
        self._thread.join(timeout=timeout)
