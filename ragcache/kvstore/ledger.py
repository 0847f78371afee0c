"""The store's ledger: its lookup counters and the per-tier counters, kept live for this process and
summed across processes in a small counter file beside the disk tier.

Owns: :class:`Ledger` (counting lookups, flushing deltas at most every few seconds, the cumulative
view ``ragcache cache stats`` shows) and :class:`CounterFile` (the file and its lock). What a lookup
is: :mod:`ragcache.kvstore.stats`. Imports only the stats module and the disk tier's atomic write;
must not import vLLM, the store, nor anything above kvstore.

The counter file (``<ssd_cache_dir>/.ragcache-counters.json``) holds the totals of every process
that used the folder since ``since`` (seconds since the epoch)::

    {"version": 1, "since": 1764600000.0, "updated": 1764603600.0,
     "lookups": {"lookups": 40, "head_lookups": 8, "head_hits": 8},
     "tiers": {"cpu": {"hits": 20, ...}, "disk": {...}, "remote": {...}}}

Each process adds only its own deltas, under an exclusive ``flock`` on a lock file beside it, and
replaces the file atomically; so concurrent processes never lose each other's counts. A process
killed with SIGKILL loses at most its last ``flush_sec`` seconds of counts. A damaged file is
started afresh (with a warning).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterable

from ragcache.kvstore.disk import write_atomically
from ragcache.kvstore.stats import LookupCounters, TierCounters

log = logging.getLogger("ragcache.kvstore")

COUNTER_FILE = ".ragcache-counters.json"
FLUSH_SEC = 5.0  # a process writes its counts at most this often (and when the store closes)
_VERSION = 1


def _empty(since: float | None = None) -> dict[str, Any]:
    return {"version": _VERSION, "since": since, "updated": None, "lookups": LookupCounters().as_dict(),
            "tiers": {}}


def _merge(into: dict[str, int], deltas: dict[str, int]) -> None:
    for name, d in deltas.items():
        into[name] = int(into.get(name, 0)) + int(d)


class CounterFile:
    """Cumulative store counters in one JSON file, shared by every process using the folder.

    Args:
        path: the file (its folder is created on the first write).
    """

    def __init__(self, path: os.PathLike | str) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def read(self) -> dict[str, Any]:
        """The totals (see the module docstring); empty ones with ``since`` None when the file does
        not exist yet or cannot be read (a damaged file is reported at DEBUG and read as empty)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("version") != _VERSION:
                raise ValueError(f"unknown counter file format in {self.path}")
            data.setdefault("lookups", {})
            data.setdefault("tiers", {})
            return data
        except FileNotFoundError:
            return _empty()
        except (OSError, ValueError) as exc:
            log.debug("counter file %s unreadable (%s); read as empty", self.path, exc)
            return _empty()

    def add(self, lookups: dict[str, int], tiers: dict[str, dict[str, int]]) -> None:
        """Add counter deltas to the totals (under the file's lock, replaced atomically).

        Raises:
            OSError: the folder or the file cannot be written (e.g. the disk is full).
        """
        with self._locked():
            data = self.read()
            now = time.time()
            if data.get("since") is None:
                data["since"] = now
            _merge(data["lookups"], lookups)
            for name, deltas in tiers.items():
                _merge(data["tiers"].setdefault(name, {}), deltas)
            data["updated"] = now
            self._write(data)

    def reset(self) -> None:
        """Start counting afresh from now.

        Raises:
            OSError: the file cannot be written.
        """
        with self._locked():
            self._write(_empty(since=time.time()))

    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return _FileLock(self.lock_path)

    def _write(self, data: dict[str, Any]) -> None:
        write_atomically(self.path, [json.dumps(data, indent=1, sort_keys=True).encode()])


