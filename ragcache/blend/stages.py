"""Where a blend's wall time goes: seconds per named stage, adding up to the whole.

Owns: :class:`StageClock` (``with clock("name"): ...`` books a block's wall time), :class:`Timed` (a
callable booked to its own stage and out of the one open around it) and :func:`synchronize` (wait
for an accelerator's queued kernels, so wall times are real). Used by the layer-wise forwards
(:mod:`ragcache.blend.forward`) and the reused-KV sources (:mod:`ragcache.blend.reused`).
Must not import vLLM, transformers, or anything above blend/ in ragcache.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class StageClock:
    """Seconds per named stage: ``with clock("name"): ...`` adds the block's wall time.

    Time spent inside a :class:`Timed` callable (an engine callback, the attention, a wait for a
    load) is booked to that callable's stage and taken out of the stage that was open around it, so
    the stages add up to the wall time without double counting.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._name: str | None = None
        self._open: str | None = None
        self._t0 = 0.0

    def __call__(self, name: str) -> "StageClock":
        self._name = name
        return self

    def __enter__(self) -> None:
        self._open, self._t0 = self._name, time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.add(self._open, time.perf_counter() - self._t0)
        self._open = None

    @property
    def current(self) -> str | None:
        """The stage open now (``with clock(name)``), or None."""
        return self._open

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def inner(self, name: str | dict[str, str], seconds: float) -> None:
        """Book ``seconds`` spent in a timed callable: to ``name`` (or, for a dict, to the name it
        gives the open stage) and out of the open stage."""
        if isinstance(name, dict):
            name = name.get(self._open or "", next(iter(name.values())))
        self.add(name, seconds)
        if self._open is not None:
            self.add(self._open, -seconds)


class Timed:
    """A callable timed into ``clock`` under ``stage`` (see :meth:`StageClock.inner`)."""

    def __init__(self, fn: Callable, clock: StageClock, stage: str | dict[str, str]) -> None:
        self._fn = fn
        self._clock = clock
        self._stage = stage
        self.seconds = 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self._fn(*args)
        finally:
            dt = time.perf_counter() - start
            self.seconds += dt
            self._clock.inner(self._stage, dt)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that wall-clock timings on an accelerator are real."""
    device = torch.device(device)
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize(device)
