"""ragcache.engine.paged_attention: vLLM's CPU attention kernel over a paged cache equals the blend's
reference attention (``causal_attention``) for every query shape the blend produces.

No engine: the kernel is called directly on a paged cache these tests fill, laid out as vLLM's CPU
backend lays out its own (``[num_blocks, Hkv, block_size, 2 * D]``, written with
``cpu_attn_reshape_and_cache``), with the backend settings of a plain Llama layer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ragcache.blend import causal_attention, torch_attention
from ragcache.engine.paged_attention import (
    PagedKernelAttention, QueryRuns, ScratchKernelAttention, choose_attention, kernel_available,
)

BLOCK = 128
#: bf16: the kernel and SDPA round differently (both accumulate in float32, in another order);
#: measured max abs diff 1.6e-2 on SmolLM2-shaped random inputs (values ~N(0, 1)), one bf16 ulp at 2-4.
BF16_ATOL = 3e-2


class CPUAttentionBackendImpl(SimpleNamespace):
    """Stands for vLLM's implementation class of that name (the kernel path checks the name)."""


def vllm_layer(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_blocks: int):
    """The attributes of a vLLM ``Attention`` layer that the kernel path reads, with an empty paged cache."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    impl = CPUAttentionBackendImpl(scale=head_dim ** -0.5, sliding_window=-1, alibi_slopes=None, logits_soft_cap=0,
                                   sinks=None, kv_cache_dtype="auto")
    return SimpleNamespace(impl=impl, isa=_get_attn_isa(dtype, BLOCK, head_dim), _k_scale_float=1.0,
                           _v_scale_float=1.0,
                           kv_cache=torch.zeros(num_blocks, num_kv_heads, BLOCK, 2 * head_dim, dtype=dtype))


def fill(layer, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write K/V of tokens 0..N-1 into the layer's cache through the request's blocks (as vLLM does)."""
    from vllm import _custom_ops as ops

    cache = layer.kv_cache
    nb, hkv, bs, _ = cache.shape
    key_cache, value_cache = cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
    pos = torch.arange(k.shape[0])
    slots = torch.tensor(block_ids)[pos // bs] * bs + pos % bs
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, layer.isa)


