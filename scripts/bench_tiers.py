#!/usr/bin/env python
"""Read bandwidth of each KV-store tier for one chunk entry, next to the disk's raw sequential read speed.

For a SmolLM2-135M-shaped entry (30 layers x 512 tokens x 3 KV heads x 64 dims, K and V) stored in
float32 and in float16, it times ``TieredStore.get`` (whole entry) and ``open`` + every
``handle.layer(i)`` (the pipelined path) from each tier, median of ``--reads`` reads:

- ``cpu``: host RAM;
- ``disk cold``: the entry file dropped from the page cache before every read (fsync +
  posix_fadvise DONTNEED), i.e. a real SSD read; ``disk warm``: served from the page cache;
- ``remote``: Redis on loopback (a throwaway ``redis-server`` from ragcache.bench.fixtures is
  started when one is installed, or pass ``--redis-url``).

The raw disk speed is ``dd`` reading a file of the same size in the same folder, after dropping it
from the page cache, and with ``iflag=direct`` (O_DIRECT). MB = 10^6 bytes. The model dtype equals
the storage dtype here, so the timings contain no dtype conversion.

    .venv/bin/python scripts/bench_tiers.py --out results/bench_tiers.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragcache.bench.fixtures import RedisServer, drop_page_cache  # noqa: E402
from ragcache.kvstore import CpuTier, DiskTier, KVSpec, RedisTier, TieredStore  # noqa: E402

MB = 1e6


def time_reads(fn, reads: int, before=None) -> tuple[float, float]:
    """(median, best) seconds of ``reads`` calls of ``fn``; ``before`` runs untimed before each."""
    times = []
    for _ in range(reads):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def read_layers(store: TieredStore, key: str) -> None:
    with store.open(key) as h:
        for i in range(h.num_layers):
            h.layer(i)


def dd_read(path: Path, direct: bool) -> float | None:
    """MB/s reported by dd reading ``path`` (None when dd is missing or fails)."""
    if shutil.which("dd") is None:
        return None
    cmd = ["dd", f"if={path}", "of=/dev/null", "bs=1M"] + (["iflag=direct"] if direct else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        return None
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", proc.stderr)
    if m and float(m.group(2)) > 0:
        return int(m.group(1)) / float(m.group(2)) / MB
    return path.stat().st_size / elapsed / MB


def raw_disk(folder: Path, nbytes: int, reads: int) -> dict:
    path = folder / "dd-probe.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
    out = {"bytes": nbytes}
    cold = []
    for _ in range(reads):
        out["cache_dropped"] = drop_page_cache(path) == 1
        cold.append(dd_read(path, direct=False))
    direct = [dd_read(path, direct=True) for _ in range(reads)]
    warm = [dd_read(path, direct=False) for _ in range(reads)]
    for name, vals in (("dd_cold_mb_s", cold), ("dd_direct_mb_s", direct), ("dd_page_cache_mb_s", warm)):
        vals = [v for v in vals if v is not None]
        out[name] = round(statistics.median(vals), 1) if vals else None
    path.unlink()
    return out


def bench_dtype(dtype: torch.dtype, args, folder: Path, redis_url: str | None) -> list[dict]:
    spec = KVSpec("bench0000000000", 1, args.layers, args.heads, args.head_dim, dtype=dtype)
    shape = (args.layers, args.tokens, args.heads, args.head_dim)
    k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    disk = DiskTier(folder / str(dtype).split(".")[-1])
    setups = [("cpu", TieredStore(spec, [(CpuTier(), 10**12)]), None)]
    disk_store = TieredStore(spec, [(disk, 10**12)])
    setups.append(("disk cold", disk_store, lambda: drop_page_cache(disk.path("bench"))))
    setups.append(("disk warm", disk_store, None))
    if redis_url:
        setups.append(("remote", TieredStore(spec, [(RedisTier(redis_url), None)]), None))
    rows = []
    for tier, store, before in setups:
        store.put("bench", k, v, 0)
        hit = store.get("bench")
        assert hit is not None and torch.equal(hit[0].k, k), f"{tier}: round trip failed"
        nbytes = hit[0].meta.nbytes
        t_get, best_get = time_reads(lambda: store.get("bench"), args.reads, before)
        t_layers, best_layers = time_reads(lambda: read_layers(store, "bench"), args.reads, before)
        rows.append({
            "dtype": str(dtype).split(".")[-1], "tier": tier, "entry_bytes": nbytes,
            "get_s": round(t_get, 5), "get_mb_s": round(nbytes / t_get / MB, 1),
            "get_best_mb_s": round(nbytes / best_get / MB, 1),
            "layers_s": round(t_layers, 5), "layers_mb_s": round(nbytes / t_layers / MB, 1),
            "layers_best_mb_s": round(nbytes / best_layers / MB, 1),
        })
    disk_store.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=512, help="tokens in the entry")
    p.add_argument("--layers", type=int, default=30, help="layers (SmolLM2-135M: 30)")
    p.add_argument("--heads", type=int, default=3, help="KV heads (SmolLM2-135M: 3)")
    p.add_argument("--head-dim", type=int, default=64, help="head size (SmolLM2-135M: 64)")
    p.add_argument("--reads", type=int, default=7, help="reads per measurement (median reported)")
    p.add_argument("--dir", default="results", help="folder on the disk to measure (a temporary "
                   "sub-folder is created and removed)")
    p.add_argument("--redis-url", default=None, help="existing Redis to use instead of a throwaway one")
    p.add_argument("--no-redis", action="store_true", help="skip the remote tier")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (copies are memory "
                   "bound; more threads only add contention on a busy machine)")
    p.add_argument("--out", default="results/bench_tiers.json", help="JSON results")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    Path(args.dir).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="bench_tiers.", dir=args.dir))
    server = None
    redis_url = None if args.no_redis else args.redis_url
    if not args.no_redis and redis_url is None:
        try:
            server = RedisServer(folder).start()
            redis_url = server.url
        except (FileNotFoundError, RuntimeError) as exc:
            print(f"note: {exc}; remote tier not measured", file=sys.stderr)
    try:
        rows = []
        for dtype in (torch.float32, torch.float16):
            rows += bench_dtype(dtype, args, folder, redis_url)
        raw = raw_disk(folder, rows[0]["entry_bytes"], args.reads)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)

    print(f"entry: {args.layers} layers x {args.tokens} tokens x {args.heads} KV heads x {args.head_dim} dims, "
          f"K+V; median of {args.reads} reads; MB = 1e6 bytes; torch threads {torch.get_num_threads()}")
    print(f"{'dtype':8} {'tier':10} {'entry MB':>9} {'get MB/s':>9} {'get ms':>8} {'layers MB/s':>12} {'layers ms':>10}")
    for r in rows:
        print(f"{r['dtype']:8} {r['tier']:10} {r['entry_bytes'] / MB:9.1f} {r['get_mb_s']:9.0f} "
              f"{r['get_s'] * 1e3:8.1f} {r['layers_mb_s']:12.0f} {r['layers_s'] * 1e3:10.1f}")
    print(f"raw disk, same folder, {raw['bytes'] / MB:.1f} MB file: dd after dropping the page cache "
          f"{raw['dd_cold_mb_s']} MB/s, dd iflag=direct {raw['dd_direct_mb_s']} MB/s, "
          f"dd from page cache {raw['dd_page_cache_mb_s']} MB/s")

    result = {
        "entry": {"layers": args.layers, "tokens": args.tokens, "kv_heads": args.heads, "head_dim": args.head_dim},
        "reads": args.reads, "tiers": rows, "raw_disk": raw,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
