"""Per-tier statistics of the store: the counters, one tier's row of ``TieredStore.stats()``, the
hit-rate line and the thread that logs it periodically.

Owns: :class:`TierCounters`, :func:`stats_row`, :func:`hit_rate_line`, :class:`HitRateLog`. Does
no I/O on the tiers and takes no lock of the store's (the store holds its lock while it reads the
counters). Imports only :mod:`ragcache.kvstore.tier`; must not import vLLM, the store, nor anything
above kvstore.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ragcache.kvstore.tier import TierUsage

log = logging.getLogger("ragcache.kvstore")


@dataclass
class TierCounters:
    """What one tier did in this process since the store was created (not thread-safe on its own).

    Attributes:
        hits: lookups (``get``/``open``) served by the tier.
        misses: lookups that reached the tier and were not served (absent, foreign, damaged).
        bytes_read: bytes of K/V read from the tier (storage dtype).
        bytes_written: bytes written into the tier (file/value size for disk/remote).
        evictions: entries evicted to stay within the tier's capacity.
        corrupt: damaged entries found (and deleted).
        foreign: entries of another model/layout/format found (left in place).
        write_errors: writes that failed and were skipped.
    """

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    corrupt: int = 0
    foreign: int = 0
    write_errors: int = 0

    def add(self, **deltas: int) -> None:
        """Add to counters by name, e.g. ``add(misses=1, foreign=1)``.

        Raises:
            AttributeError: a name that is not a counter.
        """
        for name, d in deltas.items():
            setattr(self, name, getattr(self, name) + d)

    @property
    def lookups(self) -> int:
        """Hits plus misses."""
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """hits / lookups; 0.0 before any lookup."""
        return self.hits / self.lookups if self.lookups else 0.0


def stats_row(counters: TierCounters, usage: TierUsage, capacity: int | None, up: bool) -> dict[str, Any]:
    """One tier's entry of ``TieredStore.stats()``: the counters, ``hit_rate``, ``entries`` and
    ``occupancy_bytes`` from ``usage``, ``capacity_bytes`` (None = unbounded) and ``up``."""
    c = counters
    return {
        "hits": c.hits, "misses": c.misses, "hit_rate": c.hit_rate,
        "bytes_read": c.bytes_read, "bytes_written": c.bytes_written,
        "evictions": c.evictions, "corrupt": c.corrupt, "foreign": c.foreign,
        "write_errors": c.write_errors,
        "entries": usage.entries, "occupancy_bytes": usage.bytes,
        "capacity_bytes": capacity, "up": up,
    }


def hit_rate_line(tiers: Iterable[tuple[str, TierCounters, bool]]) -> str:
    """One line of hit rates from ``(tier name, counters, up)`` top-down, e.g.
    ``cpu 75.0% (3/4) | disk 100.0% (1/1) | remote - (0/0) DOWN``."""
    parts = []
    for name, c, up in tiers:
        rate = f"{100.0 * c.hit_rate:.1f}%" if c.lookups else "-"
        parts.append(f"{name} {rate} ({c.hits}/{c.lookups})" + ("" if up else " DOWN"))
    return " | ".join(parts)


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
