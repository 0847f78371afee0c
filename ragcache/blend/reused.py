"""The cached KV a blend reuses, moved to the context's positions: streamed layer by layer, or staged.

Owns: :data:`LoadLayer` and :class:`CachedKV` (the two forms in which an engine hands a blend the
cached KV of a context) and the sources the layer-wise forwards read it from,
:func:`open_reused` -> ``get(layer) -> (k [N, Hkv, D] post-RoPE, v [N, Hkv, D])``:

- streamed (:class:`StreamedKV`, from a :data:`LoadLayer`): each layer loaded when the blend needs
  it, the next one in a background thread while the current one computes (CacheBlend §5,
  pipelining KV loading and recompute: worth it when a layer comes over a network), and moved with
  one RoPE call per layer;
- staged (:class:`StagedKV`, from a :class:`CachedKV`): every layer already in memory the engine
  keeps for it (e.g. one staging buffer the worker fills with one copy per request), every layer's
  K moved in one call at the start: a constant number of operators per blend, whatever the number
  of chunks, and no fresh memory per request.

The blend writes recomputed rows into what ``get`` returns (torch's attention path); the sources
hand out tensors nobody else reads. Must not import vLLM, transformers, or anything above blend/ in
ragcache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ragcache.blend.ops import DecoderOps
from ragcache.blend.rope import move_all_keys_, move_keys
from ragcache.blend.stages import StageClock

LoadLayer = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""``load_layer(layer) -> (k_pre [N, Hkv, D], v [N, Hkv, D])``: one layer of the cached context KV,
K before RoPE, in prompt order. May return tensors on another device or dtype (they are moved).
The blend writes recomputed rows into the returned V in place: return tensors nobody else reads
(e.g. a fresh ``torch.cat`` of the chunks' layers), not views of a cache.

Called from a background thread when prefetching: a loader that would have to run work there that
must not run beside the caller's compute raises :class:`LoadOnCaller` instead."""


class LoadOnCaller(Exception):
    """Raised by a :data:`LoadLayer` called from the prefetch thread when loading this layer needs work
    that must not run beside the caller's compute; :class:`StreamedKV` then calls it again for the
    same layer on the caller's thread, with no load running beside it.

    The case it exists for: a chunk found damaged mid-read is recomputed with a model forward, and
    vLLM's CPU GEMM (``_C::onednn_mm``) keeps one scratch buffer per process, so two forwards on two
    threads corrupt each other's results (and can crash when the buffer grows)."""


@dataclass(frozen=True)
class CachedKV:
    """Every layer of a context's cached KV at once (the staged form of :data:`LoadLayer`).

    Attributes:
        k_pre: ``[L, N, Hkv, D]`` K before RoPE, contiguous, on the ops' device in their dtype.
        v: ``[L, N, Hkv, D]`` V, likewise (each layer contiguous).

    The blend rotates ``k_pre`` in place and writes recomputed rows into both: hand it memory that
    is yours for this blend (a staging buffer), not a cache others read.
    """

    k_pre: torch.Tensor
    v: torch.Tensor


def _same_place(t: torch.Tensor, ops: DecoderOps) -> torch.Tensor:
    """``t`` on ``ops.device`` in ``ops.dtype`` (no operator when it is there already)."""
    if t.device == torch.device(ops.device) and t.dtype == ops.dtype:
        return t
    return t.to(device=ops.device, dtype=ops.dtype)


