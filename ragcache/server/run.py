"""Running ``ragcache serve``: the start-up checks, uvicorn, and a server in a child process.

Owns: :func:`check_serve_settings` (a non-loopback address needs ``serve.api_key``; the default
index must exist), :func:`serve` (uvicorn in this process, until SIGINT/SIGTERM) and
:class:`ServerProcess` (the same server in a spawned child process on a free loopback port, for
benchmarks and tools that drive it over HTTP). Never imports app/ or ui/.
"""

from __future__ import annotations

import ipaddress
import logging
import multiprocessing
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from ragcache.config import ConfigError, Settings

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_serve_settings(settings: Settings) -> None:
    """Refuse to start what would be unsafe or useless.

    Raises:
        ConfigError: ``serve.host`` is not a loopback address and ``serve.api_key`` is empty.
        IndexNotFoundError: the default index (``serve.index``) does not exist.
    """
    from ragcache.index import IndexNotFoundError, list_indexes

    s = settings.serve
    if not is_loopback(s.host) and not s.api_key:
        raise ConfigError(f"serve.host {s.host!r} accepts connections from other machines: set serve.api_key "
                          "(e.g. RAGCACHE_SERVE__API_KEY=...) so clients must send it, or bind 127.0.0.1")
    names = list_indexes(settings.ingest.index_dir)
    if s.index not in names:
        others = f" (existing: {', '.join(names)})" if names else ""
        raise IndexNotFoundError(f"the default index {s.index!r} is not under {settings.ingest.index_dir}{others}: "
                                 f"run `ragcache ingest PATH --index {s.index}` or pass --index NAME")


def serve(settings: Settings, *, log_level: str = "info") -> None:
    """Serve on ``serve.host:serve.port`` until interrupted (SIGINT/SIGTERM shut down gracefully).

    Raises:
        ConfigError / IndexNotFoundError: see :func:`check_serve_settings`.
    """
    import uvicorn

    from ragcache.server.app import create_app

    check_serve_settings(settings)
    config = uvicorn.Config(create_app(settings), host=settings.serve.host, port=settings.serve.port,
                            log_level=log_level, timeout_graceful_shutdown=10)
    uvicorn.Server(config).run()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _child(settings: Settings, log_level: str) -> None:
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(settings, log_level=log_level)


class ServerProcess:
    """``ragcache serve`` in a spawned child process on a free loopback port (a context manager).

    ``with ServerProcess(settings) as srv:`` returns once GET /health answers; ``srv.url`` is the
    base URL (``http://127.0.0.1:PORT``). Leaving the block stops the server (SIGTERM, then SIGKILL
    after ``stop_timeout_s``) together with its vLLM engine.

    Args:
        settings: the server's settings; ``serve.host`` / ``serve.port`` are replaced by 127.0.0.1
            and a free port.
        start_timeout_s: seconds to wait for the engine start-up (tens of seconds on CPU).

    Raises:
        RuntimeError: the child exited or did not answer within ``start_timeout_s``.
    """

    def __init__(self, settings: Settings, *, start_timeout_s: float = 600.0, stop_timeout_s: float = 30.0,
                 log_level: str = "warning"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = settings.model_copy(update={"serve": settings.serve.model_copy(
            update={"host": "127.0.0.1", "port": self.port})})
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_level = log_level
        self.process: Any = None

    def __enter__(self) -> "ServerProcess":
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads and vLLM state
        self.process = ctx.Process(target=_child, args=(self.settings, self.log_level), name="ragcache-serve")
        self.process.start()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if not self.process.is_alive():
                raise RuntimeError(f"the server process exited with status {self.process.exitcode} before it was "
                                   "ready (its log is above)")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not answer {self.url}/health within {self.start_timeout_s:.0f} s")

    def healthy(self) -> bool:
        """Whether GET /health answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """Stop the server and its engine (idempotent)."""
        p = self.process
        if p is None or not p.is_alive():
            return
        p.terminate()
        p.join(self.stop_timeout_s)
        if p.is_alive():
            log.warning("the server did not stop within %.0f s; killing it", self.stop_timeout_s)
            p.kill()
            p.join(5)

    def __exit__(self, *exc: object) -> None:
        self.stop()
