"""The blend's attention on vLLM's own attention kernel, over the request's paged KV cache.

Owns: :class:`QueryRuns` (a sorted set of recomputed tokens as the kernel's batch of causal query
segments), :class:`PagedKernelAttention` (one request's :data:`ragcache.blend.Attention` over its
block table), :func:`kernel_available` (whether the loaded model's attention backend is one this
module can call) and :func:`measure_attention` / :class:`AttentionChoice` (``blend.attention =
"auto"``: kernel or torch, by a start-up measurement on this host).

Why: the blend's selective layers run n recomputed queries over all N context keys. Through torch
SDPA that costs 2-4.6x what vLLM's ISA-specific CPU kernel (``cpu_attention_with_kv_cache``; ISA
amx, vec or vec16) needs for the same work (../shared/DESIGN.md). The kernel takes varlen queries
over a paged cache: each "sequence" i owns the queries ``query_start_loc[i]:query_start_loc[i+1]``,
which are its LAST tokens, and attends causally to its first ``seq_lens[i]`` cached tokens through
``block_table[i]``. So each contiguous run ``[s, e)`` of recomputed tokens becomes one sequence with
``seq_lens = e``, every row sharing the request's block table; the tokens' final K/V are already in
the paged cache (the blend's ``on_layer`` writes them right before it calls the attention). The
arguments mirror ``CPUAttentionBackendImpl.forward`` and ``CPUAttentionMetadataBuilder.build`` of
vLLM 0.32 (``vllm/v1/attention/backends/cpu_attn.py``), so the numbers are vLLM's own.

Other backends (CUDA's FlashAttention, FlashInfer, ...) are not called here: there the blend keeps
torch SDPA (:func:`ragcache.blend.torch_attention`). Imports vLLM inside functions only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)

#: ``blend.attention`` values
ATTENTION_CHOICES = ("auto", "kernel", "torch")

#: the vLLM attention implementation this module calls (by class name: no vLLM import to check)
CPU_IMPL = "CPUAttentionBackendImpl"


@dataclass(frozen=True)
class QueryRuns:
    """A strictly ascending set of context token indices as the kernel's varlen query batch.

    Attributes:
        index: ``[n]`` int64, the tokens (ascending).
        query_start_loc: ``[R + 1]`` int32, run r holds queries ``query_start_loc[r] .. [r+1]``.
        seq_lens: ``[R]`` int32, run r's last index + 1 (its queries see the cache up to there).
    """

    index: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def num_runs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def of(cls, index: torch.Tensor) -> "QueryRuns":
        """The maximal runs of consecutive indices in ``index`` (``[n]`` int64, strictly ascending, n >= 1).

        Raises:
            ValueError: ``index`` is empty, not 1-D, or not strictly ascending.
        """
        if index.dim() != 1 or index.numel() == 0:
            raise ValueError(f"query index must be a non-empty [n] tensor, got shape {tuple(index.shape)}")
        index = index.to("cpu", torch.long)
        step = index[1:] - index[:-1]
        if bool((step <= 0).any()):
            raise ValueError("query index must be strictly ascending")
        ends = torch.nonzero(step != 1).squeeze(1) + 1  # first query of every run after the first
        n = index.numel()
        bounds = torch.cat([torch.zeros(1, dtype=torch.long), ends, torch.tensor([n])])  # [R + 1]
        return cls(index=index, query_start_loc=bounds.to(torch.int32),
                   seq_lens=(index[bounds[1:] - 1] + 1).to(torch.int32))


def kernel_available(attn_layers: Sequence[Any]) -> str | None:
    """Why vLLM's CPU attention kernel cannot serve these attention layers, or None when it can.

    The layers are the model's vLLM ``Attention`` modules (``layer.self_attn.attn``), after vLLM set
    up its backend (``layer.impl``, ``layer.isa``, ``layer.kv_cache``).
    """
    if not attn_layers:
        return "the model has no attention layers"
    for layer in attn_layers:
        impl = getattr(layer, "impl", None)
        if type(impl).__name__ != CPU_IMPL:
            return f"vLLM runs attention through {type(impl).__name__}, not its CPU kernel"
        if getattr(impl, "kv_cache_dtype", "auto") != "auto":
            return f"the KV cache is quantised ({impl.kv_cache_dtype})"
        if getattr(layer, "isa", None) is None:
            return "vLLM did not set the attention ISA on the layers"
        if not isinstance(getattr(layer, "kv_cache", None), torch.Tensor):
            return "the layer's paged KV cache is not a single tensor"
    return None


class PagedKernelAttention:
    """:data:`ragcache.blend.Attention` of one request through vLLM's CPU attention kernel.

    ``attention(layer, q [n, Hq, D], index [n], k, v) -> [n, Hq, D]``: the queries of the context
    tokens at ``index`` attend causally over the paged cache of ``layer`` (which must already hold
    the layer's final K/V of the context: the blend calls ``on_layer`` first); ``k``/``v`` are not
    read. The run plan and the kernel's scheduler metadata are built once per distinct ``index``
    (the same selection serves every selective layer).

    Args:
        attn_layers: the model's vLLM ``Attention`` modules, one per layer.
        block_ids: the request's paged-cache block ids (first KV cache group), in order.
        block_size: tokens per block.
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D.
        dtype: the model's compute dtype.

    Raises:
        ValueError: (on call) the queries reach beyond the request's blocks.
    """

    def __init__(self, attn_layers: Sequence[Any], block_ids: Sequence[int], block_size: int, *, num_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.layers = list(attn_layers)
        self.block_size = block_size
        self.capacity = len(block_ids) * block_size
        self.block_table = torch.tensor(list(block_ids), dtype=torch.int32)  # [B]
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self._plans: list[tuple[torch.Tensor, QueryRuns, torch.Tensor, torch.Tensor]] = []  # index, runs, table, md

    def _plan(self, index: torch.Tensor) -> tuple[QueryRuns, torch.Tensor, torch.Tensor]:
        """Runs, block table ``[R, B]`` and scheduler metadata for ``index`` (cached for the last two)."""
        for known, runs, table, md in self._plans:
            if known is index:
                return runs, table, md
        from vllm import _custom_ops as ops
        from vllm import envs

        runs = QueryRuns.of(index)
        if int(runs.seq_lens.max()) > self.capacity:
            raise ValueError(f"queries reach token {int(runs.seq_lens.max())} but the request has "
                             f"{self.capacity} cache slots")
        table = self.block_table.unsqueeze(0).expand(runs.num_runs, -1).contiguous()  # [R, B]
        layer = self.layers[0]
        md = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=runs.num_runs, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=runs.seq_lens, dtype=self.dtype,
            query_start_loc=runs.query_start_loc, causal=True,
            sliding_window_size=layer.impl.sliding_window, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=layer.impl.kv_cache_dtype)
        self._plans = [(index, runs, table, md)] + self._plans[:1]
        return runs, table, md

    def __call__(self, layer_index: int, q: torch.Tensor, index: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        from vllm import _custom_ops as ops

        runs, table, md = self._plan(index)
        layer = self.layers[layer_index]
        impl = layer.impl
        cache = layer.kv_cache  # [num_blocks, Hkv, block_size, 2 * D]
        num_blocks, num_kv_heads, block_size, _ = cache.shape
        key_cache, value_cache = cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        query = q.contiguous()
        out = torch.empty_like(query)  # [n, Hq, D]
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=runs.query_start_loc, seq_lens=runs.seq_lens, scale=impl.scale, causal=True,
            alibi_slopes=impl.alibi_slopes, sliding_window=impl.sliding_window, block_table=table,
            softcap=impl.logits_soft_cap, scheduler_metadata=md, s_aux=impl.sinks,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=impl.kv_cache_dtype)
        return out


class ScratchKernelAttention:
    """:data:`ragcache.blend.Attention` through vLLM's CPU kernel over a scratch paged cache.

    For forwards that are not a request's (chunk KV precompute, a missing chunk computed at its
    canonical place): each call writes the ``k``/``v`` it is handed into one scratch layer of
    blocks (grown as needed, reused across layers and calls) and runs the kernel there, so chunk
    KV is computed with the same attention arithmetic as vLLM's own prefill. Not thread-safe (the
    worker runtime serialises its forwards).

    Args:
        attn_layers: the model's vLLM ``Attention`` modules (backend settings are read per layer).
        num_heads, num_kv_heads, head_dim, dtype: the model's.
        block_size: tokens per scratch block.
    """

    def __init__(self, attn_layers: Sequence[Any], *, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, block_size: int = 128):
        self.layers = list(attn_layers)
        self.shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        self.block_size = block_size
        self._cache = torch.empty(0, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)

    def __call__(self, layer_index: int, q: torch.Tensor, index: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        from vllm import _custom_ops as ops

        num_tokens = k.shape[0]
        num_blocks = (num_tokens + self.block_size - 1) // self.block_size
        if self._cache.shape[0] < num_blocks:
            self._cache = torch.zeros(num_blocks, *self._cache.shape[1:], dtype=self._cache.dtype)
        layer = self.layers[layer_index]
        cache = self._cache[:num_blocks]
        key_cache, value_cache = cache.view(num_blocks, cache.shape[1], 2 * self.block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache,
                                       torch.arange(num_tokens), layer.isa)

        class _Scratch:  # the attributes PagedKernelAttention reads of a vLLM Attention layer
            impl, isa, kv_cache = layer.impl, layer.isa, cache
            _k_scale_float, _v_scale_float = layer._k_scale_float, layer._v_scale_float

        kernel = PagedKernelAttention([_Scratch()], list(range(num_blocks)), self.block_size, **self.shape)
        return kernel(0, q, index, k, v)


@dataclass(frozen=True)
class AttentionChoice:
    """Which attention the blend runs on this engine, and why (``blend.attention``).

    Attributes:
        path: ``"kernel"`` (vLLM's CPU kernel over the paged cache) or ``"torch"`` (SDPA, the reference).
        reason: one phrase for the engine's start line.
        kernel_ms, torch_ms: the start-up measurement (``auto``), milliseconds; None when not measured.
    """

    path: str
    reason: str
    kernel_ms: float | None = None
    torch_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason, "kernel_ms": self.kernel_ms, "torch_ms": self.torch_ms}


def _scratch_runs(num_tokens: int, share: float, run: int, generator: torch.Generator) -> torch.Tensor:
    """``[~share * num_tokens]`` ascending indices in aligned runs of ``run`` tokens (a blend's shape)."""
    num_runs = max(1, int(share * num_tokens) // run)
    starts = torch.randperm(num_tokens // run, generator=generator)[:num_runs].sort().values * run
    return (starts.unsqueeze(1) + torch.arange(run)).flatten()


def measure_attention(attn_layers: Sequence[Any], *, num_heads: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, scaling: float, num_tokens: int = 2048, repeats: int = 5
                      ) -> tuple[float, float]:
    """Best-of-``repeats`` milliseconds of the kernel and of torch SDPA on the same synthetic blend layer.

    A scratch paged cache (never the engine's) holds ``num_tokens`` random keys and values; the
    queries are 15% of the tokens in runs of 8 (the blend's selective layers). Layer 0's backend
    settings (ISA, window) are used. Each is called once untimed, then the two alternate, so a burst
    of other work on a shared machine slows both alike rather than the one measured at that moment
    (the best of each is kept).

    Returns:
        ``(kernel_ms, torch_ms)``.
    """
    from vllm import _custom_ops as ops

    from ragcache.blend import torch_attention

    layer = attn_layers[0]
    g = torch.Generator().manual_seed(0)
    block_size = 128
    num_blocks = (num_tokens + block_size - 1) // block_size
    cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.arange(num_tokens)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, layer.isa)
    index = _scratch_runs(num_tokens, 0.15, 8, g)
    q = torch.randn(index.numel(), num_heads, head_dim, generator=g).to(dtype)

    class _Scratch:  # the attributes PagedKernelAttention reads of a vLLM Attention layer
        impl, isa, kv_cache = layer.impl, layer.isa, cache
        _k_scale_float = _v_scale_float = 1.0

    kernel = PagedKernelAttention([_Scratch()], list(range(num_blocks)), block_size, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    reference = torch_attention(slots, scaling)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn(0, q, index, k, v)
        return 1000 * (time.perf_counter() - t0)

    with torch.inference_mode():
        timed(kernel), timed(reference)  # first calls: lazy set-up, untimed
        pairs = [(timed(kernel), timed(reference)) for _ in range(repeats)]
    return min(p[0] for p in pairs), min(p[1] for p in pairs)


def choose_attention(setting: str, attn_layers: Sequence[Any], **shape: Any) -> AttentionChoice:
    """Resolve ``blend.attention`` for these layers.

    ``torch``: always SDPA. ``kernel``: vLLM's kernel where the backend offers it (else torch, said
    in the reason). ``auto``: where the kernel is available, whichever of the two is faster on this
    host in :func:`measure_attention` (the kernel unless torch wins by more than 10%: on some CPUs
    vLLM's kernel is slow, as its whole prefill is on AVX2-only hosts).

    Args:
        setting: ``"auto"``, ``"kernel"`` or ``"torch"``.
        attn_layers: the model's vLLM ``Attention`` modules.
        shape: ``num_heads``, ``num_kv_heads``, ``head_dim``, ``dtype``, ``scaling`` of the model.

    Raises:
        ValueError: an unknown setting.
    """
    if setting not in ATTENTION_CHOICES:
        raise ValueError(f"blend.attention must be one of {ATTENTION_CHOICES}, got {setting!r}")
    if setting == "torch":
        return AttentionChoice("torch", "blend.attention = torch")
    why_not = kernel_available(attn_layers)
    if why_not is not None:
        return AttentionChoice("torch", f"torch SDPA ({why_not})")
    isa = attn_layers[0].isa
    if setting == "kernel":
        return AttentionChoice("kernel", f"vLLM CPU kernel ({isa}), blend.attention = kernel")
    kernel_ms, torch_ms = measure_attention(attn_layers, **shape)
    if torch_ms * 1.1 < kernel_ms:
        return AttentionChoice("torch", f"torch SDPA (measured {torch_ms:.1f} ms vs vLLM's {isa} kernel "
                                        f"{kernel_ms:.1f} ms here)", round(kernel_ms, 2), round(torch_ms, 2))
    return AttentionChoice("kernel", f"vLLM CPU kernel ({isa}; measured {kernel_ms:.1f} ms vs torch SDPA "
                                     f"{torch_ms:.1f} ms here)", round(kernel_ms, 2), round(torch_ms, 2))
