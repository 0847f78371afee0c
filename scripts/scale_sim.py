"""Simulate hit rates, TTFT and shared-tier bandwidth vs replicas and corpus size from a measured
``ragcache bench scale`` result (docs/scaling.md shows its output).

Model (every measured input is read from the bench JSON; every assumption is a flag, printed with
the tables):

- question popularity over chunks follows Zipf(alpha); a tier holding the C most popular chunks of
  a corpus of N serves the share H(C, N) = sum_{i<=C} i^-alpha / sum_{i<=N} i^-alpha of chunk
  lookups (an ideal frequency cache; LRU does somewhat worse);
- each replica's RAM tier holds C_ram = ram_gb / b chunks (b: KV bytes per chunk, measured as Redis
  bytes read per request / top_k when every chunk came from the shared tier); with least-connection
  balancing every replica sees every chunk, so its RAM hit rate does not grow with replicas; with
  chunk-affinity routing the replicas' RAM adds up (n * C_ram);
- the shared tier holds C_R = redis_gb * masters / b chunks; chunks beyond it are computed;
- TTFT = cpu-tier TTFT + (share of chunks from the shared tier) * (remote - cpu TTFT, measured for
  all top_k chunks) + (share computed) * top_k * tokens per chunk / precompute tokens/s;
- shared-tier bandwidth = replicas * requests/s per replica (measured at load) * top_k * (1 - RAM
  hit rate) * b; it saturates at masters * node_gbps.

Usage: python scripts/scale_sim.py results/bench_scale.json [--alpha 0.9 --ram-gb 4 --redis-gb 64 ...]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def zipf_share(c: float, n: float, alpha: float) -> float:
    """H(C, N): share of lookups that the C most popular of N chunks receive under Zipf(alpha)."""
    c = max(0.0, min(c, n))
    if c < 1:
        return 0.0

    def gen_harmonic(x: float) -> float:  # sum_{i<=x} i^-alpha, Euler-Maclaurin for large x
        if x <= 1000:
            return sum(i ** -alpha for i in range(1, int(x) + 1))
        head = sum(i ** -alpha for i in range(1, 1001))
        if abs(alpha - 1.0) < 1e-9:
            return head + math.log(x / 1000.0)
        return head + (x ** (1 - alpha) - 1000 ** (1 - alpha)) / (1 - alpha)

    return gen_harmonic(c) / gen_harmonic(n)


def inputs(result: dict) -> dict:
    """The measured numbers the model needs, from a bench scale result."""
    fa = result["first_ask"]
    one = result["load"][0]
    k = result["top_k"]
    local = result["ingest"]["local"]
    chunks_remote = fa["tiers"].get("remote", 0)
    first_q = fa["questions"]
    # bytes per chunk: Redis bytes per request of the 1-replica load over its remote lookups
    per = next(iter(one["per_replica"].values()))
    lookups_per_req = per["chunk_lookups"] / max(1, one["requests"])
    remote_rate = per["hit_rate"].get("remote") or 0.0
    b = one["redis_bytes_read_per_request"] / max(1e-9, lookups_per_req * remote_rate)
    return {
        "kv_bytes_per_chunk": b, "top_k": k, "cpu_ttft_s": fa["cpu_ttft_p50_s"], "remote_ttft_s": fa["remote_ttft_p50_s"],
        "requests_per_s_per_replica": one["requests_per_s"], "kv_tokens_per_chunk": local["kv_tokens"] / max(1, local["kv_computed"]),
        "precompute_tokens_per_s": local["kv_tokens_per_s"], "first_ask_remote_chunks": f"{chunks_remote}/{first_q * k}",
    }


def simulate(m: dict, *, alpha: float, ram_gb: float, redis_gb: float, masters: int, node_gbps: float,
             affinity: bool, replicas: list[int], corpus: list[float]) -> list[dict]:
    b, k = m["kv_bytes_per_chunk"], m["top_k"]
    c_ram, c_redis = ram_gb * 1e9 / b, redis_gb * 1e9 * masters / b
    delta = max(0.0, m["remote_ttft_s"] - m["cpu_ttft_s"])
    compute = k * m["kv_tokens_per_chunk"] / m["precompute_tokens_per_s"]
    rows = []
    for n_chunks in corpus:
        for n in replicas:
            ram = zipf_share(c_ram * (n if affinity else 1), n_chunks, alpha)
            shared = max(0.0, zipf_share(c_redis, n_chunks, alpha) - ram)
            miss = max(0.0, 1.0 - ram - shared)
            ttft = m["cpu_ttft_s"] + shared * delta + miss * compute
            bw = n * m["requests_per_s_per_replica"] * k * (1 - ram) * b / 1e9
            rows.append({"chunks": n_chunks, "replicas": n, "ram_hit": ram, "shared_hit": shared, "computed": miss,
                         "ttft_s": ttft, "shared_gbps": bw, "shared_util": bw / (masters * node_gbps)})
    return rows


def markdown(rows: list[dict]) -> str:
    head = "| chunks | replicas | RAM hit | shared hit | computed | TTFT s | shared tier GB/s | of capacity |"
    out = [head, "|" + "---|" * 8]
    for r in rows:
        out.append(f"| {r['chunks']:.0e} | {r['replicas']} | {r['ram_hit']:.1%} | {r['shared_hit']:.1%} | "
                   f"{r['computed']:.1%} | {r['ttft_s']:.3f} | {r['shared_gbps']:.3f} | {r['shared_util']:.0%} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="bench scale JSON")
    p.add_argument("--alpha", type=float, default=0.9, help="Zipf exponent of chunk popularity (assumed)")
    p.add_argument("--ram-gb", type=float, default=4.0, help="RAM tier per replica, GB (store.cpu_kv_pool_gb)")
    p.add_argument("--redis-gb", type=float, default=64.0, help="memory per Redis master, GB (assumed)")
    p.add_argument("--masters", type=int, default=3, help="Redis Cluster masters")
    p.add_argument("--node-gbps", type=float, default=1.0, help="GB/s one Redis master can serve (assumed)")
    p.add_argument("--replicas", default="1,2,4,8,16,32,64")
    p.add_argument("--corpus", default="1e4,1e5,1e6,1e7,1e8")
    p.add_argument("--affinity", action="store_true", help="chunk-affinity routing: the replicas' RAM tiers add up")
    p.add_argument("--rps", type=float, default=None,
                   help="requests/s per replica instead of the measured one (e.g. an accelerator replica; assumed)")
    a = p.parse_args()
    m = inputs(json.loads(a.result.read_text()))
    if a.rps is not None:
        m["requests_per_s_per_replica"] = a.rps
        m["rps_assumed"] = True
    print("measured:", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}))
    print(f"assumed: Zipf alpha {a.alpha}, RAM tier {a.ram_gb} GB/replica, {a.masters} Redis masters x "
          f"{a.redis_gb} GB, {a.node_gbps} GB/s per master, affinity routing {a.affinity}\n")
    rows = simulate(m, alpha=a.alpha, ram_gb=a.ram_gb, redis_gb=a.redis_gb, masters=a.masters,
                    node_gbps=a.node_gbps, affinity=a.affinity, replicas=[int(x) for x in a.replicas.split(",")],
                    corpus=[float(x) for x in a.corpus.split(",")])
    print(markdown(rows))


if __name__ == "__main__":
    main()
