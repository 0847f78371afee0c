"""Repetition-loop share of 64-token answers over the demo corpus, per mode, through the SDK.

Asks the demo index (`make demo` builds indexes/demo) the 30 questions of the packaged bench set
(`ragcache bench ttft --dataset demo`) and `--extra` more of the same form, "What does module.name
do?", drawn with a fixed seed from the public callables of the demo's modules that the set does not
ask about (the draw depends on the Python version: 3.11.7 here). Each answer is greedy, 64 tokens
(the demo's length), at the settings in force (`RAGCACHE_BLEND__...` to change one); a loop is what
the engine counts as one (an n-gram of >= 2 tokens repeated >= 3 times in a row). Prints one line
per question and a table, and writes every answer to a JSON file.

Run from the repository root, after `make demo`:
    .venv/bin/python scripts/demo_loops.py --modes full,blend --out results/demo_loops.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.demo_cmd import DEMO_MODULES  # noqa: E402
from ragcache.bench.datasets import PACKAGED  # noqa: E402
from ragcache.config import Settings  # noqa: E402
from ragcache.pipeline import RAGPipeline  # noqa: E402


def questions(extra: int, seed: int = 0) -> list[str]:
    """The bench set's 30 questions, then ``extra`` drawn ones about functions it does not ask about."""
    asked = [ex["question"] for ex in json.loads(PACKAGED["demo"].read_text())]
    named = {q.split()[2].rstrip("?") for q in asked}
    pool = []
    for name in DEMO_MODULES:
        module = importlib.import_module(name)
        for attr in sorted(getattr(module, "__all__", dir(module))):
            target = f"{name}.{attr}"
            if not attr.startswith("_") and callable(getattr(module, attr, None)) and target not in named:
                pool.append(target)
    drawn = sorted(random.Random(seed).sample(pool, min(extra, len(pool))))
    return asked + [f"What does {target} do?" for target in drawn]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--modes", default="full,blend", help="modes to ask in, comma-separated (full, reuse, blend)")
    parser.add_argument("--extra", type=int, default=60, help="questions beyond the bench set's 30")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per answer (greedy)")
    parser.add_argument("--out", default="results/demo_loops.json",
                        help="JSON file of every answer (rewritten after each question)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rag = RAGPipeline.open(Settings.load(None), index="demo")
    rows, start = [], time.time()
    try:
        for q in questions(args.extra):
            row = {"question": q}
            for mode in modes:
                answer = rag.query(q, mode=mode, max_tokens=args.max_tokens)
                row[mode] = {"text": answer.text, "loop": bool(answer.metrics.repetition_loop),
                             "ttft_s": round(answer.metrics.ttft_s, 3)}
            rows.append(row)
            out.write_text(json.dumps(rows, indent=1))  # an interrupted run keeps what it asked
            print(q, " ".join(f"{m}:{'LOOP' if row[m]['loop'] else 'ok'}" for m in modes), flush=True)
    finally:
        rag.engine.close()
    print("\n| mode | loops | of | which |\n|---|---:|---:|---|")
    for mode in modes:
        looped = [r["question"].split()[2].rstrip("?") for r in rows if r[mode]["loop"]]
        print(f"| {mode} | {len(looped)} | {len(rows)} | {', '.join(looped)} |")
    print(f"\n{time.time() - start:.0f} s; answers in {out}")


if __name__ == "__main__":
    main()
