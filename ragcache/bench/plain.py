"""The ``plain`` baseline: the same prompts through a plain vLLM engine, without ragcache.

Owns: :class:`PlainVLLM`, a child process holding a ``vllm.LLM`` created the way a user would
create it instead of ragcache: same model folder, same dtype (the engine's resolved one), same
context length and KV cache size, prefix caching as vLLM defaults it, no KV connector, no worker
extension. The parent sends token ids and gets back vLLM's own TTFT, so ``full`` (ragcache's
engine with the connector idle) and ``plain`` are timed the same way on the same host in the same
run; the child waits idle while the parent's engine runs and vice versa.

Imports vLLM only inside the child process. Never app/ or ui/.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid
from typing import Any


def _serve(conn: Any, engine_kwargs: dict[str, Any], threads: str) -> None:
    """Child process: build the plain engine, then answer ``(token_ids, max_tokens)`` until None."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: start-up 6 s instead of 30 s
    os.environ["OMP_NUM_THREADS"] = threads
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**engine_kwargs, disable_log_stats=False, seed=0)
        conn.send({"ready": True})
    except BaseException as exc:  # report, never hang the parent
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    while True:
        job = conn.recv()
        if job is None:
            break
        token_ids, max_tokens = job
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            # a unique salt: repeated prompts are timed as fresh prefills, as ragcache's full mode
            out = llm.generate([{"prompt_token_ids": token_ids, "cache_salt": uuid.uuid4().hex}], [sp],
                               use_tqdm=False)[0]
            m = out.metrics
            conn.send({"ttft_s": float(getattr(m, "first_token_latency", 0.0) or 0.0),
                       "token_ids": list(out.outputs[0].token_ids)})
        except BaseException as exc:
            conn.send({"error": f"{type(exc).__name__}: {exc}"})


class PlainVLLM:
    """A plain ``vllm.LLM`` in a child process, for the ``plain`` baseline of ``bench ttft``.

    Args:
        model: the HF model folder the ragcache engine loaded.
        dtype: the dtype the ragcache engine resolved (``engine.dtype.dtype``), or the other one for
            the noise floor; kept as ``self.dtype``.
        max_model_len: context length in tokens.
        kv_cache_memory_bytes: paged KV cache size in bytes.
        enforce_eager: as the ragcache engine (no compile step on CPU).
        max_num_batched_tokens: vLLM's scheduler budget per step (None: vLLM's, 4096 on CPU).

    Raises:
        RuntimeError: the child could not create the engine (its error is in the message).
    """

    def __init__(self, *, model: str, dtype: str, max_model_len: int, kv_cache_memory_bytes: int,
                 enforce_eager: bool, max_num_batched_tokens: int | None = None) -> None:
        self.dtype = dtype
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        kwargs = {"model": model, "dtype": dtype, "max_model_len": max_model_len,
                  "kv_cache_memory_bytes": kv_cache_memory_bytes, "enforce_eager": enforce_eager,
                  "use_tqdm_on_load": False}  # no shard-loading bar in the benchmark's output
        if max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        threads = os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1)
        self._proc = ctx.Process(target=_serve, args=(child, kwargs, threads), daemon=True)
        self._proc.start()
        ready = self._conn.recv()
        if "error" in ready:
            self.close()
            raise RuntimeError(f"the plain vLLM baseline did not start: {ready['error']}")

    @classmethod
    def like(cls, engine: Any, dtype: str | None = None) -> "PlainVLLM":
        """A plain engine configured like ragcache's ``engine`` (a BlendEngine), in ``dtype`` (None:
        the engine's)."""
        e = engine.settings.engine
        return cls(model=str(engine.llm_info.path), dtype=dtype or engine.dtype.dtype, max_model_len=e.max_model_len,
                   kv_cache_memory_bytes=e.kv_cache_memory_bytes, enforce_eager=e.enforce_eager)

    def generate(self, token_ids: list[int], max_tokens: int) -> dict[str, Any]:
        """``{"ttft_s", "token_ids"}`` of one greedy request (seconds, the generated ids).

        Raises:
            RuntimeError: the request failed in the child.
        """
        self._conn.send((list(token_ids), int(max_tokens)))
        out = self._conn.recv()
        if "error" in out:
            raise RuntimeError(f"plain vLLM request failed: {out['error']}")
        return out

    def close(self) -> None:
        """Stop the child process."""
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()


def run_plain(settings: Any, example: Any, *, dtype: str = "auto", passages: int = 10, runs: int = 2,
              max_num_batched_tokens: int | None = None, progress: Any = None) -> dict[str, Any]:
    """Full-prefill TTFT of a plain ``vllm.LLM`` in any ``dtype`` (``ragcache bench plain``): vLLM's own
    ``auto`` downcasts a float32 checkpoint to the platform's preferred dtype, ragcache's ``auto``
    picks per host; this shows what each costs here. The example's first ``passages`` passages and
    its question (~6k tokens of MuSiQue) are prefilled ``runs`` times after an untimed short request.

    Returns:
        ``{"benchmark": "plain", "dtype", "prompt_tokens", "ttft_s": [...], "ttft_median_s"}``; seconds.

    Raises:
        RuntimeError: the plain engine did not start (its error in the message).
    """
    import statistics

    from ragcache.models import load_tokenizer, resolve_llm

    say = progress or (lambda _msg: None)
    e = settings.engine
    tokenizer = load_tokenizer(settings).tokenizer
    text = "\n\n".join(f"{title}\n{body}" for title, body in example.passages[:passages])
    ids = list(tokenizer(text + "\n" + example.question)["input_ids"])
    plain = PlainVLLM(model=str(resolve_llm(settings.models.model, settings.models.cache_dir).path), dtype=dtype,
                      max_model_len=e.max_model_len, kv_cache_memory_bytes=e.kv_cache_memory_bytes,
                      enforce_eager=e.enforce_eager, max_num_batched_tokens=max_num_batched_tokens)
    try:
        plain.generate(ids[:256], 1)  # the first request's one-time costs, untimed
        ttfts = []
        for run in range(runs):
            ttfts.append(plain.generate(ids, 1)["ttft_s"])
            say(f"run {run}: TTFT {ttfts[-1]:.2f} s")
    finally:
        plain.close()
    return {"benchmark": "plain", "dtype": dtype, "prompt_tokens": len(ids), "runs": runs,
            "max_num_batched_tokens": max_num_batched_tokens, "ttft_s": [round(t, 3) for t in ttfts],
            "ttft_median_s": round(statistics.median(ttfts), 3)}

