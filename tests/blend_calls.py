"""Blend calls written knob by knob, for the blend/ tests: a :class:`~ragcache.config.BlendKnobs`
record from the knobs a test sets (a :class:`~ragcache.strategies.Selection`, a
:class:`~ragcache.blend.select.BudgetRule`), the :class:`~ragcache.blend.BlendRequest` over it, and
``blend_kv`` of that request."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ragcache.blend import BlendRequest, BlendResult, BudgetRule, Selection, blend_kv
from ragcache.config import BlendKnobs, BlendSettings

#: BlendRequest's own fields (the rest of a call's keywords are knobs)
REQUEST_FIELDS = ("tail_ids", "segment_starts", "exact", "forced")


def knobs(*, recompute_ratio: float, check_layer: int, deviation: str, selection: Selection | None = None,
          min_recompute_tokens: int = 0, recompute_depth: float = 1.0,
          budget_rule: BudgetRule | None = None, propagate: float = 0.0,
          propagate_temperature: float = 0.05, propagate_from_depth: float = 0.0) -> BlendKnobs:
    """The record of these knobs (the settings' values for the rest); unvalidated, as a test may pass
    a value out of range to see the blend refuse it. ``selection`` default: deviation, CacheBlend's;
    ``budget_rule`` None: the fixed budget; ``propagate`` 0: no correction propagation."""
    sel = selection or Selection("deviation")
    values = {**BlendSettings().model_dump(), **{f.name: getattr(sel, f.name) for f in fields(Selection)}}
    values.update(selection=sel.strategy, probe_layers=-1 if sel.probe_layers is None else sel.probe_layers,
                  recompute_ratio=recompute_ratio, check_layer=check_layer, deviation=deviation,
                  min_recompute_tokens=min_recompute_tokens, recompute_depth=recompute_depth, budget="fixed",
                  propagate=propagate, propagate_temperature=propagate_temperature,
                  propagate_from_depth=propagate_from_depth)
    if budget_rule is not None:
        assert budget_rule.min_share == BudgetRule(mass_left=0.5).min_share, "min_share is no setting"
        values.update(budget="adaptive", mass_left=budget_rule.mass_left, max_recompute_ratio=budget_rule.max_ratio,
                      max_recompute_tokens=budget_rule.max_tokens)
    return BlendKnobs.model_construct(**values)


def blend_request(token_ids, positions, **given: Any) -> BlendRequest:
    """A :class:`BlendRequest` of ``token_ids`` at ``positions``; ``given``: its own fields
    (:data:`REQUEST_FIELDS`) and the knobs of :func:`knobs`."""
    own = {k: given.pop(k) for k in REQUEST_FIELDS if k in given}
    return BlendRequest(token_ids=token_ids, positions=positions, knobs=knobs(**given), **own)


def blend_of(ops, token_ids, positions, load_layer, *, on_layer, attention=None, write_rows=None, prefetch=True,
             **given: Any) -> BlendResult:
    """``blend_kv`` of :func:`blend_request` ``(token_ids, positions, **given)``."""
    return blend_kv(ops, blend_request(token_ids, positions, **given), load_layer, on_layer=on_layer,
                    attention=attention, write_rows=write_rows, prefetch=prefetch)
