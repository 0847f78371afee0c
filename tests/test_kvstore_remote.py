"""The Redis tier against a real redis-server: round trip, sharing, damage, and Redis dying mid-run.

Each test starts its own ``redis-server`` on a free loopback port (ragcache_testing.services, through
tests/redis_server.py) and kills it at the end; the tests skip only when no redis-server binary exists.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import redis
import torch
from kv_fixtures import SPEC, entry_bytes, make_kv
from redis_server import start_redis

from ragcache.config import StoreSettings
from ragcache.kvstore import CpuTier, DiskTier, RedisTier, TieredStore, TierUnavailableError
from ragcache_testing.services import free_port

ENTRY = entry_bytes()  # bytes of one make_kv() entry in memory (fp32)


@pytest.fixture
def redis_server(tmp_path):
    server = start_redis(tmp_path)
    yield server
    server.stop()


def test_round_trip_through_redis_is_exact(redis_server):
    store = TieredStore(SPEC, [(RedisTier(redis_server.url), None)])
    k, v = make_kv()
    store.put("a", k, v, 17)
    entry, tier = store.get("a")
    assert tier == "remote" and torch.equal(entry.k, k) and torch.equal(entry.v, v)
    assert entry.meta.start_position == 17
    with store.open("a") as h:
        assert h.tier == "remote"
        assert torch.equal(h.layer(2)[0], k[2]) and torch.equal(h.layer(3)[1], v[3])
    assert store.contains("a") == "remote" and store.get("b") is None
    stats = store.stats()["remote"]
    assert stats["up"] and stats["entries"] == 1 and stats["hits"] == 2 and stats["capacity_bytes"] is None


def test_redis_tier_pings_lists_its_keys_with_sizes_and_pops_one(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.set("unrelated", b"x")
    remote = RedisTier(redis_server.url)
    store = TieredStore(SPEC, [(remote, None)])
    k, v = make_kv()
    store.put("a", k, v, 0)
    store.put("b", *make_kv(1), 0)
    assert remote.ping() is True
    listed = {e.key: e.size for e in remote.scan()}
    assert listed == {"a": client.strlen("ragcache:kv:a"), "b": client.strlen("ragcache:kv:b")}
    item = remote.pop("a")
    assert item is not None and torch.equal(item.kv[:, 0], k) and torch.equal(item.kv[:, 1], v)
    assert client.exists("ragcache:kv:a") == 0 and remote.pop("a") is None
    assert [e.key for e in remote.scan()] == ["b"] and client.get("unrelated") == b"x"
    redis_server.stop()
    with pytest.raises(TierUnavailableError):
        remote.ping()
    with pytest.raises(TierUnavailableError):
        remote.scan()


def test_bounded_redis_tier_counts_the_entries_already_there(redis_server):
    first = TieredStore(SPEC, [(RedisTier(redis_server.url), None)])
    for key in ("a", "b"):
        first.put(key, *make_kv(), 0)
    size = redis.Redis.from_url(redis_server.url).strlen("ragcache:kv:a")
    bounded = TieredStore(SPEC, [(RedisTier(redis_server.url), int(2.5 * size))])
    bounded.put("c", *make_kv(), 0)  # a and b were found by scan at start: one of them makes room
    stats = bounded.stats()["remote"]
    assert stats["entries"] == 2 and stats["evictions"] == 1 and bounded.contains("c") == "remote"


def test_value_in_redis_is_the_same_safetensors_bytes_as_the_disk_file(redis_server, tmp_path):
    disk = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(disk, 10**9), (RedisTier(redis_server.url), None)])
    store.put("a", *make_kv(), 0)
    value = redis.Redis.from_url(redis_server.url).get("ragcache:kv:a")
    on_disk = disk.path("a").read_bytes()
    assert len(value) == len(on_disk) and value[-1000:] == on_disk[-1000:]


def test_another_host_with_an_empty_local_cache_reads_from_redis_and_promotes(redis_server, tmp_path):
    writer = TieredStore(SPEC, [(CpuTier(), 10**6), (DiskTier(tmp_path / "w"), 10**9),
                                (RedisTier(redis_server.url), None)])
    k, v = make_kv(3)
    writer.put("a", k, v, 0)
    reader = TieredStore(SPEC, [(CpuTier(), 10**6), (DiskTier(tmp_path / "r"), 10**9),
                                (RedisTier(redis_server.url), None)])
    entry, tier = reader.get("a")
    assert tier == "remote" and torch.equal(entry.k, k)
    assert reader.get("a")[1] == "cpu"
    stats = reader.stats()
    assert [stats[t]["hits"] for t in ("cpu", "disk", "remote")] == [1, 0, 1]
    assert all(t["hits"] + t["misses"] == t["lookups"] == 2 for t in stats.values())
    assert reader.ledger.summary()["misses"] == 0


def test_entry_evicted_from_disk_is_demoted_to_redis_when_missing_there(redis_server, tmp_path):
    disk = DiskTier(tmp_path / "kv")
    remote = RedisTier(redis_server.url)
    store = TieredStore(SPEC, [(disk, 10**9), (remote, None)])
    k, v = make_kv()
    store.put("a", k, v, 0)
    remote.delete("a")  # e.g. flushed by Redis' own eviction
    small = TieredStore(SPEC, [(DiskTier(tmp_path / "kv"), int(1.5 * disk.path("a").stat().st_size)),
                               (RedisTier(redis_server.url), None)])
    small.put("b", *make_kv(1), 0)  # evicts a from disk -> demoted to Redis
    assert not disk.path("a").exists()
    entry, tier = small.get("a")
    assert tier == "remote" and torch.equal(entry.v, v)


def test_damaged_redis_value_is_deleted_and_counted(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    store = TieredStore(SPEC, [(RedisTier(redis_server.url), None)])
    store.put("a", *make_kv(), 0)
    store.put("b", *make_kv(), 0)
    value = bytearray(client.get("ragcache:kv:a"))
    value[-7] ^= 0xFF
    client.set("ragcache:kv:a", bytes(value))
    client.set("ragcache:kv:b", client.get("ragcache:kv:b")[:-100])
    assert store.get("a") is None and store.get("b") is None
    assert store.stats()["remote"]["corrupt"] == 2
    assert client.exists("ragcache:kv:a", "ragcache:kv:b") == 0


def test_redis_killed_mid_run_degrades_to_local_tiers_without_exceptions(redis_server, tmp_path, caplog):
    store = TieredStore(SPEC, [(CpuTier(), ENTRY), (DiskTier(tmp_path / "kv"), 10**9),
                               (RedisTier(redis_server.url), None)],
                        remote_backoff_sec=0.2, remote_backoff_max_sec=0.5)
    ka, _ = make_kv(1)
    store.put("a", ka, ka, 0)
    assert store.stats()["remote"]["entries"] == 1
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="ragcache.kvstore"):
        kb, _ = make_kv(2)
        store.put("b", kb, kb, 0)  # cpu + disk fine, remote down
        store.put("c", kb, kb, 0)
        assert store.get("zz") is None
        assert store.get("a")[1] == "disk"
        assert store.contains("b") == "disk"
        with store.open("c") as h:
            assert torch.equal(h.layer(0)[0], kb[0])
        assert store.delete("c") is True
        stats = store.stats()
        assert stats["remote"]["up"] is False and stats["remote"]["entries"] == 0
        assert store.verify()["remote"]["up"] is False
    downs = [r for r in caplog.records if "remote tier unavailable" in r.getMessage()]
    assert len(downs) == 1  # warned once per outage
    # the same server comes back: after the back-off the tier is used again
    redis_server.start()
    deadline = time.monotonic() + 5
    while not store.stats()["remote"]["up"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.stats()["remote"]["up"] is True
    store.put("d", kb, kb, 0)
    assert store.stats()["remote"]["entries"] == 1


def test_unreachable_redis_at_start_is_marked_down_quickly(tmp_path):
    settings = StoreSettings(ssd_cache_dir=tmp_path / "kv", remote_url=f"redis://127.0.0.1:{free_port()}/0")
    t0 = time.monotonic()
    store = TieredStore.from_settings(settings, spec=SPEC)
    k, v = make_kv()
    store.put("a", k, v, 0)
    assert store.get("a")[1] == "cpu"
    assert time.monotonic() - t0 < 5
    assert store.stats()["remote"]["up"] is False and store.tier_names == ["cpu", "disk", "remote"]


def test_an_unreachable_redis_is_named_without_its_password():
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    with pytest.raises(TierUnavailableError) as err:
        RedisTier(url, connect_timeout=0.5).contains("a")
    assert f"redis://:***@127.0.0.1:{url.rsplit(':', 1)[1]}" in str(err.value) and "s3cret" not in str(err.value)


def test_clear_and_verify_cover_redis(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.set("unrelated", b"x")
    store = TieredStore(SPEC, [(RedisTier(redis_server.url), None)])
    for i in range(3):
        store.put(f"k{i}", *make_kv(i), 0)
    client.set("ragcache:kv:k1", b"\x00" * 20)
    report = store.verify()["remote"]
    assert (report["checked"], report["ok"], report["corrupt"], report["removed"]) == (3, 2, 1, ["k1"])
    store.clear()
    assert store.stats()["remote"]["entries"] == 0 and client.get("unrelated") == b"x"


def test_a_stopped_redis_costs_one_bounded_wait_then_the_local_tiers_answer(redis_server, tmp_path):
    """A SIGSTOPped Redis accepts connections and never answers: store.remote_timeout_s bounds the
    one wait that marks the tier down (10 s per reply made one served request take 25 s), and until
    the back-off is over nothing waits for it again."""
    settings = StoreSettings(ssd_cache_max_gb=0, remote_url=redis_server.url, remote_timeout_s=0.5)
    store = TieredStore.from_settings(settings, spec=SPEC)
    k, v = make_kv(1)
    assert store.put("a", k, v, 0) == ("cpu", "remote")
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert store.get("missing") is None  # cpu misses, remote times out: marked down
        waited = time.monotonic() - t0
        assert store.put("b", *make_kv(2), 0) == ("cpu",)
        assert store.get("b")[1] == "cpu" and store.get("missing-too") is None
        total = time.monotonic() - t0
        assert store.stats()["remote"]["up"] is False
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert 0.4 < waited < 2.0 and total < 2.5, (waited, total)


def test_a_full_redis_that_refuses_writes_is_logged_once_and_counted(redis_server, caplog):
    """maxmemory reached with maxmemory-policy noeviction: every remote write fails; the first one
    is logged (naming Redis' reason), all are counted as write_errors, and the local tier keeps
    the entries."""
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory", str(client.info("memory")["used_memory"] // 2))  # already over it
    client.config_set("maxmemory-policy", "noeviction")
    store = TieredStore(SPEC, [(CpuTier(), None), (RedisTier(redis_server.url), None)])
    with caplog.at_level(logging.WARNING, logger="ragcache.kvstore"):
        for i in range(4):
            assert store.put(f"k{i}", *make_kv(i), 0) == ("cpu",)
    said = [r.getMessage() for r in caplog.records if "remote tier: write of" in r.getMessage()]
    assert len(said) == 1 and "maxmemory" in said[0], said
    stats = store.stats()["remote"]
    assert stats["write_errors"] == 4 and stats["up"] is True and stats["entries"] == 0
    assert all(store.get(f"k{i}")[1] == "cpu" for i in range(4))
