"""``bench ingest``: KV precompute speed next to vLLM's own prefill of the same tokens.

Owns the ingest runner. Uses the engine it is handed through its public methods (precompute,
forget, the prompt builder's head and unit ids); imports ragcache.prompt; never app/ or ui/.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from ragcache.bench.common import Progress, warm_up
from ragcache.bench.datasets import QAExample, distinct_chunks, make_chunks
from ragcache.bench.metrics import rounded
from ragcache.options import QueryOptions
from ragcache.prompt import AssembledPrompt

if TYPE_CHECKING:
    from ragcache.engine import BlendEngine


def run_ingest(engine: "BlendEngine", examples: Sequence[QAExample], *, passages: int = 10,
               progress: Progress | None = None) -> dict[str, Any]:
    """KV precompute tokens/s next to vLLM prefill tokens/s for the same chunks.

    Both process ``[prompt head][KV context][chunk unit]`` per chunk (the placement rule,
    :func:`ragcache.prompt.lead_in_for`; precompute keeps the unit's KV; vLLM prefills the same
    tokens as a prompt with max_tokens=1); tokens/s counts unit tokens only.
    The chunks' stored KV is deleted first so precompute really computes; its time includes
    storing (top memory tier plus write-through to the persistent tiers configured). vLLM is
    measured one chunk at a time (as precompute works) and as one batch.
    """
    say = progress or (lambda _msg: None)
    chunks = distinct_chunks(c for ex in examples for c in make_chunks(engine.tokenizer, ex.passages[:passages]))
    warm_up(engine, chunks[:1])  # one-time costs of both paths (the chunk's KV is forgotten next)
    engine.forget(chunks)
    t0 = time.perf_counter()
    pre = engine.precompute(chunks)
    pre_wall = time.perf_counter() - t0
    unit_tokens = sum(len(engine.prompts.unit_ids(c)) for c in chunks)
    head = list(engine.prompts.head_ids)
    lead = head + list(engine.prompts.context_ids)
    prompts = [AssembledPrompt(lead + engine.prompts.unit_ids(c), [], 0, len(head)) for c in chunks]
    say(f"precompute: {len(chunks)} chunks, {unit_tokens} tokens in {pre.seconds:.1f} s")
    full = QueryOptions(mode="full", max_tokens=1)
    t0 = time.perf_counter()
    single = [engine.generate(p, full) for p in prompts]
    seq_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate_many(prompts, full)
    batch_wall = time.perf_counter() - t0
    ttft_sum = sum(g.metrics.ttft_s for g in single)
    out = {
        "benchmark": "ingest", "chunks": len(chunks), "unit_tokens": unit_tokens, "head_tokens": len(head),
        "kv_context_tokens": len(engine.prompts.context_ids),
        "precompute": {"computed": pre.computed, "seconds": rounded(pre.seconds, 3),
                       "wall_s": rounded(pre_wall, 3), "tokens_per_s": rounded(unit_tokens / pre.seconds, 1)},
        "vllm_prefill_sequential": {"wall_s": rounded(seq_wall, 3), "ttft_sum_s": rounded(ttft_sum, 3),
                                    "tokens_per_s": rounded(unit_tokens / ttft_sum, 1)},
        "vllm_prefill_batch": {"wall_s": rounded(batch_wall, 3), "tokens_per_s": rounded(unit_tokens / batch_wall, 1)},
    }
    out["precompute_vs_prefill_sequential"] = rounded(out["precompute"]["tokens_per_s"]
                                                      / out["vllm_prefill_sequential"]["tokens_per_s"], 3)
    out["precompute_vs_prefill_batch"] = rounded(out["precompute"]["tokens_per_s"]
                                                 / out["vllm_prefill_batch"]["tokens_per_s"], 3)
    return out
