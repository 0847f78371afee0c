"""Counting the operators a blend dispatches: its size on any device.

Owns: :class:`OpCount` and :func:`count_ops`. On an accelerator every operator a blend dispatches is
a kernel launch (or a view the host computes), and the host's time to issue them, not the device's
arithmetic, decided how fast the blend was there (docs/benchmarks.md, "GPU"); on a CPU each costs
~10 µs of fixed overhead. So the count is the blend's size in the sense that matters for speed on
any device, and it must not grow with the number of passages, runs or requests a blend serves.

The count is taken with torch's profiler (``torch.profiler.profile``, CPU activity): every operator
event whose name is ``namespace::name`` (``aten::`` and an engine's custom operators, e.g. vLLM's
``_C::``) and whose parent event is not itself an operator, i.e. the operators Python code called,
not the ones they call inside. Profiler scopes (``profiler::`` and ``record_function`` labels) are
not operators. Each operator is also put down to the code that called it (the profiler records the
Python stack): ragcache's own code (``own``), or the engine's modules (vLLM's layers, its custom-op
wrappers) and any other library (the rest), by the innermost Python frame outside torch. Which part
of a blend ragcache can shrink, and which is the engine's build (vLLM's CPU build runs its RMS norm
and SiluAndMul in their native torch form, a CUDA build as one kernel each), is then in the count.
Must not import vLLM, transformers, or anything above blend/ in ragcache.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

#: an operator event's name: ``namespace::name`` (aten::mm, _C::rms_norm, ...)
_OPERATOR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_]")
#: Kineto's log level above its highest severity (USDT, 5): none of its lines are printed
_KINETO_QUIET = "6"
#: namespaces of profiler bookkeeping, not operators
_NOT_OPERATORS = ("profiler::",)
#: the ragcache package's directory: a Python frame in a file under it is ragcache's own code
_OWN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: a Python frame's event name: ``ragcache/blend/select.py(418): tail_attention`` (see _package_of)
_FRAME = re.compile(r"^(?P<file>.+\.py)\(\d+\): ")


def is_operator(name: str) -> bool:
    """True for an operator event's name (``aten::mm``, ``_C::rotary_embedding``), False for a
    profiler scope or a label."""
    return bool(_OPERATOR.match(name)) and not name.startswith(_NOT_OPERATORS)


def _called_by_own_code(event: Any) -> bool:
    """True when the innermost Python frame above ``event`` outside torch's own files is in ragcache
    (the frames are the profiler's ``with_stack`` events; none: not ragcache's)."""
    parent = event.cpu_parent
    while parent is not None:
        frame = _FRAME.match(parent.name)
        if frame is not None:
            package = _package_of(frame.group("file"))
            if package != "torch":
                return package == "ragcache"
        parent = parent.cpu_parent
    return False


def _package_of(path: str) -> str:
    """The top-level package of a profiler frame's file (``ragcache``, ``torch``, ``vllm``, ...): the
    profiler names files relative to the ``sys.path`` entry they were found under
    (``ragcache/blend/select.py``, ``torch/_ops.py``); an absolute path is ragcache's when it lies in
    this package's directory, torch's when it has a ``torch`` folder, else the path itself."""
    if os.path.isabs(path):
        if path.startswith(_OWN_ROOT):
            return "ragcache"
        return "torch" if f"{os.sep}torch{os.sep}" in path else path
    return path.replace("\\", "/").split("/", 1)[0]


@dataclass
class OpCount:
    """The operators dispatched inside one :func:`count_ops` block.

    Attributes:
        total: top-level operators (see the module docstring).
        by_namespace: ``{"aten": 812, "_C": 64}``.
        by_name: ``{"aten::mm": 120, ...}``, every top-level operator by name.
        own: those of :attr:`total` that ragcache's own code called (the module docstring); the rest
            were called inside the engine's modules or other libraries.
    """

    total: int = 0
    by_namespace: dict[str, int] = field(default_factory=dict)
    by_name: dict[str, int] = field(default_factory=dict)
    own: int = 0

    @property
    def aten(self) -> int:
        """The ``aten::`` operators among :attr:`total`."""
        return self.by_namespace.get("aten", 0)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (travels through ``collective_rpc`` and into benchmark JSON)."""
        return {"total": self.total, "aten": self.aten, "own": self.own, "by_namespace": dict(self.by_namespace),
                "by_name": dict(self.by_name)}

    @classmethod
    def of_events(cls, events: Any) -> "OpCount":
        """The count over a profiler's ``events()`` (``torch.autograd.profiler_util.EventList``)."""
        names: Counter = Counter()
        own = 0
        for event in events:
            if not is_operator(event.name):
                continue
            parent = event.cpu_parent
            if parent is not None and is_operator(parent.name):
                continue
            names[event.name] += 1
            own += _called_by_own_code(event)
        spaces: Counter = Counter()
        for name, n in names.items():
            spaces[name.split("::", 1)[0]] += n
        return cls(total=sum(names.values()), by_namespace=dict(spaces), by_name=dict(names.most_common()), own=own)


@contextmanager
def count_ops() -> Iterator[OpCount]:
    """Count the operators dispatched inside the ``with`` block (all threads the profiler sees).

    Yields an :class:`OpCount` that is filled in when the block exits. The profiler slows the block
    down: time it separately. Kineto's own log lines (``USDT ... profiler_start`` and
    ``profiler_stop`` on stderr, per profile) are silenced unless ``KINETO_LOG_LEVEL`` is set; the
    level is read when the process's first profile starts.
    """
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_QUIET)
    from torch.profiler import ProfilerActivity, profile

    result = OpCount()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        yield result
    counted = OpCount.of_events(prof.events())
    result.total, result.by_namespace, result.by_name, result.own = (counted.total, counted.by_namespace,
                                                                     counted.by_name, counted.own)
