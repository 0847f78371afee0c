"""Per-index quality gate: the smallest recompute ratio whose blend answers like full prefill, sooner.

Owns: measuring blend against full prefill on prompts drawn from one index (:func:`calibrate`),
the probe questions made from the index's own chunks (:func:`probe_questions`), and the record
kept in the index folder (``calibration.json``, one entry per model fingerprint and selection
strategy) that ``blend.recompute_ratio = "auto"`` reads (:func:`read_calibration`).

Why probe questions from the index's chunks: the quality of a blend depends on the chunks that
end up side by side and on how strongly the question draws on them, so the prompts must be the
ones the index's own retrieval assembles. A probe takes a chunk at random (seeded), asks about
its opening words ("What do the documents say about <first words>?") and retrieves ``top_k``
chunks for that question exactly as a user question would be served. The measures are gold-free
(no answers needed, so any corpus works): the first-token KL(full || blend), the teacher-forced
NLL of full prefill's own greedy answer under blend relative to full, and the share of blend's
answers that loop (:func:`ragcache.quality.repetition_loop`); and the speedup, the median TTFT of
full prefill over blend's. A ratio is good enough when its mean KL is at most ``max_kl`` nats, its
answer NLL at most ``max_nll_rel`` above full's and it loops no more often than full prefill; it
is worth it when it is also at least ``min_speedup`` times faster. The smallest such ratio is
recorded; when none is, the calibration recommends full prefill (blend would be slower, or worse,
than not blending) and says why. Users' real questions (``questions``) are better still and are
used instead when given.

Imports the pipeline's types only for type checking; uses the engine through its public methods.
Never app/ or ui/.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ragcache.bench.metrics import mean
from ragcache.quality import kl_divergence, mean_nll
from ragcache.index import CALIBRATION

if TYPE_CHECKING:
    from ragcache.chunks import Chunk
    from ragcache.pipeline import RAGPipeline

log = logging.getLogger(__name__)

CALIBRATION_FILE = CALIBRATION  # the file in the index folder (ragcache.index lists what a folder holds)
#: ratios tried by default, ascending
DEFAULT_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
#: default quality target: mean first-token KL(full || blend) in nats
DEFAULT_MAX_KL = 0.05
#: default quality target: mean NLL of full's own answer under blend at most this much above full's
DEFAULT_MAX_NLL_REL = 0.05
#: default speed target: blend's median TTFT at least this many times below full prefill's
DEFAULT_MIN_SPEEDUP = 1.2


class CalibrationError(ValueError):
    """Calibration cannot run (bad target or ratios, no prompts)."""


@dataclass
class RatioScore:
    """Blend at one ratio against full prefill, means over the prompts.

    Attributes:
        ratio: recompute ratio in [0, 1].
        kl_mean: mean first-token KL(full || blend), nats.
        answer_nll_rel: mean NLL of full's own greedy answer under blend / under full - 1.
        ttft_median_s: median blend TTFT, seconds.
        meets: good enough and worth it: every quality target met and ``speedup >= min_speedup``.
        loop_share: share of blend's answers with a repetition loop.
        speedup: median full-prefill TTFT / median blend TTFT of the same prompts.
        good: the quality targets are met (KL, answer NLL, loops no more often than full's).
    """

    ratio: float
    kl_mean: float
    answer_nll_rel: float | None
    ttft_median_s: float
    meets: bool
    loop_share: float = 0.0
    speedup: float | None = None
    good: bool | None = None


@dataclass
class Calibration:
    """The outcome of one calibration of an index for one model and selection strategy.

    Attributes:
        ratio: the smallest ratio that met every target, or None when none did (use ``--mode full``).
        max_kl: the KL target, nats.
        selection: the token-selection strategy measured.
        model_fingerprint: the model measured (its chunk KV is what was blended).
        n: prompts measured. source: ``"questions"`` (users' questions) or ``"probes"``.
        full_ttft_median_s: median full-prefill TTFT of the same prompts, seconds.
        scores: one :class:`RatioScore` per ratio tried, ascending.
        created: UTC time, ISO 8601.
        max_nll_rel, min_speedup: the other targets.
        full_loop_share: share of full prefill's answers with a repetition loop.
        recommendation: ``"blend"`` (at ``ratio``) or ``"full"``; ``reason`` says why in one sentence.
    """

    ratio: float | None
    max_kl: float
    selection: str
    model_fingerprint: str
    n: int
    source: str
    full_ttft_median_s: float
    scores: list[RatioScore] = field(default_factory=list)
    created: str = ""
    max_nll_rel: float = DEFAULT_MAX_NLL_REL
    min_speedup: float = DEFAULT_MIN_SPEEDUP
    full_loop_share: float = 0.0
    recommendation: str = "blend"
    reason: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Calibration":
        data = dict(data)
        data["scores"] = [RatioScore(**s) for s in data.get("scores", [])]
        return cls(**data)


def _key(model_fingerprint: str, selection: str) -> str:
    return f"{model_fingerprint}/{selection}"


def read_calibration(index_path: str | os.PathLike[str], model_fingerprint: str,
                     selection: str) -> Calibration | None:
    """The index's calibration for this model and selection, or None (none recorded, or unreadable)."""
    path = Path(index_path) / CALIBRATION_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entry = data.get(_key(model_fingerprint, selection))
        return Calibration.from_dict(entry) if entry else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        log.warning("cannot read %s (%s); run `ragcache calibrate` again", path, exc)
        return None


def write_calibration(index_path: str | os.PathLike[str], cal: Calibration) -> Path:
    """Record ``cal`` in the index folder (atomically; other models' and selections' entries kept).

    Raises:
        OSError: the folder cannot be written.
    """
    folder = Path(index_path)
    path = folder / CALIBRATION_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    data[_key(cal.model_fingerprint, cal.selection)] = asdict(cal)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
    return path


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


def calibrate(rag: "RAGPipeline", questions: Sequence[str], *, ratios: Sequence[float] = DEFAULT_RATIOS,
              max_kl: float = DEFAULT_MAX_KL, max_nll_rel: float = DEFAULT_MAX_NLL_REL,
              min_speedup: float = DEFAULT_MIN_SPEEDUP, selection: str | None = None, max_tokens: int = 24,
              source: str = "probes", progress: Callable[[int], None] | None = None) -> Calibration:
    """Blend at each ratio against full prefill on ``questions`` over ``rag``'s index.

    Per question: retrieval as in a real query, one full-prefill request (greedy answer of
    ``max_tokens`` tokens, first-token distribution over the whole vocabulary), then per ratio one
    blend request (its answer and first-token distribution) and one teacher-forced score of full's
    answer. ``progress`` is called with 1 after every question.

    Returns:
        the :class:`Calibration` (not yet written; see :func:`write_calibration`).

    Raises:
        CalibrationError: no questions, a ratio outside [0, 1], ``max_kl`` <= 0, ``max_nll_rel`` < 0
            or ``min_speedup`` <= 0.
    """
    ratios = sorted(set(float(r) for r in ratios))
    if not questions:
        raise CalibrationError("no questions to calibrate with")
    if not ratios or ratios[0] < 0.0 or ratios[-1] > 1.0:
        raise CalibrationError(f"ratios must lie in [0, 1]; got {ratios}")
    if not max_kl > 0:
        raise CalibrationError(f"--max-kl must be > 0 nats; got {max_kl}")
    if not max_nll_rel >= 0:
        raise CalibrationError(f"--max-nll must be >= 0; got {max_nll_rel}")
    if not min_speedup > 0:
        raise CalibrationError(f"--min-speedup must be > 0; got {min_speedup}")
    engine = rag.engine
    selection = selection or engine.settings.blend.selection
    kls: dict[float, list[float]] = {r: [] for r in ratios}
    nlls: dict[float, list[float]] = {r: [] for r in ratios}
    ttfts: dict[float, list[float]] = {r: [] for r in ratios}
    loops: dict[float, list[float]] = {r: [] for r in ratios}
    full_nlls: list[float] = []
    full_ttfts: list[float] = []
    full_loops: list[float] = []
    for q in questions:
        prompt = engine.prompts.build(q, [r.chunk for r in rag.retrieve(q)], namespace=rag.namespace)
        full = engine.generate(prompt, "full", max_tokens=max_tokens, logprobs=-1)
        full_ttfts.append(full.metrics.ttft_s)
        full_loops.append(float(full.metrics.repetition_loop))
        answer = full.token_ids
        if answer:
            full_nlls.append(mean_nll(engine.continuation_logprobs(prompt, answer, "prefix")))
        for r in ratios:
            g = engine.generate(prompt, "blend", recompute_ratio=r, selection=selection, max_tokens=max_tokens,
                                logprobs=-1)
            kls[r].append(kl_divergence(full.first_token_logprobs or {}, g.first_token_logprobs or {}))
            ttfts[r].append(g.metrics.ttft_s)
            loops[r].append(float(g.metrics.repetition_loop))
            if answer:
                nlls[r].append(mean_nll(engine.continuation_logprobs(prompt, answer, "blend", recompute_ratio=r,
                                                                     selection=selection)))
        if progress is not None:
            progress(1)
    base = mean(full_nlls)
    full_ttft = _median(full_ttfts)
    full_loop = float(mean(full_loops) or 0.0)
    scores = []
    for r in ratios:
        kl = float(mean(kls[r]) or 0.0)
        nll = mean(nlls[r])
        nll_rel = round(nll / base - 1, 4) if (nll is not None and base) else None
        loop = float(mean(loops[r]) or 0.0)
        ttft = _median(ttfts[r])
        speedup = round(full_ttft / ttft, 3) if ttft > 0 else None
        good = kl <= max_kl and (nll_rel is None or nll_rel <= max_nll_rel) and loop <= full_loop
        scores.append(RatioScore(ratio=r, kl_mean=round(kl, 5), answer_nll_rel=nll_rel, ttft_median_s=round(ttft, 4),
                                 meets=good and speedup is not None and speedup >= min_speedup,
                                 loop_share=round(loop, 4), speedup=speedup, good=good))
    best = next((s for s in scores if s.meets), None)
    if best is not None:
        recommendation, reason = "blend", (f"blend at ratio {best.ratio:g} answers like full prefill (KL "
                                           f"{best.kl_mean:.3g} <= {max_kl:g}) {best.speedup:.1f}x sooner")
    else:
        good_ones = [s for s in scores if s.good]
        if good_ones:
            reason = (f"the smallest ratio good enough ({good_ones[0].ratio:g}) is only {good_ones[0].speedup:.2f}x "
                      f"faster than full prefill (target {min_speedup:g}x): blending does not pay on this index")
        else:
            reason = (f"no ratio tried answers like full prefill (KL <= {max_kl:g}, answer NLL within "
                      f"{100 * max_nll_rel:g}%, no more loops than full)")
        recommendation = "full"
    return Calibration(ratio=best.ratio if best else None, max_kl=max_kl, selection=selection,
                       model_fingerprint=engine.llm_info.fingerprint, n=len(questions), source=source,
                       full_ttft_median_s=round(full_ttft, 4), scores=scores,
                       created=datetime.now(timezone.utc).isoformat(timespec="seconds"), max_nll_rel=max_nll_rel,
                       min_speedup=min_speedup, full_loop_share=round(full_loop, 4),
                       recommendation=recommendation, reason=reason)


def _median(values: Sequence[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0
