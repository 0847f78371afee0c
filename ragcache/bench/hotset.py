"""``bench hotset``: steady-state traffic over a hot set of chunks.

Owns: building the question sequence whose chunk sets overlap with what earlier questions used
(:func:`build_hotset`), the runner that asks it in every mode, and its summary (TTFT over the
sequence, per-tier store hit rates, the tiers that served chunk loads, speedup decay). Uses the
engine it is handed through its public methods; imports ragcache.index.retrieval (llama-index) only
inside the runner; never app/ or ui/.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ragcache.bench.common import (
    TARGETS, BenchConfigError, Checkpoint, Progress, Variant, make_variants, ratio_name, request_record, speedup,
    target, warm_up,
)
from ragcache.bench.datasets import QAExample, distinct_chunks, make_chunks
from ragcache.bench.metrics import mean, median, percentile, rouge_l, rounded
from ragcache.chunks import Chunk
from ragcache.quality.measures import rotated

if TYPE_CHECKING:
    from ragcache.engine import BlendEngine
    from ragcache.engine.messages import PrecomputeReport, StoreStats


@dataclass
class HotQuestion(QAExample):
    """A hotset question: an example's question over its own passages plus ``hot`` passages drawn
    from the shared hot pool (``passages`` holds both, own first)."""

    hot: int


def build_hotset(examples: Sequence[QAExample], *, questions: int = 50, passages: int = 6, overlap: float = 0.7,
                 hot_pool: int = 12, seed: int = 0) -> list[HotQuestion]:
    """Questions whose chunk sets overlap about ``overlap`` with what earlier questions used.

    The hot pool is the ``hot_pool`` passages that recur most often across ``examples`` (MuSiQue
    passages repeat, which is what KV reuse feeds on). Question i is example i's question over
    ``round(overlap * passages)`` passages drawn (seeded) from the hot pool plus its own first
    passages outside the pool, ``passages`` in all.

    Raises:
        BenchConfigError: too few examples or passages for the request.
    """
    if not 0.0 <= overlap <= 1.0 or passages < 1:
        raise BenchConfigError(f"overlap must be in [0, 1] and passages >= 1; got {overlap}, {passages}")
    n_hot = round(overlap * passages)
    if n_hot > hot_pool:
        raise BenchConfigError(f"{n_hot} hot passages per question need a hot pool of at least {n_hot}")
    counts: Counter[str] = Counter()
    first: dict[str, tuple[str, str]] = {}
    for ex in examples:
        for title, text in ex.passages:
            counts[text] += 1
            first.setdefault(text, (title, text))
    pool = [first[t] for t, _ in counts.most_common(hot_pool)]
    pool_texts = {t for _, t in pool}
    if len(pool) < hot_pool:
        raise BenchConfigError(f"only {len(pool)} distinct passages for a hot pool of {hot_pool}")
    rng = random.Random(seed)
    out = []
    for ex in examples:
        if len(out) == questions:
            break
        own = [p for p in ex.passages if p[1] not in pool_texts][: passages - n_hot]
        if len(own) < passages - n_hot:
            continue
        out.append(HotQuestion(ex.index, ex.question, ex.answers, own + rng.sample(pool, n_hot), n_hot))
    if len(out) < questions:
        raise BenchConfigError(f"only {len(out)} questions could be built; use fewer or a larger dataset")
    return out


def _tier_delta(before: "StoreStats", after: "StoreStats") -> dict[str, Any]:
    """Per-tier hits, misses and hit rate between two ``engine.store_stats()`` snapshots."""
    out = {}
    for name, a in after.tiers.items():
        b = before.tiers.get(name)
        hits = a.hits - (b.hits if b else 0)
        misses = a.misses - (b.misses if b else 0)
        out[name] = {"hits": hits, "misses": misses,
                     "hit_rate": rounded(hits / (hits + misses)) if hits + misses else None,
                     "entries": a.entries, "occupancy_bytes": a.occupancy_bytes, "capacity_bytes": a.capacity_bytes}
    return out


def run_hotset(engine: "BlendEngine", questions: Sequence[HotQuestion], *, modes: Sequence[str] = ("full", "prefix",
               "blend"), max_tokens: int = 8, window: int = 10, progress: Progress | None = None,
               checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """The hotset sequence: ingest every chunk, then ask each question in every mode (rotated order).

    Chunks are put in the stable order retrieval uses. ``prefix`` gets no warm-up: it hits whatever
    exact prefixes earlier ``prefix`` requests left (the realistic case). Reports TTFT per question
    and mode, per-tier hit rates of the store over the sequence (lookups that reached each tier),
    the tiers that served blend's chunks, and the median speedup of the last ``window`` questions
    against the first ``window``. ``checkpoint`` gets the result so far after every question.
    """
    from ragcache.index.retrieval import stable_order

    say = progress or (lambda _msg: None)
    variants = make_variants(modes, [], engine.settings.blend.recompute_ratio)
    sets = [stable_order(make_chunks(engine.tokenizer, q.passages, source="musique")) for q in questions]
    t0 = time.perf_counter()
    pre = engine.precompute(distinct_chunks(c for s in sets for c in s))
    ingest_s = time.perf_counter() - t0
    say(f"ingest: {pre.computed} chunk KV computed, {pre.skipped} already stored, {ingest_s:.1f} s")
    warm_up(engine, sets[0], [v.mode for v in variants])
    before = engine.store_stats()
    seen: set[str] = set()
    prev: set[str] = set()
    records = []
    served: Counter[str] = Counter()
    for i, (q, chunks) in enumerate(zip(questions, sets)):
        ids = {c.chunk_id for c in chunks}
        prompt = engine.prompts.build(q.question, chunks)
        row: dict[str, Any] = {"index": q.index, "prompt_tokens": len(prompt.token_ids),
                               "seen_before": rounded(len(ids & seen) / len(ids)) if i else None,
                               "jaccard_prev": rounded(len(ids & prev) / len(ids | prev)) if i else None,
                               "order": [], "results": {}}
        gens = {}
        for v in rotated(variants, i):
            gens[v.name] = engine.generate(prompt, v.options(max_tokens))
            row["order"].append(v.name)
        for v in variants:
            g = gens[v.name]
            rec = request_record(g)
            rec.update(agree_rouge_l=rounded(rouge_l(g.text, gens["full"].text)), speedup=speedup(gens["full"], g))
            row["results"][v.name] = rec
            if v.mode in ("reuse", "blend"):
                served.update(g.metrics.chunk_tiers)
        records.append(row)
        seen |= ids
        prev = ids
        say(f"[{i + 1}/{len(questions)}] " + "  ".join(f"{v.name} {row['results'][v.name]['ttft_s']:.2f}s"
                                                       for v in variants))
        if checkpoint is not None and i + 1 < len(questions):
            checkpoint({**_hotset_result(engine, variants, questions, sets, records, pre, ingest_s, window,
                                         max_tokens, before, served), "partial": True})
    return _hotset_result(engine, variants, questions, sets, records, pre, ingest_s, window, max_tokens, before,
                          served)


def _hotset_result(engine: "BlendEngine", variants: Sequence[Variant], questions: Sequence[HotQuestion],
                   sets: Sequence[Sequence[Chunk]], records: list[dict[str, Any]], pre: "PrecomputeReport",
                   ingest_s: float, window: int, max_tokens: int, before: "StoreStats",
                   served: Counter[str]) -> dict[str, Any]:
    after = engine.store_stats()
    summary = {}
    for v in variants:
        ttft = [r["results"][v.name]["ttft_s"] for r in records]
        sp = [r["results"][v.name]["speedup"] for r in records]
        first, last = median(sp[:window]), median(sp[-window:])
        summary[v.name] = {
            "mode": v.mode, "recompute_ratio": v.ratio, "n": len(ttft),
            "ttft_median_s": rounded(median(ttft)), "ttft_p90_s": rounded(percentile(ttft, 90)),
            "ttft_first_median_s": rounded(median(ttft[:window])),
            "ttft_last_median_s": rounded(median(ttft[-window:])),
            "speedup_median": rounded(median(sp), 3), "speedup_first_median": rounded(first, 3),
            "speedup_last_median": rounded(last, 3),
            "last_vs_first": rounded(last / first, 3) if (first and last) else None,
            "agree_rouge_l_mean": rounded(mean(r["results"][v.name]["agree_rouge_l"] for r in records)),
        }
    total_served = sum(served.values())
    name = ratio_name(engine.settings.blend.recompute_ratio)
    targets = {}
    if name in summary:
        targets["hotset_last_vs_first"] = target(
            summary[name]["last_vs_first"], TARGETS["hotset_last_vs_first_min"], "min",
            f"median blend speedup, last {window} / first {window} questions")
    return {
        "benchmark": "hotset", "n": len(records), "window": window, "max_tokens": max_tokens,
        "passages": len(questions[0].passages) if questions else 0,
        "hot_per_question": questions[0].hot if questions else 0,
        "distinct_chunks": len({c.chunk_id for s in sets for c in s}),
        "ingest": {**pre.to_dict(), "wall_s": rounded(ingest_s, 2)},
        "overlap_seen_before_mean": rounded(mean(r["seen_before"] for r in records)),
        "jaccard_prev_mean": rounded(mean(r["jaccard_prev"] for r in records)),
        "modes": summary, "tier_hit_rates": _tier_delta(before, after),
        "served_by_tier": {t: rounded(n / total_served) for t, n in served.most_common()} if total_served else {},
        "targets": targets, "questions": records,
    }
