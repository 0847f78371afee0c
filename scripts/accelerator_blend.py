"""blend/ on an accelerator, against a full prefill there: time, host and device time, operators, host waits.

No vLLM needed: the model is a randomly initialised Llama of a chosen shape. By default the blend runs
the engine's own adapter (``ragcache.engine.ops.VLLMLlamaOps``) over a module tree laid out as
vLLM's (``tests/vllm_style.py``: each module what vLLM's GPU build runs as one fused kernel, written
with torch's closest fused operators), so the figures say what a vLLM engine would dispatch;
``--adapter hf`` runs transformers' own modules instead (``tests/hf_ops.HFLlamaOps``). bfloat16 on the
accelerator torch sees (default CUDA). The context's cached KV is staged as the worker stages it (every
layer at once, K moved in one call), and the attention is blend/'s own for a device without an
engine kernel (``masked_attention``: one launch per layer). Per context length (a 20-token lead-in
and chunks of 300 tokens, a 30-token question tail) it times, median of ``--reps`` after two warm-ups,
synchronising the device around each:

  hf_prefill   transformers' forward over context + tail (SDPA): what a transformers user runs
  compute_kv   ragcache's own layer-wise full prefill of the context (blend/ at ratio 1's math)
  blend        ``blend_batch`` of one blend at the ``[blend]`` defaults (question selection, ratio 0.15, the floor)
  blend_xN     ``--requests`` N such blends (N contexts) in one pass, as one engine step serves them
  reuse        ``reuse_kv`` (moves the cached K only)

and for one blend: the operators it dispatches (``ragcache.blend.opcount``: the torch profiler's
top-level ``aten::`` and custom operators; each a kernel launch on a GPU, views aside), in all and per
layer, also for the N-blend pass; the host time (the profiler's CPU time of those operators) and the
device time (its CUDA kernel time); and, with ``--syncs``, where the blend makes the host wait for
the device (torch's sync debug mode, by ragcache source line). Prints a table and writes JSON. Needs
transformers and pydantic-settings beside torch; measured on an NVIDIA H200 (docs/benchmarks.md, "GPU").

Columns: times in milliseconds; "blend vs prefill" is the prefill's time over the blend's (above
1: blend is sooner). On a CPU (``--device cpu``) the run is a smoke test of the script, not a
measurement: the CPU product path is vLLM's engine (use ``ragcache bench ttft``), and below
``blend.min_recompute_tokens`` (384) of context, e.g. ``--chunks 1``, the blend recomputes every token.

Run from the repository root:
    python scripts/accelerator_blend.py --shape smollm2 --chunks 5,20 --requests 4 --syncs --out results/accel_smollm2.json
    python scripts/accelerator_blend.py --shape llama8b --layers 8 --chunks 5,20 --out results/accel_llama8b.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402
from hf_ops import HFLlamaOps, cached_context  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from vllm_style import vllm_style_llama  # noqa: E402

from ragcache.blend import BlendRequest, CachedKV, Selection, blend_batch, compute_kv, reuse_kv  # noqa: E402
from ragcache.blend.opcount import count_ops  # noqa: E402
from ragcache.blend.stages import synchronize  # noqa: E402  (the blend's own stage clock uses it)
from ragcache.config import BlendSettings  # noqa: E402
from ragcache.engine.ops import VLLMLlamaOps  # noqa: E402

SHAPES = {
    # SmolLM2-135M-Instruct, the default model
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    # Llama-3-8B's layer shape (--layers of them; a smaller vocabulary, which no timed step reads)
    "llama8b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def median_seconds(fn, device: torch.device, reps: int, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync_sites(fn) -> collections.Counter:
    """Host waits for the device during ``fn()``, by the innermost ragcache line (CUDA only)."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "/ragcache/" in f.filename]
        where = f"{frames[-1].filename.split('/ragcache/')[-1]}:{frames[-1].lineno}" if frames else f"{filename}:{lineno}"
        sites[where] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    return sites


