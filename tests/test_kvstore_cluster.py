"""The remote tier on a real Redis Cluster (3 masters made with ``redis-cli --cluster create``):
entries spread over the masters, the tier's listing and clearing fan out over all of them, and a
master killed mid-run degrades a replica's store to its local tiers with one warning, exact data
and counters that add up.
"""

from __future__ import annotations

import logging
import time

import kv_fixtures
import pytest
import redis
import torch
from kv_fixtures import SPEC

from ragcache.config import ConfigError, Settings
from ragcache.kvstore import CpuTier, RedisTier, TieredStore
from tests.services import start_redis_cluster

pytestmark = pytest.mark.slow

N = 30


def make_kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_fixtures.make_kv(seed, tokens=5 + seed % 4)  # entries of several sizes


def key(i: int) -> str:
    return f"default:{i:032x}"


@pytest.fixture
def cluster(tmp_path):
    c = start_redis_cluster(tmp_path)
    yield c
    c.stop()


def remote(cluster) -> RedisTier:
    return RedisTier(cluster.url, cluster=True)


def test_entries_spread_over_the_masters_and_listing_and_clearing_reach_all(cluster):
    writer = TieredStore(SPEC, [(remote(cluster), None)])
    for i in range(N):
        assert writer.put(key(i), *make_kv(i), 3) == ("remote",)
    per_node = [redis.Redis(port=p).dbsize() for p in cluster.ports]
    assert sum(per_node) == N and min(per_node) >= 3, per_node
    stats = writer.stats()["remote"]
    assert stats["entries"] == N and stats["up"]
    assert sorted(remote(cluster).keys()) == sorted(key(i) for i in range(N))

    reader = TieredStore(SPEC, [(remote(cluster), None)])  # another process's view
    for i in range(N):
        entry, tier = reader.get(key(i))
        k, v = make_kv(i)
        assert tier == "remote" and torch.equal(entry.k, k) and torch.equal(entry.v, v)
        with reader.open(key(i)) as h:
            assert torch.equal(h.layer(3)[1], v[3])
    writer.clear("default")
    assert sum(redis.Redis(port=p).dbsize() for p in cluster.ports) == 0


def test_a_lost_master_degrades_to_local_tiers_with_one_warning_and_honest_counters(cluster, caplog):
    ingest = TieredStore(SPEC, [(remote(cluster), None)])
    for i in range(N):
        ingest.put(key(i), *make_kv(i), 3)
    replica = TieredStore(SPEC, [(CpuTier(), 10**8), (remote(cluster), None)],
                          remote_backoff_sec=0.05, remote_backoff_max_sec=0.1)
    for i in range(10):  # first asks: served by the shared tier, promoted into this replica's RAM
        assert replica.get(key(i))[1] == "remote"

    cluster.kill(0)
    served: dict[str, int] = {}
    with caplog.at_level(logging.WARNING, logger="ragcache.kvstore"):
        for rnd in range(3):
            for i in range(N):
                hit = replica.get(key(i))
                if hit is None:
                    served["miss"] = served.get("miss", 0) + 1
                    continue
                entry, tier = hit
                k, v = make_kv(i)
                assert torch.equal(entry.k, k) and torch.equal(entry.v, v)  # never wrong data
                served[tier] = served.get(tier, 0) + 1
            time.sleep(0.15)  # past the back-off: the tier is probed again (and found still down)
        assert replica.put(key(99), *make_kv(99), 3) == ("cpu",)  # the shared tier is skipped while down
    down = [r for r in caplog.records if "remote tier unavailable" in r.getMessage()]
    again = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(down) == 1 and not again, [r.getMessage() for r in caplog.records]

    stats = replica.stats()
    lookups = 10 + 3 * N
    assert stats["cpu"]["lookups"] == stats["remote"]["lookups"] == lookups
    assert stats["cpu"]["hits"] == served.get("cpu", 0) >= 30  # the ten promoted chunks, every round
    assert stats["remote"]["hits"] == 10 + served.get("remote", 0)
    assert stats["cpu"]["hits"] + stats["remote"]["hits"] + served.get("miss", 0) == lookups
    assert served.get("miss", 0) >= 2 * (N - 10)  # once down, the un-promoted chunks are misses
    assert stats["remote"]["unavailable"] >= 1 and not stats["remote"]["up"]
    assert replica.ledger.summary()["misses"] == served.get("miss", 0)


def test_several_seed_nodes_need_remote_cluster(cluster):
    from ragcache.kvstore.configure import tiers_from_settings

    s = Settings.load(store={"remote_url": cluster.url})
    with pytest.raises(ConfigError, match="set store.remote_cluster = true"):
        tiers_from_settings(s.store, torch.device("cpu"))
    with pytest.raises(ConfigError, match="must start with redis://"):
        Settings.load(store={"remote_url": cluster.url + ",http://x:1", "remote_cluster": True})
    ok = Settings.load(store={"remote_url": cluster.url, "remote_cluster": True, "ssd_cache_max_gb": 0})
    tiers = tiers_from_settings(ok.store, torch.device("cpu"))
    assert [t.name for t, _ in tiers] == ["cpu", "remote"] and tiers[-1][0].ping()
