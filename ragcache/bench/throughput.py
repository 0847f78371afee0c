"""``bench throughput``: requests/s and tokens/s of batches of concurrent requests, per mode.

Owns the throughput runner and its rows (one per batch size and mode) and the blend-over-full
ratios. Uses the engine it is handed through its public methods; never app/ or ui/.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from ragcache.bench.common import BenchConfigError, Progress
from ragcache.bench.datasets import QAExample, distinct_chunks, make_chunks
from ragcache.bench.metrics import mean, median, rounded
from ragcache.options import QueryOptions
from ragcache.quality.measures import rotated

if TYPE_CHECKING:
    from ragcache.engine import BlendEngine


def run_throughput(engine: "BlendEngine", examples: Sequence[QAExample], *, concurrency: Sequence[int] = (1, 4, 8, 16),
                   modes: Sequence[str] = ("full", "blend"), passages: int = 3, max_tokens: int = 16,
                   progress: Progress | None = None) -> dict[str, Any]:
    """Requests/s and prompt tokens/s of ``generate_many`` batches of C distinct prompts per mode.

    The prompts of the first ``max(concurrency)`` examples (``passages`` passages each) are
    ingested first; each (C, mode) batch runs once, modes alternating first per C, after one
    untimed warm-up request per mode. Every request decodes ``max_tokens`` tokens (greedy).
    """
    say = progress or (lambda _msg: None)
    n = max(concurrency)
    if len(examples) < n:
        raise BenchConfigError(f"concurrency {n} needs {n} examples; got {len(examples)}")
    prompts = []
    all_chunks = []
    for ex in examples[:n]:
        chunks = make_chunks(engine.tokenizer, ex.passages[:passages])
        all_chunks += chunks
        prompts.append(engine.prompts.build(ex.question, chunks))
    pre = engine.precompute(distinct_chunks(all_chunks))
    for m in modes:
        engine.generate(prompts[0], QueryOptions(mode=m, max_tokens=2))
    rows = []
    for j, c in enumerate(concurrency):
        for m in rotated(list(modes), j):
            batch = prompts[:c]
            t0 = time.perf_counter()
            gens = engine.generate_many(batch, QueryOptions(mode=m, max_tokens=max_tokens))
            wall = time.perf_counter() - t0
            ptoks = sum(len(p.token_ids) for p in batch)
            otoks = sum(len(g.token_ids) for g in gens)
            ttft = [g.metrics.ttft_s for g in gens]
            rows.append({"concurrency": c, "mode": m, "wall_s": rounded(wall, 3), "requests_per_s": rounded(c / wall),
                         "prompt_tokens_per_s": rounded(ptoks / wall, 1),
                         "output_tokens_per_s": rounded(otoks / wall, 2),
                         "prompt_tokens": ptoks, "output_tokens": otoks, "ttft_median_s": rounded(median(ttft)),
                         "ttft_max_s": rounded(max(ttft))})
            say(f"C={c} {m}: {c / wall:.3f} req/s, {ptoks / wall:.0f} prompt tok/s, wall {wall:.1f} s")
    ratios = []
    for c in concurrency:
        by = {r["mode"]: r for r in rows if r["concurrency"] == c}
        if "full" in by and "blend" in by:
            ratios.append({"concurrency": c, "blend_vs_full_requests_per_s":
                           rounded(by["blend"]["requests_per_s"] / by["full"]["requests_per_s"], 3)})
    return {"benchmark": "throughput", "passages": passages, "max_tokens": max_tokens,
            "prompt_tokens_mean": rounded(mean(len(p.token_ids) for p in prompts), 1), "precompute": pre.to_dict(),
            "rows": rows, "blend_vs_full": ratios}
