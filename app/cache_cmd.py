"""`ragcache cache stats|clear|drop|verify`: inspect and maintain the tiered chunk KV store."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from app.help import HelpFormatter
from ragcache.engine.messages import StoreStats, TierStats

if TYPE_CHECKING:
    from ragcache.config import Settings
    from ragcache.kvstore import KVSpec, TieredStore


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache", help="inspect and maintain the chunk KV store (stats, clear, drop, verify)",
        description="The KV store's tiers come from the [store] settings: cpu (cpu_kv_pool_gb), "
        "disk (ssd_cache_dir, ssd_cache_max_gb) and remote (remote_url).",
        formatter_class=HelpFormatter,
    )
    actions = p.add_subparsers(dest="cache_action", metavar="ACTION")
    p.set_defaults(func=lambda args: _usage(p))

    s = actions.add_parser("stats", help="hit rates since the counters started (all processes), entries, "
                           "occupancy, capacity and bytes per token of every tier, the KV compression in use, "
                           "entries per namespace",
                           formatter_class=HelpFormatter)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--reset", action="store_true", help="start the cumulative counters afresh, then show them")
    s.set_defaults(func=run_stats)

    c = actions.add_parser("clear", help="delete KV entries from the persistent tiers (disk folder and Redis): "
                           "all of them, or one namespace's", formatter_class=HelpFormatter)
    c.add_argument("--namespace", default=None, metavar="NS",
                   help="only this KV namespace and the ones below it (as `cache stats` lists them: "
                   "STORE or STORE/INDEX)")
    c.set_defaults(func=run_clear)

    d = actions.add_parser("drop", help="delete the KV of one index's chunks from the persistent tiers",
                           description="Chunks with the same text in another index of the same KV namespace "
                           "share the entry: their KV is computed again on first use.",
                           formatter_class=HelpFormatter)
    d.add_argument("--index", required=True, metavar="NAME", help="index name under ingest.index_dir, or a folder")
    d.set_defaults(func=run_drop)

    v = actions.add_parser("verify", help="check every stored entry (header, size, checksums); remove bad ones",
                           formatter_class=HelpFormatter)
    v.add_argument("--json", action="store_true", help="print JSON instead of a table")
    v.set_defaults(func=run_verify)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _open_store(settings: "Settings", spec: "KVSpec | None") -> "TieredStore":
    from ragcache.kvstore import TieredStore

    # the hit-rate logger is for long-running processes, not for a one-shot command
    return TieredStore.from_settings(settings.store, spec=spec, hit_rate_log_interval=None)


def _model_spec(settings: "Settings", quiet: bool = False) -> "KVSpec | None":
    """KVSpec of the configured LLM, or None (with a note unless ``quiet``) when it is not provisioned."""
    from ragcache.kvstore import KVSpec
    from ragcache.models import ModelNotFoundError, resolve_llm

    try:
        info = resolve_llm(settings.models.model, settings.models.cache_dir)
        return KVSpec.from_hf_config(info.path, info.fingerprint)
    except (ModelNotFoundError, OSError, KeyError, ValueError) as exc:
        if quiet:
            return None
        print(f"note: cannot resolve the model ({exc}); checking integrity only, entries of other "
              "models are not told apart (run `ragcache setup` first)", file=sys.stderr)
        return None


def _size(n: float | None) -> str:
    if n is None:
        return "unbounded"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"


def _where(settings: "Settings") -> dict[str, Any]:
    st = settings.store
    return {"ssd_cache_dir": str(st.ssd_cache_dir), "remote_url": st.remote_url or None}


def _when(ts: float | None) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _pct(n: int, total: int) -> str:
    return f"{100.0 * n / total:.1f}%" if total else "-"


def _cumulative(now: StoreStats, total: dict[str, Any]) -> StoreStats:
    """``now`` (what each tier holds, its capacity) with the counters summed over every process
    (``Ledger.cumulative()``) in place of this process's."""
    n = int(total["lookups"].get("lookups", 0))
    tiers = {}
    for name, row in now.tiers.items():
        counts = {k: v for k, v in total["tiers"].get(name, {}).items() if k in TierStats.__dataclass_fields__}
        hits = int(counts.get("hits", 0))
        tiers[name] = replace(row, **{**counts, "hits": hits, "lookups": n, "misses": max(0, n - hits),
                                      "hit_rate": hits / n if n else 0.0})
    return StoreStats(tiers)


