"""ragcache on an accelerator: blend/ and the KV tiers where the engine's device is not the CPU.

ragcache must run with the GPU build of vLLM, so nothing below the engine may assume the CPU: the
blend math takes its device from ``DecoderOps.device`` and the store from the engine's device (a
``device`` tier in accelerator memory, a pinned ``cpu`` tier, asynchronous per-layer copies). These
tests run that code on the accelerator torch sees (CUDA, ROCm, XPU, MPS …) against the same code
on the CPU and against transformers' own forward there. vLLM is not needed: the model is a tiny
random Llama behind ``tests/hf_ops.HFLlamaOps``.

Skipped where torch sees no accelerator (CI's CPU machines); run them on a GPU host with
``python -m pytest tests/test_accelerator.py``.
"""

from __future__ import annotations

import kv_fixtures
import pytest
import torch
from hf_ops import TINY_TAIL, HFLlamaOps, LayerCollector, context_layout, hf_layer_kv, tiny_context, tiny_llama
from kv_fixtures import SPEC, make_kv

from blend_calls import blend_of

from ragcache.blend import Selection, compute_kv, hkvd_budget, move_keys
from ragcache.config import StoreSettings
from ragcache.kvstore import CpuTier, TieredStore
from ragcache.kvstore.configure import tiers_from_settings


def _accelerator() -> torch.device | None:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and accelerator.is_available():
        return torch.device(accelerator.current_accelerator().type)
    return torch.device("cuda") if torch.cuda.is_available() else None


ACCEL = _accelerator()
_CPU_BUILD = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
pytestmark = pytest.mark.skipif(ACCEL is None, reason=f"torch {torch.__version__} sees no accelerator on this machine"
                                + (" (a CPU-only build of torch)" if _CPU_BUILD else ""))


