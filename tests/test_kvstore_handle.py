"""KVHandle against a stand-in store: it reports reads, damage and promotion only through HandleOwner."""

from __future__ import annotations

import pytest
import torch

from ragcache.kvstore import CorruptEntryError, KVMeta
from ragcache.kvstore.entry import StoredKV, dtype_name
from ragcache.kvstore.format import BytesEntryReader, checksums, encode
from ragcache.kvstore.handle import KVHandle
from ragcache.kvstore.memory import MemoryReader

LAYERS, TOKENS, HEADS, DIM = 3, 4, 2, 8


class Owner:
    """Records what the handle tells it; promotes entries of at most ``top_capacity`` bytes."""

    device = torch.device("cpu")
    spec_dtype = torch.float32

    def __init__(self, top_capacity: int = 10**9) -> None:
        self.top_capacity = top_capacity
        self.reads: list[tuple[int, int]] = []
        self.corrupt: list[tuple[int, str]] = []
        self.promoted: list[tuple[int, StoredKV]] = []

    def should_promote(self, pos: int, nbytes: int) -> bool:
        return pos > 0 and nbytes <= self.top_capacity

    def record_read(self, pos: int, key: str, nbytes: int) -> None:
        self.reads.append((pos, nbytes))

    def read_failed(self, pos: int, key: str, exc: Exception, head: bool = False) -> None:
        assert isinstance(exc, CorruptEntryError)
        self.corrupt.append((pos, key))

    def promote(self, pos: int, item: StoredKV) -> None:
        self.promoted.append((pos, item))


def stored(dtype: torch.dtype = torch.float16) -> StoredKV:
    kv = torch.randn(LAYERS, 2, TOKENS, HEADS, DIM, generator=torch.Generator().manual_seed(0)).to(dtype)
    meta = KVMeta("fp", 1, dtype_name(dtype), LAYERS, TOKENS, HEADS, DIM, 0, checksums(kv))
    return StoredKV("a", meta, kv)


def test_layers_come_back_in_the_owners_dtype_and_every_read_is_recorded():
    item = stored(torch.float16)
    owner = Owner()
    with KVHandle(owner, 2, BytesEntryReader(encode("a", item.meta, item.kv), "a"), "disk", False) as h:
        assert h.tier == "disk" and h.key == "a" and h.num_layers == LAYERS
        k1, v1 = h.layer(1)
        assert k1.dtype == torch.float32 and k1.shape == (TOKENS, HEADS, DIM)
        assert torch.equal(k1, item.kv[1, 0].float()) and torch.equal(v1, item.kv[1, 1].float())
    assert owner.reads == [(2, 2 * TOKENS * HEADS * DIM * 2)]  # K and V of one layer in float16
    assert owner.promoted == []  # not every layer was read


def test_close_after_every_layer_promotes_the_entry_read_from_a_persistent_tier():
    item = stored()
    owner = Owner()
    with KVHandle(owner, 1, BytesEntryReader(encode("a", item.meta, item.kv), "a"), "remote", False) as h:
        for i in reversed(range(LAYERS)):
            h.layer(i)
    [(pos, promoted)] = owner.promoted
    assert pos == 1 and promoted.key == "a" and torch.equal(promoted.kv, item.kv)
    h.close()  # idempotent: no second promotion
    assert len(owner.promoted) == 1


def test_entry_too_big_for_the_top_tier_is_not_promoted():
    item = stored()
    owner = Owner(top_capacity=item.nbytes - 1)
    with KVHandle(owner, 1, MemoryReader(item), "cpu", True) as h:
        for i in range(LAYERS):
            h.layer(i)
    assert owner.promoted == []


def test_layer_of_a_memory_tier_is_a_copy_not_a_view_of_the_stored_entry():
    item = stored(torch.float32)
    before = item.kv.clone()
    with KVHandle(Owner(), 0, MemoryReader(item), "cpu", True) as h:
        k0, _ = h.layer(0)
        k0.add_(1.0)
    assert torch.equal(item.kv, before)


def test_damaged_layer_is_reported_to_the_owner_and_closes_the_handle():
    item = stored()
    data = bytearray(encode("a", item.meta, item.kv))
    data[-3] ^= 0xFF  # last layer's V
    owner = Owner()
    h = KVHandle(owner, 2, BytesEntryReader(bytes(data), "a"), "disk", False)
    h.layer(0)
    with pytest.raises(CorruptEntryError):
        h.layer(LAYERS - 1)
    assert owner.corrupt == [(2, "a")] and owner.promoted == []
    with pytest.raises(RuntimeError):
        h.layer(0)


def test_all_layers_at_once_read_the_entry_whole_count_every_layer_and_promote_it():
    item = stored(torch.float16)
    owner = Owner()
    with KVHandle(owner, 2, BytesEntryReader(encode("a", item.meta, item.kv), "a"), "disk", False) as h:
        every = h.all_layers()
        assert every.dtype == torch.float32 and every.shape == (LAYERS, 2, TOKENS, HEADS, DIM)
        assert torch.equal(every, item.kv.float())
    assert owner.reads == [(2, LAYERS * 2 * TOKENS * HEADS * DIM * 2)]  # every layer's K and V, float16
    [(pos, promoted)] = owner.promoted
    assert pos == 2 and torch.equal(promoted.kv, item.kv)  # promoted in the storage dtype


def test_all_layers_of_a_memory_tier_are_the_stored_entry_itself():
    item = stored(torch.float32)
    with KVHandle(Owner(), 0, MemoryReader(item), "cpu", True) as h:
        assert h.all_layers().data_ptr() == item.kv.data_ptr()  # no copy: the caller copies it once


def test_a_damaged_entry_read_whole_is_reported_and_closes_the_handle():
    item = stored()
    data = bytearray(encode("a", item.meta, item.kv))
    data[-3] ^= 0xFF  # last layer's V
    owner = Owner()
    h = KVHandle(owner, 2, BytesEntryReader(bytes(data), "a"), "disk", False)
    with pytest.raises(CorruptEntryError):
        h.all_layers()
    assert owner.corrupt == [(2, "a")] and owner.promoted == []
    with pytest.raises(RuntimeError):
        h.all_layers()