def run_stats(args: argparse.Namespace) -> int:
    from ragcache.config import Settings

    settings = Settings.load(args.settings)
    store = _open_store(settings, None)
    try:
        if args.reset:
            store.ledger.reset()
        now = StoreStats.from_dict(store.stats())
        total = store.ledger.cumulative()
        namespaces = store.namespaces()
        footprint = store.footprint()
    finally:
        store.close()
    compression = _compression(settings)
    lookups = total["lookups"]
    stats = _cumulative(now, total)
    n = stats.lookups
    persisted = store.ledger.counter_file is not None
    if args.json:
        print(json.dumps({**_where(settings), "cumulative": persisted, "since": total["since"],
                          "updated": total.get("updated"), "lookups": {**lookups, "hits": stats.hits,
                                                                       "misses": stats.misses},
                          "tiers": stats.to_dict(), "namespaces": namespaces, "footprint": footprint,
                          "compression": compression}, indent=2))
        return 0
    tiers = stats.tiers
    print(f"the KV store (shared by all indexes); disk folder {settings.store.ssd_cache_dir}; "
          f"namespace {settings.store.namespace}")
    if not tiers:
        print("no tier is enabled (store.cpu_kv_pool_gb, ssd_cache_max_gb and remote_url are all off)")
        return 0
    scope = ("this process only: no disk tier to keep counters beside" if not persisted else
             "none recorded yet" if total.get("updated") is None else
             f"all processes since {_when(total['since'])}, last written {_when(total['updated'])}")
    print(f"chunk lookups: {n} ({scope}); prompt-head lookups {lookups.get('head_lookups', 0)}, "
          f"{lookups.get('head_hits', 0)} served")
    print(f"{'tier':8} {'up':4} {'hits':>8} {'hit rate':>8} {'entries':>8} {'occupancy':>10} {'capacity':>10} "
          f"{'used':>6} {'B/token':>8} {'corrupt':>7} {'unavail':>7} {'not stored':>10}")
    for name, t in tiers.items():
        cap = t.capacity_bytes
        used = f"{100.0 * t.occupancy_bytes / cap:.1f}%" if cap else "-"
        per_token = (footprint.get(name) or {}).get("bytes_per_token")
        print(f"{name:8} {'yes' if t.up else 'DOWN':4} {t.hits:>8} {_pct(t.hits, n):>8} "
              f"{t.entries:>8} {_size(t.occupancy_bytes):>10} {_size(cap):>10} {used:>6} "
              f"{'-' if per_token is None else f'{per_token:.0f}':>8} {t.corrupt:>7} {t.unavailable:>7} "
              f"{t.not_stored:>10}")
    print(f"{'miss':8} {'':4} {stats.misses:>8} {_pct(stats.misses, n):>8}   (no tier held a usable entry: computed)")
    disk = tiers.get("disk")
    if disk and disk.free_bytes is not None and disk.capacity_bytes != disk.configured_capacity_bytes:
        print(f"disk capacity is what its filesystem can hold: {_size(disk.free_bytes)} free "
              f"(store.ssd_cache_max_gb allows {_size(disk.configured_capacity_bytes)})")
    for name, counts in namespaces.items():
        listed = ", ".join(f"{ns or '(none)'} {k}" for ns, k in sorted(counts.items())) or "empty"
        print(f"{name} entries per namespace: {listed}")
    for name, fp in footprint.items():
        if fp["forms"] and (len(fp["forms"]) > 1 or compression["form"] not in fp["forms"]):
            forms = ", ".join(f"{form} {k}" for form, k in sorted(fp["forms"].items()))
            print(f"{name} entries per stored form (of {fp['sampled']} read): {forms}; only "
                  f"{compression['form']} is served (store.kv_compression), the others are recomputed")
    print(_compression_line(compression))
    print("memory tiers are per process (empty here); B/token: bytes (header, values, scales) per token of the "
          "stored entries")
    return 0


def _compression(settings: "Settings") -> dict[str, Any]:
    """The configured stored form, with the bytes per token it costs for the configured model (when
    it is provisioned) beside uncompressed float32's (``None`` when the model cannot be resolved)."""
    from ragcache.kvstore.format import bytes_per_token

    st = settings.store
    out: dict[str, Any] = {"form": st.kv_compression, "kv_dtype": st.kv_dtype, "model": None,
                           "bytes_per_token": None, "float32_bytes_per_token": None}
    spec = _model_spec(settings, quiet=True)
    if spec is not None:
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        dtype = "float32" if st.kv_dtype == "model" else st.kv_dtype  # "model": the engine's dtype, unknown here
        out.update(model=settings.models.model,
                   bytes_per_token=round(bytes_per_token(*shape, st.kv_compression, dtype)),
                   float32_bytes_per_token=round(bytes_per_token(*shape, "none", "float32")))
    return out


