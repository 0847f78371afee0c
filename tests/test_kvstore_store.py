"""TieredStore policy: capacity, LRU/LFU, promotion, demotion, restart, full disk, stats, threads."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch
from kv_fixtures import SPEC, entry_bytes, make_kv

from ragcache.config import StoreSettings
from ragcache.kvstore import CpuTier, DeviceTier, DiskTier, TieredStore

TOKENS = 6
ENTRY = entry_bytes(TOKENS)  # bytes in memory (fp32)


def put(store: TieredStore, key: str, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = make_kv(hash(key) % 1000 if seed is None else seed)
    store.put(key, k, v, 0)
    return k, v


def test_cpu_tier_never_holds_more_than_its_capacity(tmp_path):
    store = TieredStore(SPEC, [(CpuTier(), 3 * ENTRY + 100)])
    for i in range(6):
        put(store, f"k{i}")
        assert store.stats()["cpu"]["occupancy_bytes"] <= 3 * ENTRY + 100
    stats = store.stats()["cpu"]
    assert stats["entries"] == 3 and stats["evictions"] == 3
    assert [store.contains(f"k{i}") for i in range(6)] == [None, None, None, "cpu", "cpu", "cpu"]


@pytest.mark.parametrize("policy, evicted", [("lru", "a"), ("lfu", "b")])
def test_eviction_order_follows_the_policy(policy, evicted):
    store = TieredStore(SPEC, [(CpuTier(), 3 * ENTRY)], eviction_policy=policy)
    for key in "abc":
        put(store, key)
    for key in ("a", "a", "b", "c"):  # a: most used, least recent; b: used once, older than c
        assert store.get(key)[1] == "cpu"
    put(store, "d")
    survivors = {key for key in "abcd" if store.contains(key)}
    assert survivors == set("abcd") - {evicted}


def test_entry_larger_than_a_tier_skips_it_but_reaches_disk(tmp_path):
    store = TieredStore(SPEC, [(CpuTier(), ENTRY // 2), (DiskTier(tmp_path / "kv"), 10**9)])
    k, v = put(store, "big")
    entry, tier = store.get("big")
    assert tier == "disk" and torch.equal(entry.k, k)
    assert store.stats()["cpu"]["entries"] == 0


def test_hit_below_the_top_memory_tier_is_promoted(tmp_path):
    store = TieredStore(SPEC, [(CpuTier(), ENTRY), (DiskTier(tmp_path / "kv"), 10**9)])
    ka, _ = put(store, "a")
    put(store, "b")  # evicts a from cpu; disk has it (write-through)
    assert store.contains("a") == "disk"
    entry, tier = store.get("a")
    assert tier == "disk" and torch.equal(entry.k, ka)
    assert store.contains("a") == "cpu"
    entry, tier = store.get("a")
    assert tier == "cpu" and torch.equal(entry.k, ka)
    assert store.contains("b") == "disk"


def test_handle_promotes_only_after_every_layer_was_read(tmp_path):
    store = TieredStore(SPEC, [(CpuTier(), ENTRY), (DiskTier(tmp_path / "kv"), 10**9)])
    k, v = put(store, "a")
    put(store, "b")  # a now only on disk
    with store.open("a") as h:
        assert h.tier == "disk"
        h.layer(0)
    assert store.contains("a") == "disk"
    with store.open("a") as h:
        assert h.tier == "disk"
        layers = [h.layer(i) for i in range(h.num_layers)]
    assert store.contains("a") == "cpu" and store.contains("b") == "disk"
    assert all(torch.equal(kl, k[i]) and torch.equal(vl, v[i]) for i, (kl, vl) in enumerate(layers))
    entry, tier = store.get("a")
    assert tier == "cpu" and torch.equal(entry.v, v)


def test_memory_tiers_demote_on_eviction_and_promote_by_moving(tmp_path):
    # a CPU-backed "device" tier stands in for accelerator memory on CPU-only machines
    store = TieredStore(SPEC, [(DeviceTier("cpu"), ENTRY), (CpuTier(), 3 * ENTRY)])
    ka, _ = put(store, "a")
    assert store.contains("a") == "device"
    put(store, "b")  # a: device -> cpu
    assert store.contains("a") == "cpu" and store.contains("b") == "device"
    entry, tier = store.get("a")  # a: cpu -> device (moved), b: device -> cpu
    assert tier == "cpu" and torch.equal(entry.k, ka)
    assert store.contains("a") == "device" and store.contains("b") == "cpu"
    stats = store.stats()
    assert stats["device"]["entries"] == 1 and stats["cpu"]["entries"] == 1
    assert stats["device"]["evictions"] == 2


def test_entry_evicted_from_cpu_is_demoted_to_disk_when_not_there(tmp_path):
    disk = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(CpuTier(), ENTRY), (disk, 10**9)])
    ka, _ = put(store, "a")
    os.unlink(disk.path("a"))  # e.g. removed by another process or a failed write
    put(store, "b")  # evicts a from cpu -> written to disk again
    assert disk.path("a").exists()
    entry, tier = store.get("a")
    assert tier == "disk" and torch.equal(entry.k, ka)


def _file_size(tmp_path) -> int:
    probe = TieredStore(SPEC, [(DiskTier(tmp_path / "probe"), 10**9)])
    put(probe, "x0")
    return os.path.getsize(DiskTier(tmp_path / "probe").path("x0"))


def test_disk_tier_capacity_evicts_oldest_files(tmp_path):
    size = _file_size(tmp_path)
    disk = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(disk, 2 * size + size // 4)])
    for key in ("a", "b", "c"):
        put(store, key)
    assert sorted(disk.keys()) == ["b", "c"]
    assert store.stats()["disk"]["evictions"] == 1
    assert store.stats()["disk"]["occupancy_bytes"] <= 2 * size + size // 4


def test_restart_keeps_disk_entries_and_rebuilds_lru_order_from_mtimes(tmp_path):
    size = _file_size(tmp_path)
    folder = tmp_path / "kv"
    first = TieredStore(SPEC, [(CpuTier(), 10 * ENTRY), (DiskTier(folder), 10**9)])
    kept = {key: put(first, key) for key in ("a", "b", "c")}
    first.close()
    second = TieredStore(SPEC, [(CpuTier(), 10 * ENTRY), (DiskTier(folder), 3 * size + size // 4)])
    for key, (k, v) in kept.items():
        entry, tier = second.get(key)  # a hit refreshes the file's mtime
        assert tier == "disk" and torch.equal(entry.k, k) and torch.equal(entry.v, v)
    now = time.time()
    for age, key in ((300, "b"), (200, "a"), (100, "c")):  # b is the least recently used
        os.utime(DiskTier(folder).path(key), (now - age, now - age))
    third = TieredStore(SPEC, [(DiskTier(folder), 3 * size + size // 4)])
    put(third, "d")
    assert sorted(DiskTier(folder).keys()) == ["a", "c", "d"]


def test_stats_report_every_tier_and_hit_rates_that_add_up(tmp_path):
    store = TieredStore(SPEC, [(CpuTier(), ENTRY), (DiskTier(tmp_path / "kv"), 10**9)])
    put(store, "a")
    put(store, "b")
    store.get("b")  # cpu hit
    store.get("a")  # disk hit
    store.get("zz")  # miss everywhere
    stats = store.stats()
    assert list(stats) == ["cpu", "disk"]
    assert set(stats["cpu"]) >= {"hits", "misses", "lookups", "hit_rate", "bytes_read", "bytes_written", "evictions",
                                 "corrupt", "unavailable", "not_stored", "entries", "occupancy_bytes",
                                 "capacity_bytes", "free_bytes", "up"}
    assert (stats["cpu"]["hits"], stats["cpu"]["misses"]) == (1, 2)
    assert (stats["disk"]["hits"], stats["disk"]["misses"]) == (1, 2)
    assert stats["disk"]["hit_rate"] == pytest.approx(1 / 3) and stats["disk"]["bytes_read"] == ENTRY
    assert stats["cpu"]["capacity_bytes"] == ENTRY and stats["disk"]["entries"] == 2
    assert store.ledger.summary() == {**store.ledger.summary(), "lookups": 3, "hits": 2, "misses": 1}
    assert store.hit_rate_line() == "3 lookups: cpu 33.3% (1) | disk 33.3% (1) | miss 33.3% (1); head 0/0"


def test_hit_rate_log_line_is_written_periodically(tmp_path, caplog):
    settings = StoreSettings(ssd_cache_dir=tmp_path / "kv", enable_hit_rate_log=True, log_interval_sec=0.05)
    with caplog.at_level(logging.INFO, logger="ragcache.kvstore"):
        store = TieredStore.from_settings(settings, spec=SPEC)
        put(store, "a")
        store.get("a")

        def lines() -> list[str]:
            return [r.getMessage() for r in caplog.records
                    if r.name == "ragcache.kvstore" and "hit rates" in r.getMessage()]

        deadline = time.monotonic() + 5
        while len(lines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        store.close()
    assert len(lines()) >= 2 and "1 lookups: cpu 100.0% (1)" in lines()[-1]


def test_from_settings_builds_tiers_with_decimal_gb_capacities(tmp_path):
    s = StoreSettings(ssd_cache_dir=tmp_path / "kv", cpu_kv_pool_gb=0.5, ssd_cache_max_gb=2)
    store = TieredStore.from_settings(s, spec=SPEC, device=torch.device("cpu"))
    stats = store.stats()
    assert list(stats) == ["cpu", "disk"]  # no device tier on a CPU engine, no remote_url
    assert stats["cpu"]["capacity_bytes"] == 500_000_000 and stats["disk"]["capacity_bytes"] == 2 * 10**9
    off = TieredStore.from_settings(StoreSettings(ssd_cache_dir=tmp_path / "kv", cpu_kv_pool_gb=0,
                                                  ssd_cache_max_gb=0), spec=SPEC)
    assert off.tier_names == []
    k, v = make_kv()
    off.put("a", k, v, 0)  # nowhere to keep it: accepted and dropped
    assert off.get("a") is None


def test_verify_removes_damaged_entries_and_keeps_good_ones(tmp_path):
    disk = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(disk, 10**9)])
    for key in ("a", "b", "c"):
        put(store, key)
    with open(disk.path("b"), "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff\xff")
    os.truncate(disk.path("c"), 100)
    report = store.verify()["disk"]
    assert report["checked"] == 3 and report["ok"] == 1 and report["corrupt"] == 2
    assert sorted(report["removed"]) == ["b", "c"] and sorted(disk.keys()) == ["a"]


def test_delete_and_clear_empty_every_tier(tmp_path):
    disk = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(CpuTier(), 10 * ENTRY), (disk, 10**9)])
    for key in ("a", "b", "c"):
        put(store, key)
    assert store.delete("a") is True and store.delete("a") is False
    assert store.contains("a") is None and not disk.path("a").exists()
    store.clear()
    assert store.contains("b") is None and list(disk.keys()) == []
    assert store.stats()["cpu"]["entries"] == 0


def test_store_without_spec_serves_administration_only(tmp_path):
    put(TieredStore(SPEC, [(DiskTier(tmp_path / "kv"), 10**9)]), "a")
    admin = TieredStore(None, [(DiskTier(tmp_path / "kv"), 10**9)])
    assert admin.stats()["disk"]["entries"] == 1
    assert admin.contains("a") == "disk"
    assert admin.verify()["disk"]["ok"] == 1
    with pytest.raises(RuntimeError):
        admin.get("a")


def test_concurrent_threads_never_see_wrong_data(tmp_path):
    store = TieredStore(SPEC, [(CpuTier(), 4 * ENTRY), (DiskTier(tmp_path / "kv"), 12 * ENTRY)])
    expected = {f"k{i}": make_kv(seed=i) for i in range(10)}
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(40):
                key = f"k{int(torch.randint(0, 10, (1,), generator=g))}"
                op = int(torch.randint(0, 4, (1,), generator=g))
                if op == 0:
                    store.put(key, *expected[key], 0)
                elif op == 1:
                    store.delete(key)
                elif op == 2:
                    hit = store.get(key)
                    if hit is not None:
                        assert torch.equal(hit[0].k, expected[key][0])
                else:
                    handle = store.open(key)
                    if handle is not None:
                        with handle:
                            assert torch.equal(handle.layer(1)[1], expected[key][1][1])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    stats = store.stats()
    assert stats["cpu"]["occupancy_bytes"] <= 4 * ENTRY
    assert stats["cpu"]["entries"] == len(store._slots[0].index)
    assert stats["disk"]["corrupt"] == 0
