"""Per-index quality gate: the smallest recompute ratio whose blend answers like full prefill.

Owns: measuring blend against full prefill on prompts drawn from one index (:func:`calibrate`) and
the probe questions made from the index's own chunks (:func:`probe_questions`). The record it
produces is kept in the index folder (``calibration.json``, one entry per model fingerprint and
selection strategy; :class:`~ragcache.index.Calibration`, :func:`~ragcache.index.read_calibration`,
:func:`~ragcache.index.write_calibration`, re-exported here), where ``blend.recompute_ratio =
"auto"`` reads it.

Why probe questions from the index's chunks: the quality of a blend depends on the chunks that
end up side by side and on how strongly the question draws on them, so the prompts must be the
ones the index's own retrieval assembles. A probe takes a chunk at random (seeded), asks about
its opening words ("What do the documents say about <first words>?") and retrieves ``top_k``
chunks for that question exactly as a user question would be served. The measures are gold-free
(no answers needed, so any corpus works): the first-token KL(full || blend) and the teacher-forced
NLL of full prefill's own greedy answer under blend, relative to full. A ratio meets the target
when its mean KL is at most ``max_kl`` nats. Users' real questions (``questions``) are better
still and are used instead when given.

Imports the pipeline's types only for type checking; uses the engine through its public methods.
Never app/ or ui/.
"""

from __future__ import annotations

import logging
import random
import statistics
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Callable, Sequence

from ragcache.index import CALIBRATION, Calibration, RatioScore, read_calibration, write_calibration
from ragcache.options import QueryOptions, QueryOptionsError
from ragcache.quality import kl_divergence, mean_nll

if TYPE_CHECKING:
    from ragcache.chunks import Chunk
    from ragcache.pipeline import RAGPipeline

log = logging.getLogger(__name__)

#: the file in the index folder; the record (:class:`Calibration`) and its I/O live beside the
#: manifest in :mod:`ragcache.index`, so the pipeline reads it without importing this module
CALIBRATION_FILE = CALIBRATION
__all__ = ["Calibration", "CalibrationError", "RatioScore", "calibrate", "probe_questions", "read_calibration",
           "write_calibration", "DEFAULT_MAX_KL", "DEFAULT_RATIOS"]
#: ratios tried by default, ascending
DEFAULT_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
#: how full's own answer is scored (exact: vLLM's prefix cache over full prefill's KV)
EXACT = QueryOptions(mode="prefix")
#: default quality target: mean first-token KL(full || blend) in nats
DEFAULT_MAX_KL = 0.05


class CalibrationError(ValueError):
    """Calibration cannot run (bad target or ratios, no prompts)."""


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def probe_questions(chunks: Sequence["Chunk"], n: int, seed: int = 0, words: int = 8) -> list[str]:
    """``n`` questions about the opening words of chunks drawn at random (seeded) from ``chunks``.

    Raises:
        CalibrationError: ``chunks`` is empty.
    """
    usable = [c for c in chunks if c.text.split()]
    if not usable:
        raise CalibrationError("the index has no chunks to draw probe questions from; ingest documents first")
    rng = random.Random(seed)
    picks = rng.sample(usable, n) if n <= len(usable) else [rng.choice(usable) for _ in range(n)]
    return [f"What do the documents say about {' '.join(c.text.split()[:words]).rstrip('.,;:')}?" for c in picks]


def blend_options(ratios: Sequence[float], selection: str | None = None) -> dict[float, QueryOptions]:
    """The blend request of each ratio (one decoded token; ``selection`` None: ``blend.selection``),
    ascending: the ratios checked once, by :class:`~ragcache.options.QueryOptions`'s own range.

    Raises:
        CalibrationError: no ratios, a ratio outside [0, 1] or an unknown selection.
    """
    if not ratios:
        raise CalibrationError("no ratios to try")
    try:
        return {r: QueryOptions.parse({"mode": "blend", "recompute_ratio": r, "selection": selection, "max_tokens": 1},
                                      {"recompute_ratio": "ratio"})
                for r in sorted(set(float(r) for r in ratios))}
    except QueryOptionsError as exc:
        raise CalibrationError(str(exc)) from None


def calibrate(rag: "RAGPipeline", questions: Sequence[str], *, ratios: Sequence[float] = DEFAULT_RATIOS,
              max_kl: float = DEFAULT_MAX_KL, selection: str | None = None, max_tokens: int = 16,
              source: str = "probes", progress: Callable[[int], None] | None = None) -> Calibration:
    """Blend at each ratio against full prefill on ``questions`` over ``rag``'s index.

    Per question: retrieval as in a real query, one full-prefill request (greedy answer,
    first-token distribution over the whole vocabulary), then per ratio one blend request
    (first-token distribution) and one teacher-forced score of full's answer. ``progress`` is
    called with 1 after every question.

    Returns:
        the :class:`Calibration` (not yet written; see :func:`write_calibration`).

    Raises:
        CalibrationError: no questions, a ratio outside [0, 1] or ``max_kl`` <= 0.
    """
    blends = blend_options(ratios, selection)
    ratios = list(blends)
    if not questions:
        raise CalibrationError("no questions to calibrate with")
    if not max_kl > 0:
        raise CalibrationError(f"--max-kl must be > 0 nats; got {max_kl}")
    engine = rag.engine
    selection = selection or engine.settings.blend.selection
    full_opts = QueryOptions(mode="full", max_tokens=max_tokens)
    kls: dict[float, list[float]] = {r: [] for r in ratios}
    nlls: dict[float, list[float]] = {r: [] for r in ratios}
    ttfts: dict[float, list[float]] = {r: [] for r in ratios}
    full_nlls: list[float] = []
    full_ttfts: list[float] = []
    for q in questions:
        prompt = engine.prompts.build(q, [r.chunk for r in rag.retrieve(q)], namespace=rag.namespace)
        full = engine.generate(prompt, full_opts, logprobs=-1)
        full_ttfts.append(full.metrics.ttft_s)
        answer = full.token_ids
        if answer:
            full_nlls.append(mean_nll(engine.continuation_logprobs(prompt, answer, EXACT)))
        for r, blend in blends.items():
            g = engine.generate(prompt, blend, logprobs=-1)
            kls[r].append(kl_divergence(full.first_token_logprobs or {}, g.first_token_logprobs or {}))
            ttfts[r].append(g.metrics.ttft_s)
            if answer:
                nlls[r].append(mean_nll(engine.continuation_logprobs(prompt, answer, blend)))
        if progress is not None:
            progress(1)
    base = _mean(full_nlls)
    scores = []
    for r in ratios:
        kl = float(_mean(kls[r]) or 0.0)
        nll = _mean(nlls[r])
        scores.append(RatioScore(ratio=r, kl_mean=round(kl, 5),
                                 answer_nll_rel=round(nll / base - 1, 4) if (nll is not None and base) else None,
                                 ttft_median_s=round(sorted(ttfts[r])[len(ttfts[r]) // 2], 4), meets=kl <= max_kl))
    best = next((s.ratio for s in scores if s.meets), None)
    return Calibration(ratio=best, max_kl=max_kl, selection=selection, model_fingerprint=engine.llm_info.fingerprint,
                       n=len(questions), source=source,
                       full_ttft_median_s=round(sorted(full_ttfts)[len(full_ttfts) // 2], 4), scores=scores,
                       created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