def _compression_line(c: dict[str, Any]) -> str:
    what = {"none": f"none (floats: store.kv_dtype = {c['kv_dtype']})",
            "int8": "int8 (K per channel, V per token, float16 scales)",
            "int4": "int4 (K per channel, V per token, float16 scales, two values per byte)"}[c["form"]]
    line = f"compression: {what}"
    if c["bytes_per_token"] is not None:
        dtype = " if the engine runs in float32" if c["form"] == "none" and c["kv_dtype"] == "model" else ""
        line += (f"; {c['model']}: {c['bytes_per_token']} bytes per token{dtype} in 512-token chunks "
                 f"(uncompressed float32: {c['float32_bytes_per_token']})")
    return line


def _report_removed(before: StoreStats, after: StoreStats, what: str) -> int:
    for name, t in before.tiers.items():
        now = after.tiers[name]
        state = "" if now.up else " (DOWN: not cleared)"
        print(f"{name}: removed {t.entries - now.entries} {what}{state}")
    return 0 if all(t.up for t in after.tiers.values()) else 1


def run_clear(args: argparse.Namespace) -> int:
    from ragcache.config import Settings, check_namespace

    ns = args.namespace
    if ns is not None:
        for part in ns.split("/", 1):
            check_namespace(part, "--namespace")
    settings = Settings.load(args.settings)
    store = _open_store(settings, None)
    try:
        before = StoreStats.from_dict(store.stats())
        known = store.namespaces()
        store.clear(namespace=ns)
        after = StoreStats.from_dict(store.stats())
    finally:
        store.close()
    what = "entries" if ns is None else f"entries of namespace {ns}"
    code = _report_removed(before, after, what)
    if ns is not None and all(t.entries == after.tiers[name].entries for name, t in before.tiers.items()):
        listed = sorted({n for counts in known.values() for n in counts if n})
        print(f"no entries in namespace {ns}; namespaces stored: {', '.join(listed) or 'none'}", file=sys.stderr)
    return code


#: the compute dtypes chunk KV may have been computed in (part of its key)
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def run_drop(args: argparse.Namespace) -> int:
    from ragcache.config import Settings
    from ragcache.index.catalog import catalog
    from ragcache.kvstore.codec import FORMS
    from ragcache.models import load_tokenizer, resolve_llm
    from ragcache.prompt import PromptBuilder

    settings = Settings.load(args.settings)
    manifest, chunks = catalog(settings).read_chunks(args.index)
    llm = resolve_llm(settings.models.model, settings.models.cache_dir)
    tokenizer = load_tokenizer(settings).tokenizer
    keys: set[str] = set()
    for dtype in COMPUTE_DTYPES:  # the KV of every precision an engine may have computed it in ...
        for form in FORMS:  # ... and every form it may have been stored in
            builder = PromptBuilder(tokenizer, settings.prompt, llm.fingerprint,
                                    store_namespace=settings.store.namespace, compute_dtype=dtype,
                                    kv_compression=form)
            keys.update(builder.key(c, manifest.namespace) for c in chunks)
    store = _open_store(settings, None)
    try:
        before = StoreStats.from_dict(store.stats())
        for key in keys:
            store.delete(key)
        after = StoreStats.from_dict(store.stats())
    finally:
        store.close()
    print(f"index {args.index}: {len(chunks)} chunks, {len(keys)} KV keys ({', '.join(COMPUTE_DTYPES)}; stored "
          f"{', '.join(FORMS)}) in namespace "
          f"{builder.head_segment(manifest.namespace).key.rsplit(':', 1)[0]}")
    return _report_removed(before, after, "entries")


def run_verify(args: argparse.Namespace) -> int:
    from ragcache.config import Settings

    settings = Settings.load(args.settings)
    spec = _model_spec(settings)
    store = _open_store(settings, spec)
    try:
        report = store.verify()
    finally:
        store.close()
    if args.json:
        print(json.dumps({**_where(settings), "tiers": report}, indent=2))
    else:
        if not report:
            print("no persistent tier is enabled (store.ssd_cache_max_gb = 0 and no remote_url)")
        for name, r in report.items():
            if not r["up"]:
                print(f"{name}: DOWN, not checked")
                continue
            print(f"{name}: checked {r['checked']}, ok {r['ok']}, other model/layout/form {r['foreign']}, "
                  f"corrupt {r['corrupt']} (removed)")
            for key in r["removed"]:
                print(f"  removed {key}: {r['damage'][key]}")
    return 0 if all(r["up"] for r in report.values()) else 1
