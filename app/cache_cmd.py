"""`ragcache cache stats|clear|verify`: inspect and maintain the tiered chunk KV store."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from app.help import HelpFormatter

if TYPE_CHECKING:
    from ragcache.config import Settings
    from ragcache.kvstore import KVSpec, TieredStore


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache", help="inspect and maintain the chunk KV store (stats, clear, verify)",
        description="The KV store's tiers come from the [store] settings: cpu (cpu_kv_pool_gb), "
        "disk (ssd_cache_dir, ssd_cache_max_gb) and remote (remote_url).",
        formatter_class=HelpFormatter,
    )
    actions = p.add_subparsers(dest="cache_action", metavar="ACTION")
    p.set_defaults(func=lambda args: _usage(p))

    s = actions.add_parser("stats", help="entries, occupancy and capacity of every tier",
                           formatter_class=HelpFormatter)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=run_stats)

    c = actions.add_parser("clear", help="delete every KV entry from every tier (disk folder and Redis too)",
                           formatter_class=HelpFormatter)
    c.set_defaults(func=run_clear)

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


def _model_spec(settings: "Settings") -> "KVSpec | None":
    """KVSpec of the configured LLM, or None (with a note) when it is not provisioned."""
    from ragcache.kvstore import KVSpec
    from ragcache.models import ModelNotFoundError, resolve_llm

    try:
        info = resolve_llm(settings.models.model, settings.models.cache_dir)
        return KVSpec.from_hf_config(info.path, info.fingerprint)
    except (ModelNotFoundError, OSError, KeyError, ValueError) as exc:
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


def run_stats(args: argparse.Namespace) -> int:
    from ragcache.config import Settings

    settings = Settings.load(args.settings)
    store = _open_store(settings, None)
    try:
        stats = store.stats()
    finally:
        store.close()
    if args.json:
        print(json.dumps({**_where(settings), "tiers": stats}, indent=2))
        return 0
    print(f"the KV store (shared by all indexes); disk folder {settings.store.ssd_cache_dir}")
    if not stats:
        print("no tier is enabled (store.cpu_kv_pool_gb, ssd_cache_max_gb and remote_url are all off)")
        return 0
    print(f"{'tier':8} {'up':4} {'entries':>8} {'occupancy':>11} {'capacity':>11} {'used':>6}")
    for name, t in stats.items():
        cap = t["capacity_bytes"]
        used = f"{100.0 * t['occupancy_bytes'] / cap:.1f}%" if cap else "-"
        print(f"{name:8} {'yes' if t['up'] else 'DOWN':4} {t['entries']:>8} {_size(t['occupancy_bytes']):>11} "
              f"{_size(cap):>11} {used:>6}")
    print("memory tiers are per process (empty here); hit rates are per process too: "
          "turn on store.enable_hit_rate_log or see the UI")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from ragcache.config import Settings

    settings = Settings.load(args.settings)
    store = _open_store(settings, None)
    try:
        before = {name: t["entries"] for name, t in store.stats().items()}
        store.clear()
        after = store.stats()
    finally:
        store.close()
    for name, n in before.items():
        state = "" if after[name]["up"] else " (DOWN: not cleared)"
        print(f"{name}: removed {n - after[name]['entries']} entries{state}")
    return 0 if all(t["up"] for t in after.values()) else 1


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
            print(f"{name}: checked {r['checked']}, ok {r['ok']}, other model/layout {r['foreign']}, "
                  f"corrupt {r['corrupt']} (removed)")
    return 0 if all(r["up"] for r in report.values()) else 1