@pytest.fixture(scope="module")
def models():
    """The tiny Llama on the CPU and a copy on the accelerator (float32): ``(cpu, accel)`` pairs of (model, ops)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here: compare to 1e-5
    torch.backends.cudnn.allow_tf32 = False
    cpu = tiny_llama()
    accel = tiny_llama().to(ACCEL)
    yield (cpu, HFLlamaOps(cpu)), (accel, HFLlamaOps(accel))
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _blend(ops, context, **kwargs):
    got = LayerCollector(ops.num_layers)
    starts, exact = context_layout(context)
    result = blend_of(ops, context.token_ids, context.positions, context.load_layer, on_layer=got,
                      tail_ids=TINY_TAIL, segment_starts=starts, exact=exact, **kwargs)
    return result, got


def test_the_tiny_model_and_its_ops_live_on_the_accelerator(models):
    _, (model, ops) = models
    assert ops.device.type == ACCEL.type and next(model.parameters()).device.type == ACCEL.type


def test_compute_kv_on_the_accelerator_equals_transformers_there_and_the_cpu(models):
    (_, cpu_ops), (model, ops) = models
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(70)
    k_pre, v = compute_kv(ops, ids, positions)  # CPU ids: compute_kv moves them to ops.device
    assert k_pre.device.type == ACCEL.type and v.device.type == ACCEL.type
    expected = hf_layer_kv(model, ids.to(ACCEL), positions.to(ACCEL))
    cpu_k, cpu_v = compute_kv(cpu_ops, ids, positions)
    for layer in range(ops.num_layers):
        k = move_keys(ops, layer, k_pre[layer], positions.to(ACCEL))
        torch.testing.assert_close(k, expected[layer][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[layer], expected[layer][1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_pre[layer].cpu(), cpu_k[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[layer].cpu(), cpu_v[layer], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["deviation", "question"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_blend_at_ratio_one_on_the_accelerator_is_full_prefill(models, strategy, prefetch):
    _, (_, ops) = models
    context = tiny_context(ops)
    result, got = _blend(ops, context, recompute_ratio=1.0, check_layer=1, deviation="value",
                         selection=Selection(strategy), prefetch=prefetch)
    n = context.token_ids.shape[0]
    assert result.selected.tolist() == list(range(n))
    k_pre, v = compute_kv(ops, context.token_ids, context.positions)
    positions = context.positions.to(ACCEL)
    for layer in range(ops.num_layers):
        assert got.k[layer].device.type == ACCEL.type
        torch.testing.assert_close(got.k[layer], move_keys(ops, layer, k_pre[layer], positions), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.v[layer], v[layer], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["deviation", "question", "hybrid"])
def test_a_partial_blend_on_the_accelerator_picks_and_computes_what_it_does_on_the_cpu(models, strategy):
    (_, cpu_ops), (_, ops) = models
    cpu_context, context = tiny_context(cpu_ops), tiny_context(ops)
    kwargs = dict(recompute_ratio=0.2, check_layer=1, deviation="value",
                  selection=Selection(strategy, chunk_head_tokens=2))
    cpu_result, cpu_got = _blend(cpu_ops, cpu_context, **kwargs)
    result, got = _blend(ops, context, **kwargs)
    n = context.token_ids.shape[0]
    assert result.num_recomputed == cpu_result.num_recomputed == hkvd_budget(0.2, n)
    assert result.selected.cpu().tolist() == cpu_result.selected.tolist()
    for layer in range(ops.num_layers):
        torch.testing.assert_close(got.k[layer].cpu(), cpu_got.k[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.v[layer].cpu(), cpu_got.v[layer], atol=1e-5, rtol=1e-5)


def test_bfloat16_blend_at_ratio_one_on_the_accelerator_tracks_its_own_full_prefill():
    # bf16 rounds every product: the blend's layer-wise path and one compute_kv pass round in other
    # orders, so they agree to bf16's resolution (8 bits of mantissa: 2**-8 relative), not bit for bit
    model = tiny_llama().to(device=ACCEL, dtype=torch.bfloat16)
    ops = HFLlamaOps(model)
    context = tiny_context(ops)
    _, got = _blend(ops, context, recompute_ratio=1.0, check_layer=1, deviation="value",
                    selection=Selection("question"))
    k_pre, v = compute_kv(ops, context.token_ids, context.positions)
    positions = context.positions.to(ACCEL)
    for layer in range(ops.num_layers):
        assert got.k[layer].dtype == torch.bfloat16
        torch.testing.assert_close(got.k[layer], move_keys(ops, layer, k_pre[layer], positions), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.v[layer], v[layer], atol=2e-2, rtol=2e-2)


# --- the KV tiers with an accelerator engine -----------------------------------------------

ENTRY = kv_fixtures.entry_bytes()  # bytes of one make_kv() entry (float32)


def _store(tmp_path, entry_bytes: int = ENTRY, **store) -> tuple[TieredStore, CpuTier]:
    """The tiers an engine on the accelerator gets: one entry of ``entry_bytes`` fits the device
    tier, one the cpu tier; the disk keeps everything. Also the cpu tier itself. KV stored
    uncompressed unless ``store`` names a ``kv_compression``."""
    store.setdefault("kv_compression", "none")
    settings = StoreSettings(gpu_kv_pool_gb=1.5 * entry_bytes / 1e9, cpu_kv_pool_gb=1.5 * entry_bytes / 1e9,
                             ssd_cache_dir=tmp_path / "kv", ssd_cache_max_gb=1.0, **store)
    tiers = tiers_from_settings(settings, ACCEL)
    store = TieredStore(SPEC, tiers, device=ACCEL, kv_dtype=settings.kv_dtype, kv_compression=settings.kv_compression)
    return store, next(tier for tier, _ in tiers if isinstance(tier, CpuTier))


def test_an_accelerator_store_has_a_device_tier_a_pinned_cpu_tier_and_demotes_down_them(tmp_path):
    store, cpu_tier = _store(tmp_path)
    assert store.tier_names == ["device", "cpu", "disk"]
    originals = {key: make_kv(seed) for seed, key in enumerate("abc")}
    for key, (k, v) in originals.items():  # put on the accelerator, as the engine does
        assert store.put(key, k.to(ACCEL), v.to(ACCEL), 0)[0] == "device"
    assert [store.contains(key) for key in "abc"] == ["disk", "cpu", "device"]
    assert cpu_tier.get("b").kv.is_pinned()  # page-locked, so per-layer copies to the device are asynchronous
    for key in "abc":  # each lookup promotes its entry to the device tier and demotes the one there
        entry, _ = store.get(key)
        assert entry.k.device.type == ACCEL.type
        assert torch.equal(entry.k.cpu(), originals[key][0]) and torch.equal(entry.v.cpu(), originals[key][1])
        assert store.contains(key) == "device"
    store.close()


@pytest.mark.parametrize("kv_dtype", ["model", "float16"])
def test_layers_read_through_handles_arrive_on_the_accelerator_intact_from_every_tier(tmp_path, kv_dtype):
    stored = torch.float32 if kv_dtype == "model" else torch.float16
    store, _ = _store(tmp_path, ENTRY * stored.itemsize // 4, kv_dtype=kv_dtype)
    originals = {key: make_kv(seed) for seed, key in enumerate("abc")}
    for key, (k, v) in originals.items():
        store.put(key, k.to(ACCEL), v.to(ACCEL), 0)
    for key, tier in zip("cba", ["device", "cpu", "disk"]):  # each read from below is promoted
        handle = store.open(key)
        assert handle.tier == tier
        with handle:
            layers = [handle.layer(i) for i in range(SPEC.num_layers)]
        for i, (k, v) in enumerate(layers):
            assert k.device.type == ACCEL.type and k.dtype == torch.float32
            assert torch.equal(k.cpu(), originals[key][0][i].to(stored).float())
            assert torch.equal(v.cpu(), originals[key][1][i].to(stored).float())
        assert store.contains(key) == "device"  # read completely from a lower tier: promoted
    store.close()


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_compressed_layers_travel_quantised_and_are_dequantised_on_the_accelerator_from_every_tier(tmp_path, form):
    from ragcache.kvstore.codec import layer_parts, record_nbytes

    parts = layer_parts(form, torch.float16, 6, SPEC.num_kv_heads, SPEC.head_dim)
    store, _ = _store(tmp_path, SPEC.num_layers * record_nbytes(parts), kv_compression=form)
    reference = TieredStore(SPEC, [(CpuTier(), None)], kv_compression=form)  # the same codec on the CPU
    originals = {key: make_kv(seed) for seed, key in enumerate("abc")}
    for key, (k, v) in originals.items():
        store.put(key, k.to(ACCEL), v.to(ACCEL), 0)  # quantised on the accelerator
        reference.put(key, k, v, 0)
    for key, tier in zip("cba", ["device", "cpu", "disk"]):
        handle = store.open(key)
        assert handle.tier == tier and handle.meta.compression == form
        expected, _ = reference.get(key)
        with handle:
            for i in range(SPEC.num_layers):
                k, v = handle.layer(i)
                assert k.device.type == ACCEL.type and k.dtype == torch.float32
                torch.testing.assert_close(k.cpu(), expected.k[i], rtol=0, atol=1e-6)
                torch.testing.assert_close(v.cpu(), expected.v[i], rtol=0, atol=1e-6)
        assert store.contains(key) == "device"
    store.close()
