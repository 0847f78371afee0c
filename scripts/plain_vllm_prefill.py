#!/usr/bin/env python
"""Full-prefill TTFT of a plain ``vllm.LLM`` (no ragcache connector) on one MuSiQue prompt.

A check of the baseline that ``ragcache bench ttft`` compares against: ragcache's engine runs the
model in float32 on CPU (``engine.dtype = "auto"``), while a plain ``vllm.LLM`` with its own
``dtype="auto"`` downcasts a float32 checkpoint to the platform's preferred dtype (bfloat16 on
CPU). This script prefills the first example's 10 passages + question (~6.2k tokens of
SmolLM2-135M-Instruct) ``--runs`` times, each with a different first token so no prefix cache can
help, and prints vLLM's ``first_token_latency`` in seconds.

    .venv/bin/python scripts/plain_vllm_prefill.py --dtype auto
    .venv/bin/python scripts/plain_vllm_prefill.py --dtype float32 --max-num-batched-tokens 8192

One engine per process (vLLM in-process mode, 2 OpenMP threads unless OMP_NUM_THREADS is set).
"""

from __future__ import annotations

import argparse
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", help="vLLM dtype: auto, float32, bfloat16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="vLLM scheduler budget per step (default: vLLM's, 4096 on CPU)")
    parser.add_argument("--dataset", default="musique", help="QA file (see ragcache bench ttft --dataset)")
    parser.add_argument("--passages", type=int, default=10, help="passages in the prompt")
    parser.add_argument("--runs", type=int, default=2, help="timed prefills")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ragcache.bench.datasets import load_qa, resolve_dataset
    from ragcache.config import Settings
    from ragcache.models import resolve_llm

    settings = Settings.load()
    model = resolve_llm(settings.models.model, settings.models.cache_dir).path
    kwargs = dict(model=str(model), dtype=args.dtype, max_model_len=8192, enforce_eager=True,
                  enable_prefix_caching=False, kv_cache_memory_bytes=2 << 30, seed=0,
                  disable_log_stats=False)  # request metrics (first_token_latency) need stats on
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(**kwargs)
    example = load_qa(resolve_dataset(args.dataset), n=1)[0]
    text = "\n\n".join(f"{title}\n{body}" for title, body in example.passages[:args.passages])
    ids = llm.get_tokenizer()(text + "\n" + example.question)["input_ids"]
    cfg = llm.llm_engine.vllm_config
    print(f"dtype {cfg.model_config.dtype}, max_num_batched_tokens "
          f"{cfg.scheduler_config.max_num_batched_tokens}, prompt {len(ids)} tokens", flush=True)
    llm.generate([TokensPrompt(prompt_token_ids=ids[:256])], SamplingParams(max_tokens=1), use_tqdm=False)
    for run in range(args.runs):
        prompt = TokensPrompt(prompt_token_ids=[ids[0] + run + 1] + ids[1:])
        out = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        print(f"run {run}: TTFT {out.metrics.first_token_latency:.2f} s", flush=True)


if __name__ == "__main__":
    main()
