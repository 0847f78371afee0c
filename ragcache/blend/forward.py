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

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ragcache.blend.attention import causal_attention
from ragcache.blend.ops import DecoderOps
from ragcache.blend.rope import move_keys
from ragcache.blend.select import (
    Selection,
    check_mask,
    deviation_scores,
    hkvd_budget,
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
        on_layer_s: seconds spent inside the ``on_layer`` callbacks (e.g. writing a paged cache).
        stages: seconds per stage (blend): ``full_layers_s`` (every token through the layers up to
            the check layer's QKV), ``select_s`` (scores and selection), ``selective_attention_s``
            and ``selective_proj_mlp_s`` (the selected tokens' attention, and their projections,
            RoPE and MLP, from the check layer on), ``move_keys_s`` (RoPE of the reused K to the new
            positions), ``merge_s`` (writing the recomputed rows into the layer's K/V),
            ``load_wait_s`` (= load_s) and ``cache_write_s`` (= on_layer_s). On an accelerator
            the stage times include only the launch unless kernels finish within the stage.
    """

    selected: torch.LongTensor
    num_recomputed: int
    num_tokens: int
    load_s: float
    compute_s: float
    on_layer_s: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)


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
    ) -> None:
        self._ops = ops
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
        self.wait_s += time.perf_counter() - start
        return kv


class _Stages:
    """Seconds per named stage: ``with stages("name"): ...`` adds the block's wall time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._name: str | None = None
        self._t0 = 0.0

    def __call__(self, name: str) -> "_Stages":
        self._name = name
        return self

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds[self._name] = self.seconds.get(self._name, 0.0) + time.perf_counter() - self._t0


class _Timer:
    """Accumulates the seconds spent in ``on_layer``."""

    def __init__(self, on_layer: OnLayer) -> None:
        self._on_layer = on_layer
        self.seconds = 0.0

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        start = time.perf_counter()
        self._on_layer(layer, k, v)
        self.seconds += time.perf_counter() - start


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
            attn = causal_attention(q, positions, k, v, positions, ops.scaling)  # [T, Hq, D]
            hidden = ops.finish_layer(layer, hidden, attn)  # [T, hidden]
    return k_out, v_out


def blend_kv(
    ops: DecoderOps,
    token_ids: torch.LongTensor,
    positions: torch.LongTensor,
    load_layer: LoadLayer,
    *,
    recompute_ratio: float,
    check_layer: int,
    deviation: str,
    selection: Selection | None = None,
    tail_ids: torch.LongTensor | None = None,
    segment_starts: Sequence[int] = (0,),
    exact: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    on_layer: OnLayer,
    prefetch: bool = True,
) -> BlendResult:
    """CacheBlend: fuse the cached KV of the context tokens, recomputing only a selected share.

    Procedure (CacheBlend §4.2-4.3):

    1. Layers ``0 .. check_layer - 1``: a plain prefill of all N tokens (cached KV is not loaded).
       With ``tail_ids`` (the question tail that follows the context), the tail goes along, so
       its queries see the exact context of these layers.
    2. Layer ``check_layer``: fresh Q/K/V of all N tokens; the tokens to recompute are chosen by
       :func:`~ragcache.blend.select.select_tokens` under ``selection``: by KV deviation (the fresh
       V, or K with ``deviation="key"``, against the cached one), by the attention the question
       tail's queries give each context token, or a hybrid. For the question's attention the tail
       goes on alone through every later layer over the reused KV (moved to its positions), a
       probe as cheap as decoding T tokens; the scores are averaged over all layers (exact up to
       the check layer, over reused KV after it), in the spirit of ProphetKV (ICML'26). The
       layers the probe loaded are kept for step 3. Only the selected tokens' attention and MLP
       are computed.
    3. Layers ``check_layer + 1 ..``: only the selected tokens go forward. K = cached K moved to
       ``positions`` with the selected rows replaced by their fresh K, V likewise; the selected
       queries attend over all N keys with the exact causal mask by position.

    ``on_layer`` receives, for every layer, the final K (post-RoPE) and V of all N context tokens:
    fresh for layers ``<= check_layer``, fused afterwards (the tail's KV is never emitted: the
    engine prefills the tail itself). With ``recompute_ratio=1.0`` these equal ``compute_kv``'s
    output rotated to ``positions`` (up to float rounding); with ratio 0 and no forced tokens, the
    layers after the check layer equal ``reuse_kv``'s.

    Args:
        ops: the model's per-layer callables.
        token_ids: ``[N]`` int64 context token ids, in prompt order.
        positions: ``[N]`` int64 absolute positions of those tokens in the prompt.
        load_layer: ``layer -> (k_pre [N, Hkv, D], v [N, Hkv, D])`` cached KV of the context
            (rows of forced tokens are ignored and may hold anything finite). Called once per
            layer from ``check_layer`` on, in order; with ``prefetch`` from a background thread.
            The blend may write into the returned tensors: return tensors the caller owns.
        recompute_ratio: fraction of the N tokens to recompute, in ``[0, 1]``.
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
        prefetch: load layer i+1 in a background thread while layer i computes (the
            ``pipeline_overlap`` setting).

    Returns:
        ``BlendResult`` with the selected indices, the load / compute / on_layer seconds and the
        seconds per stage.

    Raises:
        ValueError: on empty or mismatched ``token_ids`` / ``positions`` / ``forced`` / ``exact``,
            a ratio outside ``[0, 1]``, a ``check_layer`` outside ``[0, num_layers)``, an unknown
            ``deviation``, a question-aware selection without ``tail_ids``, or ``load_layer``
            returning tensors of the wrong shape.
    """
    num_tokens = _check_positions(token_ids, positions)
    num_layers = ops.num_layers
    budget = hkvd_budget(recompute_ratio, num_tokens)  # validates the ratio
    if not 0 <= check_layer < num_layers:
        raise ValueError(f"check_layer must be in [0, {num_layers}), got {check_layer}")
    if deviation not in DEVIATIONS:
        raise ValueError(f"deviation must be one of {DEVIATIONS}, got {deviation!r}")
    selection = selection or Selection("deviation")
    check_mask(forced, num_tokens, "forced")
    check_mask(exact, num_tokens, "exact")
    use_tail = selection.needs_question
    if use_tail and (tail_ids is None or tail_ids.dim() != 1 or tail_ids.shape[0] == 0):
        raise ValueError(f"selection {selection.strategy!r} needs the question tail's token ids (tail_ids)")

    # With no budget, or a budget that covers every token, the choice does not depend on the scores:
    # skip the question probe (~3% of a ratio-1.0 blend) and score with zeros.
    num_forced = int(forced.sum()) if forced is not None else 0
    scores_matter = 0 < budget < num_tokens - num_forced
    use_tail = use_tail and scores_matter

    start = time.perf_counter()
    emit = _Timer(on_layer)
    clock = _Stages()
    layers_to_load = range(check_layer, num_layers)
    with torch.inference_mode(), _LayerLoader(ops, load_layer, layers_to_load, num_tokens, prefetch) as loader:
        token_ids = token_ids.to(ops.device)
        positions = positions.to(ops.device)
        n_ctx = num_tokens
        all_ids, all_pos = token_ids, positions
        if use_tail:
            tail_ids = tail_ids.to(ops.device)
            tail_pos = positions[-1] + 1 + torch.arange(tail_ids.shape[0], device=ops.device)
            all_ids, all_pos = torch.cat([token_ids, tail_ids]), torch.cat([positions, tail_pos])
        hidden = ops.embed(all_ids)  # [N(+T), hidden]
        attention_to_ctx = None  # [N] question scores summed over the layers seen so far

        def question_layer(q_tail: torch.Tensor, k_ctx: torch.Tensor, k_tail: torch.Tensor,
                           v_ctx: torch.Tensor | None = None, v_tail: torch.Tensor | None = None) -> torch.Tensor | None:
            """Add one layer's attention from the tail's queries to every context token's score;
            returns the tail's attention output when the values are given."""
            nonlocal attention_to_ctx
            out, s = question_attention(q_tail, k_ctx, k_tail, ops.scaling, v_ctx=v_ctx, v_tail=v_tail)
            attention_to_ctx = s if attention_to_ctx is None else attention_to_ctx + s
            return out

        # 1. Before the check layer: plain prefill of all tokens (and the tail, if it is needed).
        for layer in range(check_layer):
            with clock("full_layers_s"):
                q, k, v = ops.qkv(layer, hidden)  # [N(+T), Hq, D], [N(+T), Hkv, D], [N(+T), Hkv, D]
                q, k = ops.rope(layer, all_pos, q, k)
            emit(layer, k[:n_ctx], v[:n_ctx])
            with clock("full_layers_s"):
                if use_tail:
                    question_layer(q[n_ctx:], k[:n_ctx], k[n_ctx:])
                attn = causal_attention(q, all_pos, k, v, all_pos, ops.scaling)  # [N(+T), Hq, D]
                hidden = ops.finish_layer(layer, hidden, attn)  # [N(+T), hidden]

        # 2. Check layer: fresh K/V of all tokens, selection, then only the selected go on.
        k_pre_cached, v_cached = loader.get(check_layer)  # [N, Hkv, D] each
        with clock("full_layers_s"):
            q, k, v = ops.qkv(check_layer, hidden)
            q, k = ops.rope(check_layer, all_pos, q, k)
        emit(check_layer, k[:n_ctx], v[:n_ctx])
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (moved K, V), probed ahead
        scores = {}
        if use_tail:
            # The question probe (ProphetKV-style, fused over layers): the tail's queries go on
            # through every later layer over the reused KV (moved to its positions); each context
            # token is scored by the attention it receives, averaged over all layers.
            with clock("question_probe_s"):
                attn = question_layer(q[n_ctx:], k[:n_ctx], k[n_ctx:], v[:n_ctx], v[n_ctx:])  # [T, Hq, D]
                hidden_tail = ops.finish_layer(check_layer, hidden[n_ctx:], attn)  # [T, hidden]
            for layer in range(check_layer + 1, num_layers):
                k_pre_cached, v_cached_l = loader.get(layer)
                with clock("move_keys_s"):
                    held[layer] = (move_keys(ops, layer, k_pre_cached, positions), v_cached_l)
                with clock("question_probe_s"):
                    q_t, k_t, v_t = ops.qkv(layer, hidden_tail)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
                    q_t, k_t = ops.rope(layer, all_pos[n_ctx:], q_t, k_t)
                    attn = question_layer(q_t, held[layer][0], k_t, v_cached_l, v_t)  # [T, Hq, D]
                    if layer < num_layers - 1:
                        hidden_tail = ops.finish_layer(layer, hidden_tail, attn)
            scores["question"] = attention_to_ctx / num_layers
        with clock("select_s"):
            if not scores_matter:
                zeros = torch.zeros(n_ctx, device=ops.device)
                scores = {"question": zeros, "deviation": zeros} if selection.needs_question else {"deviation": zeros}
            elif selection.needs_deviation:
                if deviation == "value":
                    scores["deviation"] = deviation_scores(v_cached, v[:n_ctx])
                else:
                    k_cached = move_keys(ops, check_layer, k_pre_cached, positions)  # [N, Hkv, D]
                    scores["deviation"] = deviation_scores(k_cached, k[:n_ctx])
            selected = select_tokens(budget, selection, forced=forced, exact=exact,
                                     segment_starts=segment_starts, **scores)  # [n]
        q, k, v, hidden = q[:n_ctx], k[:n_ctx], v[:n_ctx], hidden[:n_ctx]
        num_selected = selected.shape[0]
        selected_positions = positions[selected]  # [n]
        if num_selected > 0 and check_layer < num_layers - 1:
            with clock("selective_attention_s"):
                attn = causal_attention(q[selected], selected_positions, k, v, positions, ops.scaling)  # [n, Hq, D]
            with clock("selective_proj_mlp_s"):
                hidden = ops.finish_layer(check_layer, hidden[selected], attn)  # [n, hidden]

        # 3. After the check layer: cached KV at the new positions, selected rows recomputed.
        for layer in range(check_layer + 1, num_layers):
            if layer in held:
                k_all, v_all = held.pop(layer)  # moved by the question probe
            else:
                k_pre_cached, v_all = loader.get(layer)  # [N, Hkv, D] each (ours to modify)
                with clock("move_keys_s"):
                    k_all = move_keys(ops, layer, k_pre_cached, positions)  # [N, Hkv, D]
            if num_selected > 0:
                with clock("selective_proj_mlp_s"):
                    q, k, v = ops.qkv(layer, hidden)  # [n, Hq, D], [n, Hkv, D], [n, Hkv, D]
                    q, k = ops.rope(layer, selected_positions, q, k)
                with clock("merge_s"):
                    k_all.index_copy_(0, selected, k)
                    v_all.index_copy_(0, selected, v)
                if layer < num_layers - 1:
                    with clock("selective_attention_s"):
                        attn = causal_attention(q, selected_positions, k_all, v_all, positions, ops.scaling)
                    with clock("selective_proj_mlp_s"):
                        hidden = ops.finish_layer(layer, hidden, attn)  # [n, hidden]
            emit(layer, k_all, v_all)
        _synchronize(ops.device)

    elapsed = time.perf_counter() - start
    stages = clock.seconds
    stages.update(load_wait_s=loader.wait_s, cache_write_s=emit.seconds)
    return BlendResult(
        selected=selected,
        num_recomputed=num_selected,
        num_tokens=num_tokens,
        load_s=loader.wait_s,
        compute_s=elapsed - loader.wait_s - emit.seconds,
        on_layer_s=emit.seconds,
        stages=stages,
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
    emit = _Timer(on_layer)
    clock = _Stages()
    with torch.inference_mode(), _LayerLoader(ops, load_layer, range(ops.num_layers), num_tokens, prefetch) as loader:
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
        stages={**clock.seconds, "load_wait_s": loader.wait_s, "cache_write_s": emit.seconds},
    )
