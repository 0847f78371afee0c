"""What one blend will do, decided before any tensor is touched: the pure plan of a blend.

Owns: :class:`BlendPlan` and :func:`plan_blend` (the recompute budget a ratio gives, whether the
question is probed and through which layers, the fast path at check layer 0, the recompute depth,
the candidates' refinement, the order the cached layers are needed in; the depth's rule,
:func:`~ragcache.strategies.recompute_layers`, lives with the strategies, where the settings share
it). Everything here is plain integers and ranges: a plan can be made and checked without a model,
and the layer-wise forward (:mod:`ragcache.blend.forward`) only executes it. The one decision a
plan leaves open is the budget after the question probe (:func:`ragcache.blend.forward.decide_budgets`),
because it depends on the question's attention.
Must not import vLLM, transformers, or anything above blend/ in ragcache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ragcache.blend.select import Budget, Selection, hkvd_budget
from ragcache.strategies import recompute_layers

#: what the KV deviation is measured on at the check layer
DEVIATIONS = ("value", "key")


@dataclass(frozen=True)
class BlendPlan:
    """The schedule of one blend (CacheBlend §4.2-4.3, with the question probe and refinement).

    Attributes:
        num_tokens: context tokens N.
        num_layers: the model's layers L.
        num_forced: tokens with no cached KV (always recomputed, outside the budget).
        fixed: the ratio's budget (``hkvd_budget``) and why; the adaptive budget may replace it after
            the probe.
        scores_matter: the budget is above 0 and below every choosable token, so which tokens are
            chosen depends on their scores (otherwise zeros stand for the scores and nothing is probed).
        probe: the question tail goes through ``probe_layers`` over the reused KV for its attention.
        fast_path: check layer 0 without a KV deviation to measure: no context token is computed in
            full (layer 0's fresh K/V of a token are its cached K/V moved), the probe starts at
            layer 0 and the selected tokens are computed from layer 0.
        check_layer: the layer where the tokens are chosen.
        depth_end: the selected tokens go through layers ``< depth_end`` (:func:`recompute_layers`;
            every layer when the choice does not depend on the scores); after it only forced ones.
        probe_end: the probe runs through layers ``< probe_end``.
        refine_at: the layer where the question's candidates are cut to the budget by impact, or
            None when the plan does not refine (not the fast path, no probe, one candidate per
            budget token, or a depth that ends first).
        candidates: candidates per budget token (``selection.candidates``).
    """

    num_tokens: int
    num_layers: int
    num_forced: int
    fixed: Budget
    scores_matter: bool
    probe: bool
    fast_path: bool
    check_layer: int
    depth_end: int
    probe_end: int
    refine_at: int | None
    candidates: float

    @property
    def first_selective(self) -> int:
        """The first layer where only the selected tokens are computed."""
        return 0 if self.fast_path else self.check_layer + 1

    @property
    def probe_layers(self) -> range:
        """The layers the question tail goes through alone, over the reused KV."""
        return range(self.first_selective, self.probe_end) if self.probe else range(0)

    @property
    def selective_layers(self) -> range:
        """The layers where only the selected tokens are computed."""
        return range(self.first_selective, self.num_layers)

    @property
    def schedule(self) -> tuple:
        """What blends run together in one pass must share (see :func:`~ragcache.blend.forward.blend_batch`):
        the layers computed in full, probed and refined in (budgets, depths and selections may differ)."""
        return (self.fast_path, self.check_layer, self.probe_layers, self.refine_at)

    def candidate_budget(self, tokens: int) -> int:
        """The question's candidates for a budget of ``tokens`` (never more than the choosable tokens)."""
        return min(math.ceil(round(self.candidates * tokens, 9)), self.num_tokens - self.num_forced)

    def refines(self, tokens: int) -> bool:
        """Whether, with a budget of ``tokens``, the candidates are cut at ``refine_at``."""
        return self.refine_at is not None and self.candidate_budget(tokens) > tokens

    def written_ahead(self, writes_rows: bool, propagate_from: int | None = None) -> frozenset[int]:
        """The probed layers the probe writes whole (``writes_rows``: the selective layers then write
        only their rows), short of ``propagate_from``: from that layer on, the reused rows take
        corrections (:mod:`ragcache.blend.propagate`), so the selective pass writes the layer whole."""
        if not writes_rows:
            return frozenset()
        return frozenset(layer for layer in self.probe_layers if propagate_from is None or layer < propagate_from)

    def load_order(self, writes_rows: bool, propagate_from: int | None = None) -> list[int]:
        """The cached layers in the order the blend needs them (see ``load_layer`` of
        :func:`~ragcache.blend.forward.blend_kv`): the check layer (unless the fast path skips it), the
        probed layers, then every selective layer the probe did not write whole (:meth:`written_ahead`)."""
        written = self.written_ahead(writes_rows, propagate_from)
        return (([] if self.fast_path else [self.check_layer]) + list(self.probe_layers)
                + [layer for layer in self.selective_layers if layer not in written])


def layers_for_every_token(check_layer: int, measures_deviation: bool) -> int:
    """How many layers, from the first, a blend runs for every context token: the check layer's
    ``check_layer + 1`` (a plain prefill up to it, then its fresh Q/K/V for all), or 0 on the fast path,
    check layer 0 with no KV deviation to measure, where a token's layer-0 K/V is its cached KV moved
    and the selected tokens start at layer 0 (:func:`plan_blend`)."""
    return 0 if check_layer == 0 and not measures_deviation else check_layer + 1


def plan_blend(*, num_tokens: int, num_layers: int, num_forced: int = 0, has_tail: bool, knobs: Any) -> BlendPlan:
    """The :class:`BlendPlan` of a blend of ``num_tokens`` context tokens on a model of ``num_layers``.

    Args:
        num_forced: tokens with no cached KV.
        has_tail: the question tail's token ids are given.
        knobs: the request's blend parameters (:class:`ragcache.config.BlendKnobs`, or any object
            with its attributes; see :class:`~ragcache.blend.forward.BlendRequest`): this reads
            ``recompute_ratio``, ``min_recompute_tokens``, ``recompute_depth``, ``check_layer``,
            ``deviation`` and the selection's knobs.

    Raises:
        ValueError: a ratio outside ``[0, 1]``, a negative ``min_recompute_tokens``, a
            ``recompute_depth`` outside ``(0, 1]``, a ``check_layer`` outside ``[0, num_layers)``, an
            unknown ``deviation``, selection knobs out of range, or a question-aware selection
            without the tail.
    """
    recompute_ratio, check_layer, recompute_depth = knobs.recompute_ratio, knobs.check_layer, knobs.recompute_depth
    deviation, selection = knobs.deviation, Selection.from_settings(knobs)
    budget = hkvd_budget(recompute_ratio, num_tokens, knobs.min_recompute_tokens)  # validates the ratio and the floor
    if not 0 <= check_layer < num_layers:
        raise ValueError(f"check_layer must be in [0, {num_layers}), got {check_layer}")
    if not 0.0 < recompute_depth <= 1.0:
        raise ValueError(f"recompute_depth must be in (0, 1], got {recompute_depth}")
    if deviation not in DEVIATIONS:
        raise ValueError(f"deviation must be one of {DEVIATIONS}, got {deviation!r}")
    if selection.needs_question and not has_tail:
        raise ValueError(f"selection {selection.strategy!r} needs the question tail's token ids (tail_ids)")
    floor = " (blend.min_recompute_tokens)" if budget > math.ceil(round(recompute_ratio * num_tokens, 9)) else ""
    fixed = Budget(tokens=budget, centre=budget, reason=f"fixed: {budget} tokens, ratio {recompute_ratio:g}{floor}")
    # With no budget, or a budget that covers every token, the choice does not depend on the scores:
    # skip the question probe (~3% of a ratio-1.0 blend) and score with zeros.
    scores_matter = 0 < budget < num_tokens - num_forced
    probe = selection.needs_question and scores_matter
    depth_end = recompute_layers(recompute_depth, num_layers, check_layer) if scores_matter else num_layers
    fast_path = layers_for_every_token(check_layer, selection.needs_deviation and scores_matter) == 0
    probe_end = num_layers if selection.probe_layers is None else check_layer + 1 + selection.probe_layers
    plan = BlendPlan(num_tokens=num_tokens, num_layers=num_layers, num_forced=num_forced, fixed=fixed,
                     scores_matter=scores_matter, probe=probe, fast_path=fast_path, check_layer=check_layer,
                     depth_end=depth_end, probe_end=min(probe_end, num_layers), refine_at=None,
                     candidates=selection.candidates)
    refine_at = selection.refine_layer
    if fast_path and probe and depth_end > refine_at and plan.candidate_budget(budget) > budget:
        plan = replace(plan, refine_at=refine_at)
    return plan
