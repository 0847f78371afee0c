"""ragcache.kvstore tiers and entry format: round trips, per-layer reads, damaged and foreign entries."""

from __future__ import annotations

import logging
import os
import struct

import pytest
import torch
from kv_fixtures import SPEC, make_kv

from ragcache.kvstore import (
    CorruptEntryError,
    CpuTier,
    DeviceTier,
    DiskTier,
    KVSpec,
    TieredStore,
    TierUsage,
)
from ragcache.kvstore.format import FileEntryReader


def disk_store(path, spec: KVSpec = SPEC, **kw) -> TieredStore:
    return TieredStore(spec, [(DiskTier(path), 10**9)], **kw)


EVERY_LOCAL_TIER = pytest.mark.parametrize("tier_factory", [
    lambda tmp: CpuTier(),
    lambda tmp: DeviceTier("cpu"),
    lambda tmp: DiskTier(tmp / "kv"),
], ids=["cpu", "device", "disk"])


@EVERY_LOCAL_TIER
def test_round_trip_returns_exactly_the_stored_tensors(tmp_path, tier_factory):
    tier = tier_factory(tmp_path)
    store = TieredStore(SPEC, [(tier, 10**9)])
    k, v = make_kv(tokens=7)
    store.put("chunk-a", k, v, start_position=11)
    entry, served_by = store.get("chunk-a")
    assert served_by == tier.name
    assert torch.equal(entry.k, k) and torch.equal(entry.v, v)
    assert entry.k.dtype == torch.float32 and entry.k.device.type == "cpu"
    assert entry.meta.start_position == 11 and entry.meta.num_tokens == 7
    assert entry.meta.model_fingerprint == SPEC.model_fingerprint and entry.meta.dtype == "float32"
    assert len(entry.meta.checksums) == 2 * SPEC.num_layers
    assert store.contains("chunk-a") == tier.name
    assert store.get("chunk-b") is None


@EVERY_LOCAL_TIER
def test_every_tier_answers_ping_lists_its_entries_and_pops_one(tmp_path, tier_factory):
    tier = tier_factory(tmp_path)
    store = TieredStore(SPEC, [(tier, 10**9)])
    k, v = make_kv(tokens=5)
    store.put("a", k, v, 0)
    store.put("b", *make_kv(seed=1), 0)
    assert tier.ping() is True
    listed = {e.key: e.size for e in tier.scan()}
    assert sorted(listed) == ["a", "b"]
    assert all(size >= k.numel() * 2 * 4 for size in listed.values())  # K and V in fp32, plus any header
    assert tier.usage() == TierUsage(2, sum(listed.values()))
    item = tier.pop("a")
    assert item is not None and item.key == "a" and item.meta.num_tokens == 5
    assert torch.equal(item.kv[:, 0], k) and torch.equal(item.kv[:, 1], v)
    assert not tier.contains("a") and [e.key for e in tier.scan()] == ["b"]
    assert tier.pop("a") is None


def test_disk_scan_lists_least_recently_used_first(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(tier, 10**9)])
    for key in ("a", "b", "c"):
        store.put(key, *make_kv(), 0)
    for age, key in ((100, "a"), (300, "b"), (200, "c")):
        os.utime(tier.path(key), (1e9 - age, 1e9 - age))
    assert [e.key for e in tier.scan()] == ["b", "c", "a"]
    assert [e.mtime for e in tier.scan()] == [1e9 - 300, 1e9 - 200, 1e9 - 100]


