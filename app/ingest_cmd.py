"""`ragcache ingest`: add files and folders to a named index (incremental, crash-safe)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from app.help import HelpFormatter

if TYPE_CHECKING:
    from ragcache.config import Settings
    from ragcache.ingest import KVHook

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
    p.add_argument("--prune", action="store_true", help="remove chunks of indexed files that no longer exist")
    p.add_argument("--no-kv", action="store_true", help="skip the KV precompute of new chunks")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


class EngineKVHook:
    """The KV precompute step of ``ragcache ingest``: computes and stores each new chunk's KV.

    The vLLM engine starts on the first call only, so an ingest that adds nothing starts no engine.
    ``totals`` sums the precompute reports (computed, skipped, tokens, seconds).
    """

    def __init__(self, settings: "Settings", show_progress: bool = True):
        self.settings = settings
        self.show_progress = show_progress
        self.engine = None
        self.totals = {"computed": 0, "skipped": 0, "tokens": 0, "seconds": 0.0}

    def __call__(self, chunks) -> None:
        if not chunks:
            return
        if self.engine is None:
            from ragcache.engine import BlendEngine

            print(f"starting the engine for the KV precompute of {len(chunks)} chunks ...", file=sys.stderr, flush=True)
            self.engine = BlendEngine(self.settings)
        out = self.engine.precompute(chunks, show_progress=self.show_progress)
        for k in self.totals:
            self.totals[k] += out[k]


def make_kv_hook(settings: "Settings", show_progress: bool = True) -> "KVHook | None":
    """The KV precompute step run on newly ingested chunks (see :class:`EngineKVHook`)."""
    return EngineKVHook(settings, show_progress)


def run(args: argparse.Namespace) -> int:
    from ragcache.config import Settings
    from ragcache.index import IndexMismatchError
    from ragcache.ingest import Ingestor, IngestError

    if not args.verbose:  # library chatter (faiss loader, model loading) only with -v
        for name in ("llama_index", "faiss", "sentence_transformers"):
            logging.getLogger(name).setLevel(logging.WARNING)
    settings = Settings.load(args.settings)
    want_kv = settings.ingest.precompute_kv and not args.no_kv
    kv_hook = make_kv_hook(settings, not args.quiet) if want_kv else None
    ingestor = Ingestor(settings, args.index, kv_hook=kv_hook, show_progress=not args.quiet)
    try:
        report = ingestor.ingest(args.paths, prune=args.prune)
    except (IngestError, IndexMismatchError) as exc:
        print(f"ragcache: error: {exc}", file=sys.stderr)
        return 2
    for skipped in report.skipped[:MAX_SKIPPED_SHOWN]:
        print(f"skipped {skipped.path}: {skipped.reason}", file=sys.stderr)
    if report.files_skipped > MAX_SKIPPED_SHOWN:
        print(f"... and {report.files_skipped - MAX_SKIPPED_SHOWN} more skipped", file=sys.stderr)
    print(report.summary())
    if isinstance(kv_hook, EngineKVHook):
        t = kv_hook.totals
        print(f"KV precompute: {t['computed']} entries computed ({t['tokens']} tokens, {t['seconds']:.1f} s), "
              f"{t['skipped']} already stored")
    elif not want_kv:
        print("KV precompute skipped (--no-kv): chunk KV is computed on first use instead")
    if report.total_chunks == 0:
        print(f"ragcache: error: nothing could be ingested into {report.index_path}; "
              "check the skipped files above", file=sys.stderr)
        return 1
    return 0
