"""The availability of one tier: up or down, when to retry it, how long to back off, and warnings
that do not flood the log.

Owns: :class:`TierGuard` (one per tier in the store) and :class:`TierDown`. What counts as
"unreachable" is the tier's business (it raises
:class:`~ragcache.kvstore.entry.TierUnavailableError`); what to do about it is decided here.
Imports only :mod:`ragcache.kvstore.entry`; must not import vLLM, the store, nor anything above
kvstore.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

from ragcache.kvstore.entry import TierUnavailableError

log = logging.getLogger("ragcache.kvstore")

T = TypeVar("T")
WARN_EVERY_SEC = 60.0  # one warning per tier and kind at most this often


class TierDown(Exception):
    """The tier is unavailable and has been marked down; the caller skips it (never leaves the store)."""


class TierGuard:
    """Up/down state and retry back-off of one tier. Thread-safe.

    A call through :meth:`call` that raises ``TierUnavailableError`` marks the tier down (one
    warning per outage) and schedules a retry ``backoff_sec`` later; every further failure doubles
    the wait, up to ``backoff_max_sec``. While the tier is down, :meth:`available` lets one caller
    through when the retry is due (that caller probes the tier; the others keep skipping it), and
    the first call that succeeds marks it up again (one warning) and resets the wait.

    Args:
        name: the tier's name, used in log messages.
        backoff_sec: first wait in seconds before retrying an unreachable tier.
        backoff_max_sec: longest wait in seconds between retries.
        clock: monotonic time in seconds (tests pass a fake one).

    Attributes:
        up: False while the tier is marked down.
        retry_at: ``clock()`` time from which the next retry is allowed (while down).
        backoff: the current wait in seconds.
    """

    def __init__(
        self,
        name: str,
        backoff_sec: float = 2.0,
        backoff_max_sec: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.backoff_sec = float(backoff_sec)
        self.backoff_max_sec = float(backoff_max_sec)
        self.up = True
        self.retry_at = 0.0
        self.backoff = self.backoff_sec
        self._clock = clock
        self._last_warn: dict[str, float] = {}
        self._lock = threading.Lock()

    def available(self) -> bool:
        """True when the tier is up, or down but due for a retry (then only this caller probes it)."""
        if self.up:
            return True
        now = self._clock()
        with self._lock:
            if now >= self.retry_at:
                self.retry_at = now + self.backoff  # others keep skipping while this one probes
                return True
        return False

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, keeping the tier's state: marked down when it raises
        ``TierUnavailableError``, marked up when it succeeds while down.

        Raises:
            TierDown: ``fn`` found the tier unreachable (the tier is now marked down).
            anything else ``fn`` raises, unchanged (the state is left as it was).
        """
        try:
            result = fn(*args)
        except TierUnavailableError as exc:
            self.mark_down(exc)
            raise TierDown from None
        if not self.up:
            self.mark_up()
        return result

    def mark_down(self, exc: Exception) -> None:
        """Record a failure: warn when the tier was up, else double the wait (up to the maximum)."""
        with self._lock:
            if self.up:
                self.up = False
                self.backoff = self.backoff_sec
                log.warning("%s tier unavailable (%s); continuing with the other tiers, retrying every "
                            "%.0f-%.0f s", self.name, exc, self.backoff_sec, self.backoff_max_sec)
            else:
                self.backoff = min(self.backoff * 2, self.backoff_max_sec)
            self.retry_at = self._clock() + self.backoff

    def mark_up(self) -> None:
        """Record that the tier answered again (one warning) and reset the wait."""
        with self._lock:
            if not self.up:
                self.up = True
                self.backoff = self.backoff_sec
                log.warning("%s tier reachable again", self.name)

    def warn(self, kind: str, message: str) -> None:
        """Log ``message`` as a warning unless one of the same ``kind`` (e.g. "write", "read") was
        logged for this tier less than :data:`WARN_EVERY_SEC` seconds ago."""
        now = self._clock()
        with self._lock:
            last = self._last_warn.get(kind)
            if last is not None and now - last < WARN_EVERY_SEC:
                return
            self._last_warn[kind] = now
        log.warning(message)
