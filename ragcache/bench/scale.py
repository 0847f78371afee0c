"""``bench scale``: replicas sharing one pgvector index and one Redis Cluster KV tier behind HAProxy.

Owns the scale benchmark. It starts every service itself (PostgreSQL with pgvector, a 3-master
Redis Cluster, ``ragcache serve`` replicas, HAProxy: :mod:`ragcache_testing.services`), ingests the
examples' passages with ``ragcache ingest`` (the local executor, and ``--executor ray`` when Ray is
installed), then measures with real HTTP clients:

- ingest: wall time, chunks/s and KV tokens/s, local vs Ray;
- the first ask of every question on a replica that never saw its chunks: the share of chunk KV
  served by the shared tier, and ``remote_vs_cpu_ttft`` (server TTFT of that first ask over the
  TTFT of the same prompt again from the replica's RAM tier, median of per-question ratios);
- 1 vs 2 replicas under the same client load (``clients`` concurrent clients, each sending its next
  request when the last one is answered): client TTFT p50/p90, requests/s, per-replica requests and
  hit rates, Redis bytes read per request;
- failover: a replica killed with SIGKILL mid-stream, then the balancer's next request.

Processes are started as ``python -m app.cli`` (nothing from app/ is imported); uses httpx as the
client; never ui/.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ragcache.bench.common import Progress, target
from ragcache.bench.datasets import QAExample
from ragcache.bench.metrics import median, percentile, rounded
from ragcache.bench.serve import write_passages
from ragcache_testing.services import REPO_ROOT, HAProxyBalancer, PostgresServer, RedisClusterServer, ReplicaProcess

#: targets of the scale-out benchmark: every replica's first ask served from the remote tier, remote-tier
#: TTFT at most 1.3x the RAM tier's, a Ray ingest at most 1.5x a local one's time, every request answered
#: through a failover
SCALE_TARGETS = {"replica_first_ask_remote_hit_rate_min": 1.0, "remote_vs_cpu_ttft_max": 1.3,
                 "ray_vs_local_ingest_max": 1.5, "failover_answered_min": 1.0}
INDEX = "scale"


def process_env(pg_url: str, redis_url: str, kv_dir: Path, *, cpu_gb: float = 1.0,
                extra: dict[str, str] | None = None) -> dict[str, str]:
    """The ``RAGCACHE_*`` settings of one process of the deployment (replica or ingest): the shared
    pgvector index and Redis Cluster tier, its own disk folder, a small vLLM KV cache."""
    return {
        "RAGCACHE_INGEST__VECTOR_STORE": "pgvector", "RAGCACHE_INGEST__PG_URL": pg_url,
        "RAGCACHE_STORE__REMOTE_URL": redis_url, "RAGCACHE_STORE__REMOTE_CLUSTER": "true",
        "RAGCACHE_STORE__SSD_CACHE_DIR": str(kv_dir), "RAGCACHE_STORE__CPU_KV_POOL_GB": str(cpu_gb),
        "RAGCACHE_ENGINE__MAX_MODEL_LEN": "4096", "RAGCACHE_ENGINE__KV_CACHE_MEMORY_BYTES": str(512 << 20),
        **(extra or {}),
    }


def run_ingest_process(env: dict[str, str], path: Path, index: str, executor: str, log: Path) -> dict[str, Any]:
    """``python -m app.cli ingest PATH --index INDEX --executor E`` in a child process, timed.

    Returns:
        ``{wall_s, chunks, kv_tokens, kv_computed, chunks_per_s, kv_tokens_per_s}``.

    Raises:
        RuntimeError: the ingest failed (the end of its output is in the message).
    """
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")},
            "PYTHONPATH": str(REPO_ROOT), "VLLM_LOGGING_LEVEL": "WARNING", **env}
    t0 = time.perf_counter()
    flags = [] if executor == "local" else ["--executor", executor]
    out = subprocess.run([sys.executable, "-m", "app.cli", "ingest", str(path), "--index", index, "--quiet", *flags],
                         cwd=REPO_ROOT, env=full, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log.write_text(out.stdout + "\n" + out.stderr, encoding="utf-8")
    if out.returncode != 0:
        raise RuntimeError(f"ingest ({executor}) failed with {out.returncode}: {out.stderr.strip()[-800:]}")
    chunks = int(m.group(1)) if (m := re.search(r"(\d+) chunks added", out.stdout)) else 0
    kv = re.search(r"KV precompute: (\d+) entries computed \((\d+) tokens", out.stdout)
    computed, tokens = (int(kv.group(1)), int(kv.group(2))) if kv else (0, 0)
    return {"executor": executor, "wall_s": rounded(wall, 2), "chunks": chunks, "kv_computed": computed,
            "kv_tokens": tokens, "chunks_per_s": rounded(chunks / wall, 2), "kv_tokens_per_s": rounded(tokens / wall, 1)}


def _body(question: str, top_k: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": INDEX, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            "messages": [{"role": "user", "content": question}], "ragcache": {"top_k": top_k}}


def ask(url: str, question: str, *, top_k: int, max_tokens: int) -> dict[str, Any]:
    """One non-streamed request; ``{replica, ttft_s, tiers, cached_tokens}`` (server-side TTFT).

    Raises:
        httpx.HTTPError: no answer.
    """
    import httpx

    r = httpx.post(f"{url}/v1/chat/completions", json=_body(question, top_k, max_tokens, False), timeout=600)
    r.raise_for_status()
    body = r.json()
    return {"replica": r.headers.get("x-ragcache-replica", ""), "ttft_s": body["ragcache"]["metrics"]["ttft_s"],
            "tiers": [s["tier"] for s in body["ragcache"]["sources"]],
            "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


async def _client_load(url: str, questions: Sequence[str], clients: int, *, top_k: int,
                       max_tokens: int) -> list[dict[str, Any]]:
    """``clients`` concurrent streaming clients over ``questions`` (each question once); per request
    the client TTFT (send to first text piece), the replica and the tiers."""
    import json

    import httpx

    queue = list(questions)
    out: list[dict[str, Any]] = []

    async def one(client: httpx.AsyncClient) -> None:
        while queue:
            q = queue.pop(0)
            t0 = time.perf_counter()
            first, tiers, replica = None, [], ""
            async with client.stream("POST", f"{url}/v1/chat/completions",
                                     json=_body(q, top_k, max_tokens, True)) as resp:
                resp.raise_for_status()
                replica = resp.headers.get("x-ragcache-replica", "")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - t0
                    extra = chunk.get("ragcache") or {}
                    if "metrics" in extra:
                        tiers = [s["tier"] for s in extra.get("sources", [])]
            out.append({"question": q, "client_ttft_s": first, "total_s": time.perf_counter() - t0,
                        "replica": replica, "tiers": tiers})

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*[one(client) for _ in range(clients)])
    return out


def _cache(url: str) -> dict[str, Any]:
    import httpx

    return httpx.get(f"{url}/v1/cache", timeout=60).json()["tiers"]


def _load_row(name: str, reqs: list[dict[str, Any]], wall: float, replicas: list[ReplicaProcess],
              before: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["client_ttft_s"] for r in reqs if r["client_ttft_s"] is not None]
    per: dict[str, Any] = {}
    read = 0
    for i, rep in enumerate(replicas, 1):
        label = f"replica{i}"
        now = _cache(rep.url)
        b = before.get(label, {})
        lookups = now["remote"]["lookups"] - b.get("remote", {}).get("lookups", 0)
        hits = {t: now[t]["hits"] - b.get(t, {}).get("hits", 0) for t in now}
        mine = [r for r in reqs if r["replica"] == label]
        read += now["remote"]["bytes_read"] - b.get("remote", {}).get("bytes_read", 0)
        per[label] = {"requests": len(mine), "chunk_lookups": lookups,
                      "hit_rate": {t: rounded(h / lookups, 3) if lookups else None for t, h in hits.items()},
                      "client_ttft_p50_s": rounded(median([r["client_ttft_s"] for r in mine if r["client_ttft_s"]]), 3)}
    return {"replicas": name, "requests": len(reqs), "wall_s": rounded(wall, 2),
            "requests_per_s": rounded(len(reqs) / wall, 3), "client_ttft_p50_s": rounded(median(ttfts), 3),
            "client_ttft_p90_s": rounded(percentile(ttfts, 90), 3),
            "redis_bytes_read_per_request": rounded(read / max(1, len(reqs)), 0), "per_replica": per}


def _snapshot(replicas: list[ReplicaProcess]) -> dict[str, dict[str, Any]]:
    return {f"replica{i}": _cache(r.url) for i, r in enumerate(replicas, 1)}


def failover(balancer_url: str, replicas: list[ReplicaProcess], question: str, *, top_k: int) -> dict[str, Any]:
    """Kill the replica serving a streamed answer after its first text piece; then one request
    through the balancer. ``{killed, next_status, next_replica, answered}``."""
    import httpx

    victim, broke = None, False
    try:
        with httpx.stream("POST", f"{balancer_url}/v1/chat/completions", json=_body(question, top_k, 32, True),
                          timeout=600) as resp:
            victim = replicas[int(resp.headers["x-ragcache-replica"].removeprefix("replica")) - 1]
            for line in resp.iter_lines():
                if '"content"' in line and victim.alive:
                    victim.kill()
    except httpx.HTTPError:
        broke = True
    t0 = time.perf_counter()
    r = httpx.post(f"{balancer_url}/v1/chat/completions", json=_body(question, top_k, 8, False), timeout=600)
    ok = r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"])
    return {"killed": f"replica{replicas.index(victim) + 1}" if victim else None, "stream_broke": broke,
            "next_status": r.status_code, "next_replica": r.headers.get("x-ragcache-replica"),
            "next_total_s": rounded(time.perf_counter() - t0, 3), "answered": ok}


def run_scale(examples: Sequence[QAExample], *, work_dir: Path, clients: int = 2, top_k: int = 5,
              max_tokens: int = 8, ray: bool | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """The whole scale benchmark (see the module docstring); every service is started and stopped here.

    Args:
        examples: their passages are ingested; their questions are asked.
        work_dir: logs, the passages file, the replicas' disk folders.
        clients: concurrent clients of the load phases.
        top_k: chunks per question. max_tokens: tokens decoded per answer (ignore_eos).
        ray: also ingest with ``--executor ray``; None = when the ray package is installed (else
            the result says so and the ``ray_vs_local_ingest`` target is unmeasured).

    Raises:
        RuntimeError: a service did not start, or an ingest failed.
    """
    say = progress or (lambda _m: None)
    passages = write_passages(examples, work_dir / "passages.json")
    questions = [ex.question for ex in examples]
    from ragcache.config import Settings
    from ragcache.engine.dtype import resolve_dtype

    choice = resolve_dtype(Settings.load().engine.dtype)  # what every replica resolves on this host
    result: dict[str, Any] = {"benchmark": "scale", "examples": len(examples), "clients": clients,
                              "top_k": top_k, "max_tokens": max_tokens,
                              "dtype": {"dtype": str(choice.dtype), "reason": choice.reason,
                                        "cpu_flags": sorted(choice.cpu_flags)}}
    pg = PostgresServer()
    cluster = RedisClusterServer(work_dir / "cluster")
    replicas: list[ReplicaProcess] = []
    balancer: HAProxyBalancer | None = None
    try:
        pg.start()
        cluster.start()
        say(f"PostgreSQL {pg.version()} on {pg.url}; Redis Cluster {cluster.version()} on {cluster.url}")
        services = [{"name": "postgresql+pgvector", "version": pg.version(), "nodes": 1},
                    {"name": "redis-cluster", "version": cluster.version(), "nodes": len(cluster.ports)}]
        env = process_env(pg.url, cluster.url, work_dir / "kv-ingest")
        ingest: dict[str, Any] = {}
        if ray is None:
            import importlib.util

            ray = importlib.util.find_spec("ray") is not None
        if ray:
            say("ingest with --executor ray ...")
            ingest["ray"] = run_ingest_process({**env, "RAGCACHE_STORE__NAMESPACE": "rayrun"}, passages,
                                               INDEX + "-ray", "ray", work_dir / "ingest-ray.log")
            say(f"ray: {ingest['ray']}")
        else:
            ingest["ray"] = {"skipped": "ray is not installed (pip install 'ray[data]')"}
        say("ingest with the local executor ...")
        ingest["local"] = run_ingest_process(env, passages, INDEX, "local", work_dir / "ingest-local.log")
        shutil.rmtree(work_dir / "kv-ingest", ignore_errors=True)
        say(f"local: {ingest['local']}")
        result["ingest"] = ingest

        replicas = [ReplicaProcess(process_env(pg.url, cluster.url, work_dir / f"kv-replica{i}"), INDEX,
                                   work_dir / f"replica{i}.log") for i in (1, 2)]
        replicas[0].start().wait_ready()
        say("replica1 ready")
        # first asks on replica1: every chunk from the shared tier, then the same prompt from its RAM tier
        warm = ask(replicas[0].url, "warm up: " + questions[-1], top_k=top_k, max_tokens=max_tokens)
        first, again = [], []
        for q in questions[: max(1, len(questions) // 2)]:
            first.append(ask(replicas[0].url, q, top_k=top_k, max_tokens=max_tokens))
            again.append(ask(replicas[0].url, q, top_k=top_k, max_tokens=max_tokens))
        served = [t for r in first for t in r["tiers"]]
        ratios = [a["ttft_s"] / b["ttft_s"] for a, b in zip(first, again) if b["ttft_s"]]
        result["first_ask"] = {
            "warm_up_tiers": warm["tiers"], "questions": len(first),
            "tiers": {t: served.count(t) for t in sorted(set(served))},
            "again_tiers": {t: sum(r["tiers"].count(t) for r in again) for t in {"cpu", "remote", "computed"}},
            "remote_ttft_p50_s": rounded(median([r["ttft_s"] for r in first]), 4),
            "cpu_ttft_p50_s": rounded(median([r["ttft_s"] for r in again]), 4),
            "remote_vs_cpu_ttft_median": rounded(median(ratios), 3)}
        say(f"first asks: {result['first_ask']}")

        balancer = HAProxyBalancer(work_dir / "haproxy1", [replicas[0].address]).start()
        services.append({"name": "haproxy", "version": balancer.version(), "nodes": 1})
        load = questions[len(first):] or questions
        before = _snapshot(replicas[:1])
        t0 = time.perf_counter()
        reqs = asyncio.run(_client_load(balancer.url, load, clients, top_k=top_k, max_tokens=max_tokens))
        result["load"] = [_load_row("1", reqs, time.perf_counter() - t0, replicas[:1], before)]
        balancer.stop()
        say(f"1 replica: {result['load'][0]}")

        replicas[1].start().wait_ready()
        say("replica2 ready")
        balancer = HAProxyBalancer(work_dir / "haproxy2", [r.address for r in replicas]).start()
        before = _snapshot(replicas)
        t0 = time.perf_counter()
        reqs = asyncio.run(_client_load(balancer.url, load, clients, top_k=top_k, max_tokens=max_tokens))
        result["load"].append(_load_row("2", reqs, time.perf_counter() - t0, replicas, before))
        r2 = [r for r in reqs if r["replica"] == "replica2"]
        r2_tiers = [t for r in r2 for t in r["tiers"]]
        result["replica2_tiers"] = {t: r2_tiers.count(t) for t in sorted(set(r2_tiers))}
        say(f"2 replicas: {result['load'][1]}")

        result["failover"] = failover(balancer.url, replicas, questions[0], top_k=top_k)
        say(f"failover: {result['failover']}")
        result["services"] = services + [{"name": "ragcache-serve", "version": "replicas", "nodes": len(replicas)}]
    finally:
        if balancer is not None:
            balancer.stop()
        for r in replicas:
            r.stop()
        cluster.stop()
        pg.stop()

    fa = result["first_ask"]
    remote_share = fa["tiers"].get("remote", 0) / max(1, sum(fa["tiers"].values()))
    ray_ratio = None
    if "wall_s" in result["ingest"].get("ray", {}):
        ray_ratio = result["ingest"]["ray"]["wall_s"] / result["ingest"]["local"]["wall_s"]
    result["targets"] = {
        "replica_first_ask_remote_hit_rate": target(remote_share, SCALE_TARGETS["replica_first_ask_remote_hit_rate_min"],
                                                    "min", "share of chunk KV a replica's first ask took from the "
                                                    "shared tier (chunks ingested by another process)"),
        "remote_vs_cpu_ttft": target(fa["remote_vs_cpu_ttft_median"], SCALE_TARGETS["remote_vs_cpu_ttft_max"], "max",
                                     "blend TTFT with chunk KV from the Redis Cluster over the same prompt from the "
                                     "replica's RAM tier (median of per-question ratios, server-side TTFT)"),
        "ray_vs_local_ingest": target(ray_ratio, SCALE_TARGETS["ray_vs_local_ingest_max"], "max",
                                      "ingest wall time through Ray Data over the local path, same passages"),
        "failover_answered": target(1.0 if result["failover"]["answered"] else 0.0,
                                    SCALE_TARGETS["failover_answered_min"], "min",
                                    "after a replica is killed mid-stream, the balancer's next request is answered"),
    }
    return result
