"""Layer-wise forwards over ``DecoderOps``: chunk KV precompute, CacheBlend, and plain reuse.

Owns: ``compute_kv`` (a plain prefill that returns pre-RoPE K and V), ``blend_kv`` (CacheBlend's
selective recompute), ``reuse_kv`` (cached KV moved to its new positions, nothing recomputed),
``BlendResult``, and the layer prefetch that overlaps loading layer i+1 with computing layer i.
Must not import vLLM, transformers, or anything above blend/ in ragcache.

CacheBlend (Yao et al., EuroSys'25): the KV of each retrieved chunk was computed without the other
chunks in view, so its cross-chunk attention is missing. Recomputing the KV of a small set of
high-KV-deviation (HKVD) tokens in every layer and reusing the rest restores most of it (§4.2
"selective KV recompute"); the HKVD tokens are chosen once, at an early check layer where every
token is computed in full (§4.3); loading the KV of the next layer overlaps with recomputing the
current one (§5, pipelining KV loading and recompute).

Tensors handed to ``on_layer`` are created under ``torch.inference_mode()`` and may alias what
``load_layer`` returned: copy them out (e.g. into the engine's paged cache), do not modify them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ragcache.blend.attention import Attention, torch_attention
from ragcache.blend.ops import DecoderOps
from ragcache.blend.rope import move_keys
from ragcache.blend.select import (
    Budget,
    BudgetRule,
    Selection,
    adaptive_budget,
    check_mask,
    deviation_scores,
    hkvd_budget,
    impact_scores,
    value_error,
    question_attention,
    select_tokens,
)

LoadLayer = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""``load_layer(layer) -> (k_pre [N, Hkv, D], v [N, Hkv, D])``: one layer of the cached context KV,
K before RoPE, in prompt order. May return tensors on another device or dtype (they are moved).
The blend writes recomputed rows into the returned V in place: return tensors nobody else reads
(e.g. a fresh ``torch.cat`` of the chunks' layers), not views of a cache."""

OnLayer = Callable[[int, torch.Tensor, torch.Tensor], None]
"""``on_layer(layer, k [N, Hkv, D], v [N, Hkv, D])``: the final K (post-RoPE) and V of every context
token in one layer, called once per layer in layer order."""

WriteRows = Callable[[int, torch.LongTensor, torch.Tensor, torch.Tensor], None]
"""``write_rows(layer, index [n], k [n, Hkv, D], v [n, Hkv, D])``: overwrite the rows ``index``
(int64, ascending) of ``layer``'s K (post-RoPE) and V where ``on_layer`` already wrote the whole layer."""

DEVIATIONS = ("value", "key")


@dataclass
class BlendResult:
    """What one blend (or reuse) did.

    Attributes:
        selected: ``[n]`` int64 indices (ascending) of the context tokens recomputed after the check
            layer: the HKVD tokens plus the forced ones; empty for ``reuse_kv``.
        num_recomputed: ``n``.
        num_tokens: number of context tokens N.
        load_s: seconds spent waiting for ``load_layer`` (with prefetch, only the part not hidden
            behind compute).
        compute_s: seconds of the blend's own compute (wall time minus ``load_s`` and ``on_layer_s``).
        on_layer_s: seconds spent inside the ``on_layer`` (and ``write_rows``) callbacks (e.g. writing a
            paged cache).
        budget: the recompute budget the blend chose and why (:class:`~ragcache.blend.select.Budget`;
            None for ``reuse_kv``).
        recomputed_layers: how many layers, from the first, the selected tokens were recomputed in
            (``recompute_depth``, :func:`recompute_layers`; every layer where the choice did not depend
            on the scores, e.g. ratio 1.0); 0 when no token was recomputed (and for ``reuse_kv``).
        stages: seconds per stage, adding up to the wall time. Blend: ``full_layers_s`` (every
            token's projections, RoPE and MLP in the layers up to the check layer's QKV) and
            ``full_attention_s`` (their attention), ``question_probe_s`` (the question tail through
            the later layers over the reused KV), ``select_s`` (scores and selection),
            ``selective_layers_s`` (the selected tokens' projections, RoPE and MLP from the check
            layer on, and the merge of the recomputed rows) and ``selective_attention_s`` (their
            attention); both: ``move_keys_s`` (the reused K rotated to the new positions),
            ``load_wait_s`` (= load_s) and ``cache_write_s`` (= on_layer_s).
            On an accelerator the stage times include only the launch unless kernels finish within
            the stage.
    """

    selected: torch.LongTensor
    num_recomputed: int
    num_tokens: int
    load_s: float
    compute_s: float
    on_layer_s: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)
    recomputed_layers: int = 0
    budget: Budget | None = None


