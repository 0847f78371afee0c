"""One definition of a lookup: hits and misses that add up, the head apart, damaged and unreachable
tiers counted, counters that survive the process, and namespace-scoped clearing."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from kv_fixtures import SPEC, make_kv

from ragcache.config import StoreSettings
from ragcache.kvstore import CorruptEntryError, CpuTier, DiskTier, RedisTier, TieredStore
from ragcache.kvstore.ledger import COUNTER_FILE, CounterFile
from ragcache_testing.services import free_port


def assert_adds_up(store: TieredStore) -> None:
    """Every tier: hits + misses == chunk lookups; all tiers' hits + the store's misses == lookups."""
    stats, lk = store.stats(), store.ledger.summary()
    for name, row in stats.items():
        assert row["hits"] + row["misses"] == row["lookups"] == lk["lookups"], name
    assert sum(row["hits"] for row in stats.values()) + lk["misses"] == lk["lookups"]


def test_a_layer_that_fails_its_checksum_turns_the_hit_into_a_counted_miss(tmp_path):
    disk = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(disk, 10**9)])
    store.put("a", *make_kv(), 0)
    store.put("b", *make_kv(1), 0)
    with open(disk.path("a"), "r+b") as f:  # damage the last layer's V: the header stays valid
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    handle = store.open("a")
    assert handle is not None and handle.tier == "disk"
    handle.layer(0)
    with pytest.raises(CorruptEntryError):
        handle.layer(SPEC.num_layers - 1)
    with store.open("b") as h:
        [h.layer(i) for i in range(SPEC.num_layers)]
    row = store.stats()["disk"]
    assert (row["hits"], row["misses"], row["corrupt"]) == (1, 1, 1)
    assert store.ledger.summary()["misses"] == 1 and not disk.path("a").exists()
    assert_adds_up(store)


def test_the_prompt_head_is_counted_apart_from_chunk_lookups(tmp_path):
    store = TieredStore(SPEC, [(CpuTier(), 10**9), (DiskTier(tmp_path / "kv"), 10**9)])
    store.put("head", *make_kv(), 0)
    store.put("c1", *make_kv(1), 0)
    for _ in range(3):
        with store.open("head", head=True):
            pass
        with store.open("c1"):
            pass
        assert store.open("c2") is None
    lk = store.ledger.summary()
    assert (lk["lookups"], lk["hits"], lk["misses"], lk["head_lookups"], lk["head_hits"]) == (6, 3, 3, 3, 3)
    assert store.stats()["cpu"]["hits"] == 3
    assert_adds_up(store)


def test_keys_in_a_private_namespace_count_in_no_counter(tmp_path):
    """The start-up self-check keys its KV under ``<store ns>/_self-check-...``: its misses, hits,
    reads and writes never show in the hit rates, the byte counters or the counter file."""
    disk = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(CpuTier(), 10**9), (disk, 10**9)], counter_file=tmp_path / COUNTER_FILE)
    private = [f"default/_self-check-1a2b3c4d:{d * 32}" for d in "ab"]
    assert store.open(private[0], head=True) is None and store.open(private[1]) is None  # the check's misses
    store.put(private[0], *make_kv(), 0)
    store.put(private[1], *make_kv(1), 0)
    with store.open(private[1]) as h:  # read back by its reuse request
        [h.layer(i) for i in range(SPEC.num_layers)]
    assert store.get(private[1])[1] == "cpu"
    for key in private:
        store.delete(key)
    assert store.ledger.summary()["lookups"] == 0 and store.ledger.summary()["head_lookups"] == 0
    for name, row in store.stats().items():
        assert (row["lookups"], row["hits"], row["misses"], row["bytes_read"], row["bytes_written"]) == (0, 0, 0, 0, 0), name
    # the users' lookups after it: every one a hit, 100%
    store.put("default:" + "c" * 32, *make_kv(2), 0)
    for _ in range(3):
        with store.open("default:" + "c" * 32) as h:
            h.layer(0)
    assert store.stats()["cpu"]["hit_rate"] == 1.0 and store.stats()["disk"]["misses"] == 3
    store.ledger.flush()
    assert CounterFile(tmp_path / COUNTER_FILE).read()["lookups"]["lookups"] == 3
    assert_adds_up(store)


def test_only_the_self_checks_namespace_is_private():
    from ragcache.chunks import ChunkKey, is_private_key, kv_namespace
    from ragcache.config import ConfigError, check_namespace
    from ragcache.engine.selfcheck import SELF_CHECK_NAMESPACE

    check = ChunkKey.of([1, 2, 3], "fp", kv_namespace("default", f"{SELF_CHECK_NAMESPACE}-1a2b3c4d"))
    assert is_private_key(str(check))
    for ns in ("default", kv_namespace("default", "acme"), kv_namespace("default", "a_b-c"), ""):
        assert not is_private_key(str(ChunkKey.of([1, 2, 3], "fp", ns)))
    with pytest.raises(ConfigError):  # no user can name a private namespace
        check_namespace("_self-check")


def test_lookups_reaching_an_unreachable_tier_are_counted_as_unavailable(tmp_path):
    dead = RedisTier(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.2)  # nothing listens there
    store = TieredStore(SPEC, [(CpuTier(), 10**9), (dead, None)], remote_backoff_sec=0.0, remote_backoff_max_sec=0.0)
    store.put("a", *make_kv(), 0)
    assert store.get("a")[1] == "cpu"  # served above: never reaches the remote tier
    for key in ("x", "y", "z"):
        assert store.get(key) is None
        assert store.open(key) is None
    row = store.stats()["remote"]
    assert row["up"] is False and row["unavailable"] == 6 and row["hits"] == 0
    assert_adds_up(store)


def test_counters_survive_the_process_in_a_file_beside_the_disk_tier(tmp_path):
    settings = StoreSettings(ssd_cache_dir=tmp_path / "kv", cpu_kv_pool_gb=0.0)
    first = TieredStore.from_settings(settings, spec=SPEC)
    first.put("a", *make_kv(), 0)
    first.get("a")
    first.get("missing")
    first.close()  # writes its counts
    since = CounterFile(tmp_path / "kv" / COUNTER_FILE).read()["since"]
    assert since is not None

    second = TieredStore.from_settings(settings, spec=SPEC)  # a restart: live counts start at 0
    assert second.ledger.summary()["lookups"] == 0
    second.get("a")
    total = second.ledger.cumulative()  # the file plus what this process has not written yet
    assert total["since"] == since
    assert total["lookups"]["lookups"] == 3 and total["tiers"]["disk"]["hits"] == 2
    second.ledger.reset()
    assert second.ledger.cumulative()["lookups"]["lookups"] == 0
    second.close()


def _lookups_in_another_process(folder: str, n: int) -> None:
    store = TieredStore.from_settings(StoreSettings(ssd_cache_dir=folder, cpu_kv_pool_gb=0.0), spec=SPEC)
    for _ in range(n):
        store.get("shared")
    store.close()


def test_processes_counting_at_once_lose_none_of_each_others_counts(tmp_path):
    folder = tmp_path / "kv"
    TieredStore.from_settings(StoreSettings(ssd_cache_dir=folder, cpu_kv_pool_gb=0.0), spec=SPEC).put(
        "shared", *make_kv(), 0)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_lookups_in_another_process, args=(str(folder), 25)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    total = CounterFile(folder / COUNTER_FILE).read()
    assert total["lookups"]["lookups"] == 75 and total["tiers"]["disk"]["hits"] == 75


def test_clearing_a_namespace_leaves_the_other_namespaces_alone(tmp_path):
    disk = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(CpuTier(), 10**9), (disk, 10**9)])
    keys = ["default:a1", "default/tenant-a:b1", "default/tenant-ab:c1", "other:d1", "defaulter:e1"]
    for i, key in enumerate(keys):
        store.put(key, *make_kv(i), 0)
    store.clear(namespace="default/tenant-a")
    assert [store.contains(k) for k in keys] == ["cpu", None, "cpu", "cpu", "cpu"]
    store.clear(namespace="default")  # a store namespace takes its index namespaces with it
    assert [store.contains(k) for k in keys] == [None, None, None, "cpu", "cpu"]
    assert sorted(disk.keys()) == ["defaulter:e1", "other:d1"]
    assert store.stats()["cpu"]["entries"] == 2