def test_disk_pop_of_a_damaged_file_raises_and_keeps_it(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    TieredStore(SPEC, [(tier, 10**9)]).put("a", *make_kv(), 0)
    os.truncate(tier.path("a"), 100)
    with pytest.raises(CorruptEntryError):
        tier.pop("a")
    assert tier.path("a").exists()


def test_returned_tensors_are_copies_so_in_place_rope_cannot_damage_the_cache(tmp_path):
    store = TieredStore(SPEC, [(CpuTier(), 10**9)])
    k, v = make_kv()
    store.put("a", k, v, 0)
    entry, _ = store.get("a")
    entry.k.zero_()
    with store.open("a") as h:
        k0, _ = h.layer(0)
        k0.zero_()
    again, _ = store.get("a")
    assert torch.equal(again.k, k)


def test_open_reads_single_layers_in_any_order(tmp_path):
    store = disk_store(tmp_path / "kv")
    k, v = make_kv(tokens=5)
    store.put("a", k, v, 3)
    handle = store.open("a")
    assert handle.tier == "disk" and handle.meta.num_tokens == 5
    for i in (2, 0, 3, 1):
        ki, vi = handle.layer(i)
        assert ki.shape == (5, SPEC.num_kv_heads, SPEC.head_dim)
        assert torch.equal(ki, k[i]) and torch.equal(vi, v[i])
    handle.close()
    handle.close()  # idempotent
    with pytest.raises(RuntimeError):
        handle.layer(0)
    assert store.open("missing") is None


def test_disk_file_is_plain_safetensors_with_one_tensor_per_layer(tmp_path):
    from safetensors import safe_open

    tier = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(tier, 10**9)])
    k, v = make_kv()
    store.put("ns/a:b", k, v, 9)
    with safe_open(str(tier.path("ns/a:b")), framework="pt") as f:
        assert sorted(f.keys()) == sorted([f"{n}.{i}" for i in range(4) for n in "kv"])
        assert torch.equal(f.get_tensor("k.2"), k[2]) and torch.equal(f.get_tensor("v.3"), v[3])
        md = f.metadata()
    assert md["model_fingerprint"] == SPEC.model_fingerprint and md["start_position"] == "9"
    assert list(tier.keys()) == ["ns/a:b"]


def test_disk_write_leaves_no_temporary_files(tmp_path):
    store = disk_store(tmp_path / "kv")
    for i in range(3):
        store.put(f"k{i}", *make_kv(seed=i), 0)
    assert sorted(os.listdir(tmp_path / "kv")) == [f"k{i}.safetensors" for i in range(3)]


@pytest.mark.parametrize("kv_dtype, dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_16_bit_storage_round_trips_to_the_models_dtype(tmp_path, kv_dtype, dtype):
    k, v = make_kv()
    for tier in (CpuTier(), DiskTier(tmp_path / kv_dtype)):
        store = TieredStore(SPEC, [(tier, 10**9)], kv_dtype=kv_dtype)
        store.put("a", k, v, 0)
        entry, _ = store.get("a")
        assert entry.meta.dtype == kv_dtype and entry.k.dtype == torch.float32
        assert torch.equal(entry.k, k.to(dtype).to(torch.float32))
        assert torch.equal(entry.v, v.to(dtype).to(torch.float32))
        with store.open("a") as h:
            assert torch.equal(h.layer(1)[1], v[1].to(dtype).float())
    # half the bytes of float32 on disk
    assert store.stats()["disk"]["bytes_written"] < k.numel() * 2 * 2 + 8192


def test_half_precision_model_dtype_is_stored_as_is(tmp_path):
    spec = KVSpec("fp16model", 1, 2, 1, 4, dtype=torch.float16)
    store = disk_store(tmp_path / "kv", spec=spec)
    k, v = make_kv(spec=spec)
    store.put("a", k, v, 0)
    entry, _ = store.get("a")
    assert entry.meta.dtype == "float16" and torch.equal(entry.k, k) and entry.k.dtype == torch.float16


def _data_start(path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_flipped_bytes_in_the_data_area_are_detected_deleted_and_counted_as_a_miss(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(tier, 10**9)])
    store.put("a", *make_kv(), 0)
    path = tier.path("a")
    offset = _data_start(path) + 100
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert store.get("a") is None
    stats = store.stats()["disk"]
    assert stats["corrupt"] == 1 and stats["misses"] == 1 and stats["hits"] == 0
    assert not path.exists()


def test_corruption_in_a_late_layer_fails_that_layer_of_a_handle(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(tier, 10**9)])
    k, v = make_kv()
    store.put("a", k, v, 0)
    path = tier.path("a")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 3)
        f.write(b"\x00\x01\x02")
    handle = store.open("a")
    assert torch.equal(handle.layer(0)[0], k[0])
    with pytest.raises(CorruptEntryError):
        handle.layer(SPEC.num_layers - 1)
    assert not path.exists() and store.stats()["disk"]["corrupt"] == 1
    handle.close()


@pytest.mark.parametrize("cut", ["data", "header", "empty"])
def test_truncated_file_is_detected_deleted_and_counted_as_a_miss(tmp_path, cut):
    tier = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(tier, 10**9)])
    store.put("a", *make_kv(), 0)
    path = tier.path("a")
    size = {"data": os.path.getsize(path) - 10, "header": 40, "empty": 0}[cut]
    os.truncate(path, size)
    assert store.contains("a") is None
    assert store.get("a") is None
    assert store.stats()["disk"]["corrupt"] >= 1
    assert not path.exists()


