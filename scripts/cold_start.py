#!/usr/bin/env python
"""Cold start: engine start-up time and the first long request's TTFT against the steady state.

Starts one BlendEngine (the settings' dtype and process mode), precomputes the KV of one MuSiQue
example's passages, then asks the same ~6k-token prompt ``--repeats`` times in each mode (blend,
full by default; each request with a fresh cache salt, so none is an exact-prefix hit) and
prints start-up seconds, the first request's TTFT, the median of the later ones and their ratio
(target: first <= 1.3x steady). Writes the numbers as JSON with ``--out``.

    .venv/bin/python scripts/cold_start.py --modes full,blend --repeats 4 --out results/cold_start.json

One engine per process; run it alone on the machine (TTFTs are wall-clock).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="musique", help="QA file (see ragcache bench ttft --dataset)")
    parser.add_argument("--example", type=int, default=0, help="example whose passages make the prompt")
    parser.add_argument("--passages", type=int, default=10, help="passages in the prompt")
    parser.add_argument("--modes", default="blend,full", help="modes, in the order asked")
    parser.add_argument("--repeats", type=int, default=4, help="requests per mode (the first is the cold one)")
    parser.add_argument("--kv-dir", default="/tmp/ragcache-cold-start-kv", help="chunk KV folder")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    args = parser.parse_args()

    from ragcache.bench.datasets import load_qa, make_chunks
    from ragcache.bench.environment import machine_info
    from ragcache.config import Settings
    from ragcache.engine import BlendEngine

    settings = Settings.load(store={"ssd_cache_dir": args.kv_dir, "remote_url": ""})
    t0 = time.perf_counter()
    engine = BlendEngine(settings)
    start_s = time.perf_counter() - t0
    print(f"engine start {start_s:.1f} s (dtype {engine.dtype.dtype}: {engine.dtype.reason})", flush=True)
    try:
        ex = load_qa(args.dataset, n=1, offset=args.example)[0]
        chunks = make_chunks(engine.tokenizer, ex.passages[:args.passages])
        engine.precompute(chunks)
        prompt = engine.prompts.build(ex.question, chunks)
        result = {"start_s": round(start_s, 2), "prompt_tokens": len(prompt.token_ids), "dtype": engine.dtype.dtype,
                  "machine": machine_info(), "modes": {}}
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            ttfts = [engine.generate(prompt, mode, max_tokens=1).metrics.ttft_s for _ in range(args.repeats)]
            steady = statistics.median(ttfts[1:]) if len(ttfts) > 1 else None
            ratio = ttfts[0] / steady if steady else None
            result["modes"][mode] = {"ttft_s": [round(t, 3) for t in ttfts], "first_s": round(ttfts[0], 3),
                                     "steady_median_s": None if steady is None else round(steady, 3),
                                     "first_vs_steady": None if ratio is None else round(ratio, 3)}
            print(f"{mode}: first {ttfts[0]:.2f} s, later {', '.join(f'{t:.2f}' for t in ttfts[1:])} s "
                  f"-> first / steady {ratio:.2f}" if ratio else f"{mode}: {ttfts}", flush=True)
    finally:
        engine.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
