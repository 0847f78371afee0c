"""``bench serve``: concurrent streaming clients against one ``ragcache serve``, full vs blend.

Owns the serve benchmark: an index of the examples' passages (ingested with KV precompute, as
``ragcache ingest`` does), the in-process SDK baseline, the server in a child process
(:class:`ServerProcess`), the HTTP load (``C`` clients, each sending its next
streaming chat completion as soon as the last one finished, until ``requests`` have been
answered per level and mode), the per-level rows, blend-over-full ratios and the targets. Client
TTFT is measured at the client: from sending the request to the first chunk with text
(retrieval, queueing, KV load or prefill, HTTP and SSE included). Every request sets
``ignore_eos`` so full and blend decode the same number of tokens. Uses httpx as the client;
never app/ or ui/.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Sequence

from ragcache.bench.common import BenchConfigError, Progress, target
from ragcache.bench.datasets import QAExample
from ragcache.bench.metrics import mean, median, percentile, rounded
from ragcache.config import Settings
from ragcache.quality.measures import rotated
from ragcache_testing.services import free_port, health_ok

log = logging.getLogger(__name__)

#: the index the benchmark builds in its work folder
INDEX = "bench"

#: targets of the serve benchmark: at 4 and at 8 clients blend
#: serves >= 2x the requests/s of full with a >= 3x lower client TTFT p50; at 1 client the server adds
#: <= 50 ms p50 over the in-process SDK
SERVE_TARGETS = {"blend_vs_full_rps_min": 2.0, "blend_ttft_p50_speedup_min": 3.0,
                 "server_overhead_p50_at_1_max_s": 0.05}
#: the client counts the blend-over-full targets are read at
TARGET_CONCURRENCY = (4, 8)


def _child(settings: Settings, log_level: str) -> None:
    """The server process: ``ragcache serve`` with vLLM's and the app's logs at warnings."""
    from ragcache.server import serve

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(settings, log_level=log_level)


class ServerProcess:
    """``ragcache serve`` in a spawned child process on a free loopback port (a context manager).

    A spawned child (no fork of a process holding threads and an engine), measured from outside
    like any client would. ``with ServerProcess(settings) as srv:`` returns once GET /health answers; ``srv.url`` is the
    base URL (``http://127.0.0.1:PORT``). Leaving the block stops the server (SIGTERM, then SIGKILL
    after ``stop_timeout_s``) together with its vLLM engine.

    Args:
        settings: the server's settings; ``serve.host`` / ``serve.port`` are replaced by 127.0.0.1
            and a free port.
        start_timeout_s: seconds to wait for the engine start-up (tens of seconds on CPU).

    Raises:
        RuntimeError: the child exited or did not answer within ``start_timeout_s``.
    """

    def __init__(self, settings: Settings, *, start_timeout_s: float = 600.0, stop_timeout_s: float = 30.0,
                 log_level: str = "warning"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = settings.model_copy(update={"serve": settings.serve.model_copy(
            update={"host": "127.0.0.1", "port": self.port})})
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_level = log_level
        self.process: Any = None

    def __enter__(self) -> "ServerProcess":
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads and vLLM state
        self.process = ctx.Process(target=_child, args=(self.settings, self.log_level), name="ragcache-serve")
        self.process.start()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if not self.process.is_alive():
                raise RuntimeError(f"the server process exited with status {self.process.exitcode} before it was "
                                   "ready (its log is above)")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not answer {self.url}/health within {self.start_timeout_s:.0f} s")

    def healthy(self) -> bool:
        """Whether GET /health answers 200 now."""
        return health_ok(self.url)

    def stop(self) -> None:
        """Stop the server and its engine (idempotent)."""
        p = self.process
        if p is None or not p.is_alive():
            return
        p.terminate()
        p.join(self.stop_timeout_s)
        if p.is_alive():
            log.warning("the server did not stop within %.0f s; killing it", self.stop_timeout_s)
            p.kill()
            p.join(5)

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_passages(examples: Sequence[QAExample], path: Path) -> Path:
    """The examples as a QA JSON file (``[{question, answers, ctxs: [{title, text}]}]``) that
    ``ragcache ingest`` reads as one document per distinct passage."""
    records = [{"question": ex.question, "answers": ex.answers,
                "ctxs": [{"title": t, "text": x} for t, x in ex.passages]} for ex in examples]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    return path


def sdk_baseline(settings: Settings, passages_file: Path, questions: Sequence[str], *, top_k: int,
                 max_tokens: int, progress: Progress, requests: int | None = None) -> dict[str, Any]:
    """Ingest ``passages_file`` into the work index with KV precompute on an in-process BlendEngine,
    then time the SDK: seconds from ``RAGPipeline.stream`` to its first text piece, blend mode, after
    an untimed pass of each question, over the sequence the 1-client level sends (``requests``
    questions in turn, :func:`_level`; default each once), so the server's overhead is read on the
    same prompts. Returns ``{"ingest", "ttft_s": [...], "ttft_p50_s"}``."""
    from ragcache.engine import BlendEngine
    from ragcache.options import QueryOptions, SamplingOptions
    from ragcache.pipeline import RAGPipeline

    engine = BlendEngine(settings)
    try:
        rag = RAGPipeline(settings, INDEX, engine)
        report = rag.ingest([passages_file])
        progress(f"ingested {report.total_chunks} chunks ({report.chunks_added} new) with KV precompute")
        opts = QueryOptions(mode="blend", top_k=top_k, max_tokens=max_tokens, sampling=SamplingOptions(ignore_eos=True))
        times = []
        timed_order = [questions[i % len(questions)] for i in range(max(requests or len(questions), 1))]
        for timed, order in ((False, questions), (True, timed_order)):
            for q in order:
                t0 = time.perf_counter()
                stream = rag.stream(q, opts)
                for item in stream:
                    if isinstance(item, str) and item:
                        break
                if timed:
                    times.append(time.perf_counter() - t0)
                for _ in stream:  # the rest of the answer, as a client would read it
                    pass
        return {"ingest": {"chunks": report.total_chunks, "tokens_added": report.tokens_added},
                "ttft_s": [rounded(t) for t in times], "ttft_p50_s": rounded(median(times))}
    finally:
        engine.close()


async def _one(http: Any, url: str, question: str, mode: str, *, top_k: int, max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion; client-side timings (seconds) and what the server reported."""
    body = {"model": INDEX, "messages": [{"role": "user", "content": question}], "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "ignore_eos": True, "ragcache": {"mode": mode, "top_k": top_k}}
    t0 = time.perf_counter()
    ttft, usage, server, error = None, None, {}, None
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
        else:
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                elif chunk["choices"] and ttft is None and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
                elif chunk.get("usage"):
                    usage, server = chunk["usage"], chunk["ragcache"]["metrics"]
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "usage": usage, "server": server, "error": error}


