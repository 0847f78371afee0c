"""`ragcache` command line: subcommands named after what users do.

Each command group lives in its own module under app/ and exposes ``register(subparsers)``;
this file only assembles them (listed in :data:`COMMANDS`). Errors that users can fix print one
line saying what to do and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from app import ask_cmd, bench_cmd, cache_cmd, demo_cmd, ingest_cmd, serve_cmd, setup_cmd
from app.help import HelpFormatter

#: modules under app/ that add subcommands, in --help order
COMMANDS = (setup_cmd, ingest_cmd, ask_cmd, serve_cmd, demo_cmd, cache_cmd, bench_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ragcache",
        description="RAG with a tiered chunk KV cache and CacheBlend on embedded vLLM.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--settings", default=None, help="settings TOML file (default: ./settings.toml)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ragcache.config import ConfigError
    from ragcache.index import IndexMismatchError, IndexNotFoundError
    from ragcache.models import ModelNotFoundError
    from ragcache.pipeline import EmptyIndexError
    from ragcache.prompt import PromptTooLongError

    user_errors = (ConfigError, ModelNotFoundError, IndexNotFoundError, IndexMismatchError, EmptyIndexError,
                   PromptTooLongError)

    parser = build_parser()
    args = parser.parse_args(argv)
    # vLLM logs to stdout by default: keep stdout for answers (and `--json` parseable); its
    # start-up chatter is hidden unless -v
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except user_errors as exc:
        print(f"ragcache: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ragcache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
