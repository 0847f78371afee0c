"""A throwaway redis-server on a free loopback port, for the remote-tier tests.

Starts ``redis-server --port <free> --bind 127.0.0.1 --save '' --appendonly no`` as a subprocess
and kills it at the end. Tests that need one skip with a clear message only when no
``redis-server`` binary exists (CI installs it: see .ci/run).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

NO_REDIS = "redis-server is not installed (apt-get install -y redis-server); remote-tier tests skipped"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server subprocess; ``url`` is ``redis://127.0.0.1:<port>/0``."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip(NO_REDIS)
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
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


def start_redis(tmp_path: Path) -> RedisServer:
    """Start a server in ``tmp_path/redis`` (skips the test when redis-server is missing)."""
    return RedisServer(tmp_path / "redis").start()
