"""Per-index quality gate: the cheapest recompute budget whose blend answers like full prefill, sooner.

Owns: measuring blend against full prefill on prompts drawn from one index (:func:`calibrate`) and
the probe questions made from the index's own chunks (:func:`probe_questions`). The record it
produces is kept in the index folder (``calibration.json``, one entry per model fingerprint and
selection strategy, with the settings it was measured under, outside which it does not hold; :class:`~ragcache.quality.records.Calibration`, :func:`~ragcache.quality.records.read_calibration`,
:func:`~ragcache.quality.records.write_calibration`, re-exported here), where ``blend.recompute_ratio =
"auto"`` reads it.

Why probe questions from the index's chunks: the quality of a blend depends on the chunks that
end up side by side and on how strongly the question draws on them, so the prompts must be the
ones the index's own retrieval assembles. A probe takes a chunk at random (seeded), asks about
its opening words ("What do the documents say about <first words>?") and retrieves ``top_k``
chunks for that question exactly as a user question would be served. The measures are gold-free
(no answers needed, so any corpus works): the first-token KL(full || blend), the teacher-forced
NLL of full prefill's own greedy answer under blend relative to full, and the share of blend's
answers that loop (:func:`ragcache.quality.measures.repetition_loop`); and the speedup, the median TTFT of
full prefill over blend's. A ratio is good enough when its mean KL is at most ``max_kl`` nats, its
answer NLL at most ``max_nll_rel`` above full's and it loops no more often than full prefill; it
is worth it when it is also at least ``min_speedup`` times faster and leaves some context tokens
reused (a blend that recomputes the whole context, at ratio 1 or on contexts under
``blend.min_recompute_tokens``, is full prefill through the blend's path, and a speedup measured
for it is load noise). The smallest such ratio is recorded; when none is, the calibration
recommends full prefill (blend would be slower, or worse, than not blending) and says why.
Users' real questions (``questions``) are better still and are used instead when given.

Imports the pipeline's types only for type checking; uses the engine through its public methods.
Never app/ or ui/.
"""

from __future__ import annotations

import logging
import random
import statistics
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Callable, Sequence

from ragcache.index.folder import CALIBRATION
from ragcache.options import QueryOptions, QueryOptionsError
from ragcache.quality.measures import kl_divergence, mean_nll, rotated, rouge_l
from ragcache.quality.records import Calibration, RatioScore, read_calibration, write_calibration
from ragcache.quality.table import QualityCell, QualityTable, passage_class, prompt_class

if TYPE_CHECKING:
    from ragcache.chunks import Chunk
    from ragcache.pipeline import RAGPipeline

log = logging.getLogger(__name__)

#: the file in the index folder; the record (:class:`Calibration`) and its I/O live beside the
#: manifest in :mod:`ragcache.index`, so the pipeline reads it without importing this module
CALIBRATION_FILE = CALIBRATION
__all__ = ["Calibration", "CalibrationError", "RatioScore", "calibrate", "probe_questions", "read_calibration",
           "write_calibration", "DEFAULT_MAX_KL", "DEFAULT_MASSES", "DEFAULT_RATIOS"]
#: ratios tried by default, ascending
DEFAULT_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
#: adaptive budget: thresholds (``blend.mass_left``) tried by default, cheapest (largest) first
DEFAULT_MASSES = (0.1, 0.07, 0.05, 0.03, 0.02, 0.01)
#: how full prefill's own answer is scored: exact KV (prefix mode; a scoring request reads no cached
#: block, so it is a fresh full pass: EngineBase._scoring_request); bench ttft scores with it too
EXACT = QueryOptions(mode="prefix")
#: reads a prompt's chunk KV once before the timed blends (calibrate)
WARM_UP = QueryOptions(mode="reuse", max_tokens=1)
#: one untimed full prefill before the first timed one: a process's first requests pay one-off
#: costs (2.6 s against 0.9 s for the next full prefill of a 187-token prompt), which would land on
#: full prefill's median alone, as each prompt asks it first
ENGINE_WARM_UP = QueryOptions(mode="full", max_tokens=1)
#: default quality target: mean first-token KL(full || blend) in nats
DEFAULT_MAX_KL = 0.05
#: default quality target: mean NLL of full's own answer under blend at most this much above full's
DEFAULT_MAX_NLL_REL = 0.05
#: default speed target: blend's median TTFT at least this many times below full prefill's
DEFAULT_MIN_SPEEDUP = 1.2
#: the quality table's gold-free gate: blend's greedy answers agree with full prefill's at a mean
#: Rouge-L of at least this (with gold answers, their NLL decides instead). Of the gold-free measures
#: the benchmarks record (answers equal, first-token KL, the NLL of full's answer, Rouge-L), this one
#: separated the sets whose gold NLL stays within +5% from those that do not (docs/benchmarks.md)
DEFAULT_MIN_AGREE = 0.75


