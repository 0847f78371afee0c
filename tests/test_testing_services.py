"""ragcache_testing.services on the real thing: a redis-server subprocess and files on this machine's disk."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import socket
from pathlib import Path

import pytest
import redis
from redis_server import NO_REDIS

from ragcache_testing.services import RedisNotInstalledError, RedisServer, drop_page_cache, free_port

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason=NO_REDIS)


def _reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def test_free_port_is_bindable_on_loopback():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@needs_redis
def test_redis_server_answers_until_killed_and_comes_back_empty_on_the_same_port(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        client = redis.Redis.from_url(server.url)
        assert server.url == f"redis://127.0.0.1:{server.port}/0" and client.ping()
        client.set("k", b"v")
        server.stop()
        assert server.proc is None and not _reachable(server.port)
        server.start()
        assert redis.Redis.from_url(server.url).get("k") is None  # no persistence
        assert not any((tmp_path / "redis").iterdir())  # nothing saved in its folder
    finally:
        server.stop()


@needs_redis
def test_redis_server_as_context_manager_is_killed_on_exit(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        assert redis.Redis.from_url(server.url).ping()
        proc = server.proc
    assert proc.poll() is not None and not _reachable(server.port)


@needs_redis
def test_redis_server_that_cannot_bind_its_port_raises_instead_of_hanging(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = RedisServer(tmp_path / "redis", port=busy.getsockname()[1])
        with pytest.raises(RuntimeError, match="redis-server"):
            server.start(timeout=5.0)
    assert server.proc is None


def test_missing_redis_binary_is_reported_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisNotInstalledError, match="apt-get install -y redis-server") as err:
        RedisServer(tmp_path / "redis")
    assert isinstance(err.value, FileNotFoundError)


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (Linux mincore over a fresh read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            pytest.skip("mmap failed; cannot inspect the page cache here")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                pytest.skip("mincore is not available here")
            return sum(b & 1 for b in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
def test_drop_page_cache_evicts_a_file_or_every_file_below_a_folder(tmp_path):
    nested = tmp_path / "kv" / "a" / "b"
    nested.mkdir(parents=True)
    files = [tmp_path / "kv" / "one.safetensors", nested / "two.safetensors"]
    data = os.urandom(1 << 20)
    for f in files:
        f.write_bytes(data)
        assert f.read_bytes() == data  # read through the page cache
    if _resident_pages(files[0]) == 0:
        pytest.skip("this file system keeps no page cache for the test files")

    assert drop_page_cache(files[0]) == 1
    assert _resident_pages(files[0]) == 0 and _resident_pages(files[1]) > 0
    files[0].read_bytes()
    assert drop_page_cache(tmp_path / "kv") == 2
    assert all(_resident_pages(f) == 0 for f in files)
    assert all(f.read_bytes() == data for f in files)  # contents untouched
    assert drop_page_cache(tmp_path / "missing") == 0