async def _level(url: str, questions: Sequence[str], mode: str, *, clients: int, requests: int, top_k: int,
                 max_tokens: int) -> dict[str, Any]:
    """``clients`` concurrent closed-loop clients sending ``requests`` streamed completions in all."""
    import httpx

    todo = list(range(requests))
    records: list[dict[str, Any]] = []

    async def client(http: Any) -> None:
        while todo:
            i = todo.pop(0)
            records.append(await _one(http, url, questions[i % len(questions)], mode, top_k=top_k,
                                      max_tokens=max_tokens))

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    ok = [r for r in records if r["error"] is None and r["usage"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "concurrency": clients, "mode": mode, "requests": len(records), "errors": len(records) - len(ok),
        "wall_s": rounded(wall, 3), "requests_per_s": rounded(len(ok) / wall),
        "output_tokens_per_s": rounded(sum(r["usage"]["completion_tokens"] for r in ok) / wall, 2),
        "ttft_p50_s": rounded(median(ttft)), "ttft_p90_s": rounded(percentile(ttft, 90)),
        "server_ttft_p50_s": rounded(median([r["server"]["ttft_s"] for r in ok])),
        "e2e_p50_s": rounded(median([r["e2e_s"] for r in ok])),
        "prompt_tokens_mean": rounded(mean(r["usage"]["prompt_tokens"] for r in ok), 1),
        "cached_tokens_mean": rounded(mean(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok), 1),
        "first_error": next((r["error"] for r in records if r["error"]), None),
    }


def serve_targets(rows: Sequence[dict[str, Any]], sdk_p50: float | None) -> dict[str, Any]:
    """The targets from the rows: blend over full at each of :data:`TARGET_CONCURRENCY` clients, and
    the server's overhead at 1 client (``met`` is None where a level was not measured)."""
    by = {(r["concurrency"], r["mode"]): r for r in rows}
    t = SERVE_TARGETS
    out: dict[str, Any] = {}
    for c in TARGET_CONCURRENCY:
        full, blend = by.get((c, "full")), by.get((c, "blend"))
        rps = blend["requests_per_s"] / full["requests_per_s"] if full and blend and full["requests_per_s"] else None
        ttft = (full["ttft_p50_s"] / blend["ttft_p50_s"]
                if full and blend and full["ttft_p50_s"] and blend["ttft_p50_s"] else None)
        out[f"blend_vs_full_requests_per_s_at_{c}"] = target(
            rps, t["blend_vs_full_rps_min"], "min", f"requests/s of blend / full, {c} concurrent streaming clients")
        out[f"blend_ttft_p50_speedup_at_{c}"] = target(
            ttft, t["blend_ttft_p50_speedup_min"], "min", f"client TTFT p50 of full / blend, {c} concurrent clients")
    blend1 = by.get((1, "blend"))
    over = blend1["ttft_p50_s"] - sdk_p50 if blend1 and blend1["ttft_p50_s"] is not None and sdk_p50 else None
    out["server_overhead_ttft_p50_at_1_s"] = target(over, t["server_overhead_p50_at_1_max_s"], "max",
                                                    "client TTFT p50 over HTTP minus the in-process SDK's, blend, "
                                                    "1 client")
    return out


def run_serve(settings: Settings, examples: Sequence[QAExample], *, work_dir: Path,
              concurrency: Sequence[int] = (1, 4, 8, 16), modes: Sequence[str] = ("full", "blend"),
              requests: int = 16, top_k: int = 3, max_tokens: int = 16,
              progress: Progress | None = None) -> dict[str, Any]:
    """Run the serve benchmark (see the module docstring); ``settings`` should keep the KV in a scratch
    folder (:func:`ragcache.bench.environment.bench_settings`). Each level sends ``max(C, requests)``
    requests; levels run in increasing C, the modes' order rotating per level, after one untimed
    pass of every question in each mode.

    Raises:
        BenchConfigError: no examples, or an unknown mode.
    """
    say = progress or (lambda _msg: None)
    if not examples:
        raise BenchConfigError("bench serve needs at least one example")
    bad = [m for m in modes if m not in ("full", "prefix", "reuse", "blend")]
    if bad:
        raise BenchConfigError(f"unknown modes {bad}; use full, prefix, reuse or blend")
    settings = settings.model_copy(deep=True)
    settings.ingest.index_dir = work_dir / "indexes"
    settings.serve.index = INDEX
    settings.serve.max_in_flight = max(64, max(concurrency))
    questions = [ex.question for ex in examples]
    passages = write_passages(examples, work_dir / "passages.json")
    sdk = sdk_baseline(settings, passages, questions, top_k=top_k, max_tokens=max_tokens, progress=say,
                       requests=max(1, requests))  # the 1-client level's sequence
    say(f"in-process SDK (blend): time to first piece p50 {sdk['ttft_p50_s']} s")
    rows = []
    with ServerProcess(settings) as srv:
        say(f"server ready at {srv.url}")

        async def warm() -> None:  # every question in blend (chunk KV from disk into the cpu tier), one per mode
            for m in modes:
                n = len(questions) if m in ("reuse", "blend") else 1
                await _level(srv.url, questions, m, clients=1, requests=n, top_k=top_k, max_tokens=2)
        asyncio.run(warm())
        for j, c in enumerate(concurrency):
            for m in rotated(list(modes), j):
                row = asyncio.run(_level(srv.url, questions, m, clients=c, requests=max(c, requests), top_k=top_k,
                                         max_tokens=max_tokens))
                rows.append(row)
                say(f"C={c} {m}: {row['requests_per_s']} req/s, client TTFT p50 {row['ttft_p50_s']} s, "
                    f"{row['errors']} errors")
    ratios = []
    for c in concurrency:
        by = {r["mode"]: r for r in rows if r["concurrency"] == c}
        if "full" in by and "blend" in by and by["full"]["requests_per_s"] and by["blend"]["ttft_p50_s"]:
            ratios.append({"concurrency": c,
                           "requests_per_s": rounded(by["blend"]["requests_per_s"] / by["full"]["requests_per_s"], 3),
                           "ttft_p50_speedup": rounded(by["full"]["ttft_p50_s"] / by["blend"]["ttft_p50_s"], 3)})
    return {"benchmark": "serve", "n": len(examples), "top_k": top_k, "max_tokens": max_tokens,
            "requests_per_level": requests, "modes": list(modes), "sdk": sdk, "rows": rows, "blend_vs_full": ratios,
            "targets": serve_targets(rows, sdk["ttft_p50_s"])}
