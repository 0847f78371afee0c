"""Engine processes die with the process that started them, however it ends (``kill -9`` included).

Owns: :func:`arm` (called by a process before it starts a vLLM engine) and :func:`hold` (run in
each child that engine starts, at its first ``import ragcache``). Imports only the standard library.

Why: vLLM runs its engine core (``VLLM::EngineCore``, ~1 GB, and on GPUs worker processes) as
child processes. A parent that exits normally shuts them down; one killed with SIGKILL cannot, and
the engine core then lives on under PID 1, still holding its memory and writing chunk KV, while a
restarted server starts a second one beside it.

How: :func:`arm` records this process's pid in the environment (``RAGCACHE_LIFELINE_PID``), which
every child inherits. A child started by ``multiprocessing`` (vLLM's spawn: multiprocessing says
so while it prepares the child and once it runs; a fork, through an ``os.register_at_fork`` hook)
runs :func:`hold` as soon as it imports ragcache: a spawned engine core of the CLI imports it while
multiprocessing re-imports the parent's main module, first thing; otherwise when vLLM loads
ragcache's worker extension, before the model. :func:`hold` starts a daemon thread that waits for
the parent to exit (``os.pidfd_open``, readable when the process is gone; a 0.2 s poll of
``os.getppid()`` where pidfds are missing) and then SIGKILLs its own process; its own children
(vLLM's workers) see their parent go and do the same, or exit through vLLM's death pipe. A child
whose parent died before it got that far exits at once. ``PR_SET_PDEATHSIG`` is not used: it fires
when the parent *thread* that started the child exits, which would kill an engine created in a
short-lived thread.

Processes that did not come from an armed process (a ``ragcache`` command run by a user, a
subprocess with the variable inherited) are left alone: only multiprocessing children hold on.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

#: environment variable holding the pid of the process whose children must die with it
ENV = "RAGCACHE_LIFELINE_PID"
#: seconds between parent checks where pidfds are unavailable
POLL_S = 0.2

_watching = False
_fork_hook = False


def arm() -> None:
    """Make the multiprocessing children this process starts from now on (vLLM's engine core and
    workers) die when it exits. Idempotent; cheap (no thread in this process)."""
    global _fork_hook
    os.environ[ENV] = str(os.getpid())
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork)
        _fork_hook = True


def _after_fork() -> None:
    global _watching
    _watching = False  # the parent's watcher thread did not survive the fork
    hold(forked=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _multiprocessing_child() -> bool:
    """Whether this process was started by ``multiprocessing`` (spawn or forkserver), while it is
    being prepared (the parent's main module re-imported) or once it runs."""
    mp = sys.modules.get("multiprocessing")
    if mp is None:  # every multiprocessing child has imported it already
        return False
    return mp.parent_process() is not None or bool(getattr(mp.current_process(), "_inheriting", False))


def hold(*, forked: bool = False) -> bool:
    """In a child of an armed process: die with the parent (see the module docstring).

    Args:
        forked: called from the fork hook (the child of any ``os.fork`` of an armed process).

    Returns:
        whether this process now watches its parent (False: not an armed process's
        multiprocessing child, or already watching). Exits the process (status 1) when the armed
        parent is already gone.
    """
    global _watching
    armed = os.environ.get(ENV, "")
    if _watching or not armed.isdigit():
        return False
    if not forked and not _multiprocessing_child():
        return False  # a user's own process that inherited the variable
    parent = os.getppid()
    if parent != int(armed) and not _alive(int(armed)):
        os._exit(1)  # the process that started us died before we could watch it
    _watching = True
    threading.Thread(target=_wait_then_die, args=(parent,), name="ragcache-lifeline", daemon=True).start()
    os.environ[ENV] = str(os.getpid())  # our own children watch us
    return True


def _wait_then_die(parent: int) -> None:
    fd = None
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfds (old kernel, other OS): poll below
        pass
    if fd is not None and os.getppid() == parent:  # the pidfd is our parent's (its pid was not reused)
        select.select([fd], [], [])  # readable once the parent has exited
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)
