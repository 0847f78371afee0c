"""Throwaway services for benchmarks and tests: a redis-server on a loopback port, cold page cache.

Owns the one implementation of: finding a free loopback port; starting ``redis-server`` without
persistence and waiting for its PONG; killing it (and starting it again on the same port, as a
test of a Redis outage needs); evicting files from the OS page cache so that the next read is a
real disk read. Used by the ``tiers`` runner, by tests/ (tests/redis_server.py only adds the
pytest skip) and by scripts/bench_tiers.py.

Standard library only: never the engine, pytest, app/ or ui/.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

NOT_INSTALLED = "redis-server is not installed (apt-get install -y redis-server)"


class RedisNotInstalledError(FileNotFoundError):
    """No ``redis-server`` binary on PATH."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` subprocess on 127.0.0.1, no persistence; ``url`` is ``redis://127.0.0.1:<port>/0``.

    ``start()`` launches it and waits for PONG; ``stop()`` kills it; ``start()`` again brings it
    back on the same port. As a context manager it starts on enter and stops on exit.

    Args:
        workdir: redis-server's working folder (created on start).
        port: the port; default a free one.

    Raises:
        RedisNotInstalledError: no redis-server binary.
    """

    def __init__(self, workdir: str | os.PathLike[str], port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisNotInstalledError(NOT_INSTALLED)
        self.binary = binary
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> "RedisServer":
        """Start the server and wait until it answers PING; returns self.

        Raises:
            RuntimeError: it exited, or did not answer within ``timeout`` seconds (then it is killed);
                either way no process is left and ``start()`` may be called again.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(f"redis-server exited with {code} on port {self.port}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout} s")

    def stop(self) -> None:
        """Kill the server (SIGKILL: an abrupt failure, like a crashed or unreachable Redis)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def drop_page_cache(path: str | os.PathLike[str]) -> int:
    """Drop a file, or every file below a folder, from the OS page cache; returns the files dropped.

    fsync + ``POSIX_FADV_DONTNEED`` per file: only these files are affected (no root, no global
    drop_caches), so the next read is a real disk read. A file that cannot be opened or advised
    (or a platform without posix_fadvise) is not counted.
    """
    root = Path(path)
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    n = 0
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)
    return n