def query_sets(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    scattered = torch.randperm(n, generator=g)[: max(1, n // 7)].sort().values
    starts = torch.randperm(n // 8, generator=g)[: max(1, n // 60)].sort().values * 8
    runs = (starts.unsqueeze(1) + torch.arange(8)).flatten()
    return {"all": torch.arange(n), "contiguous tail": torch.arange(n // 3, n), "scattered": scattered,
            "runs of 8": runs, "first token": torch.tensor([0]), "last token": torch.tensor([n - 1])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])  # GQA (SmolLM2), MHA, GQA wide heads
def test_kernel_attention_equals_causal_attention(dtype, heads):
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(sum(heads))
    n = 700  # not a multiple of the block size
    block_ids = [5, 1, 3, 0, 6, 2]  # scattered blocks, in request order
    layer = vllm_layer(num_heads, num_kv_heads, head_dim, dtype, num_blocks=8)
    k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    fill(layer, block_ids, k, v)
    kernel = PagedKernelAttention([layer], block_ids, BLOCK, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, dtype=dtype)
    reference = torch_attention(torch.arange(n), head_dim ** -0.5)
    for name, index in query_sets(n, g).items():
        q = torch.randn(index.numel(), num_heads, head_dim, generator=g).to(dtype)
        got = kernel(0, q, index, k, v)
        expected = reference(0, q, index, k, v)
        assert got.shape == expected.shape == (index.numel(), num_heads, head_dim) and got.dtype == dtype
        atol = 1e-5 if dtype == torch.float32 else BF16_ATOL
        torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0, msg=name)


def test_scratch_kernel_attention_uses_the_kv_it_is_handed():
    g = torch.Generator().manual_seed(3)
    layer = vllm_layer(9, 3, 64, torch.float32, num_blocks=1)
    scratch = ScratchKernelAttention([layer], num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    for n in (40, 300):  # grows its blocks on demand
        k, v = torch.randn(n, 3, 64, generator=g), torch.randn(n, 3, 64, generator=g)
        q = torch.randn(n, 9, 64, generator=g)
        index = torch.arange(n)
        expected = causal_attention(q, index, k, v, index, 64 ** -0.5)
        torch.testing.assert_close(scratch(0, q, index, k, v), expected, atol=1e-5, rtol=0)


def test_query_runs_split_sorted_tokens_into_maximal_runs():
    runs = QueryRuns.of(torch.tensor([0, 1, 2, 7, 9, 10]))
    assert runs.query_start_loc.tolist() == [0, 3, 4, 6]
    assert runs.seq_lens.tolist() == [3, 8, 11]  # each run sees the cache up to its last token
    assert runs.num_runs == 3 and runs.query_start_loc.dtype == runs.seq_lens.dtype == torch.int32
    assert QueryRuns.of(torch.tensor([4])).seq_lens.tolist() == [5]
    for bad in (torch.tensor([], dtype=torch.long), torch.tensor([3, 3]), torch.tensor([5, 2])):
        with pytest.raises(ValueError):
            QueryRuns.of(bad)


def test_queries_beyond_the_requests_blocks_are_refused():
    layer = vllm_layer(9, 3, 64, torch.float32, num_blocks=2)
    kernel = PagedKernelAttention([layer], [0], BLOCK, num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    k = torch.zeros(200, 3, 64)
    with pytest.raises(ValueError, match="cache slots"):
        kernel(0, torch.zeros(1, 9, 64), torch.tensor([150]), k, k)


def test_the_choice_follows_the_setting_and_the_backend():
    layer = vllm_layer(9, 3, 64, torch.float32, num_blocks=2)
    shape = dict(num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32, scaling=0.125)
    assert choose_attention("torch", [layer], **shape).path == "torch"
    assert choose_attention("kernel", [layer], **shape).path == "kernel"
    auto = choose_attention("auto", [layer], **shape)
    assert auto.path in ("kernel", "torch") and auto.kernel_ms > 0 and auto.torch_ms > 0
    assert "measured" in auto.reason
    other = SimpleNamespace(impl=SimpleNamespace(), isa=None, kv_cache=None)  # e.g. a GPU backend
    assert "not its CPU kernel" in kernel_available([other])
    fallback = choose_attention("kernel", [other], **shape)
    assert fallback.path == "torch" and "not its CPU kernel" in fallback.reason
    with pytest.raises(ValueError, match="blend.attention"):
        choose_attention("fast", [layer], **shape)


def test_auto_measures_the_two_paths_alternately(monkeypatch):
    # a burst of other work on a shared machine must slow both measurements, not only the one running
    import ragcache.blend
    import ragcache.engine.paged_attention as pa

    calls = []
    kernel_call, torch_attention = pa.PagedKernelAttention.__call__, ragcache.blend.torch_attention

    def kernel_spy(self, *args):
        calls.append("kernel")
        return kernel_call(self, *args)

    def torch_spy(*args):
        fn = torch_attention(*args)
        return lambda *a: (calls.append("torch"), fn(*a))[1]

    monkeypatch.setattr(pa.PagedKernelAttention, "__call__", kernel_spy)
    monkeypatch.setattr(ragcache.blend, "torch_attention", torch_spy)
    layer = vllm_layer(9, 3, 64, torch.float32, num_blocks=2)
    kernel_ms, torch_ms = pa.measure_attention([layer], num_heads=9, num_kv_heads=3, head_dim=64,
                                               dtype=torch.float32, scaling=0.125, num_tokens=256, repeats=4)
    assert calls == ["kernel", "torch"] * 5 and kernel_ms > 0 and torch_ms > 0  # one untimed pair, then 4


def test_an_engine_whose_blend_runs_torch_on_an_accelerator_warns_at_start(caplog):
    # the worker's reply to INIT on a GPU host today: vLLM's CUDA backend is not the CPU kernel
    from ragcache.engine.base import EngineBase, accelerator_blend_warning

    engine = object.__new__(EngineBase)
    with caplog.at_level("WARNING", logger="ragcache.engine.base"):
        engine._worker_ready({"device": "cuda:0", "attention": "torch",
                              "attention_reason": "torch SDPA (vLLM runs attention through FlashAttentionImpl, "
                                                  "not its CPU kernel)"})
    assert engine.device == "cuda:0"
    [record] = [r for r in caplog.records if r.name == "ragcache.engine.base"]
    assert record.getMessage().startswith("blend on cuda:0 runs ragcache's own layer-wise forward with torch SDPA")
    assert "ragcache bench ttft --modes full,blend" in record.getMessage()
    assert accelerator_blend_warning("cpu", "torch") is None  # the CPU's own choice, said in the start line
    assert accelerator_blend_warning("cuda:0", "kernel") is None
    caplog.clear()
    with caplog.at_level("WARNING", logger="ragcache.engine.base"):
        object.__new__(EngineBase)._worker_ready({"device": "cpu", "attention": "kernel", "attention_reason": ""})
    assert not [r for r in caplog.records if r.name == "ragcache.engine.base"]


class FlashAttentionImpl(SimpleNamespace):
    """Stands for vLLM's CUDA FlashAttention implementation class of that name."""


def reference_flash_varlen(q, k_cache, v_cache, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k,
                           softmax_scale, causal, block_table, out, **_):
    """``vllm_flash_attn.flash_attn_varlen_func`` over a paged cache, in torch: segment i's queries
    ``cu_seqlens_q[i]:[i+1]`` see the first ``seqused_k[i]`` tokens of its blocks, causal bottom-right."""
    assert causal and k_cache.shape[1] == BLOCK  # [num_blocks, block_size, Hkv, D]
    for i in range(len(seqused_k)):
        lo, hi, used = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
        keys = k_cache[block_table[i].long()].flatten(0, 1)[:used]  # [used, Hkv, D]
        values = v_cache[block_table[i].long()].flatten(0, 1)[:used]
        positions = torch.arange(used)
        out[lo:hi] = causal_attention(q[lo:hi], positions[used - (hi - lo):], keys, values, positions, softmax_scale)
    assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) and max_seqlen_k == int(seqused_k.max())
    return out


def test_the_flash_path_runs_each_recomputed_run_as_a_segment_over_its_requests_blocks(monkeypatch):
    import sys
    from types import ModuleType

    from ragcache.engine.paged_attention import FlashPagedAttention, engine_attention, flash_available

    num_heads, num_kv_heads, head_dim = 9, 3, 64
    cache = torch.zeros(8, num_kv_heads, BLOCK, 2 * head_dim)  # vLLM's FlashAttention layout, as its CPU backend's
    impl = FlashAttentionImpl(scale=head_dim ** -0.5, sliding_window=(-1, -1), alibi_slopes=None, logits_soft_cap=0,
                              sinks=None, kv_cache_dtype="auto", vllm_flash_attn_version=3)
    layer = SimpleNamespace(impl=impl, kv_cache=cache)
    assert "vllm_flash_attn" in flash_available([layer])  # this host's vLLM has no CUDA extensions
    stub = ModuleType("vllm.vllm_flash_attn")
    stub.flash_attn_varlen_func = reference_flash_varlen
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", stub)
    assert flash_available([layer]) is None
    choice = choose_attention("auto", [layer], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              dtype=torch.float32, scaling=impl.scale)
    assert choice.path == "kernel" and "FlashAttention 3" in choice.reason
    g = torch.Generator().manual_seed(9)
    sizes, blocks = [300, 140], [[5, 1, 3], [0, 6]]  # two requests' contexts, scattered blocks
    ks = [torch.randn(n, num_kv_heads, head_dim, generator=g) for n in sizes]
    vs = [torch.randn(n, num_kv_heads, head_dim, generator=g) for n in sizes]
    for k, v, ids in zip(ks, vs, blocks):  # the blend writes the layer's K/V first
        pos = torch.arange(k.shape[0])
        block, offset = torch.tensor(ids)[pos // BLOCK], pos % BLOCK
        cache[block, :, offset, :head_dim] = k
        cache[block, :, offset, head_dim:] = v
    attention = engine_attention([layer], blocks, BLOCK, starts=[0, 300, 440], caches=None, num_heads=num_heads,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.float32)
    assert isinstance(attention, FlashPagedAttention)
    index = torch.tensor([0, 1, 2, 57, 58, 299, 300, 301, 420, 439])  # runs in both requests, one at each edge
    q = torch.randn(index.numel(), num_heads, head_dim, generator=g)
    reference = torch_attention(torch.cat([torch.arange(n) for n in sizes]), impl.scale, [0, 300, 440])
    expected = reference(0, q, index, torch.cat(ks), torch.cat(vs))
    torch.testing.assert_close(attention(0, q, index, None, None), expected, atol=1e-5, rtol=0)
