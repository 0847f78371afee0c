"""The pytest side of ragcache_testing.services.RedisServer: a throwaway redis-server, or a skip.

Tests that need one skip with a clear message only when no ``redis-server`` binary exists (CI
installs it: see .ci/run). Starting, waiting for PONG, killing and restarting live in
:mod:`ragcache_testing.services`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ragcache_testing.services import NOT_INSTALLED, RedisNotInstalledError, RedisServer

NO_REDIS = f"{NOT_INSTALLED}; remote-tier tests skipped"


def start_redis(tmp_path: Path) -> RedisServer:
    """Start a server in ``tmp_path/redis`` (skips the test when redis-server is missing)."""
    try:
        server = RedisServer(tmp_path / "redis")
    except RedisNotInstalledError:
        pytest.skip(NO_REDIS)
    return server.start()