class _LayerLoader:
    """Calls ``load_layer`` for a fixed sequence of layers, in that order.

    With ``prefetch``, the next layer in the sequence is loaded in one background thread while the
    caller computes the current one (torch and file I/O release the GIL, so the two overlap). The
    first layer starts loading at construction.
    """

    def __init__(
        self,
        ops: DecoderOps,
        load_layer: LoadLayer,
        layers: Iterable[int],
        num_tokens: int,
        prefetch: bool,
        clock: "_Stages | None" = None,
    ) -> None:
        self._ops = ops
        self._clock = clock
        self._load_layer = load_layer
        self._shape = (num_tokens, ops.num_kv_heads, ops.head_dim)
        self._layers = deque(layers)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ragcache-blend-load") if prefetch else None
        self._next: tuple[int, Future] | None = None
        self.wait_s = 0.0
        self._submit_next()

    def __enter__(self) -> _LayerLoader:
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
            return (
                k_pre.to(device=self._ops.device, dtype=self._ops.dtype),
                v.to(device=self._ops.device, dtype=self._ops.dtype),
            )

    def _submit_next(self) -> None:
        if self._pool is not None and self._layers:
            layer = self._layers.popleft()
            self._next = (layer, self._pool.submit(self._load, layer))

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached ``(k_pre [N, Hkv, D], v [N, Hkv, D])`` of ``layer`` on ``ops.device`` in ``ops.dtype``."""
        start = time.perf_counter()
        if self._pool is None:
            if not self._layers or self._layers.popleft() != layer:
                raise RuntimeError(f"layer {layer} requested out of the planned order")
            kv = self._load(layer)
        else:
            if self._next is None or self._next[0] != layer:
                raise RuntimeError(f"layer {layer} requested out of the planned order")
            kv = self._next[1].result()
            self._submit_next()
        waited = time.perf_counter() - start
        self.wait_s += waited
        if self._clock is not None:
            self._clock.inner("load_wait_s", waited)
        return kv


class _Stages:
    """Seconds per named stage: ``with stages("name"): ...`` adds the block's wall time.

    Time spent inside a :class:`_Timer` (an engine callback, the attention, a wait for a load) is
    booked to that timer's stage and taken out of the stage that was open around it, so the stages
    add up to the wall time without double counting.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._name: str | None = None
        self._open: str | None = None
        self._t0 = 0.0

    def __call__(self, name: str) -> "_Stages":
        self._name = name
        return self

    def __enter__(self) -> None:
        self._open, self._t0 = self._name, time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.add(self._open, time.perf_counter() - self._t0)
        self._open = None

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def inner(self, name: str | dict[str, str], seconds: float) -> None:
        """Book ``seconds`` spent in a timed callable: to ``name`` (or, for a dict, to the name it
        gives the open stage) and out of the open stage."""
        if isinstance(name, dict):
            name = name.get(self._open or "", next(iter(name.values())))
        self.add(name, seconds)
        if self._open is not None:
            self.add(self._open, -seconds)


class _Timer:
    """A callable timed into ``clock`` under ``stage`` (see :meth:`_Stages.inner`)."""

    def __init__(self, fn: Callable, clock: _Stages, stage: str | dict[str, str]) -> None:
        self._fn = fn
        self._clock = clock
        self._stage = stage
        self.seconds = 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self._fn(*args)
        finally:
            dt = time.perf_counter() - start
            self.seconds += dt
            self._clock.inner(self._stage, dt)


def _synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that wall-clock timings on an accelerator are real."""
    device = torch.device(device)
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize(device)


def _check_positions(token_ids: torch.Tensor, positions: torch.Tensor) -> int:
    if token_ids.dim() != 1 or token_ids.shape[0] == 0:
        raise ValueError(f"token_ids must be a non-empty [N] tensor, got shape {tuple(token_ids.shape)}")
    if positions.shape != token_ids.shape:
        raise ValueError(f"positions {tuple(positions.shape)} do not match token_ids {tuple(token_ids.shape)}")
    return token_ids.shape[0]


def compute_kv(
    ops: DecoderOps,
    token_ids: torch.LongTensor,
    positions: torch.LongTensor,
    keep_from: int = 0,
    attention: Attention | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain layer-wise prefill of ``token_ids`` at ``positions``; returns their pre-RoPE K and V.

    Every token attends causally to all earlier tokens (exact full prefill). Used to precompute a
    chunk's KV after a canonical lead-in (``keep_from = len(lead_in)`` drops the lead-in's KV) and
    to compute a chunk whose KV is missing at query time.

    Args:
        ops: the model's per-layer callables.
        token_ids: ``[T]`` int64 token ids.
        positions: ``[T]`` int64 absolute positions (usually ``start + arange(T)``).
        keep_from: index of the first token whose KV is returned, in ``[0, T)``.
        attention: the causal attention (:data:`~ragcache.blend.attention.Attention`; called with
            every token as a query and the layer's K/V, nothing written before it: it must use the
            ``k``/``v`` it is handed); default :func:`~ragcache.blend.attention.torch_attention`.

    Returns:
        ``(k_pre, v)``, each ``[num_layers, T - keep_from, Hkv, D]`` on ``ops.device`` in
        ``ops.dtype``; K before RoPE (rotate with ``move_keys`` to place it).

    Raises:
        ValueError: if ``token_ids`` is empty or not 1-D, ``positions`` has another shape, or
            ``keep_from`` is outside ``[0, T)``.
    """
    num_tokens = _check_positions(token_ids, positions)
    if not 0 <= keep_from < num_tokens:
        raise ValueError(f"keep_from must be in [0, {num_tokens}), got {keep_from}")
    num_layers = ops.num_layers
    with torch.inference_mode():
        token_ids = token_ids.to(ops.device)
        positions = positions.to(ops.device)
        attention = attention or torch_attention(positions, ops.scaling)
        everything = torch.arange(num_tokens, device=ops.device)
        shape = (num_layers, num_tokens - keep_from, ops.num_kv_heads, ops.head_dim)
        k_out = torch.empty(shape, device=ops.device, dtype=ops.dtype)  # [L, T', Hkv, D]
        v_out = torch.empty(shape, device=ops.device, dtype=ops.dtype)  # [L, T', Hkv, D]

        hidden = ops.embed(token_ids)  # [T, hidden]
        for layer in range(num_layers):
            q, k, v = ops.qkv(layer, hidden)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
            k_out[layer] = k[keep_from:]
            v_out[layer] = v[keep_from:]
            if layer == num_layers - 1:
                break  # the last layer's output is not part of any KV
            q, k = ops.rope(layer, positions, q, k)
            attn = attention(layer, q, everything, k, v)  # [T, Hq, D]
            hidden = ops.finish_layer(layer, hidden, attn)  # [T, hidden]
    return k_out, v_out


