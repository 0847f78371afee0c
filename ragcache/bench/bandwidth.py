"""Read bandwidth of each KV-store tier for one chunk entry, beside the disk's raw sequential read
speed (``ragcache bench bandwidth``). Not TTFT: ``bench tiers`` measures what a request sees.

For an entry shaped like SmolLM2-135M's (30 layers x 512 tokens x 3 KV heads x 64 dims, K and V),
stored in float32 and in float16, it times ``TieredStore.get`` (the whole entry) and ``open`` +
every ``handle.layer(i)`` (the pipelined path) from each tier, median of ``reads`` reads:

- ``cpu``: host RAM;
- ``disk cold``: the entry file dropped from the page cache before every read (fsync +
  posix_fadvise DONTNEED), i.e. a real SSD read; ``disk warm``: served from the page cache;
- ``remote``: Redis on loopback (a throwaway ``redis-server`` of :mod:`ragcache_testing.services`
  when one is installed, or ``redis_url``).

The raw disk speed is ``dd`` reading a file of the same size in the same folder, after dropping it
from the page cache, and with ``iflag=direct`` (O_DIRECT). MB = 10^6 bytes. The model dtype equals
the storage dtype here, so the timings contain no dtype conversion. Imports torch and the KV store
only (no model, no vLLM). Never app/ or ui/.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from ragcache.bench.common import Progress
from ragcache_testing.services import RedisServer, drop_page_cache

MB = 1e6


def _time_reads(fn: Callable[[], Any], reads: int, before: Callable[[], Any] | None = None) -> tuple[float, float]:
    """(median, best) seconds of ``reads`` calls of ``fn``; ``before`` runs untimed before each."""
    times = []
    for _ in range(reads):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def _read_layers(store: Any, key: str) -> None:
    with store.open(key) as h:
        for i in range(h.num_layers):
            h.layer(i)


def _dd_read(path: Path, direct: bool) -> float | None:
    """MB/s that dd reports reading ``path`` (None when dd is missing or fails)."""
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


def _raw_disk(folder: Path, nbytes: int, reads: int) -> dict[str, Any]:
    path = folder / "dd-probe.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
    out: dict[str, Any] = {"bytes": nbytes}
    cold = []
    for _ in range(reads):
        out["cache_dropped"] = drop_page_cache(path) == 1
        cold.append(_dd_read(path, direct=False))
    direct = [_dd_read(path, direct=True) for _ in range(reads)]
    warm = [_dd_read(path, direct=False) for _ in range(reads)]
    for name, vals in (("dd_cold_mb_s", cold), ("dd_direct_mb_s", direct), ("dd_page_cache_mb_s", warm)):
        vals = [v for v in vals if v is not None]
        out[name] = round(statistics.median(vals), 1) if vals else None
    path.unlink()
    return out


def _bench_dtype(dtype: Any, shape: tuple[int, int, int, int], reads: int, folder: Path,
                 redis_url: str | None) -> list[dict[str, Any]]:
    import torch

    from ragcache.kvstore import CpuTier, DiskTier, KVSpec, RedisTier, TieredStore

    layers, tokens, heads, head_dim = shape
    spec = KVSpec("bench0000000000", 1, layers, heads, head_dim, dtype=dtype)
    k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    disk = DiskTier(folder / str(dtype).split(".")[-1])
    disk_store = TieredStore(spec, [(disk, 10**12)])
    setups = [("cpu", TieredStore(spec, [(CpuTier(), 10**12)]), None),
              ("disk cold", disk_store, lambda: drop_page_cache(disk.path("bench"))),
              ("disk warm", disk_store, None)]
    if redis_url:
        setups.append(("remote", TieredStore(spec, [(RedisTier(redis_url), None)]), None))
    rows = []
    for tier, store, before in setups:
        store.put("bench", k, v, 0)
        hit = store.get("bench")
        if hit is None or not torch.equal(hit[0].k, k):
            raise RuntimeError(f"{tier}: the entry did not come back as stored")
        nbytes = hit[0].meta.nbytes
        t_get, best_get = _time_reads(lambda: store.get("bench"), reads, before)
        t_layers, best_layers = _time_reads(lambda: _read_layers(store, "bench"), reads, before)
        rows.append({
            "dtype": str(dtype).split(".")[-1], "tier": tier, "entry_bytes": nbytes,
            "get_s": round(t_get, 5), "get_mb_s": round(nbytes / t_get / MB, 1),
            "get_best_mb_s": round(nbytes / best_get / MB, 1),
            "layers_s": round(t_layers, 5), "layers_mb_s": round(nbytes / t_layers / MB, 1),
            "layers_best_mb_s": round(nbytes / best_layers / MB, 1),
        })
    disk_store.close()
    return rows


def run_bandwidth(work_dir: Path, *, tokens: int = 512, layers: int = 30, heads: int = 3, head_dim: int = 64,
                  reads: int = 7, redis_url: str | None = None, remote: bool = True, threads: int = 1,
                  progress: Progress | None = None) -> dict[str, Any]:
    """Time reads of one entry from each tier (see the module docstring) in ``work_dir`` (a folder on
    the disk to measure; left empty).

    Args:
        tokens, layers, heads, head_dim: the entry's shape.
        reads: reads per measurement (the median is reported).
        redis_url: an existing Redis for the remote tier; None: a throwaway redis-server, when installed.
        remote: measure the remote tier at all.
        threads: torch intra-op threads (copies are memory bound; more threads add contention on a
            busy machine).

    Returns:
        ``{"benchmark": "bandwidth", "entry", "reads", "tiers": [row per dtype and tier], "raw_disk",
        "torch_threads"}``; rows hold seconds and MB/s.
    """
    import torch

    say = progress or (lambda _msg: None)
    torch.set_num_threads(threads)
    server = None
    if remote and redis_url is None:
        try:
            server = RedisServer(work_dir / "redis").start()
            redis_url = server.url
        except (FileNotFoundError, RuntimeError) as exc:
            say(f"note: {exc}; remote tier not measured")
    try:
        rows = []
        for dtype in (torch.float32, torch.float16):
            rows += _bench_dtype(dtype, (layers, tokens, heads, head_dim), reads, work_dir,
                                 redis_url if remote else None)
            say(f"{str(dtype).split('.')[-1]}: {', '.join(r['tier'] for r in rows if r['dtype'] in str(dtype))} done")
        raw = _raw_disk(work_dir, rows[0]["entry_bytes"], reads)
    finally:
        if server is not None:
            server.stop()
    return {"benchmark": "bandwidth", "entry": {"layers": layers, "tokens": tokens, "kv_heads": heads,
                                                "head_dim": head_dim},
            "reads": reads, "tiers": rows, "raw_disk": raw, "torch_threads": torch.get_num_threads()}
