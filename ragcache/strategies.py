"""Blend's token-selection strategies: one record per strategy, and the knobs of a selection.

Owns: the registry of strategies (:data:`STRATEGIES`, :func:`register`, :func:`get`,
:func:`names`), each a :class:`Strategy` record saying what its scores need (the question tail's
attention, the KV deviation at the check layer), the layer ``blend.check_layer = "auto"`` resolves
to for it and the ``[blend]`` settings it reads; :class:`Selection`, the knobs one blend selects
with; and :func:`recompute_layers`, the recompute depth's rule. The settings
(:mod:`ragcache.config`), the engine's messages and worker, and the selection code in
:mod:`ragcache.blend.select` consult these records instead of comparing strategy names. The
strategies themselves (deviation, question, hybrid) are described in :mod:`ragcache.blend.select`.

Adding a strategy takes one record here and one score function in blend/::

    from ragcache.strategies import Strategy, register
    from ragcache.blend.select import score_function

    register(Strategy("first-tokens", check_layer=0))    # needs neither the question nor the deviation

    @score_function("first-tokens")
    def first_tokens(selection, scores):                 # [S] float32 >= 0, higher is chosen first
        return 1.0 / (1.0 + scores.offsets.float())

after which ``blend.selection = "first-tokens"``, a request's ``selection`` and the blend accept it
(tests/test_selection_registry.py does this). The registry is per process: vLLM's engine core and
workers run in processes of their own, so an engine serves a strategy only where the module that
registers it is imported in those processes too (as ragcache's own three are, with this module).

Imports nothing from ragcache and no torch: the settings import it, and blend/ builds on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

#: how question attention is pooled over the query heads (:func:`ragcache.blend.select.question_attention`)
QUESTION_HEADS = ("mean", "max")

#: ``[blend]`` settings every strategy's blend reads (the budget, the depth, the chunk structure, the runs)
COMMON_SETTINGS = ("min_recompute_tokens", "recompute_depth", "chunk_head_tokens", "max_chunk_share", "granule")
#: and those a strategy that measures the KV deviation reads
DEVIATION_SETTINGS = ("deviation",)
#: and those a strategy scored by the question's attention reads (the probe, the refinement, the budget)
QUESTION_SETTINGS = ("probe_layers", "question_heads", "candidates", "refine_layer", "budget")

#: a need: True, False, or a predicate of the selection's knobs (a :class:`Selection` or the
#: ``[blend]`` settings, read by attribute, e.g. ``question_weight``)
Need = bool | Callable[[Any], bool]


@dataclass(frozen=True)
class Strategy:
    """One token-selection strategy: what its scores need and which settings they read.

    Attributes:
        name: how settings, requests and the CLI name it (``blend.selection``, a request's
            ``selection``, ``--selection``); no ``/`` (``"question/16"`` adds a granule).
        question: its scores read the question tail's attention (the question probe): a bool or a
            predicate of the knobs (see :data:`Need`).
        deviation: its scores read the KV deviation at the check layer: a bool or a predicate.
        check_layer: the layer ``blend.check_layer = "auto"`` resolves to: 0 when the scores do not
            need the deviation (layer 0's KV moves exactly: no context token is computed in full),
            1 when they may (the deviation at layer 0 is zero; tokens have seen each other at 1).
        settings: the ``[blend]`` settings its scores read besides :data:`COMMON_SETTINGS` and those
            its needs bring in (:data:`DEVIATION_SETTINGS`, :data:`QUESTION_SETTINGS`), e.g. hybrid's
            ``question_weight``.
    """

    name: str
    question: Need = False
    deviation: Need = False
    check_layer: int = 1
    settings: tuple[str, ...] = ()

    def needs_question(self, knobs: Any) -> bool:
        """Whether a blend with ``knobs`` (a :class:`Selection` or the ``[blend]`` settings) scores by
        the question's attention."""
        return self.question(knobs) if callable(self.question) else bool(self.question)

    @property
    def may_read_question(self) -> bool:
        """Whether some knobs make its scores read the question's attention (False: no settings do,
        so a request asking for what only the question gives, the adaptive budget, contradicts it)."""
        return callable(self.question) or bool(self.question)

    def needs_deviation(self, knobs: Any) -> bool:
        """Whether a blend with ``knobs`` scores by the KV deviation at the check layer."""
        return self.deviation(knobs) if callable(self.deviation) else bool(self.deviation)

    def reads(self, knobs: Any) -> tuple[str, ...]:
        """The ``[blend]`` settings a blend with ``knobs`` reads (names without ``blend.``): what a
        calibration under other values of them does not hold for."""
        return (COMMON_SETTINGS + (DEVIATION_SETTINGS if self.needs_deviation(knobs) else ()) + self.settings
                + (QUESTION_SETTINGS if self.needs_question(knobs) else ()))


#: name -> record, in registration order (the order error messages and ``--help`` list them in)
STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` to :data:`STRATEGIES`; its score function goes in
    :data:`ragcache.blend.select.SCORES` (``@score_function(name)``). Returns it.

    Raises:
        ValueError: the name is empty, holds ``/``, or is registered already; ``check_layer`` < 0.
    """
    if not strategy.name or "/" in strategy.name:
        raise ValueError(f"a selection strategy's name must be non-empty and without '/', got {strategy.name!r}")
    if strategy.name in STRATEGIES:
        raise ValueError(f"selection strategy {strategy.name!r} is registered already")
    if strategy.check_layer < 0:
        raise ValueError(f"check_layer must be >= 0, got {strategy.check_layer}")
    STRATEGIES[strategy.name] = strategy
    return strategy


def names() -> tuple[str, ...]:
    """The registered strategies' names, in registration order."""
    return tuple(STRATEGIES)


def get(name: str) -> Strategy:
    """The record of strategy ``name``.

    Raises:
        ValueError: no strategy of that name is registered (the message lists those that are).
    """
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"selection must be one of {names()}, got {name!r}") from None


def check_name(value: Any) -> str:
    """``value`` when it names a registered strategy: the validator of ``blend.selection`` and of a
    request's selection (:data:`ragcache.config.SelectionName`).

    Raises:
        ValueError: ``"Input should be 'deviation', 'question' or 'hybrid'"`` (the names registered),
            as pydantic words a choice.
    """
    if isinstance(value, str) and value in STRATEGIES:
        return value
    quoted = [repr(n) for n in STRATEGIES]
    choices = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    raise ValueError(f"Input should be {choices}")


register(Strategy("deviation", deviation=True))
register(Strategy("question", question=True, check_layer=0))
register(Strategy("hybrid", question=lambda k: k.question_weight > 0, deviation=lambda k: k.question_weight < 1,
                  settings=("question_weight",)))


@dataclass(frozen=True)
class Selection:
    """How the tokens to recompute are chosen (defaults live in ``ragcache.config.BlendSettings``).

    Attributes:
        strategy: a registered strategy's name (:func:`names`; ``"deviation"``, ``"question"`` or
            ``"hybrid"``, see :mod:`ragcache.blend.select`).
        chunk_head_tokens: the first k tokens of every moved chunk are always in the set (any strategy).
        question_weight: hybrid: weight of the question-attention rank against the deviation rank,
            in [0, 1] (0 = deviation only, 1 = question only).
        max_chunk_share: no chunk takes more than this share of the budget, in (0, 1] (any strategy).
        granule: tokens are chosen in aligned runs of this many tokens within each chunk (1 = token
            by token), >= 1.
        probe_layers: question scores: how many layers after the check layer the question tail is
            probed through over the reused KV (0 = the layers up to the check layer only, which
            cost nothing extra; None = every later layer).
        question_heads: question scores: how each layer's per-head attention is pooled over the
            query heads, ``"mean"`` or ``"max"``.
        candidates: question selection at check layer 0: the question picks this many times the
            budget and the budget is kept among them by impact at layer ``refine_layer`` (see
            :mod:`ragcache.blend.select`), >= 1 (1 = by question attention alone).
        refine_layer: with ``candidates`` > 1, the layer at which the budget is kept among the
            candidates (their V error summed over layers 1 .. ``refine_layer``), >= 1.

    Raises (on construction):
        ValueError: an unregistered strategy or a knob out of its range.
    """

    strategy: str
    chunk_head_tokens: int = 0
    question_weight: float = 0.5
    max_chunk_share: float = 1.0
    granule: int = 1
    probe_layers: int | None = None
    question_heads: str = "mean"
    candidates: float = 1.0
    refine_layer: int = 1

    def __post_init__(self) -> None:
        get(self.strategy)
        if self.chunk_head_tokens < 0:
            raise ValueError(f"chunk_head_tokens must be >= 0, got {self.chunk_head_tokens}")
        if not 0.0 <= self.question_weight <= 1.0:
            raise ValueError(f"question_weight must be in [0, 1], got {self.question_weight}")
        if not 0.0 < self.max_chunk_share <= 1.0:
            raise ValueError(f"max_chunk_share must be in (0, 1], got {self.max_chunk_share}")
        if self.granule < 1:
            raise ValueError(f"granule must be >= 1, got {self.granule}")
        if self.probe_layers is not None and self.probe_layers < 0:
            raise ValueError(f"probe_layers must be >= 0 or None, got {self.probe_layers}")
        if self.question_heads not in QUESTION_HEADS:
            raise ValueError(f"question_heads must be one of {QUESTION_HEADS}, got {self.question_heads!r}")
        if not self.candidates >= 1.0:
            raise ValueError(f"candidates must be >= 1, got {self.candidates}")
        if self.refine_layer < 1:
            raise ValueError(f"refine_layer must be >= 1, got {self.refine_layer}")

    @classmethod
    def from_settings(cls, blend: Any, strategy: str | None = None, granule: int | None = None) -> "Selection":
        """The selection the ``[blend]`` settings ``blend`` (``ragcache.config.BlendSettings``) give,
        with a request's own ``strategy`` and ``granule`` where it sets them (None: the settings').
        ``blend.probe_layers = -1`` (every later layer) becomes None.

        Raises:
            ValueError: as on construction.
        """
        knobs = {f.name: getattr(blend, f.name) for f in fields(cls) if f.name != "strategy"}
        knobs["granule"] = blend.granule if granule is None else granule
        knobs["probe_layers"] = None if blend.probe_layers < 0 else blend.probe_layers
        return cls(strategy or blend.selection, **knobs)

    @property
    def needs_question(self) -> bool:
        """True when the question tail's attention is part of the score (the strategy's record says)."""
        return get(self.strategy).needs_question(self)

    @property
    def needs_deviation(self) -> bool:
        """True when the KV deviation at the check layer is part of the score (the strategy's record says)."""
        return get(self.strategy).needs_deviation(self)


def recompute_layers(recompute_depth: float, num_layers: int, check_layer: int) -> int:
    """How many layers, from the first, the selected tokens are recomputed in (``recompute_depth``):
    ``ceil(recompute_depth * num_layers)``, at least ``check_layer + 1``, at most ``num_layers``."""
    return min(num_layers, max(check_layer + 1, math.ceil(round(recompute_depth * num_layers, 9))))