class StreamedKV:
    """Calls ``load_layer`` for a fixed sequence of layers, in that order, and moves each K.

    With ``prefetch``, the next layer in the sequence is loaded in one background thread while the
    caller computes the current one (torch and file I/O release the GIL, so the two overlap). The
    first layer starts loading at construction. A load that raises :class:`LoadOnCaller` there is
    done again on the caller's thread before the next one starts. Waits are booked to
    ``load_wait_s``, moves to ``move_keys_s``.
    """

    def __init__(self, ops: DecoderOps, load_layer: LoadLayer, layers: Iterable[int], positions: torch.Tensor,
                 prefetch: bool, clock: StageClock | None = None) -> None:
        self._ops = ops
        self._clock = clock
        self._load_layer = load_layer
        self._positions = positions
        self._shape = (positions.shape[0], ops.num_kv_heads, ops.head_dim)
        self._layers = deque(layers)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ragcache-blend-load") if prefetch else None
        self._next: tuple[int, Future] | None = None
        self.wait_s = 0.0
        self._submit_next()

    def __enter__(self) -> "StreamedKV":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _load(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            k_pre, v = self._load_layer(layer)
            if tuple(k_pre.shape) != self._shape or tuple(v.shape) != self._shape:
                raise ValueError(
                    f"load_layer({layer}) returned k {tuple(k_pre.shape)}, v {tuple(v.shape)}; expected {self._shape}"
                )
            return _same_place(k_pre, self._ops), _same_place(v, self._ops)

    def _submit_next(self) -> None:
        if self._pool is not None and self._layers:
            layer = self._layers.popleft()
            self._next = (layer, self._pool.submit(self._load, layer))

    def _book(self, stage: str, seconds: float) -> None:
        if self._clock is not None:
            self._clock.inner(stage, seconds)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k [N, Hkv, D] moved to the positions, v [N, Hkv, D])`` of ``layer`` on ``ops.device``
        in ``ops.dtype`` (loaded again on every call: the caller may write into them).

        Raises:
            RuntimeError: ``layer`` out of the planned order.
            ValueError: ``load_layer`` returned tensors of the wrong shape.
        """
        return self.get_pre(layer)[1:]

    def get_pre(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_pre, k, v)``: :meth:`get` with the keys before RoPE as loaded, ``[N, Hkv, D]`` each.

        Raises:
            as :meth:`get`.
        """
        start = time.perf_counter()
        if self._pool is None:
            if not self._layers or self._layers.popleft() != layer:
                raise RuntimeError(f"layer {layer} requested out of the planned order")
            k_pre, v = self._load(layer)
        else:
            if self._next is None or self._next[0] != layer:
                raise RuntimeError(f"layer {layer} requested out of the planned order")
            try:
                k_pre, v = self._next[1].result()
            except LoadOnCaller:
                k_pre, v = self._load(layer)  # here, with no load in the background
            self._submit_next()
        waited = time.perf_counter() - start
        self.wait_s += waited
        self._book("load_wait_s", waited)
        start = time.perf_counter()
        k = move_keys(self._ops, layer, k_pre, self._positions)
        self._book("move_keys_s", time.perf_counter() - start)
        return k_pre, k, v


class StagedKV:
    """Every layer of a :class:`CachedKV`, K moved to the positions in place at construction (booked
    to ``move_keys_s``). ``get`` returns views of it: the same tensors on every call, so the caller
    must not write into a layer it will read again unchanged.

    With ``keep_pre`` (a blend that reads the keys before RoPE, :meth:`get_pre`) the keys stay as
    cached and each ``get`` moves its layer into a new tensor (one rotary call per call).
    """

    def __init__(self, ops: DecoderOps, cached: CachedKV, positions: torch.Tensor, clock: StageClock | None = None,
                 keep_pre: bool = False):
        shape = (ops.num_layers, positions.shape[0], ops.num_kv_heads, ops.head_dim)
        if tuple(cached.k_pre.shape) != shape or tuple(cached.v.shape) != shape:
            raise ValueError(f"cached KV has k {tuple(cached.k_pre.shape)}, v {tuple(cached.v.shape)}; "
                             f"expected {shape}")
        self._ops, self._clock, self._positions = ops, clock, positions
        self._k_pre = _same_place(cached.k_pre, ops).unbind(0) if keep_pre else None
        self._k: tuple[torch.Tensor, ...] = ()
        if not keep_pre:
            start = time.perf_counter()
            self._k = move_all_keys_(ops, _same_place(cached.k_pre, ops), positions).unbind(0)
            self._book(time.perf_counter() - start)
        self._v = _same_place(cached.v, ops).unbind(0)
        self.wait_s = 0.0

    def __enter__(self) -> "StagedKV":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _book(self, seconds: float) -> None:
        if self._clock is not None:
            self._clock.inner("move_keys_s", seconds)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k [N, Hkv, D] moved, v [N, Hkv, D])`` of ``layer`` (views of the cached KV; with
        ``keep_pre`` K is a new tensor)."""
        if self._k_pre is None:
            return self._k[layer], self._v[layer]
        return self.get_pre(layer)[1:]

    def get_pre(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_pre, k, v)``, ``[N, Hkv, D]`` each: :meth:`get` with the keys before RoPE (a view of
        the cached KV: do not write into it).

        Raises:
            RuntimeError: the source was made without ``keep_pre``.
        """
        if self._k_pre is None:
            raise RuntimeError("StagedKV.get_pre needs keep_pre=True (the keys were moved in place)")
        start = time.perf_counter()
        k = move_keys(self._ops, layer, self._k_pre[layer], self._positions)
        self._book(time.perf_counter() - start)
        return self._k_pre[layer], k, self._v[layer]


def open_reused(ops: DecoderOps, load: LoadLayer | CachedKV, layers: Iterable[int], positions: torch.Tensor,
                prefetch: bool, clock: StageClock | None = None, keep_pre: bool = False) -> StreamedKV | StagedKV:
    """The source of the reused KV: staged for a :class:`CachedKV`, else streamed over ``layers``
    (the order the caller will ask for them) with ``prefetch``. With ``keep_pre`` its ``get_pre``
    also gives the keys before RoPE (a streamed source always can)."""
    if isinstance(load, CachedKV):
        return StagedKV(ops, load, positions, clock, keep_pre)
    return StreamedKV(ops, load, layers, positions, prefetch, clock)
