"""``bench tiers``: blend TTFT with the chunk KV served from cpu, disk or Redis, pipeline_overlap on and off.

Owns: the tier layouts (store overrides per layout), one engine per layout in a child process
(the store's tiers are fixed at engine start), and the summary against the cpu tier. Starts its
own engines (imports ragcache.engine, hence vLLM, inside the child only) and a throwaway Redis
from :mod:`ragcache_testing.services`; never app/ or ui/.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from ragcache.bench.common import TARGETS, Progress, target
from ragcache.bench.datasets import QAExample, make_chunks
from ragcache.bench.metrics import median, percentile, rounded
from ragcache.config import Settings
from ragcache.options import QueryOptions
from ragcache.quality.measures import rotated
from ragcache_testing.services import RedisServer, drop_page_cache

#: store overrides per tier layout. ``cpu`` and ``disk`` share one disk folder (the KV is computed
#: once for both; in ``cpu`` an untimed request first promotes it into the cpu tier, which lookups
#: reach first); ``remote`` has Redis alone.
TIER_LAYOUTS: dict[str, dict[str, Any]] = {
    "cpu": {"cpu_kv_pool_gb": 8.0, "ssd_cache_max_gb": 50.0, "remote_url": ""},
    "disk": {"cpu_kv_pool_gb": 0.0, "ssd_cache_max_gb": 50.0, "remote_url": ""},
    "remote": {"cpu_kv_pool_gb": 0.0, "ssd_cache_max_gb": 0.0},
}


def _tiers_child(layout: str, settings_file: str | None, store: dict[str, Any], engine_over: dict[str, Any],
                 examples: list[dict[str, Any]], passages: int, repeats: int, queue: Any) -> None:
    """One tier layout in a fresh process (the store's tiers are fixed when the engine starts)."""
    try:
        queue.put(_tiers_layout(layout, settings_file, store, engine_over,
                                [QAExample(**e) for e in examples], passages, repeats))
    except BaseException as exc:  # report, never hang the parent
        queue.put({"layout": layout, "error": f"{type(exc).__name__}: {exc}"})


#: the timed request: blend, one decoded token (TTFT)
BLEND_1 = QueryOptions(mode="blend", max_tokens=1)


def _tiers_layout(layout: str, settings_file: str | None, store: dict[str, Any], engine_over: dict[str, Any],
                  examples: Sequence[QAExample], passages: int, repeats: int) -> dict[str, Any]:
    from ragcache.engine import BlendEngine

    settings = Settings.load(settings_file, store=store, engine=engine_over)
    engine = BlendEngine(settings)
    try:
        setups = [(layout, False)] + ([("disk-cold", True)] if layout == "disk" else [])
        rows = []
        for i, ex in enumerate(examples):
            chunks = make_chunks(engine.tokenizer, ex.passages[:passages])
            engine.precompute(chunks)
            prompt = engine.prompts.build(ex.question, chunks)
            # untimed: the first requests pay one-time costs, and in ``cpu`` this promotes KV found on disk
            engine.generate(prompt, BLEND_1)
            full = QueryOptions(mode="full", max_tokens=1)
            ref = engine.generate(prompt, full).metrics.ttft_s if layout == "cpu" else None
            for rep in range(repeats):
                for name, cold in setups:
                    for overlap in rotated([True, False], i + rep):
                        if cold:
                            drop_page_cache(Path(settings.store.ssd_cache_dir))
                        engine.settings.blend.pipeline_overlap = overlap
                        g = engine.generate(prompt, BLEND_1)
                        m = g.metrics
                        rows.append({"tier": name, "pipeline_overlap": overlap, "example": ex.index, "repeat": rep,
                                     "ttft_s": rounded(m.ttft_s), "load_s": rounded(m.load_s),
                                     "worker_s": rounded(m.worker_s), "ctx_tokens": m.ctx_tokens,
                                     "served_by": sorted(set(m.chunk_tiers)), "full_ttft_s": rounded(ref)})
        return {"layout": layout, "startup_s": round(engine.startup_s, 1), "rows": rows}
    finally:
        engine.close()


def run_tiers(settings_file: str | None, examples: Sequence[QAExample], *, kv_root: Path, passages: int = 10,
              repeats: int = 2, layouts: Sequence[str] = ("cpu", "disk", "remote"),
              engine_overrides: Mapping[str, Any] | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Blend TTFT with the chunk KV in exactly one tier, pipeline_overlap on and off.

    One engine per layout, each in its own process, since the tiers are fixed at engine start:
    ``cpu`` (served by the cpu pool; see :data:`TIER_LAYOUTS`), ``disk`` (disk only; served warm
    from the page cache, and ``disk-cold`` after dropping the KV files from the page cache; the
    row's ``served_by`` says which tier served), ``remote`` (Redis only: a throwaway
    redis-server on a loopback port; skipped when redis-server is missing). Per example and repeat,
    both overlap settings run in rotated order. ``full`` TTFT is measured in the cpu layout as a
    reference. Ratios are medians of per-example, per-repeat ratios to the cpu tier (same overlap).
    """
    import multiprocessing as mp

    say = progress or (lambda _msg: None)
    payload = [asdict(e) for e in examples]
    results: dict[str, Any] = {}
    notes = []
    redis: RedisServer | None = None
    ctx = mp.get_context("spawn")
    try:
        for layout in layouts:
            kv_dir = kv_root / ("remote" if layout == "remote" else "disk")
            store = {**TIER_LAYOUTS[layout], "ssd_cache_dir": str(kv_dir)}
            if layout == "remote":
                try:
                    redis = RedisServer(kv_root / "redis").start()
                except (FileNotFoundError, RuntimeError) as exc:
                    notes.append(f"remote tier skipped: {exc}")
                    continue
                store["remote_url"] = redis.url
            say(f"tier layout {layout}: starting an engine")
            queue = ctx.Queue()
            proc = ctx.Process(target=_tiers_child, args=(layout, None if settings_file is None else str(settings_file),
                                                          store, dict(engine_overrides or {}), payload, passages,
                                                          repeats, queue))
            proc.start()
            res = queue.get()
            proc.join()
            if "error" in res:
                raise RuntimeError(f"tier layout {layout} failed: {res['error']}")
            results[layout] = res
            say(f"tier layout {layout}: done ({len(res['rows'])} requests)")
            if redis is not None:
                redis.stop()
                redis = None
    finally:
        if redis is not None:
            redis.stop()
    rows = [r for res in results.values() for r in res["rows"]]
    return {"benchmark": "tiers", "n": len(examples), "passages": passages, "repeats": repeats,
            "full_ttft_median_s": rounded(median([r["full_ttft_s"] for r in rows if r["full_ttft_s"] is not None])),
            **_tiers_summary(rows), "notes": notes,
            "startup_s": {k: v["startup_s"] for k, v in results.items()}, "rows": rows}


def _tiers_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``summary`` (one row per tier and overlap setting, ratios to the cpu tier) and ``targets``."""
    cpu = {(r["example"], r["repeat"], r["pipeline_overlap"]): r["ttft_s"] for r in rows if r["tier"] == "cpu"}
    summary = []
    for tier in dict.fromkeys(r["tier"] for r in rows):
        for overlap in (True, False):
            sel = [r for r in rows if r["tier"] == tier and r["pipeline_overlap"] == overlap]
            if not sel:
                continue
            ratio = [r["ttft_s"] / cpu[k] for r in sel
                     if (k := (r["example"], r["repeat"], overlap)) in cpu and cpu[k]]
            summary.append({
                "tier": tier, "pipeline_overlap": overlap, "n": len(sel),
                "ttft_median_s": rounded(median([r["ttft_s"] for r in sel])),
                "ttft_p90_s": rounded(percentile([r["ttft_s"] for r in sel], 90)),
                "load_s_median": rounded(median([r["load_s"] for r in sel])),
                "worker_s_median": rounded(median([r["worker_s"] for r in sel])),
                "vs_cpu_median": rounded(median(ratio), 3),
                "served_by": sorted({t for r in sel for t in r["served_by"]}),
            })
    targets = {}
    for tier, name, note in (
            ("disk", "disk_vs_cpu", "median TTFT(disk)/TTFT(cpu), pipeline_overlap on, page cache warm"),
            ("disk-cold", "disk_cold_vs_cpu", "as disk_vs_cpu with the KV files dropped from the page cache")):
        on = next((s for s in summary if s["tier"] == tier and s["pipeline_overlap"]), None)
        if on:
            targets[name] = target(on["vs_cpu_median"], TARGETS["disk_vs_cpu_ttft_max"], "max", note)
    return {"summary": summary, "targets": targets}