def op_counts(fn) -> collections.Counter:
    """aten ops dispatched during ``fn()`` by who asked (torch's dispatch, after decomposition): ``modules``
    (the model's own modules: tests/vllm_style.py or transformers), ``adapter`` (the DecoderOps
    adapter) or ``blend`` (ragcache/blend)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for frame in reversed(traceback.extract_stack(limit=24)):
                name = frame.filename
                if name.endswith(("vllm_style.py", "/modeling_llama.py", "/torch/nn/modules/sparse.py")):
                    counts["modules"] += 1
                    break
                if name.endswith(("hf_ops.py", "/engine/ops/llama.py")):
                    counts["adapter"] += 1
                    break
                if "/ragcache/" in name:
                    counts["blend"] += 1
                    break
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return counts


def host_and_device_ms(fn, device: torch.device) -> tuple[float, float | None]:
    """The profiler's CPU time of the operators ``fn()`` dispatched (host) and, on CUDA, its kernel time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.key_averages()
    host = sum(e.self_cpu_time_total for e in events) / 1e3
    device_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3 if device.type == "cuda" else None
    return host, device_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="layer shape of the random model")
    parser.add_argument("--layers", type=int, default=argparse.SUPPRESS, help="layers (default: all of the shape's)")
    parser.add_argument("--chunks", default="5,20", help="chunks of 300 tokens per context, comma-separated")
    parser.add_argument("--requests", type=int, default=4, help="blends in the batched pass (blend_xN)")
    parser.add_argument("--adapter", choices=("vllm", "hf"), default="vllm",
                        help="vllm: ragcache's vLLM adapter over vLLM-style modules; hf: transformers' modules")
    parser.add_argument("--device", default="cuda", help="torch device (cpu: a smoke test of the script only)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per step (the median is kept)")
    parser.add_argument("--syncs", action="store_true", help="count the host waits of one blend (CUDA)")
    parser.add_argument("--out", type=Path, default=Path("results/accelerator_blend.json"), help="result JSON")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"torch {torch.__version__} sees no CUDA device: run this on a GPU host, or pass --device cpu "
                     "for a smoke test of the script")
    dims = dict(SHAPES[args.shape])
    if getattr(args, "layers", None):
        dims["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    config = LlamaConfig(**dims, max_position_embeddings=16384, attn_implementation="sdpa",
                         rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    with device:
        model = LlamaForCausalLM(config).to(dtype=torch.bfloat16).eval()
    ops = VLLMLlamaOps(vllm_style_llama(model)) if args.adapter == "vllm" else HFLlamaOps(model)
    b = BlendSettings()
    selection = Selection(b.selection, b.chunk_head_tokens, b.question_weight, b.max_chunk_share, b.granule,
                          None if b.probe_layers < 0 else b.probe_layers, b.question_heads, b.candidates,
                          b.refine_layer)
    check_layer = b.check_layer_for(b.selection)
    g = torch.Generator().manual_seed(1)
    rows = []
    for n_chunks in (int(x) for x in args.chunks.split(",")):
        contexts, requests = [], []
        for _ in range(max(1, args.requests)):
            lead = torch.randint(0, dims["vocab_size"], (20,), generator=g).tolist()
            chunks = [torch.randint(0, dims["vocab_size"], (300,), generator=g).tolist() for _ in range(n_chunks)]
            ctx = cached_context(ops, lead, chunks)
            n = ctx.token_ids.shape[0]
            exact = torch.zeros(n, dtype=torch.bool)
            exact[:ctx.chunk_starts[0]] = True  # the lead-in is at its own place
            contexts.append(ctx)
            requests.append(BlendRequest(
                token_ids=ctx.token_ids, positions=ctx.positions, recompute_ratio=b.recompute_ratio,
                min_recompute_tokens=b.min_recompute_tokens, recompute_depth=b.recompute_depth,
                check_layer=check_layer, deviation=b.deviation, selection=selection,
                tail_ids=torch.randint(0, dims["vocab_size"], (30,), generator=g), segment_starts=[0, *ctx.chunk_starts],
                exact=exact))
        ctx = contexts[0]
        n = ctx.token_ids.shape[0]
        prompt = torch.cat([ctx.token_ids, requests[0].tail_ids]).to(device)
        result = {}

        def staged(count: int) -> CachedKV:  # the worker's staging copy of the chunks, every layer at once
            return CachedKV(k_pre=torch.cat([c.k_pre for c in contexts[:count]], dim=1),
                            v=torch.cat([c.v for c in contexts[:count]], dim=1))

        def blend(count: int = 1):
            result[count] = blend_batch(ops, requests[:count], staged(count), on_layer=lambda layer, k, v: None,
                                        prefetch=False)

        with torch.inference_mode():
            ms = {"hf_prefill": median_seconds(lambda: model.model(input_ids=prompt[None], use_cache=True), device,
                                               args.reps),
                  "compute_kv": median_seconds(lambda: compute_kv(ops, ctx.token_ids, ctx.positions), device, args.reps),
                  "blend": median_seconds(blend, device, args.reps)}
            stages = result[1][0].stages  # of the last timed blend (the counting runs below are slower)
            recomputed = int(result[1][0].num_recomputed)
            if args.requests > 1:
                ms[f"blend_x{args.requests}"] = median_seconds(lambda: blend(args.requests), device, args.reps)
            ms["reuse"] = median_seconds(lambda: reuse_kv(ops, ctx.positions, staged(1), lambda *a: None), device,
                                         args.reps)
            sites = sync_sites(blend) if args.syncs and device.type == "cuda" else None
            with count_ops() as one:
                blend()
            with count_ops() as many:
                blend(args.requests)
            host_ms, device_ms = host_and_device_ms(blend, device)
            ops_by = op_counts(blend)
        layers = dims["num_hidden_layers"]
        row = {"context_tokens": n, **{f"{k}_ms": round(v * 1e3, 2) for k, v in ms.items()},
               "recomputed": recomputed,
               "blend_vs_hf_prefill": round(ms["hf_prefill"] / ms["blend"], 2),
               "blend_stages_ms": {k.removesuffix("_s"): round(v * 1e3, 2) for k, v in stages.items()},
               "ops_per_blend": one.total, "ops_per_layer": round(one.total / layers, 1),
               f"ops_per_pass_x{args.requests}": many.total,
               "host_ms": round(host_ms, 2), "device_ms": None if device_ms is None else round(device_ms, 2),
               "aten_ops_by_caller": dict(ops_by), "top_ops": dict(list(one.by_name.items())[:12])}
        if sites is not None:
            row["host_waits"] = sum(sites.values())
            row["host_wait_sites"] = dict(sites.most_common(12))
        rows.append(row)

    name = torch.cuda.get_device_name() if device.type == "cuda" else str(device)
    adapter = "ragcache's vLLM adapter over vLLM-style modules" if args.adapter == "vllm" else "transformers' modules"
    print(f"{name}, torch {torch.__version__}, bf16, shape {args.shape} ({dims['num_hidden_layers']} layers), {adapter}, "
          f"blend at the [blend] defaults ({b.selection}, ratio {b.recompute_ratio}, floor {b.min_recompute_tokens})")
    xn = f"blend_x{args.requests}_ms"
    print(f"| context tokens | hf prefill ms | compute_kv ms | blend ms | {args.requests} blends ms | reuse ms | recomputed "
          "| blend vs prefill | ops / blend (per layer) | ops / pass of N | host ms | device ms | host waits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context_tokens']} | {r['hf_prefill_ms']} | {r['compute_kv_ms']} | {r['blend_ms']} | "
              f"{r.get(xn, '-')} | {r['reuse_ms']} | {r['recomputed']} | {r['blend_vs_hf_prefill']}x | "
              f"{r['ops_per_blend']} ({r['ops_per_layer']}) | {r[f'ops_per_pass_x{args.requests}']} | {r['host_ms']} | "
              f"{r['device_ms'] if r['device_ms'] is not None else '-'} | {r.get('host_waits', '-')} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "accelerator", "device": name, "torch": torch.__version__, "dtype": "bfloat16",
                                    "shape": args.shape, "adapter": args.adapter, "requests": args.requests,
                                    "dims": dims, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