@dataclass
class _Context:
    """One blend's inputs on the compute device (set up by :func:`blend_kv`).

    Attributes:
        ids, positions: ``[N]`` context token ids and positions.
        tail_ids, tail_positions: ``[T]`` the question tail's ids and positions, or None when the
            selection does not score by the question.
        forced, exact: ``[N]`` bool masks (see :func:`blend_kv`), or None.
        everything: ``[N]`` the index of every context token (the queries of a full layer).
    """

    ids: torch.Tensor
    positions: torch.Tensor
    tail_ids: torch.Tensor | None
    tail_positions: torch.Tensor | None
    forced: torch.Tensor | None
    exact: torch.Tensor | None
    everything: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.everything = torch.arange(self.ids.shape[0], device=self.ids.device)

    @property
    def n(self) -> int:
        return self.ids.shape[0]


class _QuestionScores:
    """The attention each context token receives from the question tail, summed over the layers seen."""

    def __init__(self, scaling: float, heads: str = "mean") -> None:
        self.scaling = scaling
        self.heads = heads  # pooling over query heads (question_attention)
        self.total: torch.Tensor | None = None  # [N] float32
        self.layers = 0

    def attend(self, q_tail: torch.Tensor, k_ctx: torch.Tensor, k_tail: torch.Tensor, v_ctx: torch.Tensor,
               v_tail: torch.Tensor) -> torch.Tensor:
        """The tail's attention output ``[T, Hq, D]`` over the context and itself; adds the layer's scores."""
        out, s = question_attention(q_tail, k_ctx, k_tail, self.scaling, v_ctx=v_ctx, v_tail=v_tail, heads=self.heads)
        self.total = s if self.total is None else self.total + s
        self.layers += 1
        return out

    def mean(self) -> torch.Tensor:
        """``[N]`` float32: the scores averaged over the layers seen."""
        return self.total / max(self.layers, 1)


def _full_layer(ops: DecoderOps, layer: int, ctx: _Context, hidden: torch.Tensor, on_layer: OnLayer,
                attention: Attention, question: _QuestionScores | None) -> torch.Tensor:
    """One layer for every context token (and the tail, when ``question`` scores it): fresh K/V of the
    context to ``on_layer``, the context's causal attention through ``attention``, the tail's over the
    context and itself. ``hidden`` ``[N(+T), hidden]`` -> the layer's output, same shape (§4.3: the
    layers up to the check layer are computed in full)."""
    n = ctx.n
    all_pos = ctx.positions if question is None else torch.cat([ctx.positions, ctx.tail_positions])
    q, k, v = ops.qkv(layer, hidden)  # [N(+T), Hq, D], [N(+T), Hkv, D], [N(+T), Hkv, D]
    q, k = ops.rope(layer, all_pos, q, k)
    k_ctx, v_ctx = k[:n], v[:n]
    on_layer(layer, k_ctx, v_ctx)
    attn = attention(layer, q[:n], ctx.everything, k_ctx, v_ctx)  # [N, Hq, D]
    if question is not None:
        attn = torch.cat([attn, question.attend(q[n:], k_ctx, k[n:], v_ctx, v[n:])])  # [N+T, Hq, D]
    return ops.finish_layer(layer, hidden, attn)


