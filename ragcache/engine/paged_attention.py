"""The blend's attention on vLLM's own attention kernel, over the request's paged KV cache.

Owns: :class:`QueryRuns` (a sorted set of recomputed tokens as the kernel's batch of causal query
segments), :class:`PagedKernelAttention` (one request's :data:`ragcache.blend.Attention` over its
block table), :func:`kernel_available` (whether the loaded model's attention backend is one this
module can call) and :func:`measure_attention` / :class:`AttentionChoice` (``blend.attention =
"auto"``: kernel or torch, by a start-up measurement on this host).

Why: the blend's selective layers run n recomputed queries over all N context keys. Through torch
SDPA that costs several times what vLLM's ISA-specific CPU kernel (``cpu_attention_with_kv_cache``;
ISA amx, vec or vec16) needs for the same work. The kernel takes varlen queries
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
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger(__name__)

#: ``blend.attention`` values
ATTENTION_CHOICES = ("auto", "kernel", "torch")

#: the vLLM attention implementation this module calls (by class name: no vLLM import to check)
CPU_IMPL = "CPUAttentionBackendImpl"


@dataclass(frozen=True)
class QueryRuns:
    """Ascending rows of one or more requests' contexts as the kernel's varlen query batch.

    Attributes:
        index: ``[n]`` int64, the rows (ascending).
        query_start_loc: ``[R + 1]`` int32, run r holds queries ``query_start_loc[r] .. [r+1]``.
        seq_lens: ``[R]`` int32, run r's last token + 1 within its request (its queries see the
            request's cache up to there).
        request: ``[R]`` int64, the request each run belongs to.
    """

    index: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    request: torch.Tensor

    @property
    def num_runs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def of(cls, index: torch.Tensor, starts: torch.Tensor | None = None) -> "QueryRuns":
        """The maximal runs of consecutive rows in ``index`` (``[n]`` int64, strictly ascending, n >= 1)
        that do not cross a request: request j owns rows ``starts[j] .. starts[j + 1]`` (``starts``
        ``[R + 1]`` int64; None: one request owning every row). A constant number of operators
        whatever the number of runs and requests.

        Raises:
            ValueError: ``index`` is empty, not 1-D, or not strictly ascending.
        """
        if index.dim() != 1 or index.numel() == 0:
            raise ValueError(f"query index must be a non-empty [n] tensor, got shape {tuple(index.shape)}")
        index = index.to("cpu", torch.long)
        step = index[1:] - index[:-1]
        if bool((step <= 0).any()):
            raise ValueError("query index must be strictly ascending")
        if starts is None:
            request, local, cut = torch.zeros_like(index), index, step != 1
        else:
            request = torch.searchsorted(starts[1:], index, right=True)
            local = index - starts[request]
            cut = (step != 1) | (request[1:] != request[:-1])
        n = index.numel()
        bounds = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(cut).squeeze(1) + 1,
                            torch.tensor([n])])  # [R + 1]
        return cls(index=index, query_start_loc=bounds.to(torch.int32),
                   seq_lens=(local[bounds[1:] - 1] + 1).to(torch.int32), request=request[bounds[:-1]])


@dataclass(frozen=True)
class PagedContexts:
    """Where the contexts of one pass sit in vLLM's paged cache (the pass's rows are its requests'
    context tokens one after another).

    Attributes:
        starts: ``[R + 1]`` int64, request j owns rows ``starts[j] .. starts[j + 1]``.
        tables: ``[R, B]`` int32, each request's block ids in order (padded with 0; never read past
            the request's own blocks).
        capacity: ``[R]`` int64, cache slots each request's blocks hold.
        block_size: tokens per block.
    """

    starts: torch.Tensor
    tables: torch.Tensor
    capacity: torch.Tensor
    block_size: int

    @classmethod
    def of(cls, block_ids: Sequence[Sequence[int]], sizes: Sequence[int], block_size: int) -> "PagedContexts":
        """Requests with blocks ``block_ids[j]`` and ``sizes[j]`` context tokens each."""
        width = max(len(b) for b in block_ids)
        tables = torch.tensor([list(b) + [0] * (width - len(b)) for b in block_ids], dtype=torch.int32)
        starts = torch.tensor([0, *sizes]).cumsum(0)
        return cls(starts=starts, tables=tables, capacity=torch.tensor([len(b) * block_size for b in block_ids]),
                   block_size=block_size)

    def slots(self, device: torch.device) -> torch.Tensor:
        """``[S]`` int64: each row's slot in the paged cache (``block * block_size + offset``)."""
        sizes = self.starts[1:] - self.starts[:-1]
        request = torch.repeat_interleave(torch.arange(sizes.shape[0]), sizes)
        local = torch.arange(int(self.starts[-1])) - self.starts[request]
        blocks = self.tables.long()[request, local // self.block_size]
        return (blocks * self.block_size + local % self.block_size).to(device)


def kernel_available(attn_layers: Sequence[Any]) -> str | None:
    """Why vLLM's CPU attention kernel cannot serve these attention layers, or None when it can.

    The layers are the model's vLLM ``Attention`` modules (``layer.self_attn.attn``), after vLLM set
    up its backend (``layer.impl``, ``layer.isa``, ``layer.kv_cache``).
    """
    return _backend_unusable(attn_layers, CPU_IMPL, "its CPU kernel", lambda layer, impl: (
        "vLLM did not set the attention ISA on the layers" if getattr(layer, "isa", None) is None else None))


def _backend_unusable(attn_layers: Sequence[Any], impl_name: str, backend: str,
                      layer_check: Callable[[Any, Any], str | None]) -> str | None:
    """Why the attention layers do not run on vLLM's ``impl_name`` backend with a plain paged cache
    (``layer_check(layer, impl)``: the backend's own condition), or None."""
    if not attn_layers:
        return "the model has no attention layers"
    for layer in attn_layers:
        impl = getattr(layer, "impl", None)
        if type(impl).__name__ != impl_name:
            return f"vLLM runs attention through {type(impl).__name__}, not {backend}"
        if getattr(impl, "kv_cache_dtype", "auto") != "auto":
            return f"the KV cache is quantised ({impl.kv_cache_dtype})"
        why = layer_check(layer, impl)
        if why is not None:
            return why
        if not isinstance(getattr(layer, "kv_cache", None), torch.Tensor):
            return "the layer's paged KV cache is not a single tensor"
    return None


def _heads_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[n, H, D]`` as vLLM's CPU kernels read it: any token stride, dense heads (a view of a
    projection output is taken as is; anything else is copied)."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def _split_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU backend layer's ``[num_blocks, Hkv, block_size, 2 * D]`` cache as its key and value caches
    (as ``CPUAttentionBackendImpl.forward`` splits it)."""
    num_blocks, num_kv_heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    return key_cache, value_cache


class KernelCaches:
    """The key and value caches of every attention layer, split once (not on every call): the layers'
    paged caches are allocated once by vLLM, so the views stay valid while their storage does."""

    def __init__(self, attn_layers: Sequence[Any]) -> None:
        self.layers = list(attn_layers)
        self._views: list[tuple[int, torch.Tensor, torch.Tensor] | None] = [None] * len(self.layers)

    def __getitem__(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.layers[layer_index].kv_cache
        known = self._views[layer_index]
        if known is None or known[0] != cache.data_ptr():
            known = (cache.data_ptr(), *_split_cache(cache))
            self._views[layer_index] = known
        return known[1], known[2]


class PagedKernelAttention:
    """:data:`ragcache.blend.Attention` of one pass's requests through vLLM's CPU attention kernel.

    ``attention(layer, q [n, Hq, D], index [n], k, v) -> [n, Hq, D]``: the queries of the rows at
    ``index`` attend causally over the paged cache of ``layer`` (which must already hold the layer's
    final K/V of the contexts: the blend writes them first), each within its own request's blocks;
    ``k``/``v`` are not read. One kernel call per layer whatever the number of requests and runs: the
    run plan and the kernel's scheduler metadata are built once per distinct ``index`` (the same
    selection serves every selective layer).

    Args:
        attn_layers: the model's vLLM ``Attention`` modules, one per layer.
        block_ids: one request's paged-cache block ids in order, or with ``starts`` one such list per request.
        block_size: tokens per block.
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D.
        dtype: the model's compute dtype.
        starts: ``[R + 1]`` the first row of every request and the number of rows, or None for one request.
        caches: the layers' split caches (:class:`KernelCaches`), shared across requests; made here when None.

    Raises:
        ValueError: (on call) the queries reach beyond their request's blocks.
    """

    def __init__(self, attn_layers: Sequence[Any], block_ids: Sequence[int] | Sequence[Sequence[int]], block_size: int,
                 *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 starts: Sequence[int] | None = None, caches: KernelCaches | None = None):
        self.layers = list(attn_layers)
        self.caches = caches or KernelCaches(self.layers)
        self.block_size = block_size
        if starts is None:  # one request owning every row
            self.starts = None
            self.block_table = torch.tensor(list(block_ids), dtype=torch.int32).unsqueeze(0)  # [1, B]
            self.capacity = torch.tensor([len(block_ids) * block_size])
        else:
            contexts = PagedContexts.of(block_ids, [b - a for a, b in zip(starts[:-1], starts[1:])], block_size)
            self.starts, self.block_table, self.capacity = contexts.starts, contexts.tables, contexts.capacity
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self._plans: list[tuple[torch.Tensor, QueryRuns, torch.Tensor, Any]] = []  # index, runs, table, metadata

    def _plan(self, index: torch.Tensor) -> tuple[QueryRuns, torch.Tensor, Any]:
        """Runs, block table ``[R, B]`` and the backend's metadata (:meth:`_metadata`) for ``index``
        (cached for the last two).

        Raises:
            ValueError: a run's queries reach beyond its request's cache slots.
        """
        for known, runs, table, md in self._plans:
            if known is index:
                return runs, table, md
        runs = QueryRuns.of(index, self.starts)
        if bool((runs.seq_lens > self.capacity[runs.request]).any()):
            reach = int((runs.seq_lens - self.capacity[runs.request]).max())
            raise ValueError(f"queries reach {reach} tokens beyond their request's cache slots")
        table, md = self._metadata(runs, index.device)
        self._plans = [(index, runs, table, md)] + self._plans[:1]
        return runs, table, md

    def _metadata(self, runs: QueryRuns, device: torch.device) -> tuple[torch.Tensor, Any]:
        """The runs' block table ``[R, B]`` and vLLM's CPU scheduler metadata for them."""
        from vllm import _custom_ops as ops
        from vllm import envs

        layer = self.layers[0]
        md = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=runs.num_runs, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=runs.seq_lens, dtype=self.dtype,
            query_start_loc=runs.query_start_loc, causal=True,
            sliding_window_size=layer.impl.sliding_window, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=layer.impl.kv_cache_dtype)
        return self.block_table[runs.request], md

    def __call__(self, layer_index: int, q: torch.Tensor, index: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        from vllm import _custom_ops as ops

        runs, table, md = self._plan(index)
        layer = self.layers[layer_index]
        impl = layer.impl
        key_cache, value_cache = self.caches[layer_index]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [n, Hq, D]
        ops.cpu_attention_with_kv_cache(  # reads q through its strides (a view of the projection is fine)
            query=_heads_dense(q), key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=runs.query_start_loc, seq_lens=runs.seq_lens, scale=impl.scale, causal=True,
            alibi_slopes=impl.alibi_slopes, sliding_window=impl.sliding_window, block_table=table,
            softcap=impl.logits_soft_cap, scheduler_metadata=md, s_aux=impl.sinks,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=impl.kv_cache_dtype)
        return out


class PagedWriter:
    """Writes a pass's final K/V into vLLM's paged cache: whole layers (``on_layer``) and recomputed
    rows (``write_rows``), one call per layer whatever the number of requests.

    On vLLM's CPU backend the cache is written with ``cpu_attn_reshape_and_cache`` over key and value
    caches split once (:class:`KernelCaches`); any other backend through its own
    ``impl.do_kv_cache_update``. The slots of a rows index are looked up once per distinct index.

    Args:
        attn_layers: the model's vLLM ``Attention`` modules.
        slots: ``[S]`` int64, every row's slot (:meth:`PagedContexts.slots`), on the cache's device.
        caches: the CPU backend's split caches, or None for another backend.
    """

    def __init__(self, attn_layers: Sequence[Any], slots: torch.Tensor, caches: KernelCaches | None = None):
        self.layers = list(attn_layers)
        self.slots = slots
        self.caches = caches
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, their slots)

    def _write(self, layer_index: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        layer = self.layers[layer_index]
        if self.caches is None:
            layer.impl.do_kv_cache_update(layer, k.contiguous(), v.contiguous(), layer.kv_cache, slots)
            return
        from vllm import _custom_ops as ops

        key_cache, value_cache = self.caches[layer_index]
        # reads k and v through their strides (as vLLM's own layer hands it views of its projection)
        ops.cpu_attn_reshape_and_cache(_heads_dense(k), _heads_dense(v), key_cache, value_cache, slots, layer.isa,
                                       k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                       kv_cache_dtype=layer.impl.kv_cache_dtype)

    def layer(self, layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``on_layer``: every row's K ``[S, Hkv, D]`` (post-RoPE) and V of one layer."""
        self._write(layer_index, self.slots, k, v)

    def rows(self, layer_index: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``write_rows``: rows ``[n]`` of one layer, K/V ``[n, Hkv, D]``."""
        if self._rows is None or self._rows[0] is not rows:
            self._rows = (rows, self.slots[rows])
        self._write(layer_index, self._rows[1], k, v)


#: vLLM's CUDA FlashAttention implementation this module calls (by class name: no vLLM import to check)
FLASH_IMPL = "FlashAttentionImpl"


def flash_available(attn_layers: Sequence[Any]) -> str | None:
    """Why vLLM's CUDA FlashAttention (its ``vllm_flash_attn`` varlen call over the paged cache) cannot
    serve these attention layers, or None when it can."""
    why = _backend_unusable(attn_layers, FLASH_IMPL, "FlashAttention", lambda layer, impl: (
        "decode context parallelism splits the KV cache" if getattr(impl, "dcp_world_size", 1) > 1 else None))
    if why is not None:
        return why
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401
    except ImportError as exc:
        return f"vllm.vllm_flash_attn is not importable ({exc})"
    return None


class FlashPagedAttention(PagedKernelAttention):
    """:data:`ragcache.blend.Attention` of one pass's requests through vLLM's CUDA FlashAttention.

    The same contract as :class:`PagedKernelAttention` (every run of recomputed rows one varlen
    segment over its request's blocks, one call per layer), through
    ``vllm.vllm_flash_attn.flash_attn_varlen_func``: ``cu_seqlens_q`` are the runs' query starts,
    ``seqused_k`` their ends, ``block_table`` their request's blocks; FlashAttention aligns the causal
    mask bottom-right, which is exactly a run's queries being the last tokens of the keys it sees.
    The cache is split as ``FlashAttentionImpl.forward`` of vLLM 0.32 splits it (``[num_blocks, Hkv,
    block_size, 2 * D]`` -> key and value ``[num_blocks, block_size, Hkv, D]``). Written from vLLM's
    source; not run on a GPU in this project's tests (none was available): the start-up self-check
    compares every blend path with vLLM's own prefill before blend is served.
    """

    def _metadata(self, runs: QueryRuns, device: torch.device) -> tuple[torch.Tensor, Any]:
        """The runs' block table on ``device`` and FlashAttention's varlen arguments: cumulative query
        starts, key lengths, the longest query run and the longest key run."""
        lengths = runs.query_start_loc[1:] - runs.query_start_loc[:-1]
        md = (runs.query_start_loc.to(device), runs.seq_lens.to(device), int(lengths.max()), int(runs.seq_lens.max()))
        return self.block_table[runs.request].to(device), md

    def __call__(self, layer_index: int, q: torch.Tensor, index: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        _, table, (query_start_loc, seq_lens, max_q, max_k) = self._plan(index)
        layer = self.layers[layer_index]
        impl = layer.impl
        key_cache, value_cache = layer.kv_cache.transpose(1, 2).split(self.head_dim, dim=-1)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [n, Hq, D]
        window = getattr(impl, "sliding_window", None)
        flash_attn_varlen_func(
            q, key_cache, value_cache, max_seqlen_q=max_q, cu_seqlens_q=query_start_loc, max_seqlen_k=max_k,
            seqused_k=seq_lens, softmax_scale=impl.scale, causal=True,
            window_size=list(window) if window is not None and tuple(window) != (-1, -1) else None,
            softcap=impl.logits_soft_cap or 0.0, alibi_slopes=impl.alibi_slopes, block_table=table, out=out,
            fa_version=impl.vllm_flash_attn_version, s_aux=getattr(impl, "sinks", None))
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
    """Resolve ``blend.attention`` for these layers: the engine's own attention backend where this
    module can call it, on every device.

    ``torch``: always SDPA. ``kernel``: vLLM's own kernel over the paged cache where the backend
    offers one this module calls (its CPU kernel, or its CUDA FlashAttention), else torch (said in
    the reason). ``auto``: FlashAttention where vLLM runs it (SDPA's per-request calls are what made
    the blend slow on a GPU); on CPU, where the kernel is available, whichever of the two is faster on
    this host in :func:`measure_attention` (the kernel unless torch wins by more than 10%: on some
    CPUs vLLM's kernel is slow, as its whole prefill is on AVX2-only hosts).

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
    if flash_available(attn_layers) is None:
        version = getattr(attn_layers[0].impl, "vllm_flash_attn_version", None)
        return AttentionChoice("kernel", f"vLLM FlashAttention{f' {version}' if version else ''} varlen over the "
                                         f"paged cache, blend.attention = {setting}")
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


def engine_attention(attn_layers: Sequence[Any], block_ids: Sequence[Sequence[int]], block_size: int, *,
                     starts: Sequence[int], caches: KernelCaches | None, **shape: Any) -> PagedKernelAttention:
    """The engine's own attention for one pass (``blend.attention`` resolved to ``kernel``): vLLM's
    CUDA FlashAttention where the layers run it, else its CPU kernel. ``shape``: ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``dtype``."""
    kind = FlashPagedAttention if flash_available(attn_layers) is None else PagedKernelAttention
    return kind(attn_layers, block_ids, block_size, starts=starts, caches=caches, **shape)
