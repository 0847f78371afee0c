"""Cold start (``ragcache bench coldstart``): the engine's start-up seconds, and the first long
request's TTFT against the steady state of the same prompt.

One engine (the settings' dtype and process mode) precomputes the KV of one example's passages,
then answers the same ~6k-token prompt ``repeats`` times in each mode (each request with a fresh
cache salt, so none is an exact-prefix hit): the first request's TTFT, the median of the later ones
and their ratio (target: first <= 1.3x steady). Run it alone on the machine: TTFTs are wall-clock.
Never app/ or ui/.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Sequence

from ragcache.bench.common import Progress
from ragcache.bench.datasets import QAExample, make_chunks
from ragcache.bench.metrics import rounded
from ragcache.options import QueryOptions

if TYPE_CHECKING:
    from ragcache.engine import BlendEngine


def run_coldstart(engine: "BlendEngine", example: QAExample, *, passages: int = 10,
                  modes: Sequence[str] = ("blend", "full"), repeats: int = 4,
                  progress: Progress | None = None) -> dict[str, Any]:
    """First and later TTFTs per mode on one just-started engine (see the module docstring).

    Returns:
        ``{"benchmark": "coldstart", "startup_s", "prompt_tokens", "modes": {mode: {"ttft_s": [...],
        "first_s", "steady_median_s", "first_vs_steady"}}}``; seconds.
    """
    say = progress or (lambda _msg: None)
    chunks = make_chunks(engine.tokenizer, example.passages[:passages])
    engine.precompute(chunks)
    prompt = engine.prompts.build(example.question, chunks)
    out: dict[str, Any] = {"benchmark": "coldstart", "startup_s": rounded(engine.startup_s, 2),
                           "prompt_tokens": len(prompt.token_ids), "repeats": repeats, "modes": {}}
    for mode in modes:
        options = QueryOptions(mode=mode, max_tokens=1)
        ttfts = [engine.generate(prompt, options).metrics.ttft_s for _ in range(repeats)]
        steady = statistics.median(ttfts[1:]) if len(ttfts) > 1 else None
        out["modes"][mode] = {"ttft_s": [rounded(t, 3) for t in ttfts], "first_s": rounded(ttfts[0], 3),
                              "steady_median_s": rounded(steady, 3),
                              "first_vs_steady": rounded(ttfts[0] / steady, 3) if steady else None}
        say(f"{mode}: first {ttfts[0]:.2f} s, later " + ", ".join(f"{t:.2f}" for t in ttfts[1:]) + " s")
    return out