def _check_layer_kv(ops: DecoderOps, layer: int, ctx: _Context, hidden: torch.Tensor, on_layer: OnLayer,
                    question: _QuestionScores | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The check layer's fresh Q/K/V of every context token (K/V to ``on_layer``), and the tail's output.

    Returns:
        ``(q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D], hidden_tail [T, hidden] or None)``; the tail
        has gone through the whole check layer (its attention scores are added to ``question``).
    """
    n = ctx.n
    all_pos = ctx.positions if question is None else torch.cat([ctx.positions, ctx.tail_positions])
    q, k, v = ops.qkv(layer, hidden)
    q, k = ops.rope(layer, all_pos, q, k)
    on_layer(layer, k[:n], v[:n])
    hidden_tail = None
    if question is not None:
        attn_tail = question.attend(q[n:], k[:n], k[n:], v[:n], v[n:])  # [T, Hq, D]
        hidden_tail = ops.finish_layer(layer, hidden[n:], attn_tail)  # [T, hidden]
    return q[:n], k[:n], v[:n], hidden_tail


def _question_probe(ops: DecoderOps, layers: range, ctx: _Context, hidden_tail: torch.Tensor,
                    loader: "_LayerLoader", move: Callable[[int, torch.Tensor], torch.Tensor],
                    question: _QuestionScores, on_layer: OnLayer | None = None,
                    keep_v: Collection[int] = ()) -> dict[int, torch.Tensor]:
    """The question tail alone through ``layers`` over the reused KV of the context (ProphetKV-style
    scores fused over layers, ICML'26): each layer's cached K is loaded and moved to the context's
    positions (``move(layer, k_pre)``); no context token is computed. The layers are not kept: with
    ``on_layer`` each goes to the engine's cache now (the selective pass then overwrites only the
    recomputed rows), without it the selective pass loads them again (cheaper than holding every
    layer's KV, see :func:`blend_kv`). Returns the cached V ``[N, Hkv, D]`` of the layers in
    ``keep_v`` that are among ``layers`` (for :func:`_refine`), by layer."""
    kept: dict[int, torch.Tensor] = {}
    for layer in layers:
        k_pre, v_cached = loader.get(layer)
        if layer in keep_v:
            kept[layer] = v_cached
        k_moved = move(layer, k_pre)  # [N, Hkv, D]
        if on_layer is not None:
            on_layer(layer, k_moved, v_cached)
        q_t, k_t, v_t = ops.qkv(layer, hidden_tail)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        q_t, k_t = ops.rope(layer, ctx.tail_positions, q_t, k_t)
        attn = question.attend(q_t, k_moved, k_t, v_cached, v_t)  # [T, Hq, D]
        if layer < ops.num_layers - 1:
            hidden_tail = ops.finish_layer(layer, hidden_tail, attn)
    return kept


def _select(ops: DecoderOps, layer: int, ctx: _Context, budget: int, selection: Selection, deviation: str,
            segment_starts: Sequence[int], fresh: tuple[torch.Tensor, torch.Tensor] | None,
            cached: tuple[torch.Tensor, torch.Tensor] | None, question: _QuestionScores | None,
            scores_matter: bool) -> torch.Tensor:
    """``[n]`` ascending indices of the tokens to recompute (§4.3 and :func:`select_tokens`).

    ``fresh`` and ``cached`` are the check layer's ``(k, v)``: fresh (post-RoPE) and cached (K
    before RoPE), compared for the KV deviation (None when the selection does not measure it).
    """
    scores: dict[str, torch.Tensor] = {}
    if not scores_matter:  # the choice cannot depend on the scores: zeros stand for them
        zeros = torch.zeros(ctx.n, device=ops.device)
        scores = {"deviation": zeros, **({"question": zeros} if selection.needs_question else {})}
    else:
        if question is not None:
            scores["question"] = question.mean()
        if selection.needs_deviation:
            if deviation == "value":
                scores["deviation"] = deviation_scores(cached[1], fresh[1])
            else:
                scores["deviation"] = deviation_scores(move_keys(ops, layer, cached[0], ctx.positions), fresh[0])
    return select_tokens(budget, selection, forced=ctx.forced, exact=ctx.exact, segment_starts=segment_starts,
                         **scores)


def _adapt(ctx: _Context, question: _QuestionScores, rule: BudgetRule, ratio: float, min_tokens: int) -> Budget:
    """The request's recompute budget from the question's attention (:func:`~ragcache.blend.select.
    adaptive_budget`), over the tokens that may be chosen and whose KV moved (neither forced nor exact)."""
    movable = torch.ones(ctx.n, dtype=torch.bool, device=ctx.ids.device)
    for mask in (ctx.exact, ctx.forced):
        if mask is not None:
            movable &= ~mask
    return adaptive_budget(question.mean(), movable, ratio=ratio, min_tokens=min_tokens, rule=rule)


def _refine(ops: DecoderOps, ctx: _Context, layer: int, candidates: torch.Tensor, hidden: torch.Tensor,
            reused_v: torch.Tensor, error: torch.Tensor | None, question: _QuestionScores, budget: int,
            selection: Selection, segment_starts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradual filtering at ``layer`` (CacheBlend §4.3, weighted by the question): of the question's
    ``candidates`` ``[m]``, which have been through layers ``0 .. layer - 1`` (``hidden`` ``[m, ...]``
    entering ``layer``), keep ``budget`` (plus the forced ones) by impact
    (:func:`~ragcache.blend.select.impact_scores`: question attention x the L2 error of their reused
    V, here against ``reused_v`` ``[N, Hkv, D]`` of ``layer``, plus ``error`` ``[m]``, the error
    summed over the layers before it, or None).

    Returns:
        ``(selected [n], hidden [n, ...])``: the kept candidates, ascending, and their rows.
    """
    _, _, fresh_v = ops.qkv(layer, hidden)  # [m, Hkv, D]
    total = value_error(fresh_v, reused_v[candidates])  # [m]
    if error is not None:
        total += error
    impact = impact_scores(question.mean(), candidates, total)
    # no exact mask here: it would rank an exact candidate below every non-candidate; an exact
    # token's reused V has no error, so its impact already ranks it last among the candidates
    final = select_tokens(budget, selection, question=impact, forced=ctx.forced, segment_starts=segment_starts)
    keep = torch.isin(candidates, final)
    # a run the question trimmed may be taken whole here: its tokens outside the candidates have not
    # been through the layers before, so the budget they held goes to the best remaining candidates
    short = min(final.numel(), candidates.numel()) - int(keep.sum())
    if short > 0:
        rest = impact[candidates].masked_fill(keep, -1.0)
        keep[torch.topk(rest, short).indices] = True
    return candidates[keep], hidden[keep]


