"""TierSlot: one tier's index, counters and guarded single-tier steps."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ragcache.kvstore import CpuTier, DiskTier, KVSpec, TieredStore, TierUnavailableError, TierUsage
from ragcache.kvstore.guard import TierGuard
from ragcache.kvstore.slot import TierSlot

SPEC = KVSpec(model_fingerprint="b179c9523d0e6a0f", layout_version=1, num_layers=2, num_kv_heads=1,
              head_dim=4, dtype=torch.float32)


class Unreachable:
    """A persistent tier whose every call finds the medium unreachable."""

    name = "remote"
    memory = False

    def __getattr__(self, method: str):
        def call(*args):
            raise TierUnavailableError("connection refused")
        return call


def slot_of(tier, capacity: int | None = 10**9) -> TierSlot:
    return TierSlot(tier, capacity, "lru", TierGuard(tier.name), threading.RLock())


def fill(folder, keys) -> DiskTier:
    store = TieredStore(SPEC, [(DiskTier(folder), None)])
    for key in keys:
        store.put(key, torch.zeros(2, 3, 1, 4), torch.ones(2, 3, 1, 4), 0)
    return DiskTier(folder)


def test_unreachable_tier_reports_no_usage_cannot_tell_what_it_holds_and_is_marked_down():
    slot = slot_of(Unreachable(), None)
    assert slot.index is None  # unbounded persistent tier: no index
    assert slot.usage() == TierUsage(0, 0)
    assert slot.guard.up is False
    assert slot.holds("a") is True  # cannot tell: nothing gets written into it
    assert slot.delete("a") is False and slot.open_checked("a", SPEC.mismatch) is None
    assert slot.counters == type(slot.counters)()  # nothing counted here: the store counts the lookup


def test_rescan_indexes_what_the_folder_holds_and_keeps_access_counts(tmp_path):
    disk = fill(tmp_path / "kv", ["a", "b"])
    slot = slot_of(disk)
    assert len(slot.index) == 0
    slot.rescan()
    assert len(slot.index) == 2 and slot.index.used_bytes == sum(f.size for f in disk.scan())
    slot.record_hit("a", 0, 0)
    slot.record_hit("a", 0, 0)
    os.unlink(disk.path("b"))  # removed by another process
    fill(tmp_path / "kv", ["c"])  # written by another process
    slot.rescan()
    assert ("a" in slot.index, "b" in slot.index, "c" in slot.index) == (True, False, True)
    assert slot.index.freq("a") == 3 and slot.index.freq("c") == 1
    assert slot.counters.hits == 2


def test_open_checked_finds_usable_entries_and_counts_foreign_ones(tmp_path):
    fill(tmp_path / "kv", ["a"])
    slot = slot_of(DiskTier(tmp_path / "kv"))
    other = KVSpec("0000000000000000", 1, 2, 1, 4)
    assert slot.open_checked("missing", SPEC.mismatch) is None
    assert slot.open_checked("a", other.mismatch) is None
    reader = slot.open_checked("a", SPEC.mismatch)
    assert reader is not None and reader.meta.num_tokens == 3
    reader.close()
    c = slot.counters
    assert (c.foreign, c.corrupt, c.hits) == (1, 0, 0)


def test_unbounded_memory_tier_keeps_an_index_and_an_unknown_policy_is_refused():
    assert slot_of(CpuTier(), None).index is not None
    with pytest.raises(ValueError):
        TierSlot(CpuTier(), None, "fifo", TierGuard("cpu"), threading.RLock())