def test_garbage_file_under_a_key_is_a_counted_miss(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    tier.path("a").write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"x" * 50)
    store = TieredStore(SPEC, [(tier, 10**9)])
    assert store.open("a") is None
    assert store.stats()["disk"]["corrupt"] == 1 and not tier.path("a").exists()


def test_file_renamed_to_another_key_is_not_returned(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(tier, 10**9)])
    store.put("a", *make_kv(), 0)
    os.replace(tier.path("a"), tier.path("b"))
    assert store.get("b") is None and store.stats()["disk"]["corrupt"] == 1


@pytest.mark.parametrize("other", [
    dict(model_fingerprint="0000000000000000"),
    dict(layout_version=2),
    dict(num_kv_heads=4),
])
def test_entry_of_another_model_or_layout_is_not_returned_and_left_alone(tmp_path, other):
    folder = tmp_path / "kv"
    fields = dict(model_fingerprint=SPEC.model_fingerprint, layout_version=1, num_layers=4,
                  num_kv_heads=2, head_dim=8, dtype=torch.float32) | other
    foreign_spec = KVSpec(**fields)
    disk_store(folder, spec=foreign_spec).put("a", *make_kv(spec=foreign_spec), 0)
    store = disk_store(folder)
    assert store.get("a") is None
    assert store.open("a") is None
    assert store.contains("a") is None
    stats = store.stats()["disk"]
    assert stats["foreign"] == 2 and stats["corrupt"] == 0 and stats["misses"] == 2
    assert DiskTier(folder).path("a").exists()
    report = store.verify()["disk"]
    assert report["foreign"] == 1 and report["corrupt"] == 0 and DiskTier(folder).path("a").exists()


def test_safetensors_file_not_written_by_ragcache_is_foreign_and_left_alone(tmp_path):
    from safetensors.torch import save_file

    tier = DiskTier(tmp_path / "kv")
    save_file({"w": torch.zeros(3)}, str(tier.path("a")))
    store = TieredStore(SPEC, [(tier, 10**9)])
    assert store.get("a") is None
    assert store.stats()["disk"]["foreign"] == 1 and tier.path("a").exists()


def test_each_kind_of_foreign_entry_is_logged_once_per_tier(tmp_path, caplog):
    folder = tmp_path / "kv"
    other = KVSpec("0000000000000000", 1, 4, 2, 8)
    for key in ("other1", "other2"):
        disk_store(folder, spec=other).put(key, *make_kv(), 0)
    disk_store(folder, kv_compression="int8").put("int8", *make_kv(), 0)  # a swapped stored form
    damaged = DiskTier(folder).path("damaged")  # a header whose format field was overwritten
    disk_store(folder).put("damaged", *make_kv(), 0)
    damaged.write_bytes(damaged.read_bytes().replace(b'"ragcache-kv/1"', b'"ragcache-kv/X"', 1))
    store = disk_store(folder)
    with caplog.at_level(logging.DEBUG, logger="ragcache.kvstore"):
        for key in ("other1", "other2", "other1", "int8", "damaged", "damaged"):
            assert store.get(key) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all("left in place" in w for w in warnings), warnings
    assert "'other1'" in warnings[0] and "model_fingerprint" in warnings[0]
    assert "'int8'" in warnings[1] and "stored form 'int8'" in warnings[1]
    assert "'damaged'" in warnings[2] and "ragcache-kv/X" in warnings[2]
    assert store.stats()["disk"]["foreign"] == 6 and store.stats()["disk"]["corrupt"] == 0
    assert sorted(DiskTier(folder).keys()) == ["damaged", "int8", "other1", "other2"]


def test_file_vanishing_is_a_plain_miss(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    store = TieredStore(SPEC, [(tier, 10**9)])
    store.put("a", *make_kv(), 0)
    handle_reader = FileEntryReader(tier.path("a"), "a")
    os.unlink(tier.path("a"))
    assert store.get("a") is None and store.stats()["disk"]["corrupt"] == 0
    assert handle_reader.read_all().shape == (4, 2, 6, 2, 8)  # an open reader keeps its inode
    handle_reader.close()


def test_put_rejects_wrong_shapes_and_bad_keys(tmp_path):
    store = TieredStore(SPEC, [(CpuTier(), 10**9)])
    k, v = make_kv()
    with pytest.raises(ValueError):
        store.put("a", k[:, :, :1], v[:, :, :1], 0)
    with pytest.raises(ValueError):
        store.put("a", k, v[:, :3], 0)
    with pytest.raises(ValueError):
        store.put("../etc/passwd", k, v, 0)
    with pytest.raises(ValueError):
        store.put("a", k, v, -1)
