"""`ragcache` command line: subcommands named after what users do.

Each command group lives in its own module under app/ and exposes ``register(subparsers)``;
this file only assembles them (listed in :data:`COMMANDS`). Errors that users can fix print one
line saying what to do and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from app import ask_cmd, bench_cmd, cache_cmd, calibrate_cmd, demo_cmd, ingest_cmd, setup_cmd
from app.help import HelpFormatter
from app.output import configure_output

#: modules under app/ that add subcommands, in --help order
COMMANDS = (setup_cmd, ingest_cmd, ask_cmd, calibrate_cmd, demo_cmd, cache_cmd, bench_cmd)


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
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_output(args.verbose)

    from ragcache.config import ConfigError
    from ragcache.index import IndexMismatchError, IndexNotFoundError
    from ragcache.models import ModelNotFoundError
    from ragcache.pipeline import EmptyIndexError
    from ragcache.prompt import PromptTooLongError

    user_errors = (ConfigError, ModelNotFoundError, IndexNotFoundError, IndexMismatchError, EmptyIndexError,
                   PromptTooLongError)

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
