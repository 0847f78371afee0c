"""Blend's answer quality per class of request, as ``ragcache calibrate`` measures it for an index and
``engine.mode = "auto"`` routes by it.

Owns: the prompt-length and passage-length classes (:func:`prompt_class`, :func:`passage_class`),
:class:`QualityCell` (one class's measures and verdict), :class:`QualityTable` (an index's cells,
and :meth:`QualityTable.prior`, the rule for a class not measured) and :class:`IndexQuality` (what the
router is handed: a table, or why none is used). Kept in the index's ``calibration.json``
(:class:`ragcache.quality.records.Calibration`). Imports nothing of ragcache, so the engine reads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


#: prompt-length classes, tokens: short < 2,500 <= mid < 5,000 <= long (the benchmarks' classes too)
PROMPT_CLASS_EDGES = (2500, 5000)
#: passage-length classes (mean tokens per retrieved chunk): short < 200 <= mid < 400 <= long
PASSAGE_CLASS_EDGES = (200, 400)
_CLASSES = ("short", "mid", "long")


def _classify(value: float, edges: tuple[int, int]) -> str:
    return _CLASSES[sum(value >= e for e in edges)]


def prompt_class(tokens: float) -> str:
    """``"short"``, ``"mid"`` or ``"long"`` for a prompt of ``tokens`` tokens (:data:`PROMPT_CLASS_EDGES`)."""
    return _classify(tokens, PROMPT_CLASS_EDGES)


def passage_class(tokens: float) -> str:
    """``"short"``, ``"mid"`` or ``"long"`` for retrieved chunks of ``tokens`` tokens on average
    (:data:`PASSAGE_CLASS_EDGES`)."""
    return _classify(tokens, PASSAGE_CLASS_EDGES)


@dataclass
class QualityCell:
    """Blend's answers against full prefill's for one prompt-length and passage-length class, on the
    index's probe questions (or the user's QA file), measured by ``ragcache calibrate``.

    Attributes:
        prompt_class, passage_class: the class (:func:`prompt_class`, :func:`passage_class`).
        n: prompts measured. prompt_tokens, passage_tokens: their mean lengths, tokens.
        agree: share of blend's greedy answers equal to full prefill's. rouge_l: their mean Rouge-L
            against full prefill's (the gold-free gate).
        kl_mean: mean first-token KL(full || blend), nats.
        answer_nll_rel: mean NLL of full's answer under blend / under full - 1 (None: no answer).
        gold_nll_rel: mean NLL of the gold answers under blend / under full - 1 (None: no gold).
        loops_blend, loops_full: share of answers with a repetition loop.
        passes: blend is faithful here. why: the measure that decided, in words.
    """

    prompt_class: str
    passage_class: str
    n: int
    prompt_tokens: float
    passage_tokens: float
    agree: float
    rouge_l: float
    kl_mean: float
    answer_nll_rel: float | None
    gold_nll_rel: float | None
    loops_blend: float
    loops_full: float
    passes: bool
    why: str


@dataclass
class QualityTable:
    """Blend's answer quality per class for one index (``Calibration.quality``), read by the router
    (:mod:`ragcache.engine.route`).

    Attributes:
        cells: one :class:`QualityCell` per class measured.
    """

    cells: list[QualityCell] = field(default_factory=list)

    def cell(self, prompt: str, passage: str) -> QualityCell | None:
        """The cell of this prompt-length and passage-length class, or None (not measured)."""
        return next((c for c in self.cells if c.prompt_class == prompt and c.passage_class == passage), None)

    def nearest(self, prompt: str, passage: str) -> QualityCell | None:
        """The cell of this class, else the measured cell of the same passage-length class nearest in
        prompt length (the index's own evidence about its passages), else None."""
        exact = self.cell(prompt, passage)
        if exact is not None:
            return exact
        same = [c for c in self.cells if c.passage_class == passage]
        if not same:
            return None
        order = _CLASSES.index(prompt)
        return min(same, key=lambda c: (abs(_CLASSES.index(c.prompt_class) - order), -_CLASSES.index(c.prompt_class)))

    @staticmethod
    def prior(passage_tokens: float, min_passage_tokens: int) -> tuple[bool, str]:
        """The rule for a class no calibration measured: blend only over passages of at least
        ``min_passage_tokens`` tokens on average (``route.min_passage_tokens``). Reused KV computed
        after the prompt head alone departs most from full prefill's where passages are short (each
        token's reused KV saw fewer of its own passage's tokens); docs/benchmarks.md holds the
        measurements behind the default. Returns ``(passes, why)``."""
        if passage_tokens >= min_passage_tokens:
            return True, f"passages of >= {min_passage_tokens} tokens keep full prefill's answers"
        return False, f"passages under route.min_passage_tokens = {min_passage_tokens}"

    def to_list(self) -> list[dict[str, Any]]:
        """Plain data, as ``calibration.json`` keeps it."""
        return [asdict(c) for c in self.cells]

    @classmethod
    def from_list(cls, data: list[dict[str, Any]] | None) -> "QualityTable | None":
        """Inverse of :meth:`to_list` (None for None).

        Raises:
            TypeError: a cell with a missing or unknown field.
        """
        return None if data is None else cls([QualityCell(**c) for c in data])


@dataclass(frozen=True)
class IndexQuality:
    """What the router knows of an index's blend quality: its table, or why none is used.

    Attributes:
        table: the index's :class:`QualityTable`, or None (not calibrated, or stale).
        note: why there is no table, e.g. ``"the index's quality table was measured under other settings
            (engine.dtype = 'float32' (calibrated with 'bfloat16'))"``; "" when there is one.
    """

    table: QualityTable | None = None
    note: str = ""
