"""Layer-wise forwards over ``DecoderOps``: chunk KV precompute, CacheBlend, and plain reuse.

Owns: ``compute_kv`` (a plain prefill that returns pre-RoPE K and V, optionally after a lead-in
whose KV was computed once: ``lead_in_kv``, :class:`LeadIns`), ``blend_batch`` (CacheBlend's
selective recompute for every blend of an engine step in one pass) and ``blend_kv`` (one blend),
``reuse_kv`` (cached KV moved to its new positions, nothing recomputed), :class:`BlendRequest`,
:class:`BlendResult`, and the phases a blend's plan (:mod:`ragcache.blend.plan`) is executed in.
Must not import vLLM, transformers, or anything above blend/ in ragcache.

CacheBlend (Yao et al., EuroSys'25): the KV of each retrieved chunk was computed without the other
chunks in view, so its cross-chunk attention is missing. Recomputing the KV of a small set of
high-KV-deviation (HKVD) tokens in every layer and reusing the rest restores most of it (§4.2
"selective KV recompute"); the HKVD tokens are chosen once, at an early check layer where every
token is computed in full (§4.3); loading the KV of the next layer overlaps with recomputing the
current one (§5, pipelining KV loading and recompute; :mod:`ragcache.blend.reused`).

A blend is a plan (:func:`~ragcache.blend.plan.plan_blend`: budget, probe, depth, refinement) run in
phases, each a short function here taking the pass's state (:class:`_Pass`: the model, the blends
with their plans and budgets, the rows, the reused KV, the callbacks, the clock):
:func:`_prefill_to_check` (the layers before the check layer for every token, and the check layer's
fresh KV), :func:`_probe` (the question tail alone over the reused KV), :func:`decide_budgets` (each
blend's budget after the probe, as its parameters say), :func:`_select` / :class:`_Refinement`
(which tokens), and :func:`_selective_layers` (only those tokens, in every later layer; with
``knobs.propagate`` their corrections spread to the tokens left reused,
:mod:`ragcache.blend.propagate`). Several
blends of one engine step run as one pass (:func:`blend_batch`): their context tokens are
concatenated, projections and MLP run on all their selected tokens at once, the attention is one
call of the engine's varlen kernel, and the number of operators a pass dispatches does not grow with
its requests, chunks or runs (:mod:`ragcache.blend.opcount`).

Tensors handed to ``on_layer`` are created under ``torch.inference_mode()`` and may alias what
``load_layer`` returned: copy them out (e.g. into the engine's paged cache), do not modify them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ragcache.blend.attention import Attention, masked_attention, torch_attention
from ragcache.blend.ops import DecoderOps
from ragcache.blend.plan import DEVIATIONS, BlendPlan, plan_blend, recompute_layers
from ragcache.blend.propagate import Propagation
from ragcache.blend.reused import CachedKV, LoadLayer, open_reused
from ragcache.blend.select import (
    Budget,
    BudgetRule,
    Selection,
    TailMasks,
    adaptive_budget,
    check_mask,
    deviation_scores,
    impact_scores,
    select_grouped,
    tail_attention,
    value_error,
)
from ragcache.blend.stages import StageClock, Timed, synchronize

__all__ = ["DEVIATIONS", "BlendRequest", "BlendResult", "CachedKV", "LoadLayer", "OnLayer", "WriteRows", "blend_batch",
           "blend_kv", "compute_kv", "decide_budgets", "LeadInKV", "LeadIns", "lead_in_kv", "recompute_layers", "reuse_kv"]

OnLayer = Callable[[int, torch.Tensor, torch.Tensor], None]
"""``on_layer(layer, k [N, Hkv, D], v [N, Hkv, D])``: the final K (post-RoPE) and V of every context
token in one layer, called once per layer in layer order (for a batch: every request's rows, in order)."""

WriteRows = Callable[[int, torch.LongTensor, torch.Tensor, torch.Tensor], None]
"""``write_rows(layer, index [n], k [n, Hkv, D], v [n, Hkv, D])``: overwrite the rows ``index``
(int64, ascending) of ``layer``'s K (post-RoPE) and V where ``on_layer`` already wrote the whole layer."""


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
            the stage. In a batched pass every request reports the pass's times (what it waited).
        batch: how many blends ran in the same pass (1 alone).
        attention_pairs: the query-key pairs the selective attention computed, summed over its
            layers: each recomputed query with the keys at or before it in its own context (the
            causal work; ``selective_attention_s`` over it is the attention's cost per pair, to set
            against a full prefill's). In a batched pass, the pass's pairs (as its times). 0 for
            ``reuse_kv``.
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
    batch: int = 1
    attention_pairs: int = 0


def _check_positions(token_ids: torch.Tensor, positions: torch.Tensor) -> int:
    if token_ids.dim() != 1 or token_ids.shape[0] == 0:
        raise ValueError(f"token_ids must be a non-empty [N] tensor, got shape {tuple(token_ids.shape)}")
    if positions.shape != token_ids.shape:
        raise ValueError(f"positions {tuple(positions.shape)} do not match token_ids {tuple(token_ids.shape)}")
    return token_ids.shape[0]


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (no operator when it is there already)."""
    return t if t.device == torch.device(device) else t.to(device)


def _cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


def _qkv_rope(ops: DecoderOps, layer: int, hidden: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ops.qkv`` with q and k rotated to ``positions``: the adapter's ``qkv_rope`` where it has one
    (rotated where the projection wrote them), else ``qkv`` then ``rope``."""
    fused = getattr(ops, "qkv_rope", None)
    if fused is not None:
        return fused(layer, hidden, positions)
    q, k, v = ops.qkv(layer, hidden)
    q, k = ops.rope(layer, positions, q, k)
    return q, k, v


@dataclass(frozen=True, eq=False)
class LeadInKV:
    """The KV of a lead-in (the tokens chunk KV is computed after), computed once and attended to
    by every chunk computed after it (:func:`compute_kv` with ``lead_in=``), so a chunk's precompute
    costs its own tokens' projections and MLP, not the lead-in's again (a prefix cache, as vLLM's
    automatic prefix caching shares a prompt's common head).

    Attributes:
        token_ids: the lead-in's token ids (what it was computed from; positions ``0 .. P-1``).
        k: ``[L - 1, P, Hkv, D]`` K rotated to positions ``0 .. P-1``, every layer but the last
            (the last layer's KV is never attended to by a prefill that returns only KV).
        v: ``[L - 1, P, Hkv, D]`` V, the same layers.
    """

    token_ids: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        """P, the lead-in's tokens."""
        return len(self.token_ids)


def lead_in_kv(ops: DecoderOps, token_ids: Sequence[int], attention: Attention | None = None) -> LeadInKV:
    """Prefill ``token_ids`` at positions ``0 .. P-1`` once and keep every layer's K (rotated) and V
    for chunks computed after it (:class:`LeadInKV`).

    Args:
        ops: the model's per-layer callables.
        token_ids: the lead-in's P token ids (P >= 1).
        attention: the causal attention (as :func:`compute_kv`'s).

    Raises:
        ValueError: if ``token_ids`` is empty.
    """
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    k, v = _prefill(ops, ids, torch.arange(len(ids)), 0, attention, None, keep_rotated=True)
    return LeadInKV(tuple(int(t) for t in token_ids), k, v)


class LeadIns:
    """The KV of the few most recent lead-ins (:func:`lead_in_kv`), each computed on first use: one
    per prompt head and KV context in use, so every chunk computed after one reuses its KV.

    Args:
        ops: the model's per-layer callables.
        attention: the causal attention the lead-ins are computed with (as :func:`compute_kv`'s).
        kept: how many lead-ins are kept (the least recently used goes first).
    """

    def __init__(self, ops: DecoderOps, attention: Attention | None = None, kept: int = 4):
        self.ops, self.attention, self.kept = ops, attention, kept
        self._kv: dict[tuple[int, ...], LeadInKV] = {}  # oldest first

    def get(self, token_ids: Sequence[int]) -> LeadInKV:
        """The lead-in's :class:`LeadInKV`, computed now if it is not kept."""
        key = tuple(token_ids)
        kv = self._kv.pop(key, None) or lead_in_kv(self.ops, key, attention=self.attention)
        self._kv[key] = kv
        while len(self._kv) > self.kept:
            self._kv.pop(next(iter(self._kv)))
        return kv


def compute_kv(
    ops: DecoderOps,
    token_ids: torch.LongTensor,
    positions: torch.LongTensor,
    keep_from: int = 0,
    attention: Attention | None = None,
    lead_in: LeadInKV | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain layer-wise prefill of ``token_ids`` at ``positions``; returns their pre-RoPE K and V.

    Every token attends causally to all earlier tokens (exact full prefill). Used to precompute a
    chunk's KV after a canonical lead-in and to compute a chunk whose KV is missing at query time:
    either the lead-in is part of ``token_ids`` (``keep_from = len(lead_in)`` drops its KV) or it
    was computed once (``lead_in``: :func:`lead_in_kv`) and ``token_ids`` are the chunk's alone,
    attending to the lead-in's cached KV (the same arithmetic up to float rounding: the chunk's
    rows go through the projections without the lead-in's beside them).

    Args:
        ops: the model's per-layer callables.
        token_ids: ``[T]`` int64 token ids.
        positions: ``[T]`` int64 absolute positions (usually ``start + arange(T)``); with
            ``lead_in``, after it (every position ``>= lead_in.length``).
        keep_from: index of the first token whose KV is returned, in ``[0, T)``.
        attention: the causal attention (:data:`~ragcache.blend.attention.Attention`; called with
            the queries of ``token_ids`` and the layer's K/V, the lead-in's rows first when there is
            one, nothing written before it: it must use the ``k``/``v`` it is handed); default
            :func:`~ragcache.blend.attention.torch_attention`.
        lead_in: the cached KV of the tokens before ``token_ids`` (positions ``0 .. P-1``), or None.

    Returns:
        ``(k_pre, v)``, each ``[num_layers, T - keep_from, Hkv, D]`` on ``ops.device`` in
        ``ops.dtype``; K before RoPE (rotate with ``move_keys`` to place it).

    Raises:
        ValueError: if ``token_ids`` is empty or not 1-D, ``positions`` has another shape or (with
            ``lead_in``) overlaps the lead-in, or ``keep_from`` is outside ``[0, T)``.
    """
    return _prefill(ops, token_ids, positions, keep_from, attention, lead_in, keep_rotated=False)


def _prefill(ops: DecoderOps, token_ids: torch.LongTensor, positions: torch.LongTensor, keep_from: int,
             attention: Attention | None, lead_in: LeadInKV | None, keep_rotated: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_kv`'s loop; with ``keep_rotated`` the K it returns is rotated and the last
    layer is left out (:func:`lead_in_kv`)."""
    num_tokens = _check_positions(token_ids, positions)
    if not 0 <= keep_from < num_tokens:
        raise ValueError(f"keep_from must be in [0, {num_tokens}), got {keep_from}")
    before = 0 if lead_in is None else lead_in.length
    if before and int(positions.min()) < before:
        raise ValueError(f"positions start at {int(positions.min())}, inside the lead-in's {before} tokens")
    num_layers = ops.num_layers
    with torch.inference_mode():
        token_ids = token_ids.to(ops.device)
        positions = positions.to(ops.device)
        if attention is None:
            every = positions if not before else torch.cat([torch.arange(before, device=ops.device), positions])
            attention = torch_attention(every, ops.scaling)
        queries = torch.arange(before, before + num_tokens, device=ops.device)  # their rows among the keys
        kept = num_layers - 1 if keep_rotated else num_layers
        shape = (kept, num_tokens - keep_from, ops.num_kv_heads, ops.head_dim)
        k_out = torch.empty(shape, device=ops.device, dtype=ops.dtype)  # [L, T', Hkv, D]
        v_out = torch.empty(shape, device=ops.device, dtype=ops.dtype)  # [L, T', Hkv, D]

        hidden = ops.embed(token_ids)  # [T, hidden]
        for layer in range(num_layers):
            q, k, v = ops.qkv(layer, hidden)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
            if not keep_rotated:
                k_out[layer] = k[keep_from:]
                v_out[layer] = v[keep_from:]
            if layer == num_layers - 1:
                break  # the last layer's output is not part of any KV
            q, k = ops.rope(layer, positions, q, k)
            if keep_rotated:
                k_out[layer] = k[keep_from:]
                v_out[layer] = v[keep_from:]
            if before:
                k = torch.cat([lead_in.k[layer], k])  # [P + T, Hkv, D]
                v = torch.cat([lead_in.v[layer], v])
            attn = attention(layer, q, queries, k, v)  # [T, Hq, D]
            hidden = ops.finish_layer(layer, hidden, attn)  # [T, hidden]
    return k_out, v_out


@dataclass(frozen=True, eq=False)
class BlendRequest:
    """One blend's inputs: the context, the question tail, where its chunks start, which tokens are
    exact or forced, and the request's blend parameters.

    Attributes:
        token_ids: ``[N]`` int64 context token ids, in prompt order.
        positions: ``[N]`` int64 absolute positions of those tokens in the prompt (ascending).
        knobs: the request's blend parameters, read by attribute (:class:`ragcache.config.BlendKnobs`,
            or any object with its attributes): ``recompute_ratio`` in [0, 1], ``min_recompute_tokens``
            (with a ratio above 0, at least this many tokens, all N when fewer;
            :func:`~ragcache.blend.select.hkvd_budget`), ``recompute_depth`` in (0, 1] (the share
            of layers, from the first, the selected tokens are recomputed in; applies only when a
            selection is made), ``check_layer`` in ``[0, num_layers)``, ``deviation`` (``"value"``
            or ``"key"``), the selection's knobs (:meth:`ragcache.strategies.Selection.from_settings`)
            and the budget's (``budget``, ``mass_left``, ``max_recompute_ratio``,
            ``max_recompute_tokens``).
        tail_ids: ``[T]`` int64 ids of the tokens after the context (the question and the
            assistant-turn opening), at positions ``positions[-1] + 1 ..``; needed by question-aware
            selection, ignored otherwise.
        segment_starts: first index of each cached segment in the context (ascending, from 0).
        exact: ``[N]`` bool, tokens whose cached KV is already exact (the prompt head, a chunk at its
            canonical place): recomputed only when the budget exceeds every other token.
        forced: ``[N]`` bool, True for tokens with no cached KV (always recomputed), or None.
        selection: the knobs' :class:`~ragcache.strategies.Selection` (derived).
        budget_rule: the adaptive budget's :class:`~ragcache.blend.select.BudgetRule` where
            ``knobs.budget`` is ``"adaptive"``, else None: the ratio's budget (derived; applies
            with question scores, :func:`decide_budgets`).

    Raises (on construction):
        ValueError: empty or mismatched ``token_ids`` / ``positions`` / ``forced`` / ``exact``, or
            selection knobs out of range.
    """

    token_ids: torch.LongTensor
    positions: torch.LongTensor
    knobs: Any
    tail_ids: torch.LongTensor | None = None
    segment_starts: Sequence[int] = (0,)
    exact: torch.Tensor | None = None
    forced: torch.Tensor | None = None
    selection: Selection = field(init=False)
    budget_rule: BudgetRule | None = field(init=False)

    def __post_init__(self) -> None:
        n = _check_positions(self.token_ids, self.positions)
        check_mask(self.forced, n, "forced")
        check_mask(self.exact, n, "exact")
        k = self.knobs
        object.__setattr__(self, "selection", Selection.from_settings(k))
        object.__setattr__(self, "budget_rule", BudgetRule(k.mass_left, k.max_recompute_ratio,
                                                           max_tokens=k.max_recompute_tokens)
                           if k.budget == "adaptive" else None)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def plan(self, num_layers: int) -> BlendPlan:
        """This blend's :class:`~ragcache.blend.plan.BlendPlan` on a model of ``num_layers``.

        Raises:
            ValueError: see :func:`~ragcache.blend.plan.plan_blend`.
        """
        tail = self.tail_ids
        return plan_blend(num_tokens=self.num_tokens, num_layers=num_layers,
                          num_forced=int(self.forced.sum()) if self.forced is not None else 0,
                          has_tail=tail is not None and tail.dim() == 1 and tail.shape[0] > 0, knobs=self.knobs)

    def pass_key(self, num_layers: int) -> tuple:
        """Blends with equal keys can run in one pass of :func:`blend_batch`: the same layers computed
        in full, probed and refined in, the same selection and deviation."""
        return (self.plan(num_layers).schedule, self.selection, self.knobs.deviation)


class _Batch:
    """The blends of one pass on the compute device: their context tokens one after another (the
    pass's "rows": request r owns rows ``starts[r] .. starts[r + 1]``), and their question tails."""

    def __init__(self, ops: DecoderOps, requests: Sequence[BlendRequest], probe: bool) -> None:
        device = ops.device
        self.size = len(requests)
        self.sizes = [r.num_tokens for r in requests]
        self.starts = [0]
        for size in self.sizes:
            self.starts.append(self.starts[-1] + size)
        self.n = self.starts[-1]
        self.starts_t = torch.tensor(self.starts, device=device)
        self.ids = _on(_cat([r.token_ids for r in requests]), device)
        self.positions = _on(_cat([r.positions for r in requests]), device)
        self.forced, self.exact = (self._mask([getattr(r, name) for r in requests], device) for name in ("forced", "exact"))
        self.segment_starts = [list(r.segment_starts) for r in requests]
        self.everything = torch.arange(self.n, device=device)
        self.tail_sizes = [r.tail_ids.shape[0] for r in requests] if probe else []
        self.tail_ids = self.tail_positions = self.all_positions = None
        if probe:  # tail token j of request r sits at its context's last position + 1 + j
            self.tail_ids = _on(_cat([r.tail_ids for r in requests]), device)
            sizes = torch.tensor(self.tail_sizes, device=device)
            first = torch.cumsum(sizes, 0) - sizes
            last = self.positions[self.starts_t[1:] - 1]
            self.tail_positions = (last + 1 - first).repeat_interleave(sizes) + torch.arange(sum(self.tail_sizes),
                                                                                            device=device)
            self.all_positions = torch.cat([self.positions, self.tail_positions])  # rows, then tails

    def _mask(self, masks: list[torch.Tensor | None], device: torch.device) -> torch.Tensor | None:
        if all(m is None for m in masks):
            return None
        return _on(_cat([torch.zeros(n, dtype=torch.bool) if m is None else m for m, n in zip(masks, self.sizes)]),
                   device)

    def request_of(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n]`` int64: the request each of ``rows`` belongs to."""
        return torch.searchsorted(self.starts_t[1:], rows, right=True)

    def split(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Ascending ``rows`` as each request's own token indices."""
        if self.size == 1:
            return [rows]
        cuts = torch.searchsorted(rows, self.starts_t).tolist()
        return [rows[a:b] - lo for a, b, lo in zip(cuts[:-1], cuts[1:], self.starts)]


class _QuestionProbe:
    """The attention the question tails give the context rows, summed over the layers probed
    (:func:`~ragcache.blend.select.tail_attention` over the requests padded to the longest)."""

    def __init__(self, ops: DecoderOps, batch: _Batch, heads: str) -> None:
        device = ops.device
        self.scaling = ops.scaling
        self.size = batch.size
        sizes, tails = torch.tensor(batch.sizes, device=device), torch.tensor(batch.tail_sizes, device=device)
        n_max, t_max = max(batch.sizes), max(batch.tail_sizes)
        self.masks = TailMasks.of(sizes, tails, n_max, t_max, ops.num_heads, ops.num_heads // ops.num_kv_heads, heads,
                                  ops.dtype, device)
        if batch.size > 1:  # padded positions read a real row (masked out), so no gather reads past the end
            j, t = torch.arange(n_max, device=device), torch.arange(t_max, device=device)
            self.ctx_index = batch.starts_t[:-1, None] + j.minimum(sizes[:, None] - 1)  # [R, N]
            self.ctx_valid = j < sizes[:, None]
            tail_first = torch.cumsum(tails, 0) - tails
            self.tail_index = tail_first[:, None] + t.minimum(tails[:, None] - 1)  # [R, T]
            self.tail_rows = torch.arange(batch.size * t_max, device=device).view(batch.size, t_max)[
                t < tails[:, None]]  # [sum T]: the real tail rows of [R * T]
        self.total: torch.Tensor | None = None  # [R, N] float32
        self.layers = 0
        self._mean: torch.Tensor | None = None

    def attend(self, q_tail: torch.Tensor, k_ctx: torch.Tensor, k_tail: torch.Tensor, v_ctx: torch.Tensor,
               v_tail: torch.Tensor) -> torch.Tensor:
        """The tails' attention output ``[sum T, Hq, D]`` over their contexts (rows ``[S, Hkv, D]``) and
        themselves (``[sum T, ...]``); adds the layer's scores."""
        if self.size == 1:
            out, scores = tail_attention(q_tail, torch.cat([k_ctx, k_tail]), torch.cat([v_ctx, v_tail]), self.scaling,
                                         self.masks)
        else:
            out, scores = tail_attention(
                q_tail[self.tail_index], torch.cat([k_ctx[self.ctx_index], k_tail[self.tail_index]], dim=1),
                torch.cat([v_ctx[self.ctx_index], v_tail[self.tail_index]], dim=1), self.scaling, self.masks)
        self.total = scores if self.total is None else self.total.add_(scores)
        self.layers += 1
        self._mean = None
        return out if self.size == 1 else out[self.tail_rows]

    def mean(self) -> torch.Tensor:
        """``[S]`` float32: each row's score averaged over the layers seen."""
        if self._mean is None:
            total = self.total / max(self.layers, 1)
            self._mean = total[0] if self.size == 1 else total[self.ctx_valid]
        return self._mean


@dataclass
class _Rows:
    """The rows the selective layers compute: ``rows`` ``[n]`` ascending, their residual stream
    ``hidden`` ``[n, ...]`` and ``positions`` ``[n]``, and (with a recompute depth) the layer each
    stops before, ``stop`` ``[n]``."""

    rows: torch.Tensor
    hidden: torch.Tensor
    positions: torch.Tensor
    stop: torch.Tensor | None = None

    def keep(self, mask: torch.Tensor) -> "_Rows":
        return _Rows(self.rows[mask], self.hidden[mask], self.positions[mask],
                     None if self.stop is None else self.stop[mask])


@dataclass
class _Checked:
    """What :func:`_prefill_to_check` leaves: the check layer's fresh ``q`` ``[S, Hq, D]``, ``k``, ``v``
    ``[S, Hkv, D]``, the residual stream entering it ``hidden`` ``[S(+T), ...]``, and its reused
    ``cached`` ``(k, v)`` (K moved)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    hidden: torch.Tensor
    cached: tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Blend:
    """One blend of a pass: its request, its plan, and the budget :func:`decide_budgets` chose (None
    before the choice)."""

    request: BlendRequest
    plan: BlendPlan
    budget: Budget | None = None

    @property
    def tokens(self) -> int:
        """The budget's context tokens."""
        return self.budget.tokens

    @property
    def refining(self) -> bool:
        """Its candidates are cut to the budget at the plan's refine layer (:meth:`BlendPlan.refines
        <ragcache.blend.plan.BlendPlan.refines>`)."""
        return self.plan.refines(self.budget.tokens)

    @property
    def chosen(self) -> int:
        """Tokens the selection takes: the question's candidates where it refines, else the budget."""
        return self.plan.candidate_budget(self.tokens) if self.refining else self.tokens


@dataclass
class _Pass:
    """The state of one pass of :func:`blend_batch`, handed whole to its phases.

    Attributes:
        ops: the model's per-layer callables.
        blends: the pass's blends in row order; they share the schedule, selection and deviation
            (:meth:`BlendRequest.pass_key`).
        batch: their rows and tails on the compute device.
        kv: the reused KV: ``kv.get(layer)`` -> ``(k, v)``, each ``[S, Hkv, D]``, K moved to the rows'
            positions (:func:`~ragcache.blend.reused.open_reused`).
        emit: ``on_layer``, timed as ``cache_write_s``.
        write_rows: ``write_rows`` (:data:`WriteRows`), timed as ``cache_write_s``.
        attend: the context's attention (:data:`~ragcache.blend.attention.Attention`), timed per stage.
        clock: the pass's seconds per stage.
        written: the probed layers that go to ``emit`` from the probe (the selective layers then hand
            only their rows to ``write_rows``; :meth:`~ragcache.blend.plan.BlendPlan.written_ahead`).
        question: the tails' attention over the rows where the plan probes, else None.
        checked: what :func:`_prefill_to_check` left; None on the fast path.
        refinement: the candidates' cut; None where no blend refines.
        propagation: the recomputed rows' corrections spread to the reused ones
            (:class:`~ragcache.blend.propagate.Propagation`); None where no blend propagates.
    """

    ops: DecoderOps
    blends: list[_Blend]
    batch: _Batch
    kv: Any
    emit: Timed
    write_rows: Timed
    attend: Attention
    clock: StageClock
    written: frozenset[int]
    question: _QuestionProbe | None = None
    checked: _Checked | None = None
    refinement: _Refinement | None = None
    propagation: Propagation | None = None

    @property
    def plan(self) -> BlendPlan:
        """The first blend's plan: its schedule is every blend's."""
        return self.blends[0].plan

    @property
    def selection(self) -> Selection:
        """The pass's selection (every blend's)."""
        return self.blends[0].request.selection


def _full_layer(p: _Pass, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """One layer for every context row (and the tails, when ``p.question`` scores them): fresh K/V of the
    context to ``p.emit``, the context's causal attention through ``p.attend``, the tails' over their
    contexts and themselves. ``hidden`` ``[S(+T), ...]`` -> the layer's output, same shape (§4.3: the
    layers up to the check layer are computed in full)."""
    ops, batch, question = p.ops, p.batch, p.question
    n = batch.n
    if question is None:
        q, k, v = _qkv_rope(ops, layer, hidden, batch.positions)  # [S, Hq, D], [S, Hkv, D], [S, Hkv, D]
        p.emit(layer, k, v)
        return ops.finish_layer(layer, hidden, p.attend(layer, q, batch.everything, k, v))
    q, k, v = _qkv_rope(ops, layer, hidden, batch.all_positions)  # [S+T, ...]
    k_ctx, v_ctx = k[:n], v[:n]
    p.emit(layer, k_ctx, v_ctx)
    attn = p.attend(layer, q[:n], batch.everything, k_ctx, v_ctx)  # [S, Hq, D]
    attn = torch.cat([attn, question.attend(q[n:], k_ctx, k[n:], v_ctx, v[n:])])  # [S+T, Hq, D]
    return ops.finish_layer(layer, hidden, attn)


def _probe(p: _Pass, hidden_tail: torch.Tensor, keep_v: Collection[int] = ()) -> dict[int, torch.Tensor]:
    """The question tails (``hidden_tail`` ``[T, hidden]`` entering the first probed layer) alone through
    the plan's probe layers over the reused KV of their contexts (ProphetKV-style scores fused over
    layers, ICML'26); no context token is computed. Each reused layer in ``p.written`` goes to
    ``p.emit`` (the selective layers then write only their rows). Returns the reused V ``[S, Hkv,
    D]`` of the probed layers in ``keep_v`` (for :class:`_Refinement`)."""
    ops, batch, question = p.ops, p.batch, p.question
    kept: dict[int, torch.Tensor] = {}
    for layer in p.plan.probe_layers:
        k, v = p.kv.get(layer)  # [S, Hkv, D], moved to the context's positions
        if layer in keep_v:
            kept[layer] = v
        if layer in p.written:
            p.emit(layer, k, v)
        q_t, k_t, v_t = _qkv_rope(ops, layer, hidden_tail, batch.tail_positions)  # [T, Hq, D], [T, Hkv, D] x2
        attn = question.attend(q_t, k, k_t, v, v_t)  # [T, Hq, D]
        if layer < ops.num_layers - 1:
            hidden_tail = ops.finish_layer(layer, hidden_tail, attn)
    return kept


def _prefill_to_check(p: _Pass) -> _Checked:
    """Layers ``0 .. check_layer - 1`` for every row (and the tails), the check layer's fresh Q/K/V of
    every row (K/V to ``p.emit``), then the question probe from the check layer on (§4.3)."""
    ops, batch, question = p.ops, p.batch, p.question
    n, layer = batch.n, p.plan.check_layer
    with p.clock("full_layers_s"):
        hidden = ops.embed(batch.ids if question is None else torch.cat([batch.ids, batch.tail_ids]))
        for i in range(layer):
            hidden = _full_layer(p, i, hidden)
        q, k, v = _qkv_rope(ops, layer, hidden, batch.positions if question is None else batch.all_positions)
        p.emit(layer, k[:n], v[:n])
        hidden_tail = None
        if question is not None:  # the tails go through the whole check layer
            attn_tail = question.attend(q[n:], k[:n], k[n:], v[:n], v[n:])  # [T, Hq, D]
            hidden_tail = ops.finish_layer(layer, hidden[n:], attn_tail)
    cached = p.kv.get(layer)
    if question is not None:
        with p.clock("question_probe_s"):
            _probe(p, hidden_tail)
    return _Checked(q[:n], k[:n], v[:n], hidden, cached)


def decide_budgets(p: _Pass) -> list[Budget]:
    """The recompute budget of each blend of the pass ``p``, in order, after the question probe.

    Executes the budget each request's parameters carry (decided upstream,
    :func:`ragcache.options.choose_budget`): a blend with a :class:`~ragcache.blend.select.BudgetRule`
    (``knobs.budget = "adaptive"``) and question scores gets the adaptive budget
    (:func:`~ragcache.blend.select.adaptive_budget`: the question's attention left on reused KV, over
    the tokens that may be chosen and whose KV moved, neither forced nor exact); every other blend
    keeps its plan's budget (the ratio's, ``hkvd_budget``).
    """
    question, batch = p.question, p.batch
    if question is None or all(b.request.budget_rule is None for b in p.blends):
        return [b.plan.fixed for b in p.blends]
    scores = question.mean()  # [S]
    movable = torch.ones(batch.n, dtype=torch.bool, device=scores.device)
    for mask in (batch.exact, batch.forced):
        if mask is not None:
            movable &= ~mask
    out = []
    for b, lo, hi in zip(p.blends, batch.starts[:-1], batch.starts[1:]):
        request = b.request
        if request.budget_rule is None:
            out.append(b.plan.fixed)
        else:
            out.append(adaptive_budget(scores[lo:hi], movable[lo:hi], ratio=request.knobs.recompute_ratio,
                                       min_tokens=request.knobs.min_recompute_tokens, rule=request.budget_rule))
    return out


def _select(p: _Pass) -> torch.Tensor:
    """``[n]`` ascending rows to recompute, each blend's :attr:`_Blend.chosen` of its own plus its forced
    ones (§4.3 and :func:`~ragcache.blend.select.select_grouped`): by the strategy's scores, which read
    the question's attention, the KV deviation at the check layer (the fresh V, or K with
    ``deviation="key"``, against the reused one), both or neither, as its record says
    (:mod:`ragcache.strategies`)."""
    ops, batch, selection, scores = p.ops, p.batch, p.selection, {}
    if not any(b.plan.scores_matter for b in p.blends):  # the choice cannot depend on the scores: zeros stand in
        zeros = torch.zeros(batch.n, device=ops.device)
        scores = {"deviation": zeros, **({"question": zeros} if selection.needs_question else {})}
    else:
        if selection.needs_question:
            scores["question"] = p.question.mean()
        if selection.needs_deviation:
            which = 1 if p.blends[0].request.knobs.deviation == "value" else 0
            scores["deviation"] = deviation_scores(p.checked.cached[which], (p.checked.k, p.checked.v)[which])
    return select_grouped([b.chosen for b in p.blends], selection, forced=batch.forced, exact=batch.exact,
                          segment_starts=batch.segment_starts, starts=batch.starts, device=ops.device, **scores)


class _Refinement:
    """Gradual filtering at layer ``at`` (CacheBlend §4.3, weighted by the question; fast path only):
    the question's candidates go through layers ``0 .. at - 1``, their reused V's error is summed over
    layers ``1 .. at`` (``reused_v`` by layer), and at ``at`` each refining blend keeps its budget
    among them by impact (:func:`~ragcache.blend.select.impact_scores`); the others keep every
    candidate (they have as many as their budget)."""

    def __init__(self, at: int, reused_v: dict[int, torch.Tensor]) -> None:
        self.at = at
        self.reused_v = reused_v
        self.error: torch.Tensor | None = None  # [m] float32

    def observe(self, layer: int, rows: torch.Tensor, fresh_v: torch.Tensor) -> None:
        """A layer before ``at``: add the candidates' V error there."""
        e = value_error(fresh_v, self.reused_v[layer][rows])  # [m]
        self.error = e if self.error is None else self.error + e

    def cut(self, p: _Pass, sel: _Rows) -> _Rows:
        """The candidates ``sel`` (entering layer ``at``) cut to each blend's budget (plus the forced)."""
        ops, batch = p.ops, p.batch
        _, _, fresh_v = ops.qkv(self.at, sel.hidden)  # [m, Hkv, D]
        total = value_error(fresh_v, self.reused_v[self.at][sel.rows])  # [m]
        if self.error is not None:
            total += self.error
        impact = impact_scores(p.question.mean(), sel.rows, total)
        # no exact mask here: it would rank an exact candidate below every non-candidate; an exact
        # token's reused V has no error, so its impact already ranks it last among the candidates
        final = select_grouped([b.tokens for b in p.blends], p.selection, question=impact, forced=batch.forced,
                               segment_starts=batch.segment_starts, starts=batch.starts)
        keep = torch.isin(sel.rows, final)
        # a run the question trimmed may be taken whole here: its tokens outside the candidates have not
        # been through the layers before, so the budget they held goes to the best remaining candidates
        request = batch.request_of(sel.rows)
        counts = [torch.bincount(r, minlength=batch.size) for r in (batch.request_of(final), request, request[keep])]
        short = counts[0].minimum(counts[1]) - counts[2]  # [R]
        if int(short.max()) > 0:
            rest = impact[sel.rows].masked_fill(keep, -1.0)
            order = torch.argsort(rest, descending=True, stable=True)
            order = order[torch.argsort(request[order], stable=True)]  # by request, best first
            rank = torch.empty_like(order)
            rank[order] = torch.arange(order.shape[0], device=order.device) - (torch.cumsum(counts[1], 0)
                                                                              - counts[1])[request[order]]
            keep |= rank < short[request]
        return sel.keep(keep)


def _selective_layer(p: _Pass, layer: int, sel: _Rows, reused: tuple[torch.Tensor, torch.Tensor] | None,
                     last: bool, observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None,
                     reused_k_pre: torch.Tensor | None = None) -> torch.Tensor:
    """One layer after the check layer for the selected rows only (§4.2, selective KV recompute).

    ``reused`` ``(k, v)``, each ``[S, Hkv, D]``, holds the reused KV at the new positions; the selected
    rows are replaced by their fresh K/V (in place), the layer's final K/V go to ``p.emit``, and the
    selected queries attend over them through ``p.attend``. With ``reused`` None the engine already
    holds the layer's reused KV (the question probe wrote it): only the selected rows go to
    ``p.write_rows``, and ``p.attend`` reads the layer back from the engine's cache (``k = v = None``).
    With ``p.propagation`` and ``reused_k_pre`` (``[S, Hkv, D]``, the reused K before RoPE) the rows
    left reused first take the selected rows' corrections (:class:`~ragcache.blend.propagate.Propagation`,
    timed as ``propagate_s``).
    Returns the rows' residual stream leaving the layer (with ``last``: no row needs it, only their
    K/V are written, and ``sel.hidden`` is returned). ``observe(layer, rows, v)`` sees the fresh V
    before any write.
    """
    ops = p.ops
    if reused_k_pre is None:
        q, k, v = _qkv_rope(ops, layer, sel.hidden, sel.positions)  # [n, Hq, D], [n, Hkv, D], [n, Hkv, D]
    else:
        q, k_pre, v = ops.qkv(layer, sel.hidden)
        q, k = ops.rope(layer, sel.positions, q, k_pre)
    if observe is not None:
        observe(layer, sel.rows, v)
    k_all, v_all = reused if reused is not None else (None, None)
    if reused_k_pre is not None:  # given with the layer's reused KV in hand
        t0 = time.perf_counter()
        p.propagation.apply_(sel.rows, k_pre, v, reused_k_pre, k_all, v_all, p.batch.positions,
                             lambda x, positions: ops.rope(layer, positions, None, x)[1], layer)
        p.clock.inner("propagate_s", time.perf_counter() - t0)
    if reused is None:
        p.write_rows(layer, sel.rows, k, v)
    else:
        k_all.index_copy_(0, sel.rows, k)
        v_all.index_copy_(0, sel.rows, v)
        p.emit(layer, k_all, v_all)
    if last:
        return sel.hidden
    return ops.finish_layer(layer, sel.hidden, p.attend(layer, q, sel.rows, k_all, v_all))


def _selective_layers(p: _Pass, sel: _Rows) -> torch.Tensor:
    """The selected rows through every layer from the plan's first selective layer (the fast path's
    refinement at its layer; each request's rows stop at its depth unless forced); returns every row
    recomputed in some layer."""
    ops, batch, plans, refine = p.ops, p.batch, [b.plan for b in p.blends], p.refinement
    num_layers, written = ops.num_layers, p.written
    stops = {q.depth_end for q in plans if q.depth_end < num_layers}
    forced = any(q.num_forced for q in plans)
    recomputed = sel.rows

    def observe(layer: int, rows: torch.Tensor, fresh_v: torch.Tensor) -> None:  # timed as selection
        t0 = time.perf_counter()
        refine.observe(layer, rows, fresh_v)
        p.clock.inner("select_s", time.perf_counter() - t0)

    for layer in p.plan.selective_layers:
        if layer in stops and sel.rows.numel() > 0:  # a request's rows keep their reused KV from here on
            if sel.stop is None:
                depth = torch.tensor([q.depth_end for q in plans], device=sel.rows.device)[batch.request_of(sel.rows)]
                sel.stop = depth if batch.forced is None else depth.masked_fill(batch.forced[sel.rows], num_layers)
            sel = sel.keep(sel.stop > layer)
        # no row needs an output after the model's last layer, nor after the last layer every row stops at
        last = layer == num_layers - 1 or not (forced or any(q.depth_end > layer + 1 for q in plans))
        reused = k_pre = None
        if layer not in written and p.propagation is not None and p.propagation.active(layer):
            k_pre, *reused = p.kv.get_pre(layer)  # [S, Hkv, D] each (K and V ours to modify)
        elif layer not in written:
            reused = p.kv.get(layer)  # [S, Hkv, D] each (ours to modify)
            if refine is not None and 1 <= layer <= refine.at:
                refine.reused_v[layer] = reused[1]  # read before the selective layer writes its rows
        if refine is not None and layer == refine.at:  # the candidates -> the budget (timed as selection)
            t0 = time.perf_counter()
            sel = refine.cut(p, sel)
            recomputed = sel.rows
            p.clock.inner("select_s", time.perf_counter() - t0)
        seen = observe if refine is not None and 1 <= layer < refine.at else None
        if sel.rows.numel() > 0:
            sel.hidden = _selective_layer(p, layer, sel, reused, last, seen, k_pre)
        elif reused is not None:
            p.emit(layer, *reused)
    return recomputed


class _PairCount:
    """An :data:`Attention` that also counts the causal query-key pairs of the calls made while
    ``stage`` is open in ``clock``: per query, the keys at or before it in its own request's rows.

    Counted on the device and read once (:meth:`total`); the count of an ``index`` is kept while the
    same tensor comes back (the selective layers pass one per selection).
    """

    def __init__(self, attend: Attention, batch: "_Batch", clock: StageClock, stage: str) -> None:
        self._attend, self._batch, self._clock, self._stage = attend, batch, clock, stage
        self._index: torch.Tensor | None = None
        self._pairs: torch.Tensor | None = None  # of self._index, int64 scalar
        self._sum: torch.Tensor | None = None

    def __call__(self, layer: int, q: torch.Tensor, index: torch.LongTensor, k: torch.Tensor | None,
                 v: torch.Tensor | None) -> torch.Tensor:
        if self._clock.current == self._stage:
            if self._index is not index:
                local = index if self._batch.size == 1 else index - self._batch.starts_t[self._batch.request_of(index)]
                self._index, self._pairs = index, (local + 1).sum()
            self._sum = self._pairs if self._sum is None else self._sum + self._pairs
        return self._attend(layer, q, index, k, v)

    def total(self) -> int:
        """The pairs counted so far."""
        return 0 if self._sum is None else int(self._sum)


def blend_batch(ops: DecoderOps, requests: Sequence[BlendRequest], load: LoadLayer | CachedKV, *, on_layer: OnLayer,
                attention: Attention | None = None, write_rows: WriteRows | None = None,
                prefetch: bool = True) -> list[BlendResult]:
    """CacheBlend for several blends in one pass (one engine step's), each as :func:`blend_kv` alone.

    The requests' context tokens are the pass's rows, request after request (``load``, ``on_layer``,
    ``write_rows`` and ``attention`` see every request's rows in that order; ``attention`` must keep
    each request's queries to its own rows, as vLLM's varlen kernel does with a block table per
    request, or :func:`~ragcache.blend.attention.torch_attention` given the requests' ``starts``).
    Projections and MLP run once per layer on every request's tokens; the question tails are probed
    together (padded to the longest); the selection is one grouped call. The operators a pass
    dispatches do not grow with its requests, chunks or runs (except with a chunk cap or chunk heads,
    chosen request by request, and torch's reference attention, one call per request).

    Args:
        requests: blends with equal :meth:`BlendRequest.pass_key` (group the others into passes of their own).
        load: the cached KV of every row: per layer (:data:`~ragcache.blend.reused.LoadLayer`, ``[S,
            Hkv, D]``) or every layer at once (:class:`~ragcache.blend.reused.CachedKV`).
        on_layer, attention, write_rows, prefetch: as :func:`blend_kv`.

    Returns:
        one :class:`BlendResult` per request, in order (indices within its own context).

    Raises:
        ValueError: as :func:`blend_kv`, or requests whose pass keys differ.
    """
    if not requests:
        return []
    blends = [_Blend(r, r.plan(ops.num_layers)) for r in requests]
    plan, first = blends[0].plan, requests[0]
    if any((b.plan.schedule, b.request.selection, b.request.knobs.deviation)
           != (plan.schedule, first.selection, first.knobs.deviation) for b in blends):
        raise ValueError("blends of one pass must share their schedule, selection and deviation "
                         "(group them by BlendRequest.pass_key)")
    start, clock = time.perf_counter(), StageClock()
    emit, rows = Timed(on_layer, clock, "cache_write_s"), Timed(write_rows, clock, "cache_write_s")
    with torch.inference_mode():
        batch = _Batch(ops, requests, plan.probe)
        propagation = Propagation.of(batch.starts, [r.knobs for r in requests], batch.exact, batch.forced,
                                     batch.segment_starts, num_layers=ops.num_layers)
        # a propagating selective layer corrects every reused row: it needs the layer in hand, so the
        # probe does not write it ahead and the layer is written whole
        writes = write_rows is not None and attention is not None
        propagate_from = None if propagation is None else propagation.start_layer
        with open_reused(ops, load, plan.load_order(writes, propagate_from), batch.positions, prefetch, clock,
                         keep_pre=propagation is not None) as kv:
            pairs = _PairCount(attention or _reference_attention(ops, batch), batch, clock, "selective_layers_s")
            attend = Timed(pairs, clock,
                           {"full_layers_s": "full_attention_s", "selective_layers_s": "selective_attention_s"})
            p = _Pass(ops, blends, batch, kv, emit, rows, attend, clock, plan.written_ahead(writes, propagate_from),
                      question=_QuestionProbe(ops, batch, first.selection.question_heads) if plan.probe else None,
                      propagation=propagation)
            reused_v = {}
            if plan.fast_path:
                # Layer 0's K/V of a token depend on that token alone, so the cached KV moved to the new
                # positions is layer 0's fresh KV: no context token is computed in full; the question tail
                # is probed from layer 0 on, and only the selected tokens are computed, from layer 0.
                if p.question is not None:
                    with clock("question_probe_s"):
                        keep_v = range(1, plan.refine_at + 1) if plan.refine_at is not None else ()
                        reused_v = _probe(p, ops.embed(batch.tail_ids), keep_v)
            else:
                p.checked = _prefill_to_check(p)
            with clock("select_s"):
                for b, budget in zip(blends, decide_budgets(p)):
                    b.budget = budget
                selected = _select(p)  # [n]
            with clock("selective_layers_s"):
                sel = _first_selective(p, selected)
                if any(b.refining for b in blends):
                    p.refinement = _Refinement(plan.refine_at, reused_v)
                recomputed = _selective_layers(p, sel)
            synchronize(ops.device)
        elapsed, write_s = time.perf_counter() - start, emit.seconds + rows.seconds
    attention_pairs = pairs.total()
    return [BlendResult(selected=part, num_recomputed=int(part.numel()), num_tokens=b.plan.num_tokens,
                        load_s=kv.wait_s, compute_s=elapsed - kv.wait_s - write_s, on_layer_s=write_s,
                        stages=dict(clock.seconds), recomputed_layers=b.plan.depth_end if part.numel() > 0 else 0,
                        budget=b.budget, batch=batch.size, attention_pairs=attention_pairs)
            for part, b in zip(batch.split(recomputed), blends)]


def _reference_attention(ops: DecoderOps, batch: _Batch) -> Attention:
    """blend/'s own attention where the engine hands none: on a CPU :func:`~ragcache.blend.attention.
    torch_attention` (blocks of queries, each over the keys it can see), elsewhere :func:`~ragcache.blend.
    attention.masked_attention` (one launch per layer for every request)."""
    fn = torch_attention if torch.device(ops.device).type == "cpu" else masked_attention
    return fn(batch.positions, ops.scaling, batch.starts)


def _first_selective(p: _Pass, selected: torch.Tensor) -> _Rows:
    """The ``selected`` rows entering the first selective layer: embedded (fast path), or through the
    check layer's attention over every row's fresh KV and the rest of that layer."""
    ops, batch, checked, layer = p.ops, p.batch, p.checked, p.plan.check_layer
    positions = batch.positions[selected]
    if checked is None:
        return _Rows(selected, ops.embed(batch.ids[selected]), positions)  # [n, hidden]
    hidden = checked.hidden[:batch.n][selected]
    if selected.numel() > 0 and layer < ops.num_layers - 1:
        hidden = ops.finish_layer(layer, hidden, p.attend(layer, checked.q[selected], selected, checked.k, checked.v))
    return _Rows(selected, hidden, positions)


def blend_kv(
    ops: DecoderOps,
    request: BlendRequest,
    load_layer: LoadLayer | CachedKV,
    *,
    on_layer: OnLayer,
    attention: Attention | None = None,
    write_rows: WriteRows | None = None,
    prefetch: bool = True,
) -> BlendResult:
    """CacheBlend: fuse the cached KV of the context tokens, recomputing only a selected share.

    Procedure (CacheBlend §4.2-4.3): a plan (:meth:`BlendRequest.plan`), then one phase function each
    (:func:`blend_batch` runs them, here for one blend):

    1. Layers ``0 .. check_layer - 1`` (:func:`_prefill_to_check`): a plain prefill of all N tokens (cached
       KV is not loaded). With ``tail_ids`` (the question tail that follows the context), the tail
       goes along, so its queries see the exact context of these layers.
    2. Layer ``check_layer``: fresh Q/K/V of all N tokens. For the
       question's attention the tail then goes on alone through every later layer over the reused
       KV (moved to its positions) (:func:`_probe`), a probe as cheap as decoding T
       tokens; the scores are averaged over all layers (exact up to the check layer, over reused KV
       after it), in the spirit of ProphetKV (ICML'26). The probed layers are not kept (the memory
       they held cost more in page faults): with ``write_rows`` each goes to ``on_layer`` as the
       probe leaves it and step 3 writes only the recomputed rows; without it step 3 loads and
       moves those layers again. The budget is decided after the probe
       (:func:`decide_budgets`: the ratio's, or the adaptive one where ``knobs.budget`` says so), and
       the tokens to recompute are chosen by :func:`_select` under the knobs' selection: by KV
       deviation (the fresh V, or K with ``deviation="key"``, against the cached one), by the
       attention the question tail gives each context token, or a hybrid, token by token or in runs
       (``granule``).
       Only the selected tokens' attention and MLP are computed.
    3. Layers ``check_layer + 1 ..`` (:func:`_selective_layers`): only the selected tokens go
       forward. K = cached K moved to ``positions`` with the selected rows replaced by their fresh
       K, V likewise; the selected queries attend over all N keys with the exact causal mask by
       position. With ``knobs.recompute_depth`` < 1 they stop after the first ``ceil(depth * L)`` layers
       and the later layers keep the reused KV (forced tokens, which have none, go on to the end).

    With ``knobs.check_layer`` 0 and no KV deviation to measure, steps 1-2 compute no context token in
    full: a token's layer-0 K/V depend on that token alone, so the cached KV moved to ``positions``
    is layer 0's fresh KV. The question probe starts at layer 0 and the selected tokens are
    computed from layer 0 (step 3 from layer 0), which saves a projection pass over all N tokens.
    There, with ``selection.candidates`` > 1, the question picks that many times the budget, they
    go through layers ``0 .. R - 1`` (R = ``selection.refine_layer``), and at layer R the budget is
    kept among them by impact (:class:`_Refinement`: the question's attention times their reused V's
    error summed over layers 1 .. R, CacheBlend's gradual filtering); only the kept tokens go on,
    the dropped ones keep the fresh KV of the layers they went through.

    Every attention over the context runs through ``attention`` (default: blend/'s own, :func:`torch_attention`
    on a CPU and :func:`~ragcache.blend.attention.masked_attention` elsewhere),
    right after ``on_layer`` (or ``write_rows``) received that layer's final K/V: an engine passes its
    own kernel over the cache ``on_layer`` writes. ``on_layer`` receives, for every layer, the final K (post-RoPE)
    and V of all N context tokens: fresh for layers ``<= check_layer`` (layer 0 on the fast path above:
    cached and moved, which is the fresh KV up to rounding), fused afterwards (the
    tail's KV is never emitted: the engine prefills the tail itself). With ``knobs.recompute_ratio = 1.0``
    these equal ``compute_kv``'s output rotated to ``positions`` (up to float rounding); with ratio
    0 and no forced tokens, the layers after the check layer equal ``reuse_kv``'s.

    Args:
        ops: the model's per-layer callables.
        request: the context, its question tail, its chunks and the request's blend parameters
            (:class:`BlendRequest`; the parameters' defaults live in one place,
            ``ragcache.config.BlendSettings``).
        load_layer: the cached KV of the context (rows of forced tokens are ignored and may hold
            anything finite): every layer at once (:class:`~ragcache.blend.reused.CachedKV`: K moved
            in place in one call, no layer loaded twice), or ``layer -> (k_pre [N, Hkv, D], v [N,
            Hkv, D])`` (:data:`~ragcache.blend.reused.LoadLayer`), called in
            :meth:`BlendPlan.load_order <ragcache.blend.plan.BlendPlan.load_order>`'s order (without
            ``write_rows`` a probed layer is loaded twice); with ``prefetch`` from a background thread.
            The blend may write into the returned tensors: return tensors the caller owns.
        on_layer: ``(layer, k [N, Hkv, D], v [N, Hkv, D]) -> None``, see above.
        attention: the context's causal attention (:data:`~ragcache.blend.attention.Attention`);
            default :func:`~ragcache.blend.attention.torch_attention` over ``positions`` on a CPU,
            :func:`~ragcache.blend.attention.masked_attention` on any other device.
        write_rows: ``(layer, index [n], k [n, Hkv, D], v [n, Hkv, D]) -> None`` (:data:`WriteRows`),
            overwriting rows of a layer ``on_layer`` wrote; give it only with an ``attention`` that
            reads K/V back from the engine's cache. Then a layer the question probe loaded goes to
            ``on_layer`` from the probe (reused KV moved), the selective pass writes only its
            recomputed rows and calls ``attention`` with ``k = v = None``: no layer is loaded or
            moved twice, and the result is the same.
        prefetch: load layer i+1 in a background thread while layer i computes (the
            ``pipeline_overlap`` setting).

    Returns:
        ``BlendResult`` with the selected indices, the budget, the load / compute / on_layer seconds
        and the seconds per stage.

    Raises:
        ValueError: as :func:`~ragcache.blend.plan.plan_blend` (a knob out of its range, a
            question-aware selection without ``tail_ids``), or ``load_layer`` returning tensors of
            the wrong shape.
    """
    return blend_batch(ops, [request], load_layer, on_layer=on_layer, attention=attention, write_rows=write_rows,
                       prefetch=prefetch)[0]


def reuse_kv(
    ops: DecoderOps,
    positions: torch.LongTensor,
    load_layer: LoadLayer | CachedKV,
    on_layer: OnLayer,
    prefetch: bool = True,
) -> BlendResult:
    """The ``reuse`` mode: every layer's cached K moved to ``positions``, V as is, nothing recomputed.

    Several requests' contexts one after another are reused alike (reuse needs no boundaries).

    Args:
        ops: the model's per-layer callables (only ``rope`` is used).
        positions: ``[N]`` int64 absolute positions of the context tokens in the prompt.
        load_layer: ``layer -> (k_pre [N, Hkv, D], v [N, Hkv, D])``, called for every layer in order,
            or every layer at once (:class:`~ragcache.blend.reused.CachedKV`).
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
    start, clock = time.perf_counter(), StageClock()
    emit = Timed(on_layer, clock, "cache_write_s")
    with torch.inference_mode():
        positions = _on(positions, ops.device)
        with open_reused(ops, load_layer, range(ops.num_layers), positions, prefetch, clock) as kv:
            for layer in range(ops.num_layers):
                emit(layer, *kv.get(layer))
            synchronize(ops.device)
        selected = torch.empty(0, dtype=torch.long, device=ops.device)
    elapsed = time.perf_counter() - start
    return BlendResult(selected=selected, num_recomputed=0, num_tokens=num_tokens, load_s=kv.wait_s,
                       compute_s=elapsed - kv.wait_s - emit.seconds, on_layer_s=emit.seconds, stages=clock.seconds)
