"""Compressed chunk KV (``store.kv_compression``): error bounds of each quantiser, stored bytes, the
stored form as part of an entry's identity (another form is refused, then replaced), checksums
that catch a flipped byte in a compressed entry on disk and in Redis, and non-finite scales (or
uncompressed K/V) behind rewritten checksums refused by every read.

Through the real tiers (cpu, device on the CPU, disk, a real redis-server); no model.
"""

from __future__ import annotations

import json
import logging
import struct

import pytest
import redis
import torch
from kv_fixtures import SPEC, poison
from redis_server import start_redis
from safetensors import safe_open

from ragcache.chunks import ChunkKey
from ragcache.kvstore import CorruptEntryError, CpuTier, DeviceTier, DiskTier, KVSpec, RedisTier, TieredStore
from ragcache.kvstore.codec import ERROR_BOUNDS, MIN_SCALE, QMAX, decode_all, encode, layer_parts
from ragcache.kvstore.format import FORMAT_QUANTISED

#: a spec shaped like a small real model's KV (head_dim 64), float32
REAL = KVSpec("c0mpre55ed000000", 1, num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float32)


def kv_like_a_model(tokens: int = 40, spec: KVSpec = REAL, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K with a few outlier channels (as pre-RoPE K has), V with tokens of varied magnitude."""
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, tokens, spec.num_kv_heads, spec.head_dim)
    k = torch.randn(shape, generator=g)
    k[..., :4] *= 12.0  # outlier channels
    v = torch.randn(shape, generator=g) * torch.rand(spec.num_layers, tokens, spec.num_kv_heads, 1, generator=g) * 3
    return k.to(spec.dtype), v.to(spec.dtype)


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_round_trip_error_is_within_the_documented_bound_of_each_quantiser(form):
    k, v = kv_like_a_model()
    kv = encode(k, v, form, torch.float16)
    parts = layer_parts(form, torch.float16, *k.shape[1:])
    k_hat, v_hat = decode_all(form, parts, kv, torch.float32, torch.device("cpu"))
    bound = ERROR_BOUNDS[form]
    # K per channel (max over the chunk's tokens), V per token (max over the head's dimensions)
    k_group = k.abs().amax(dim=1, keepdim=True).clamp_min(QMAX[form] * MIN_SCALE)
    v_group = v.abs().amax(dim=3, keepdim=True).clamp_min(QMAX[form] * MIN_SCALE)
    assert bool(((k_hat - k).abs() <= bound * k_group).all())
    assert bool(((v_hat - v).abs() <= bound * v_group).all())
    # and the bound is tight enough to mean something: the relative error of the whole tensor
    rel = {"int8": 0.01, "int4": 0.2}[form]
    assert (k_hat - k).norm() / k.norm() < rel and (v_hat - v).norm() / v.norm() < rel
    assert (k_hat - k).abs().max() > 0  # lossy, really quantised


def _stored_layers(form: str, lengths: list[int], layer: int = 1) -> list:
    from ragcache.kvstore.codec import StoredLayer

    out = []
    for j, t in enumerate(lengths):
        k, v = kv_like_a_model(tokens=t, seed=j)
        parts = layer_parts(form, torch.float16 if form != "none" else torch.float32, t, 2, 64)
        out.append(StoredLayer(form, parts, encode(k, v, form, torch.float32 if form == "none" else torch.float16)[layer]))
    return out


@pytest.mark.parametrize("form", ["none", "int8", "int4"])
def test_one_layer_of_many_entries_decodes_as_each_entry_alone_concatenated(form):
    from ragcache.kvstore.codec import decode_layer, decode_layers

    layers = _stored_layers(form, [7, 40, 1, 23])
    k, v = decode_layers(layers, torch.bfloat16, torch.device("cpu"))
    one = [decode_layer(x.form, x.parts, x.record, torch.bfloat16, torch.device("cpu")) for x in layers]
    assert k.shape == v.shape == (71, 2, 64) and k.dtype == v.dtype == torch.bfloat16
    assert torch.equal(k, torch.cat([a for a, _ in one])) and torch.equal(v, torch.cat([b for _, b in one]))
    # mixed forms (a chunk computed during a request beside stored ones) decode one by one, alike
    mixed = layers[:2] + _stored_layers("none", [5])
    k, v = decode_layers(mixed, torch.float32, torch.device("cpu"))
    assert k.shape == (52, 2, 64) and torch.equal(v[47:], decode_layer("none", mixed[2].parts, mixed[2].record,
                                                                       torch.float32, torch.device("cpu"))[1])


def test_decoding_a_layer_of_more_entries_takes_no_more_kernels():
    """The dequantisation of one layer costs a fixed number of kernels whatever the number of chunks in
    the context (only views of each entry's parts are per entry): what keeps compressed KV from adding
    per-chunk work to every layer of a blend."""
    from torch.profiler import ProfilerActivity, profile

    from ragcache.kvstore.codec import decode_layers

    views = {"aten::slice", "aten::view", "aten::select", "aten::as_strided", "aten::alias", "aten::lift_fresh",
             "aten::detach", "aten::detach_", "aten::unsqueeze", "aten::expand"}

    def kernels(n: int) -> int:
        layers = _stored_layers("int8", [30] * n)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode_layers(layers, torch.bfloat16, torch.device("cpu"))
        return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name not in views
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))

    assert kernels(2) == kernels(12) <= 20


def _stored_entries(form: str, lengths: list[int]) -> list:
    from ragcache.kvstore.codec import StoredEntry

    out = []
    for j, t in enumerate(lengths):
        k, v = kv_like_a_model(tokens=t, seed=j)
        parts = layer_parts(form, torch.float16 if form != "none" else torch.float32, t, 2, 64)
        out.append(StoredEntry(form, parts, encode(k, v, form, torch.float32 if form == "none" else torch.float16)))
    return out


@pytest.mark.parametrize("form", ["none", "int8", "int4"])
def test_every_layer_of_many_entries_decodes_as_each_layer_alone(form):
    from ragcache.kvstore.codec import StoredLayer, decode_entries, decode_layers

    entries = _stored_entries(form, [7, 40, 1, 23])
    k, v = decode_entries(entries, torch.bfloat16, torch.device("cpu"))
    layers = entries[0].record.shape[0]
    assert k.shape == v.shape == (layers, 71, 2, 64) and k.dtype == v.dtype == torch.bfloat16
    for i in range(layers):
        ki, vi = decode_layers([StoredLayer(e.form, e.parts, e.record[i]) for e in entries], torch.bfloat16,
                               torch.device("cpu"))
        assert torch.equal(k[i], ki) and torch.equal(v[i], vi), i
    one_by_one = (torch.empty_like(k), torch.empty_like(v))  # a CPU's way: layer by layer into the caller's buffer
    got = decode_entries(entries, torch.bfloat16, torch.device("cpu"), out=one_by_one, layers_per_call=1)
    assert got[0] is one_by_one[0] and torch.equal(got[0], k) and torch.equal(got[1], v)
    mixed = entries[:2] + _stored_entries("none", [5])  # a chunk computed during the request among stored ones
    k, v = decode_entries(mixed, torch.float32, torch.device("cpu"))
    assert k.shape == (layers, 52, 2, 64)
    assert torch.equal(v[:, 47:], decode_entries(mixed[2:], torch.float32, torch.device("cpu"))[1])


def test_decoding_every_layer_of_more_entries_dispatches_no_more_operators_per_layer():
    """What the worker stages for a blend: every layer of every chunk in a fixed number of operators
    per layer whatever the number of chunks; one split per entry (views included), once for all
    its layers."""
    from ragcache.blend.opcount import count_ops
    from ragcache.kvstore.codec import decode_entries

    def ops(n: int, layers_per_call: int | None) -> int:
        entries = _stored_entries("int8", [30] * n)
        with count_ops() as counted:
            decode_entries(entries, torch.bfloat16, torch.device("cpu"), layers_per_call=layers_per_call)
        return counted.total

    layers = _stored_entries("int8", [1])[0].record.shape[0]
    assert ops(12, None) - ops(2, None) == 10 and ops(2, None) <= 50
    assert ops(12, 1) - ops(2, 1) == 10  # layer by layer: a fixed number per layer
    assert ops(2, 1) - ops(2, None) <= 16 * (layers - 1)  # each further round: a few slices and kernels


def test_a_group_of_zeros_and_tiny_values_round_trips_without_dividing_by_zero():
    k, v = kv_like_a_model(tokens=5)
    k[:, :, :, 7] = 0.0  # a channel that is zero on every token
    v[:, 2] = 1e-9  # a token whose values are tiny
    kv = encode(k, v, "int8", torch.float16)
    k_hat, v_hat = decode_all("int8", layer_parts("int8", torch.float16, 5, 2, 64), kv, torch.float32,
                              torch.device("cpu"))
    assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
    assert bool((k_hat[:, :, :, 7] == 0).all()) and float((v_hat[:, 2] - v[:, 2]).abs().max()) <= MIN_SCALE / 2


@pytest.mark.parametrize("tier_factory", [
    lambda tmp: CpuTier(), lambda tmp: DeviceTier("cpu"), lambda tmp: DiskTier(tmp / "kv"),
], ids=["cpu", "device", "disk"])
@pytest.mark.parametrize("form", ["int8", "int4"])
def test_every_tier_serves_the_dequantised_kv_layer_by_layer_in_the_spec_dtype(tmp_path, tier_factory, form):
    spec = KVSpec(REAL.model_fingerprint, 1, 3, 2, 64, dtype=torch.bfloat16)
    k, v = kv_like_a_model(spec=spec)
    store = TieredStore(spec, [(tier_factory(tmp_path), 10**9)], kv_compression=form)
    store.put("chunk", k, v, start_position=3)
    entry, tier = store.get("chunk")
    assert entry.meta.compression == form and entry.k.dtype == torch.bfloat16 and entry.k.shape == k.shape
    bound = ERROR_BOUNDS[form] * 1.01 + 2**-7  # and bf16's own rounding of the result
    assert bool(((entry.k.float() - k.float()).abs() <= bound * k.float().abs().amax(1, keepdim=True)).all())
    with store.open("chunk") as h:
        for i in (2, 0, 1):  # any order, one layer at a time
            ki, vi = h.layer(i)
            assert ki.shape == (40, 2, 64) and vi.dtype == torch.bfloat16
            assert torch.equal(ki, entry.k[i]) and torch.equal(vi, entry.v[i])
            ki.zero_()  # the caller's own copy: the stored entry is untouched
    again, _ = store.get("chunk")
    assert torch.equal(again.k, entry.k)


def test_stored_bytes_per_token_are_a_quarter_and_an_eighth_of_float32_plus_the_scales(tmp_path):
    tokens, spec = 400, KVSpec("b" * 16, 1, 30, 3, 64)  # SmolLM2-135M's KV shape
    k, v = torch.randn(30, tokens, 3, 64), torch.randn(30, tokens, 3, 64)
    sizes = {}
    for form in ("none", "int8", "int4"):
        disk = DiskTier(tmp_path / form)
        TieredStore(spec, [(disk, 10**12)], kv_compression=form).put("x", k, v, 0)
        sizes[form] = disk.path("x").stat().st_size
    payload = 30 * tokens * 2 * 3 * 64  # elements
    scales = 30 * (3 * 64 + tokens * 3) * 2  # float16 bytes: K per channel, V per token and head
    assert sizes["int8"] - payload - scales < 12_000  # the rest is the header (~5-9 KB)
    assert sizes["int4"] - payload // 2 - scales < 12_000
    ratio8, ratio4 = sizes["int8"] / sizes["none"], sizes["int4"] / sizes["none"]
    assert 0.25 < ratio8 < 0.26  # above a quarter only by the scales (and a header of the same size)
    assert 0.125 < ratio4 < 0.132


def test_a_compressed_entry_is_plain_safetensors_with_its_form_in_the_header(tmp_path):
    disk = DiskTier(tmp_path / "kv")
    store = TieredStore(REAL, [(disk, 10**9)], kv_compression="int4")
    k, v = kv_like_a_model(tokens=6)
    store.put("chunk", k, v, 0)
    with safe_open(str(disk.path("chunk")), framework="pt") as f:
        md = f.metadata()
        assert md["format"] == FORMAT_QUANTISED and md["compression"] == "int4"
        assert list(f.keys()) == sorted(f"{n}.{i}" for i in range(3) for n in ("k", "k_scale", "v", "v_scale"))
        assert f.get_tensor("k.1").dtype == torch.uint8 and tuple(f.get_tensor("k.1").shape) == (6, 2, 32)
        assert f.get_tensor("v_scale.2").dtype == torch.float16 and tuple(f.get_tensor("v_scale.2").shape) == (6, 2)


@pytest.mark.parametrize("stored, served", [("int8", "none"), ("none", "int8"), ("int8", "int4")])
def test_an_entry_of_another_form_is_refused_then_replaced_by_a_recomputed_one(tmp_path, stored, served):
    folder = tmp_path / "kv"
    k, v = kv_like_a_model()
    TieredStore(REAL, [(DiskTier(folder), 10**9)], kv_compression=stored).put("chunk", k, v, 0)
    store = TieredStore(REAL, [(DiskTier(folder), 10**9)], kv_compression=served)
    assert store.get("chunk") is None and store.open("chunk") is None and store.contains("chunk") is None
    assert store.stats()["disk"]["foreign"] == 2 and DiskTier(folder).contains("chunk")  # left in place
    assert store.verify()["disk"]["foreign"] == 1
    store.put("chunk", k, v, 0)  # the caller recomputed it: stored in the served form, over the other
    entry, tier = store.get("chunk")
    assert tier == "disk" and entry.meta.compression == served


def test_the_stored_form_is_part_of_the_chunk_key():
    keys = {form: str(ChunkKey.of([5, 6, 7], "fp", "default", compute_dtype="bfloat16", kv_compression=form))
            for form in ("none", "int8", "int4")}
    assert len(set(keys.values())) == 3
    assert keys["none"] == str(ChunkKey.of([5, 6, 7], "fp", "default", compute_dtype="bfloat16"))


def flip(data: bytes, offset: int) -> bytes:
    raw = bytearray(data)
    raw[offset] ^= 0x01
    return bytes(raw)


def data_offset(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def scale_offset(data: bytes, name: str) -> int:
    """Absolute offset of the first byte of tensor ``name`` in an entry's bytes."""
    header = json.loads(data[8:data_offset(data)])
    return data_offset(data) + header[name]["data_offsets"][0]


@pytest.mark.parametrize("where", ["k.1", "k_scale.0", "v_scale.2"])
def test_a_flipped_byte_in_a_compressed_disk_entry_is_caught_by_its_checksum(tmp_path, where):
    disk = DiskTier(tmp_path / "kv")
    store = TieredStore(REAL, [(disk, 10**9)], kv_compression="int8")
    store.put("chunk", *kv_like_a_model(), 0)
    path = disk.path("chunk")
    path.write_bytes(flip(path.read_bytes(), scale_offset(path.read_bytes(), where) + 1))
    with store.open("chunk") as h:
        layer = int(where.rsplit(".", 1)[1])
        for i in range(layer):
            h.layer(i)  # the layers before are intact
        with pytest.raises(Exception, match=f"checksum mismatch in {where}"):
            h.layer(layer)
    assert store.stats()["disk"]["corrupt"] == 1 and not path.exists()
    assert store.get("chunk") is None


def test_a_flipped_byte_in_a_compressed_redis_value_is_caught_by_its_checksum(tmp_path):
    server = start_redis(tmp_path)
    try:
        client = redis.Redis.from_url(server.url)
        store = TieredStore(REAL, [(RedisTier(server.url), None)], kv_compression="int4")
        store.put("a", *kv_like_a_model(), 0)
        store.put("b", *kv_like_a_model(seed=1), 0)
        value = client.get("ragcache:kv:a")
        client.set("ragcache:kv:a", flip(value, scale_offset(value, "v_scale.1")))
        value = client.get("ragcache:kv:b")
        client.set("ragcache:kv:b", flip(value, len(value) - 3))  # the last layer's V scales
        assert store.get("a") is None and store.get("b") is None
        assert store.stats()["remote"]["corrupt"] == 2
        assert client.exists("ragcache:kv:a", "ragcache:kv:b") == 0
    finally:
        server.stop()


def test_int4_needs_an_even_head_dim_and_quantised_forms_refuse_non_finite_kv(tmp_path):
    odd = KVSpec("0dd0000000000000", 1, 2, 1, 5)
    with pytest.raises(ValueError, match="odd"):
        TieredStore(odd, [(CpuTier(), None)], kv_compression="int4")
    store = TieredStore(SPEC, [(CpuTier(), None)], kv_compression="int8")
    k, v = torch.randn(4, 3, 2, 8), torch.randn(4, 3, 2, 8)
    k[1, 1, 1, 1] = float("inf")
    with pytest.raises(ValueError, match="kv_compression"):
        store.put("x", k, v, 0)
    with pytest.raises(ValueError, match="unknown KV compression"):
        TieredStore(SPEC, [(CpuTier(), None)], kv_compression="int3")


@pytest.mark.parametrize("form, kv_dtype", [("int8", "model"), ("int4", "model"), ("none", "float16")])
def test_as_stored_gives_exactly_what_a_read_of_the_stored_entry_gives(form, kv_dtype):
    store = TieredStore(REAL, [(CpuTier(), None)], kv_compression=form, kv_dtype=kv_dtype)
    k, v = kv_like_a_model()
    k2, v2 = store.as_stored(k, v)
    store.put("chunk", k, v, 0)
    entry, _ = store.get("chunk")
    assert torch.equal(k2, entry.k) and torch.equal(v2, entry.v) and not torch.equal(k2, k)


def test_as_stored_hands_back_the_tensors_themselves_when_stored_as_they_are():
    store = TieredStore(REAL, [(CpuTier(), None)], kv_compression="none")
    k, v = kv_like_a_model()
    k2, v2 = store.as_stored(k, v)
    assert k2 is k and v2 is v


NAN, INF = float("nan"), float("inf")
#: (stored form, tensor poisoned, value): a quantised entry's V or K scales, an uncompressed entry's K
POISONS = [("int8", "v_scale.1", NAN), ("int8", "k_scale.2", INF), ("int4", "v_scale.0", -INF),
           ("none", "k.1", NAN)]


def _written(folder, form: str, keys) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the same KV under ``keys`` in a disk-only store (so a later store's cpu tier is empty)."""
    k, v = kv_like_a_model()
    writer = TieredStore(REAL, [(DiskTier(folder), 10**9)], kv_compression=form)
    for key in keys:
        writer.put(key, k, v, 0)
    return k, v


@pytest.mark.parametrize("form, tensor, value", POISONS)
def test_non_finite_floats_behind_matching_checksums_are_corrupt_in_every_read_of_a_disk_entry(
        tmp_path, caplog, form, tensor, value):
    folder = tmp_path / "kv"
    disk = DiskTier(folder)
    keys = ("get", "layer", "whole", "verify")
    _written(folder, form, keys)
    for key in keys:
        disk.path(key).write_bytes(poison(disk.path(key).read_bytes(), tensor, value))
    store = TieredStore(REAL, [(CpuTier(), 10**9), (disk, 10**9)], kv_compression=form)
    why = f"non-finite values in {tensor}"
    with caplog.at_level(logging.WARNING, logger="ragcache.kvstore"):
        assert store.get("get") is None  # a whole read (TieredStore.get)
        handle = store.open("layer")  # the header is intact: the damage shows at its layer
        layer = int(tensor.rsplit(".", 1)[1])
        for i in range(layer):
            handle.stored_layer(i)
        with pytest.raises(CorruptEntryError, match=why):
            handle.stored_layer(layer)
        with pytest.raises(CorruptEntryError, match=why):
            store.open("whole").stored_entry()  # what the batched blend pass reads
        report = store.verify()["disk"]
    assert report["removed"] == ["verify"] and report["damage"] == {"verify": why} and report["ok"] == 0
    assert store.stats()["disk"]["corrupt"] == 4 and store.stats()["cpu"]["entries"] == 0  # nothing promoted
    assert list(disk.keys()) == []  # every one deleted
    warned = [r.getMessage() for r in caplog.records if why in r.getMessage()]
    assert sorted(w.split("'")[1] for w in warned) == sorted(keys)  # one line each


def test_non_finite_scales_behind_matching_checksums_are_corrupt_in_redis(tmp_path):
    server = start_redis(tmp_path)
    try:
        client = redis.Redis.from_url(server.url)
        store = TieredStore(REAL, [(RedisTier(server.url), None)], kv_compression="int8")
        for key in ("a", "b", "c"):
            store.put(key, *kv_like_a_model(), 0)
        for key, tensor, value in (("a", "v_scale.0", NAN), ("b", "k_scale.1", INF), ("c", "v_scale.2", NAN)):
            client.set(f"ragcache:kv:{key}", poison(client.get(f"ragcache:kv:{key}"), tensor, value))
        assert store.get("a") is None
        with store.open("b") as handle, pytest.raises(CorruptEntryError, match="non-finite values in k_scale.1"):
            handle.stored_entry()
        report = store.verify()["remote"]
        assert report["removed"] == ["c"] and report["damage"]["c"] == "non-finite values in v_scale.2"
        assert store.stats()["remote"]["corrupt"] == 3
        assert client.exists("ragcache:kv:a", "ragcache:kv:b", "ragcache:kv:c") == 0
    finally:
        server.stop()


@pytest.mark.parametrize("form", ["none", "int8"])
def test_no_tier_takes_non_finite_kv(form):
    store = TieredStore(REAL, [(CpuTier(), 10**9), (DeviceTier("cpu"), 10**9)], kv_compression=form)
    k, v = kv_like_a_model()
    v[2, 5, 1, 7] = NAN
    with pytest.raises(ValueError, match="non-finite"):
        store.put("chunk", k, v, 0)
    assert store.contains("chunk") is None and store.stats()["cpu"]["entries"] == 0


def test_an_intact_entry_passes_the_finite_check_whatever_its_magnitudes(tmp_path):
    folder = tmp_path / "kv"
    k, v = kv_like_a_model()
    k[0] = 3e38  # a float32 sum of these overflows; each value is finite
    store = TieredStore(REAL, [(DiskTier(folder), 10**9)], kv_compression="none")
    store.put("big", k, v, 0)
    entry, tier = store.get("big")
    assert tier == "disk" and torch.equal(entry.k, k) and store.verify()["disk"]["ok"] == 1