class CalibrationError(ValueError):
    """Calibration cannot run (bad target or ratios, no prompts)."""


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def probe_questions(chunks: Sequence["Chunk"], n: int, seed: int = 0, words: int = 8) -> list[str]:
    """``n`` questions about the opening words of chunks drawn at random (seeded) from ``chunks``.

    With more questions than chunks, every chunk is asked about once, then about its next ``words``
    words, and so on, so no prompt is measured twice; only when the chunks' words run out do
    questions repeat.

    Raises:
        CalibrationError: ``chunks`` is empty.
    """
    usable = [c for c in chunks if c.text.split()]
    if not usable:
        raise CalibrationError("the index has no chunks to draw probe questions from; ingest documents first")
    rng = random.Random(seed)

    def about(chunk: "Chunk", window: int = 0) -> str | None:
        said = chunk.text.split()[window * words:(window + 1) * words]
        return f"What do the documents say about {' '.join(said).rstrip('.,;:')}?" if said else None

    if n <= len(usable):
        return [about(c) for c in rng.sample(usable, n)]
    order = rng.sample(usable, len(usable))
    questions: list[str] = []
    longest = max(len(c.text.split()) for c in usable)
    for window in range((longest + words - 1) // words):
        for q in (about(c, window) for c in order):
            if q is not None and q not in questions and len(questions) < n:
                questions.append(q)
    while len(questions) < n:  # every distinct question asked: they repeat
        questions += questions[:n - len(questions)]
    return questions


def blend_options(ratios: Sequence[float], selection: str | None = None,
                  max_tokens: int = 1) -> dict[float, QueryOptions]:
    """The blend request of each ratio (``max_tokens`` decoded; ``selection`` None: ``blend.selection``),
    ascending: the ratios checked once, by :class:`~ragcache.options.QueryOptions`'s own range.

    Raises:
        CalibrationError: no ratios, a ratio outside [0, 1] or an unknown selection.
    """
    if not ratios:
        raise CalibrationError("no ratios to try")
    try:
        return {r: QueryOptions.parse({"mode": "blend", "recompute_ratio": r, "selection": selection,
                                       "max_tokens": max_tokens},
                                      {"recompute_ratio": "ratio"})
                for r in sorted(set(float(r) for r in ratios))}
    except QueryOptionsError as exc:
        raise CalibrationError(str(exc)) from None


def budget_options(ratio: float, masses: Sequence[float], selection: str | None = None,
                   max_tokens: int = 1) -> dict[tuple[float, float], QueryOptions]:
    """The adaptive-budget blend request of each threshold in ``masses`` (``mass_left``) around
    ``ratio``, cheapest (largest threshold) first: the thresholds checked once, by
    :class:`~ragcache.options.QueryOptions`'s own range.

    Raises:
        CalibrationError: no thresholds, or one outside (0, 1).
    """
    if not masses:
        raise CalibrationError("no mass_left thresholds to try")
    try:
        return {(ratio, m): QueryOptions.parse({"mode": "blend", "recompute_ratio": ratio, "selection": selection,
                                                "budget": "adaptive", "mass_left": m, "max_tokens": max_tokens},
                                               {"mass_left": "mass_left"})
                for m in sorted(set(float(m) for m in masses), reverse=True)}
    except QueryOptionsError as exc:
        raise CalibrationError(str(exc)) from None


def calibrate(rag: "RAGPipeline", questions: Sequence[str], *, ratios: Sequence[float] | None = None,
              max_kl: float = DEFAULT_MAX_KL, max_nll_rel: float = DEFAULT_MAX_NLL_REL,
              min_speedup: float = DEFAULT_MIN_SPEEDUP, selection: str | None = None, max_tokens: int = 24,
              source: str = "probes", progress: Callable[[int], None] | None = None,
              masses: Sequence[float] | None = None, answers: Sequence[Sequence[str]] | None = None,
              quality_top_ks: Sequence[int | None] | None = (None,)) -> Calibration:
    """Blend at each ratio (or, with ``masses``, at each adaptive-budget threshold) against full
    prefill on ``questions`` over ``rag``'s index.

    ``ratios`` (None: :data:`DEFAULT_RATIOS`) are the fixed budgets tried. With ``masses`` (the
    adaptive budget, ``blend.budget = "adaptive"``) they are instead the ratios the budgets are
    centred on (None: the settings' ratio, ``blend.recompute_ratio``, or ``blend.fallback_ratio``
    for ``"auto"``): around each, the blends run with ``mass_left`` set to each threshold in turn.
    Per ratio the largest threshold (the fewest tokens recomputed) that meets the targets is the
    candidate, and the record keeps the candidate that recomputed the smallest share of the
    contexts (the smaller ratio on a tie): the rule fitted on this index's own questions, which
    ``recompute_ratio = "auto"`` then uses.

    Per question: retrieval as in a real query, one full-prefill request (greedy answer of
    ``max_tokens`` tokens, first-token distribution over the whole vocabulary), then per ratio one
    blend request (its answer and first-token distribution) and one teacher-forced score of full's
    answer, the ratios in an order rotated per question (:func:`~ragcache.quality.measures.rotated`). Before
    the timed blends, one untimed one-token ``reuse`` request reads the prompt's chunk KV once, which
    promotes it from a slower tier to RAM where the RAM tier has room: the ratios' TTFTs are then
    compared as a user's repeated questions over the index see them, not with one ratio per
    question paying the first disk or remote read (without a RAM tier every blend reads alike).
    ``progress`` is called with 1 after every question.

    Then, unless ``quality_top_ks`` is None, the quality table of ``engine.mode = "auto"``
    (:func:`measure_quality` on the same questions, with ``answers`` where given, at each of
    ``quality_top_ks``) goes into the record's ``quality``.

    Returns:
        the :class:`Calibration` (not yet written; see :func:`write_calibration`).

    Raises:
        CalibrationError: no questions, a ratio outside [0, 1], ``max_kl`` <= 0, ``max_nll_rel`` < 0
            or ``min_speedup`` <= 0.
    """
    if masses is not None:
        centres = [rag.settings.blend.static_ratio] if ratios is None else ratios
        blend_options(centres, selection)  # each centre checked as a ratio is
        blends = {}
        for centre in sorted(set(float(r) for r in centres)):
            blends.update(budget_options(centre, masses, selection, max_tokens))
    else:
        ratios = DEFAULT_RATIOS if ratios is None else ratios
        blends = {(r, None): o for r, o in blend_options(ratios, selection, max_tokens).items()}
    points = list(blends)  # (ratio, mass_left or None): per ratio ascending, cheapest first
    if not questions:
        raise CalibrationError("no questions to calibrate with")
    if not max_kl > 0:
        raise CalibrationError(f"--max-kl must be > 0 nats; got {max_kl}")
    if not max_nll_rel >= 0:
        raise CalibrationError(f"--max-nll must be >= 0; got {max_nll_rel}")
    if not min_speedup > 0:
        raise CalibrationError(f"--min-speedup must be > 0; got {min_speedup}")
    engine = rag.engine
    selection = selection or engine.settings.blend.selection
    full_opts = QueryOptions(mode="full", max_tokens=max_tokens)
    kls: dict[tuple, list[float]] = {r: [] for r in points}
    nlls: dict[tuple, list[float]] = {r: [] for r in points}
    ttfts: dict[tuple, list[float]] = {r: [] for r in points}
    loops: dict[tuple, list[float]] = {r: [] for r in points}
    shares: dict[tuple, list[float]] = {r: [] for r in points}
    full_nlls: list[float] = []
    full_ttfts: list[float] = []
    full_loops: list[float] = []
    for i, q in enumerate(questions):
        prompt = engine.prompts.build(q, [r.chunk for r in rag.retrieve(q)], namespace=rag.namespace)
        if i == 0:
            engine.generate(prompt, ENGINE_WARM_UP, logprobs=-1)
        full = engine.generate(prompt, full_opts, logprobs=-1)
        full_ttfts.append(full.metrics.ttft_s)
        full_loops.append(float(full.metrics.repetition_loop))
        answer = full.token_ids
        if answer:
            full_nlls.append(mean_nll(engine.continuation_logprobs(prompt, answer, EXACT)))
        engine.generate(prompt, WARM_UP)  # the chunk KV's first read, untimed (see the docstring)
        for r in rotated(points, i):
            blend = blends[r]
            g = engine.generate(prompt, blend, logprobs=-1)
            kls[r].append(kl_divergence(full.first_token_logprobs or {}, g.first_token_logprobs or {}))
            ttfts[r].append(g.metrics.ttft_s)
            loops[r].append(float(g.metrics.repetition_loop))
            if g.metrics.ctx_tokens:
                shares[r].append(g.metrics.recomputed_tokens / g.metrics.ctx_tokens)
            if answer:
                nlls[r].append(mean_nll(engine.continuation_logprobs(prompt, answer, blend)))
        if progress is not None:
            progress(1)
    base = _mean(full_nlls)
    full_ttft = _median(full_ttfts)
    full_loop = float(_mean(full_loops) or 0.0)
    scores = []
    for r in points:
        kl = float(_mean(kls[r]) or 0.0)
        nll = _mean(nlls[r])
        nll_rel = round(nll / base - 1, 4) if (nll is not None and base) else None
        loop = float(_mean(loops[r]) or 0.0)
        ttft = _median(ttfts[r])
        speedup = round(full_ttft / ttft, 3) if ttft > 0 else None
        share = _mean(shares[r])
        good = kl <= max_kl and (nll_rel is None or nll_rel <= max_nll_rel) and loop <= full_loop
        score = RatioScore(ratio=r[0], kl_mean=round(kl, 5), answer_nll_rel=nll_rel, ttft_median_s=round(ttft, 4),
                           meets=False, loop_share=round(loop, 4), speedup=speedup, good=good,
                           recomputed_share=None if share is None else round(share, 4), mass_left=r[1])
        # a blend over the whole context is full prefill through the blend's path: its "speedup" is noise
        score.meets = good and speedup is not None and speedup >= min_speedup and not score.whole_context
        scores.append(score)
    best = _cheapest(scores)
    if best is not None:
        at = f"ratio {best.ratio:g}" if best.mass_left is None else (
            f"mass_left {best.mass_left:g} around ratio {best.ratio:g} (recomputing "
            f"{100 * (best.recomputed_share or 0):.0f}% of these contexts)")
        recommendation, reason = "blend", (f"blend at {at} answers like full prefill (KL "
                                           f"{best.kl_mean:.3g} <= {max_kl:g}) {best.speedup:.1f}x sooner")
        if best.raised_by_floor:
            reason += (f", recomputing {100 * best.recomputed_share:.0f}% of these contexts (blend.min_recompute_tokens "
                       f"raises a short context's budget above the ratio)")
    elif all(s.whole_context for s in scores):
        reason = "every ratio tried recomputes the whole context"
        if any(s.ratio < 1 for s in scores):
            reason += (f" (these prompts' contexts are no longer than blend.min_recompute_tokens = "
                       f"{engine.settings.blend.min_recompute_tokens} tokens)")
        reason += (": that is full prefill through the blend's own path, never sooner than vLLM's; blending pays on "
                   "longer contexts (more or longer chunks per prompt: retrieval.top_k, ingest.chunk_size) or with a "
                   "lower blend.min_recompute_tokens, at some cost in answer quality")
        recommendation = "full"
    else:
        good_ones = [s for s in scores if s.good and not s.whole_context]
        if good_ones:
            cheapest = good_ones[0]
            what = (f"ratio ({cheapest.ratio:g})" if cheapest.mass_left is None
                    else f"budget (mass_left {cheapest.mass_left:g})")
            reason = (f"the smallest {what} good enough is only {cheapest.speedup:.2f}x "
                      f"faster than full prefill (target {min_speedup:g}x): blending does not pay on this index")
        else:
            tried = "ratio" if masses is None else "budget"
            reason = (f"no {tried} tried answers like full prefill (KL <= {max_kl:g}, answer NLL within "
                      f"{100 * max_nll_rel:g}%, no more loops than full)")
            if any(s.good for s in scores):
                reason += " except those that recompute the whole context, which is full prefill done slower"
        recommendation = "full"
    quality = None
    if quality_top_ks is not None:
        quality = measure_quality(rag, questions, answers=answers, top_ks=quality_top_ks, progress=progress).to_list()
    return Calibration(ratio=best.ratio if best else None, mass_left=best.mass_left if best else None,
                       max_kl=max_kl, selection=selection,
                       model_fingerprint=engine.llm_info.fingerprint, n=len(questions), source=source,
                       full_ttft_median_s=round(full_ttft, 4), scores=scores,
                       created=datetime.now(timezone.utc).isoformat(timespec="seconds"), max_nll_rel=max_nll_rel,
                       min_speedup=min_speedup, full_loop_share=round(full_loop, 4),
                       recommendation=recommendation, reason=reason,
                       settings=rag.calibrated_settings(selection), quality=quality)


def _cheapest(scores: Sequence[RatioScore]) -> RatioScore | None:
    """The score to record among ``scores`` (per ratio ascending, each ratio's cheapest first), or None
    when none meets the targets: the first that meets under a fixed budget; under an adaptive one,
    per centre ratio the first that meets, then of those the one that recomputed the smallest share
    (the earlier on a tie or where a share is unknown)."""
    meeting = [s for s in scores if s.meets]
    if not meeting or meeting[0].mass_left is None:
        return meeting[0] if meeting else None
    firsts: dict[float, RatioScore] = {}
    for s in meeting:
        firsts.setdefault(s.ratio, s)
    unknown = float("inf")
    return min(firsts.values(), key=lambda s: unknown if s.recomputed_share is None else s.recomputed_share)


def _median(values: Sequence[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def measure_quality(rag: "RAGPipeline", questions: Sequence[str], *, answers: Sequence[Sequence[str]] | None = None,
                    top_ks: Sequence[int | None] = (None,), max_tokens: int = 16,
                    max_gold_nll_rel: float = DEFAULT_MAX_NLL_REL, min_agree: float = DEFAULT_MIN_AGREE,
                    progress: Callable[[int], None] | None = None) -> QualityTable:
    """Blend's answers against full prefill's per prompt-length and passage-length class
    (:func:`~ragcache.quality.table.prompt_class`, :func:`~ragcache.quality.table.passage_class`): the
    table ``engine.mode = "auto"`` routes by.

    Each question is retrieved with each of ``top_ks`` (None: ``retrieval.top_k``) and answered greedily
    (``max_tokens``) in full prefill and in the blend a request gets on this index (the settings, and
    the calibrated ratio under ``blend.recompute_ratio = "auto"``); its class is that of its prompt.
    Per class: the share of equal answers, the first-token KL, the NLL of full's answer under blend and,
    with ``answers`` (gold answers per question), the gold answers' NLL under blend against full's.
    A class passes with gold answers when their NLL is at most ``max_gold_nll_rel`` above full's;
    without, when blend's answers agree with full's at a mean Rouge-L of at least ``min_agree``; and
    in both only when blend loops no more often than full prefill.
    ``progress`` is called with 1 after every prompt.

    Raises:
        CalibrationError: no questions, or ``answers`` not one list per question.
    """
    if not questions:
        raise CalibrationError("no questions to measure the quality table with")
    if answers is not None and len(answers) != len(questions):
        raise CalibrationError(f"{len(answers)} answer lists for {len(questions)} questions")
    engine = rag.engine
    full_opts = QueryOptions(mode="full", max_tokens=max_tokens)
    blend_opts, _ = rag._for_engine(QueryOptions(mode="blend", max_tokens=max_tokens))
    rows: dict[tuple[str, str], list[dict[str, float | None]]] = {}
    warmed = False
    for k in top_ks:
        for q, gold in zip(questions, answers or [None] * len(questions)):
            chunks = [r.chunk for r in rag.retrieve(q, top_k=k)]
            prompt = engine.prompts.build(q, chunks, namespace=rag.namespace)
            if not warmed:
                engine.generate(prompt, ENGINE_WARM_UP)
                warmed = True
            full = engine.generate(prompt, full_opts, logprobs=-1)
            blend = engine.generate(prompt, blend_opts, logprobs=-1)
            row: dict[str, float | None] = {
                "prompt_tokens": len(prompt.token_ids),
                "passage_tokens": statistics.fmean(s.length for s in prompt.segments[1:]) if chunks else 0.0,
                "agree": float(blend.token_ids == full.token_ids), "rouge": rouge_l(blend.text, full.text),
                "kl": kl_divergence(full.first_token_logprobs or {}, blend.first_token_logprobs or {}),
                "loop_blend": float(blend.metrics.repetition_loop), "loop_full": float(full.metrics.repetition_loop),
                "nll_full": None, "nll_blend": None, "gold_full": None, "gold_blend": None}
            if full.token_ids:
                row["nll_full"] = mean_nll(engine.continuation_logprobs(prompt, full.token_ids, EXACT))
                row["nll_blend"] = mean_nll(engine.continuation_logprobs(prompt, full.token_ids, blend_opts))
            ids = list(engine.tokenizer(gold[0].strip(), add_special_tokens=False)["input_ids"]) if gold else []
            if ids:
                row["gold_full"] = mean_nll(engine.continuation_logprobs(prompt, ids, EXACT))
                row["gold_blend"] = mean_nll(engine.continuation_logprobs(prompt, ids, blend_opts))
            key = (prompt_class(row["prompt_tokens"]), passage_class(row["passage_tokens"]))
            rows.setdefault(key, []).append(row)
            if progress is not None:
                progress(1)
    return QualityTable([_quality_cell(key, rs, max_gold_nll_rel, min_agree) for key, rs in sorted(rows.items())])


def _rel(rows: Sequence[dict[str, float | None]], blend: str, full: str) -> float | None:
    """mean(blend) / mean(full) - 1 over the rows that have both, or None."""
    pairs = [(r[blend], r[full]) for r in rows if r[blend] is not None and r[full] is not None]
    if not pairs or not sum(f for _, f in pairs):
        return None
    return round(sum(b for b, _ in pairs) / sum(f for _, f in pairs) - 1.0, 4)


def _quality_cell(key: tuple[str, str], rows: Sequence[dict[str, float | None]], max_gold_nll_rel: float,
                  min_agree: float) -> QualityCell:
    """One class's measures and verdict (see :func:`measure_quality`)."""
    n = len(rows)
    agree = statistics.fmean(r["agree"] for r in rows)
    rouge = statistics.fmean(r["rouge"] for r in rows)
    kl = statistics.fmean(r["kl"] for r in rows)
    loops_blend = statistics.fmean(r["loop_blend"] for r in rows)
    loops_full = statistics.fmean(r["loop_full"] for r in rows)
    gold = _rel(rows, "gold_blend", "gold_full")
    if gold is not None:
        passes = gold <= max_gold_nll_rel
        why = f"gold-answer NLL {100 * gold:+.1f}% of full prefill's (at most {100 * max_gold_nll_rel:+g}%)"
    else:
        passes = rouge >= min_agree
        why = (f"Rouge-L of blend's answers against full prefill's {rouge:.2f}, needs at least {min_agree:g} "
               f"({round(agree * n)}/{n} equal, first-token KL {kl:.3f})")
    if loops_blend > loops_full:
        passes = False
        why += f"; loops in {loops_blend:.0%} of blend's answers against {loops_full:.0%} of full's"
    return QualityCell(prompt_class=key[0], passage_class=key[1], n=n,
                       prompt_tokens=round(statistics.fmean(r["prompt_tokens"] for r in rows), 1),
                       passage_tokens=round(statistics.fmean(r["passage_tokens"] for r in rows), 1),
                       agree=round(agree, 4), rouge_l=round(rouge, 4), kl_mean=round(kl, 5), answer_nll_rel=_rel(rows, "nll_blend", "nll_full"),
                       gold_nll_rel=gold, loops_blend=round(loops_blend, 4), loops_full=round(loops_full, 4),
                       passes=passes, why=why)