class _FileLock:
    """An exclusive ``flock`` on ``path`` for the duration of a ``with`` block."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: Any = None

    def __enter__(self) -> "_FileLock":
        self._fh = open(self.path, "a")
        fcntl.flock(self._fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fh, fcntl.LOCK_UN)
        self._fh.close()


class Ledger:
    """The store's counters: lookups (store-wide) and each tier's :class:`TierCounters`.

    Args:
        tiers: ``(name, counters)`` of every tier, top-down (the slots' own counter objects).
        lock: the store's lock; it guards every counter.
        counter_file: where the totals across processes are kept; None = this process only.
        flush_sec: the least seconds between two writes of the counter file.

    Attributes:
        lookups: this process's :class:`LookupCounters`.
        started: when this ledger started counting (seconds since the epoch).
    """

    def __init__(self, tiers: Iterable[tuple[str, TierCounters]], lock: threading.RLock,
                 counter_file: CounterFile | None = None, flush_sec: float = FLUSH_SEC) -> None:
        self.lookups = LookupCounters()
        self._tiers = dict(tiers)
        self._lock = lock
        self.counter_file = counter_file
        self.flush_sec = float(flush_sec)
        self.started = time.time()
        self._flushed = (LookupCounters(), {name: TierCounters() for name in self._tiers})
        self._last_flush = time.monotonic()
        self._flush_lock = threading.Lock()
        self._warned = False
        if counter_file is not None:
            ref = weakref.ref(self)
            atexit.register(lambda: (lambda ledger: ledger and ledger.flush())(ref()))

    # ---- counting (call with or without the store's lock held: it is re-entrant)

    def lookup(self, served: bool, head: bool = False) -> None:
        """Count one lookup (``head``: the prompt head's, counted apart) and whether a tier served
        it. The serving tier's hit is counted by its slot (``TierSlot.record_hit``)."""
        with self._lock:
            if head:
                self.lookups.add(head_lookups=1, head_hits=int(served))
            else:
                self.lookups.add(lookups=1)

    def retract_hit(self, tier: str, head: bool = False) -> None:
        """A lookup ``tier`` served turned out unusable (a damaged layer, a failed read): it is a
        miss after all."""
        with self._lock:
            if head:
                self.lookups.head_hits -= 1
            else:
                self._tiers[tier].hits -= 1

    # ---- views

    def summary(self) -> dict[str, Any]:
        """This process's lookups: ``{lookups, hits, misses, head_lookups, head_hits, since}``
        (``hits`` = chunk lookups any tier served, ``misses`` = lookups none served)."""
        with self._lock:
            hits = sum(c.hits for c in self._tiers.values())
            lk = self.lookups
            return {"lookups": lk.lookups, "hits": hits, "misses": max(0, lk.lookups - hits),
                    "head_lookups": lk.head_lookups, "head_hits": lk.head_hits, "since": self.started}

    def cumulative(self) -> dict[str, Any]:
        """Totals across processes: the counter file plus this process's counts not written yet;
        this process's counts alone (``since`` = its start) without a counter file. Shape as in
        the module docstring."""
        data = self.counter_file.read() if self.counter_file is not None else _empty()
        lookups, tiers = self._deltas()
        _merge(data["lookups"], lookups)
        for name, deltas in tiers.items():
            _merge(data["tiers"].setdefault(name, {}), deltas)
        if data.get("since") is None:
            data["since"] = self.started
        return data

    def reset(self) -> None:
        """Start the cumulative counts afresh (the counter file; this process's live counts stay).

        Raises:
            OSError: the counter file cannot be written.
        """
        self.flush()
        if self.counter_file is not None:
            self.counter_file.reset()

    # ---- persistence

    def _deltas(self) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        with self._lock:
            return (self.lookups.minus(self._flushed[0]),
                    {name: c.minus(self._flushed[1][name]) for name, c in self._tiers.items()})

    def maybe_flush(self) -> None:
        """Write this process's new counts to the counter file when ``flush_sec`` have passed."""
        if self.counter_file is not None and time.monotonic() - self._last_flush >= self.flush_sec:
            self.flush()

    def flush(self) -> None:
        """Write this process's new counts to the counter file now. A failure (e.g. a full disk)
        is logged once and the counts are kept for the next try."""
        if self.counter_file is None or not self._flush_lock.acquire(blocking=False):
            return
        try:
            self._last_flush = time.monotonic()
            with self._lock:
                lookups, tiers = self._deltas()
                snapshot = (LookupCounters(**self.lookups.as_dict()),
                            {name: TierCounters(**c.as_dict()) for name, c in self._tiers.items()})
            if not any(lookups.values()) and not any(v for d in tiers.values() for v in d.values()):
                return
            try:
                self.counter_file.add(lookups, tiers)
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    log.warning("cannot write the KV store's counters to %s (%s); they are kept in memory",
                                self.counter_file.path, exc)
                return
            self._flushed = snapshot
        finally:
            self._flush_lock.release()
