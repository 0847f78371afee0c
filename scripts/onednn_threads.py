"""Is vLLM's CPU matrix multiply safe to call from two threads at once? It is not, and this shows it.

vLLM's CPU build runs a model's linear layers through ``torch.ops._C.onednn_mm``, whose handlers
share one process-wide scratch buffer (``DNNLScratchPadManager`` in vLLM's csrc/cpu/dnnl_helper).
Two threads in it at once corrupt each other's results, and can crash when the buffer grows. This
is why ragcache never runs a model forward outside the engine's own thread: a chunk found damaged
while layers are read ahead in the background is recomputed on the caller's thread
(``ragcache.blend.LoadOnCaller``).

The script multiplies a few activation shapes by a SmolLM2-sized projection (576 x 1536), first
on one thread, then the same calls on two threads at once, and counts the products that differ
bitwise from the one-thread result. It prints the counts and writes them, with the machine
(``ragcache.bench.environment.machine_info``) and the CPU's reported flags, as JSON. The two-thread
part may kill the process instead (a segmentation fault or an abort: an exit status of 139 or
134): that is the same finding.

Usage::

    python scripts/onednn_threads.py [--dtype bfloat16|float32] [--rounds 300] [--out FILE]

Raises SystemExit when the installed vLLM has no ``onednn_mm`` (a GPU build).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = (7, 300, 1500, 3000)  # activation rows: a decode step to a long prefill
K, N = 576, 1536  # SmolLM2-135M's hidden size and its MLP width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=300, help="passes over the shapes per thread")
    parser.add_argument("--out", default="onednn_threads.json", help="JSON file to write")
    args = parser.parse_args()

    from vllm import _custom_ops as ops

    from ragcache.bench.environment import machine_info
    from ragcache.engine.dtype import REPORTED_CPU_FLAGS, cpu_flags

    if not getattr(ops, "_supports_onednn", False):
        raise SystemExit("this vLLM build has no onednn_mm (a GPU build?): nothing to check")
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(N, K, generator=g).to(dtype) for _ in range(2)]
    handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]
    xs = [torch.randn(m, K, generator=g).to(dtype) for m in SHAPES]
    expected = [[ops.onednn_mm(h, x, None) for x in xs] for h in handlers]

    def run(t: int, differ: list[int]) -> None:
        for _ in range(args.rounds):
            for x, want in zip(xs, expected[t]):
                differ[t] += not torch.equal(ops.onednn_mm(handlers[t], x, None), want)

    rows = []
    for threads in (1, 2):
        differ = [0, 0]
        workers = [threading.Thread(target=run, args=(t, differ)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        calls = threads * args.rounds * len(SHAPES)
        rows.append({"threads": threads, "calls": calls, "differ": sum(differ[:threads])})

    machine = {**machine_info(), "cpu_flags": sorted(cpu_flags() & set(REPORTED_CPU_FLAGS))}
    print(f"onednn_mm, {args.dtype}, {K}x{N} weights, rows {SHAPES}; CPU: {machine.get('cpu_model')}")
    print("| threads at once | products | differ from one thread's |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {row['threads']} | {row['calls']:,} | {row['differ']:,} |")
    with open(args.out, "w") as f:
        json.dump({"dtype": args.dtype, "shape": [K, N], "rows_per_call": SHAPES, "machine": machine,
                   "torch_threads": torch.get_num_threads(), "results": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
