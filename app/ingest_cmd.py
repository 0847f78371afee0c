"""`ragcache ingest`: add files and folders to a named index (incremental, crash-safe)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from app.help import HelpFormatter
from ragcache.engine.messages import PrecomputeReport, StoreStats, TierStats

if TYPE_CHECKING:
    from ragcache.config import Settings
    from ragcache.ingest.ingestor import KVHook

#: skipped inputs listed one per line; the rest are counted
MAX_SKIPPED_SHOWN = 50


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ingest", help="index files and folders (txt, md, html, pdf, json/jsonl QA sets)",
        description="Chunk files into LLM-token chunks, embed them and add them to an index. "
        "Re-running adds only new or changed files.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (recursive)")
    p.add_argument("--index", default="default", metavar="NAME",
                   help="index name under ingest.index_dir, or a folder path")
    p.add_argument("--namespace", default=None, metavar="NAME",
                   help="the index's own KV namespace, set at its first ingest: its chunk KV is never shared "
                   "with (nor visible to) other namespaces (default: none, i.e. store.namespace alone)")
    p.add_argument("--prune", action="store_true", help="remove chunks of indexed files that no longer exist")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv", choices=("eager", "lazy"), default=None,
                    help="eager: compute and store each new chunk's KV now; lazy: index only, each chunk's KV is "
                    "computed at its first retrieval and stored then (default: ingest.kv, eager)")
    kv.add_argument("--no-kv", dest="kv", action="store_const", const="lazy", help="the same as --kv lazy")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--executor", choices=("local", "ray"), default=None,
                   help="local: this process; ray: read, split, embed and KV precompute as Ray Data stages "
                   "(default: ingest.executor, local)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="Ray cluster for --executor ray (default: ingest.ray_address; empty = a local Ray)")
    p.add_argument("--actors", type=int, default=None, metavar="N",
                   help="--executor ray: actors per stage for embedding and KV precompute (default: ingest.ray_actors; "
                   "0 = sized from the cluster's resources)")
    p.set_defaults(func=run)


class EngineKVHook:
    """The KV precompute step of ``ragcache ingest``: computes and stores each new chunk's KV.

    The vLLM engine starts on the first call only, so an ingest that adds nothing starts no engine.
    ``totals`` sums the precompute reports (computed, skipped, tokens, seconds, and the keys of the
    computed entries); ``store`` holds the store's per-tier stats after the last call. The summary
    counts what each tier holds at the end, not what it took: a tier that is full evicts earlier
    entries of the same ingest to take later ones.
    """

    def __init__(self, settings: "Settings", show_progress: bool = True):
        self.settings = settings
        self.show_progress = show_progress
        self.engine = None
        self.totals = PrecomputeReport()
        self.store = StoreStats()

    def __call__(self, chunks, namespace: str = "") -> None:
        if not chunks:
            return
        if self.engine is None:
            from ragcache.engine import BlendEngine

            print(f"starting the engine for the KV precompute of {len(chunks)} chunks ...", file=sys.stderr, flush=True)
            self.engine = BlendEngine(self.settings)
        self.totals.add(self.engine.precompute(chunks, show_progress=self.show_progress, namespace=namespace))
        self.store = self.engine.store_stats()

    def summary(self) -> list[str]:
        """The KV lines of the ingest summary: entries computed and where they are kept now; a warning
        for every persistent tier that does not hold them all (full, capped by its filesystem, down,
        failing)."""
        t = self.totals
        holders = self.engine.store_holders(t.computed_keys) if t.computed_keys else []
        self.store = self.engine.store_stats()
        held = dict.fromkeys(self.store.names, 0)  # per tier: the entries computed here that it holds now
        for tiers in holders:
            for tier in tiers:
                held[tier] = held.get(tier, 0) + 1
        where = ", ".join(f"{tier} {n}" + (" (this process's memory)" if tier in MEMORY_TIERS else "")
                          for tier, n in held.items()) or "no tier"
        lines = [f"KV precompute: {t.computed} entries computed ({t.tokens} tokens, each chunk's separator and any new "
                 f"prompt head included, {t.seconds:.1f} s), "
                 f"{t.skipped} already stored; stored on {where}"]
        for tier, n in held.items():
            missed = t.computed - n
            if tier in MEMORY_TIERS or missed <= 0:
                continue
            lines.append(f"warning: {missed} of {t.computed} new entries are not on the {tier} tier "
                         f"({_why_missing(self.store.tiers.get(tier, TierStats()))}); see `ragcache cache stats`")
        lost = sum(not any(tier not in MEMORY_TIERS for tier in tiers) for tiers in holders)
        if lost > 0:
            lines.append(f"warning: {lost} new entries are on no persistent tier: they are computed again when first "
                         "used")
        return lines


def _why_missing(row: TierStats) -> str:
    """Why a persistent tier does not hold every new entry, from its stats row."""
    if not row.up:
        return "the tier is down"
    parts = []
    if row.not_stored:
        parts.append(f"no room: {row.not_stored} entries not stored, {(row.free_bytes or 0) / 1e6:.0f} MB free")
    cap, setting = row.capacity_bytes, row.configured_capacity_bytes
    if cap is not None and setting is not None and cap < setting:
        parts.append(f"it holds at most {cap / 1e6:.1f} MB: its filesystem is smaller than the setting "
                     f"({setting / 1e9:g} GB)")
    if row.evictions:
        parts.append(f"{row.evictions} entries evicted to make room")
    if row.write_errors:
        parts.append(f"{row.write_errors} write errors")
    return "; ".join(parts) or "removed since they were written"


#: tiers that live in the ingest process's memory only (gone when it exits)
MEMORY_TIERS = ("device", "cpu")


def make_kv_hook(settings: "Settings", show_progress: bool = True) -> "KVHook | None":
    """The KV precompute step run on newly ingested chunks (see :class:`EngineKVHook`)."""
    return EngineKVHook(settings, show_progress)


def check_inputs(args: argparse.Namespace, settings: "Settings") -> None:
    """Every check that needs no model, before anything is loaded: the namespace, the index name
    and folder, and that at least one path exists.

    Raises:
        ConfigError / IndexNameError / IndexMismatchError / NoInputError: one line with the fix.
    """
    from ragcache.config import check_namespace
    from ragcache.index.folder import check_index_folder, resolve_index_path
    from ragcache.ingest.ingestor import check_inputs_exist

    if args.namespace is not None:
        check_namespace(args.namespace, "--namespace")
    if settings.ingest.vector_store == "pgvector":
        from ragcache.index.catalog import PgCatalog

        PgCatalog(settings).name(args.index)  # a valid name and a pg_url (the database is reached later)
    else:
        check_index_folder(resolve_index_path(args.index, settings.ingest.index_dir))
    if args.actors is not None:
        from ragcache.config import check_value

        check_value("ingest", "ray_actors", args.actors, "--actors")
    check_inputs_exist(args.paths)


def run(args: argparse.Namespace) -> int:
    from ragcache.config import Settings
    from ragcache.ingest.ingestor import Ingestor

    if not args.verbose:  # library chatter (faiss loader, model loading) only with -v
        for name in ("llama_index", "faiss", "sentence_transformers"):
            logging.getLogger(name).setLevel(logging.WARNING)
    settings = Settings.load(args.settings)
    check_inputs(args, settings)
    want_kv = (args.kv or settings.ingest.kv) == "eager"
    executor = args.executor or settings.ingest.executor
    if args.actors is not None and executor != "ray":
        from ragcache.config import ConfigError

        raise ConfigError(f"--actors {args.actors} sizes the pools of --executor ray; add --executor ray or drop "
                          "--actors")
    if executor == "ray":
        from ragcache.ingest.ray_ingestor import RayIngestor

        address = settings.ingest.ray_address if args.ray_address is None else args.ray_address
        kv_hook = None
        ingestor = RayIngestor(settings, args.index, precompute_kv=want_kv, ray_address=address,
                               actors=args.actors, show_progress=not args.quiet, namespace=args.namespace)
    else:
        kv_hook = make_kv_hook(settings, not args.quiet) if want_kv else None
        ingestor = Ingestor(settings, args.index, kv_hook=kv_hook, show_progress=not args.quiet,
                            namespace=args.namespace)
    report = ingestor.ingest(args.paths, prune=args.prune)
    for skipped in report.skipped[:MAX_SKIPPED_SHOWN]:
        print(f"skipped {skipped.path}: {skipped.reason}", file=sys.stderr)
    if report.files_skipped > MAX_SKIPPED_SHOWN:
        print(f"... and {report.files_skipped - MAX_SKIPPED_SHOWN} more skipped", file=sys.stderr)
    for part in report.left_out[:MAX_SKIPPED_SHOWN]:
        print(f"skipped {part.path} {part.reason}; the rest of the file is kept", file=sys.stderr)
    if len(report.left_out) > MAX_SKIPPED_SHOWN:
        print(f"... and {len(report.left_out) - MAX_SKIPPED_SHOWN} more parts of files skipped", file=sys.stderr)
    print(report.summary() + (f"; KV namespace {report.namespace}" if report.namespace else ""))
    if isinstance(kv_hook, EngineKVHook) and kv_hook.engine is not None:
        for line in kv_hook.summary():
            print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout)
    elif executor == "ray" and want_kv and report.chunks_added:
        t = ingestor.kv_totals
        where = ", ".join(f"{tier} {n}" for tier, n in t.stored.items()) or "no tier"
        print(f"KV precompute: {t.computed} entries computed ({t.tokens} tokens, on Ray: "
              f"{ingestor.kv_actors_used} KV actors), "
              f"{report.chunks_added - t.computed} already stored; stored on {where}")
    elif not want_kv and report.chunks_added:
        print("KV lazy: nothing computed now; each chunk's KV is computed at its first retrieval and stored then "
              "(--kv eager computes it at ingest)")
    if report.nothing_usable or report.total_chunks == 0:
        print(f"ragcache: error: nothing could be ingested into {report.index_path} from the given paths; "
              "check the skipped files above", file=sys.stderr)
        return 2
    return 0