def _selective_layer(ops: DecoderOps, layer: int, ctx: _Context, hidden: torch.Tensor, selected: torch.Tensor,
                     k_all: torch.Tensor | None, v_all: torch.Tensor | None, on_layer: OnLayer, attention: Attention,
                     write_rows: WriteRows | None = None, *, last: bool = False,
                     observe_v: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """One layer after the check layer for the selected tokens only (§4.2, selective KV recompute).

    ``k_all`` / ``v_all`` ``[N, Hkv, D]`` hold the reused KV at the new positions; the selected rows
    are replaced by their fresh K/V (in place), the layer's final K/V go to ``on_layer``, and the
    selected queries attend over them through ``attention``. With ``k_all = v_all = None`` the
    engine already holds the layer's reused KV (the question probe wrote it): only the selected rows
    go to ``write_rows``, and ``attention`` reads the layer back from the engine's cache.
    ``hidden`` ``[n, hidden]`` -> the layer's output for the selected tokens (with ``last``, the
    model's last layer or the last one these tokens are recomputed in, no output is needed: only
    their K/V are written and ``hidden`` is returned). ``observe_v(layer, v [n, Hkv, D])`` sees the
    selected tokens' fresh V before any row is written.
    """
    q, k, v = ops.qkv(layer, hidden)  # [n, Hq, D], [n, Hkv, D], [n, Hkv, D]
    if observe_v is not None:
        observe_v(layer, v)
    q, k = ops.rope(layer, ctx.positions[selected], q, k)
    if k_all is None:
        write_rows(layer, selected, k, v)
    else:
        k_all.index_copy_(0, selected, k)
        v_all.index_copy_(0, selected, v)
        on_layer(layer, k_all, v_all)
    if last:
        return hidden
    attn = attention(layer, q, selected, k_all, v_all)  # [n, Hq, D]
    return ops.finish_layer(layer, hidden, attn)


def recompute_layers(recompute_depth: float, num_layers: int, check_layer: int) -> int:
    """How many layers, from the first, the selected tokens are recomputed in (:func:`blend_kv`'s
    ``recompute_depth``): ``ceil(recompute_depth * num_layers)``, at least ``check_layer + 1``."""
    return min(num_layers, max(check_layer + 1, math.ceil(round(recompute_depth * num_layers, 9))))


def blend_kv(
    ops: DecoderOps,
    token_ids: torch.LongTensor,
    positions: torch.LongTensor,
    load_layer: LoadLayer,
    *,
    recompute_ratio: float,
    min_recompute_tokens: int = 0,
    recompute_depth: float = 1.0,
    check_layer: int,
    deviation: str,
    selection: Selection | None = None,
    tail_ids: torch.LongTensor | None = None,
    segment_starts: Sequence[int] = (0,),
    exact: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    on_layer: OnLayer,
    attention: Attention | None = None,
    write_rows: WriteRows | None = None,
    prefetch: bool = True,
    budget_rule: BudgetRule | None = None,
) -> BlendResult:
    """CacheBlend: fuse the cached KV of the context tokens, recomputing only a selected share.

    Procedure (CacheBlend §4.2-4.3), one step function each:

    1. Layers ``0 .. check_layer - 1`` (:func:`_full_layer`): a plain prefill of all N tokens (cached
       KV is not loaded). With ``tail_ids`` (the question tail that follows the context), the tail
       goes along, so its queries see the exact context of these layers.
    2. Layer ``check_layer`` (:func:`_check_layer_kv`): fresh Q/K/V of all N tokens. For the
       question's attention the tail then goes on alone through every later layer over the reused
       KV (moved to its positions) (:func:`_question_probe`), a probe as cheap as decoding T
       tokens; the scores are averaged over all layers (exact up to the check layer, over reused KV
       after it), in the spirit of ProphetKV (ICML'26). The probed layers are not kept (the memory
       they held cost more in page faults): with ``write_rows`` each goes to ``on_layer`` as the
       probe leaves it and step 3 writes only the recomputed rows; without it step 3 loads and
       moves those layers again. The tokens to
       recompute are chosen by :func:`_select` under ``selection``: by KV deviation (the fresh V,
       or K with ``deviation="key"``, against the cached one), by the attention the question tail
       gives each context token, or a hybrid, token by token or in runs (``selection.granule``).
       Only the selected tokens' attention and MLP are computed.
    3. Layers ``check_layer + 1 ..`` (:func:`_selective_layer`): only the selected tokens go
       forward. K = cached K moved to ``positions`` with the selected rows replaced by their fresh
       K, V likewise; the selected queries attend over all N keys with the exact causal mask by
       position. With ``recompute_depth`` < 1 they stop after the first ``ceil(depth * L)`` layers
       and the later layers keep the reused KV (forced tokens, which have none, go on to the end).

    With ``check_layer`` 0 and no KV deviation to measure, steps 1-2 compute no context token in
    full: a token's layer-0 K/V depend on that token alone, so the cached KV moved to ``positions``
    is layer 0's fresh KV. The question probe starts at layer 0 and the selected tokens are
    computed from layer 0 (step 3 from layer 0), which saves a projection pass over all N tokens.
    There, with ``selection.candidates`` > 1, the question picks that many times the budget, they
    go through layers ``0 .. R - 1`` (R = ``selection.refine_layer``), and at layer R the budget is
    kept among them by impact (:func:`_refine`: the question's attention times their reused V's
    error summed over layers 1 .. R, CacheBlend's gradual filtering); only the kept tokens go on,
    the dropped ones keep the fresh KV of the layers they went through.

    Every attention over the context runs through ``attention`` (default :func:`torch_attention`),
    right after ``on_layer`` (or ``write_rows``) received that layer's final K/V: an engine passes its
    own kernel over the cache ``on_layer`` writes. ``on_layer`` receives, for every layer, the final K (post-RoPE)
    and V of all N context tokens: fresh for layers ``<= check_layer`` (layer 0 on the fast path above:
    cached and moved, which is the fresh KV up to rounding), fused afterwards (the
    tail's KV is never emitted: the engine prefills the tail itself). With ``recompute_ratio=1.0``
    these equal ``compute_kv``'s output rotated to ``positions`` (up to float rounding); with ratio
    0 and no forced tokens, the layers after the check layer equal ``reuse_kv``'s.

    Args:
        ops: the model's per-layer callables.
        token_ids: ``[N]`` int64 context token ids, in prompt order.
        positions: ``[N]`` int64 absolute positions of those tokens in the prompt (ascending).
        load_layer: ``layer -> (k_pre [N, Hkv, D], v [N, Hkv, D])`` cached KV of the context
            (rows of forced tokens are ignored and may hold anything finite). Called in this order:
            the check layer (unless the fast path below skips it), the question probe's layers, then
            every layer after the check layer (from layer 0 on the fast path) that ``write_rows``
            does not cover, so without ``write_rows`` a probed layer is loaded twice; with
            ``prefetch`` from a background thread.
            The blend may write into the returned tensors: return tensors the caller owns.
        recompute_ratio: fraction of the N tokens to recompute, in ``[0, 1]``.
        recompute_depth: share of the layers, from the first, in which the selected tokens are
            recomputed, in (0, 1]: from layer ``ceil(recompute_depth * L)`` on (at least the check
            layer + 1) only forced tokens go forward and every other token keeps its reused KV.
            Applies only when a selection is made (a budget below every token): ratio 1.0 stays
            exact. Measured in docs/benchmarks.md ("recompute depth").
        min_recompute_tokens: with a ratio above 0, recompute at least this many tokens (all N
            when fewer; :func:`~ragcache.blend.select.hkvd_budget`).
        check_layer: the layer where the tokens are selected, in ``[0, num_layers)``.
        deviation: ``"value"`` (as in the paper) or ``"key"``: which of the check layer's cached and
            fresh KV are compared.
        selection: the selection strategy (default: deviation only, CacheBlend's).
        tail_ids: ``[T]`` int64 ids of the tokens after the context (the question and the
            assistant-turn opening), at positions ``positions[-1] + 1 ..``; needed by
            question-aware selection, ignored otherwise.
        segment_starts: first index of each cached segment in the context (ascending, from 0).
        exact: ``[N]`` bool, tokens whose cached KV is already exact (the prompt head, a chunk at
            its canonical place): recomputed only when the budget exceeds every other token.
        forced: ``[N]`` bool, True for tokens with no cached KV (always recomputed), or None.
        (The defaults of ratio, check layer, deviation and selection live in one place:
        ``ragcache.config.BlendSettings``.)
        on_layer: ``(layer, k [N, Hkv, D], v [N, Hkv, D]) -> None``, see above.
        attention: the context's causal attention (:data:`~ragcache.blend.attention.Attention`);
            default :func:`~ragcache.blend.attention.torch_attention` over ``positions``.
        write_rows: ``(layer, index [n], k [n, Hkv, D], v [n, Hkv, D]) -> None`` (:data:`WriteRows`),
            overwriting rows of a layer ``on_layer`` wrote; give it only with an ``attention`` that
            reads K/V back from the engine's cache. Then a layer the question probe loaded goes to
            ``on_layer`` from the probe (reused KV moved), the selective pass writes only its
            recomputed rows and calls ``attention`` with ``k = v = None``: no layer is loaded or
            moved twice, and the result is the same.
        prefetch: load layer i+1 in a background thread while layer i computes (the
            ``pipeline_overlap`` setting).
        budget_rule: with question scores, the budget adapts to the request (:func:`~ragcache.blend.
            select.adaptive_budget`: the question's attention left on reused KV, around the ratio's
            budget); None keeps the ratio's budget (``hkvd_budget``) for every request.

    Returns:
        ``BlendResult`` with the selected indices, the load / compute / on_layer seconds and the
        seconds per stage.

    Raises:
        ValueError: on empty or mismatched ``token_ids`` / ``positions`` / ``forced`` / ``exact``,
            a ratio outside ``[0, 1]``, a negative ``min_recompute_tokens``, a ``recompute_depth``
            outside ``(0, 1]``, a ``check_layer``
            outside ``[0, num_layers)``, an unknown ``deviation``, a question-aware selection without
            ``tail_ids``, or ``load_layer`` returning tensors of the wrong shape.
    """
    num_tokens = _check_positions(token_ids, positions)
    num_layers = ops.num_layers
    budget = hkvd_budget(recompute_ratio, num_tokens, min_recompute_tokens)  # validates the ratio and the floor
    if not 0 <= check_layer < num_layers:
        raise ValueError(f"check_layer must be in [0, {num_layers}), got {check_layer}")
    if not 0.0 < recompute_depth <= 1.0:
        raise ValueError(f"recompute_depth must be in (0, 1], got {recompute_depth}")
    if deviation not in DEVIATIONS:
        raise ValueError(f"deviation must be one of {DEVIATIONS}, got {deviation!r}")
    selection = selection or Selection("deviation")
    check_mask(forced, num_tokens, "forced")
    check_mask(exact, num_tokens, "exact")
    if selection.needs_question and (tail_ids is None or tail_ids.dim() != 1 or tail_ids.shape[0] == 0):
        raise ValueError(f"selection {selection.strategy!r} needs the question tail's token ids (tail_ids)")
    # With no budget, or a budget that covers every token, the choice does not depend on the scores:
    # skip the question probe (~3% of a ratio-1.0 blend) and score with zeros.
    num_forced = int(forced.sum()) if forced is not None else 0
    scores_matter = 0 < budget < num_tokens - num_forced
    use_tail = selection.needs_question and scores_matter
    # the selected tokens go forward through layers < depth_end; after it only the forced ones do
    depth_end = recompute_layers(recompute_depth, num_layers, check_layer) if scores_matter else num_layers

    # Which layers the cached KV is loaded for, in order (see load_layer): the question probe's, then
    # the selective layers' again. The probe's moved layers are not kept for the selective pass:
    # holding every layer's K/V (~140 MB for 6k tokens of SmolLM2) made a request touch that much
    # fresh memory whenever the heap had no room for it (e.g. the first blend after an ingest), and
    # those page faults cost more than loading and moving a layer twice (docs/benchmarks.md).
    fast_path = check_layer == 0 and not (selection.needs_deviation and scores_matter)
    # question selection refined at layer R (_refine): the question picks more, layer R keeps the budget
    candidate_budget = min(math.ceil(round(selection.candidates * budget, 9)), num_tokens - num_forced)
    refine_at = selection.refine_layer
    refine = fast_path and use_tail and depth_end > refine_at and candidate_budget > budget
    probe_end = num_layers if selection.probe_layers is None else check_layer + 1 + selection.probe_layers
    probe_end = min(probe_end, num_layers)
    probe_layers = range(0 if fast_path else check_layer + 1, probe_end) if use_tail else range(0)
    selective_layers = range(0 if fast_path else check_layer + 1, num_layers)
    written = set(probe_layers) if write_rows is not None and attention is not None else set()  # by the probe
    plan = (([] if fast_path else [check_layer]) + list(probe_layers)
            + [layer for layer in selective_layers if layer not in written])

    start = time.perf_counter()
    clock = _Stages()
    emit = _Timer(on_layer, clock, "cache_write_s")
    # the ratio's budget, unless the question's attention changes it (_adapt)
    floor = " (blend.min_recompute_tokens)" if budget > math.ceil(round(recompute_ratio * num_tokens, 9)) else ""
    chosen = Budget(tokens=budget, centre=budget, reason=f"fixed: {budget} tokens, ratio {recompute_ratio:g}{floor}")
    with torch.inference_mode(), _LayerLoader(ops, load_layer, plan, num_tokens, prefetch, clock) as loader:
        ctx = _Context(
            ids=token_ids.to(ops.device), positions=positions.to(ops.device),
            tail_ids=tail_ids.to(ops.device) if use_tail else None,
            tail_positions=(positions[-1] + 1 + torch.arange(tail_ids.shape[0])).to(ops.device) if use_tail else None,
            forced=None if forced is None else forced.to(ops.device),
            exact=None if exact is None else exact.to(ops.device),
        )
        attend = _Timer(attention or torch_attention(ctx.positions, ops.scaling), clock,
                        {"full_layers_s": "full_attention_s", "selective_layers_s": "selective_attention_s"})
        question = _QuestionScores(ops.scaling, selection.question_heads) if use_tail else None
        move = _Timer(lambda layer, k_pre: move_keys(ops, layer, k_pre, ctx.positions), clock, "move_keys_s")
        probe_emit = emit if written else None
        rows = _Timer(write_rows, clock, "cache_write_s") if written else None

        # the refinement (fast path): reused V [N, Hkv, D] of layers 1 .. R, and the candidates' V error [m]
        # summed over the layers they have been through
        reused_v: dict[int, torch.Tensor] = {}
        error: torch.Tensor | None = None
        if fast_path:
            # Layer 0's K/V of a token depend on that token alone, so the cached KV moved to the new
            # positions is layer 0's fresh KV: no context token is computed in full; the question tail
            # is probed from layer 0 on, and only the selected tokens are computed, from layer 0.
            if question is not None:
                with clock("question_probe_s"):
                    reused_v.update(_question_probe(ops, probe_layers, ctx, ops.embed(ctx.tail_ids), loader, move,
                                                    question, probe_emit, range(1, refine_at + 1) if refine else ()))
            with clock("select_s"):
                if budget_rule is not None and question is not None:
                    chosen = _adapt(ctx, question, budget_rule, recompute_ratio, min_recompute_tokens)
                    budget = chosen.tokens
                    candidate_budget = min(math.ceil(round(selection.candidates * budget, 9)), num_tokens - num_forced)
                    refine = refine and candidate_budget > budget
                selected = _select(ops, 0, ctx, candidate_budget if refine else budget, selection, deviation,
                                   segment_starts, None, None, question, scores_matter)  # [n]
            with clock("selective_layers_s"):
                hidden = ops.embed(ctx.ids[selected])  # [n, hidden]
        else:
            # 1. Before the check layer: plain prefill of all tokens (and the tail, if it is needed).
            with clock("full_layers_s"):
                hidden = ops.embed(ctx.ids if question is None else torch.cat([ctx.ids, ctx.tail_ids]))  # [N(+T), hidden]
                for layer in range(check_layer):
                    hidden = _full_layer(ops, layer, ctx, hidden, emit, attend, question)
            # 2. Check layer: fresh K/V of all tokens, the question probe, the selection.
            with clock("full_layers_s"):
                q, k, v, hidden_tail = _check_layer_kv(ops, check_layer, ctx, hidden, emit, question)
            k_pre_cached, v_cached = loader.get(check_layer)  # [N, Hkv, D] each
            if question is not None:
                with clock("question_probe_s"):
                    _question_probe(ops, probe_layers, ctx, hidden_tail, loader, move, question, probe_emit)
            with clock("select_s"):
                if budget_rule is not None and question is not None:
                    chosen = _adapt(ctx, question, budget_rule, recompute_ratio, min_recompute_tokens)
                    budget = chosen.tokens
                selected = _select(ops, check_layer, ctx, budget, selection, deviation, segment_starts, (k, v),
                                   (k_pre_cached, v_cached), question, scores_matter)  # [n]
            # 3. The selected tokens through the check layer's attention, then every later layer.
            with clock("selective_layers_s"):
                if selected.numel() > 0 and check_layer < num_layers - 1:
                    hidden = ops.finish_layer(check_layer, hidden[:ctx.n][selected],
                                              attend(check_layer, q[selected], selected, k, v))  # [n, hidden]
        recomputed = selected  # every token recomputed in some layer

        def refined(layer: int) -> None:  # the candidates -> the budget (timed as selection)
            nonlocal selected, hidden, recomputed
            t0 = time.perf_counter()
            selected, hidden = _refine(ops, ctx, layer, selected, hidden, reused_v[layer], error, question, budget,
                                       selection, segment_starts)
            recomputed = selected
            clock.inner("select_s", time.perf_counter() - t0)

        def observe(layer: int, fresh_v: torch.Tensor) -> None:  # a layer before R: add the candidates' V error
            nonlocal error
            t0 = time.perf_counter()
            e = value_error(fresh_v, reused_v[layer][selected])  # [m]
            error = e if error is None else error + e
            clock.inner("select_s", time.perf_counter() - t0)

        with clock("selective_layers_s"):
            for layer in selective_layers:
                if layer == depth_end and selected.numel() > 0:  # the rest keep their reused KV from here
                    if ctx.forced is None:
                        selected = selected[:0]
                    else:
                        keep = ctx.forced[selected]
                        selected, hidden = selected[keep], hidden[keep]
                # the layer before depth_end needs no output for tokens that stop there
                last = layer == num_layers - 1 or (layer == depth_end - 1 and ctx.forced is None)
                seen = observe if refine and 1 <= layer < refine_at else None  # the candidates' V error
                if layer in written:  # the probe wrote the reused KV: only the recomputed rows change
                    if refine and layer == refine_at:
                        refined(layer)
                    if selected.numel() > 0:
                        hidden = _selective_layer(ops, layer, ctx, hidden, selected, None, None, emit, attend, rows,
                                                  last=last, observe_v=seen)
                    continue
                k_pre, v_all = loader.get(layer)  # [N, Hkv, D] each (ours to modify)
                if refine and 1 <= layer <= refine_at:
                    reused_v[layer] = v_all  # read before the selective layer writes its rows
                if refine and layer == refine_at:
                    refined(layer)
                k_all = move(layer, k_pre)
                if selected.numel() > 0:
                    hidden = _selective_layer(ops, layer, ctx, hidden, selected, k_all, v_all, emit, attend, last=last,
                                              observe_v=seen)
                else:
                    emit(layer, k_all, v_all)
        _synchronize(ops.device)

    elapsed = time.perf_counter() - start
    write_s = emit.seconds + (rows.seconds if rows is not None else 0.0)
    return BlendResult(
        selected=recomputed,
        num_recomputed=int(recomputed.numel()),
        num_tokens=num_tokens,
        load_s=loader.wait_s,
        compute_s=elapsed - loader.wait_s - write_s,
        on_layer_s=write_s,
        stages=clock.seconds,
        recomputed_layers=depth_end if recomputed.numel() > 0 else 0,
        budget=chosen,
    )


def reuse_kv(
    ops: DecoderOps,
    positions: torch.LongTensor,
    load_layer: LoadLayer,
    on_layer: OnLayer,
    prefetch: bool = True,
) -> BlendResult:
    """The ``reuse`` mode: every layer's cached K moved to ``positions``, V as is, nothing recomputed.

    Args:
        ops: the model's per-layer callables (only ``rope`` is used).
        positions: ``[N]`` int64 absolute positions of the context tokens in the prompt.
        load_layer: ``layer -> (k_pre [N, Hkv, D], v [N, Hkv, D])``, called for every layer in order.
        on_layer: ``(layer, k [N, Hkv, D], v [N, Hkv, D]) -> None`` with K post-RoPE.
        prefetch: load layer i+1 in a background thread while layer i is moved.

    Returns:
        ``BlendResult`` with an empty ``selected`` and the load / compute / on_layer seconds.

    Raises:
        ValueError: if ``positions`` is empty or not 1-D, or ``load_layer`` returns the wrong shape.
    """
    if positions.dim() != 1 or positions.shape[0] == 0:
        raise ValueError(f"positions must be a non-empty [N] tensor, got shape {tuple(positions.shape)}")
    num_tokens = positions.shape[0]
    start = time.perf_counter()
    clock = _Stages()
    emit = _Timer(on_layer, clock, "cache_write_s")
    with torch.inference_mode(), _LayerLoader(ops, load_layer, range(ops.num_layers), num_tokens, prefetch,
                                              clock) as loader:
        positions = positions.to(ops.device)
        for layer in range(ops.num_layers):
            k_pre_cached, v_cached = loader.get(layer)  # [N, Hkv, D] each
            with clock("move_keys_s"):
                k = move_keys(ops, layer, k_pre_cached, positions)
            emit(layer, k, v_cached)
        _synchronize(ops.device)
        selected = torch.empty(0, dtype=torch.long, device=ops.device)
    elapsed = time.perf_counter() - start
    return BlendResult(
        selected=selected,
        num_recomputed=0,
        num_tokens=num_tokens,
        load_s=loader.wait_s,
        compute_s=elapsed - loader.wait_s - emit.seconds,
        on_layer_s=emit.seconds,
        stages=clock.seconds,
    )
