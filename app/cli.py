"""`ragcache` command line: subcommands named after what users do.

Each command group lives in its own module under app/ and exposes ``register(subparsers)``;
this file only assembles them (listed in :data:`COMMANDS`). Errors that users can fix print one
line naming the problem and the fix and exit with status 2, without a traceback (``-v`` adds it).
"""

from __future__ import annotations

import argparse
import sys
import traceback

from app import ask_cmd, bench_cmd, cache_cmd, calibrate_cmd, demo_cmd, ingest_cmd, serve_cmd, setup_cmd
from app.help import HelpFormatter, Parser
from app.output import configure_output

#: modules under app/ that add subcommands, in --help order
COMMANDS = (setup_cmd, ingest_cmd, ask_cmd, serve_cmd, calibrate_cmd, demo_cmd, cache_cmd, bench_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ragcache",
        description="RAG with a tiered chunk KV cache and CacheBlend on embedded vLLM.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--settings", default=None, help="settings TOML file (default: ./settings.toml)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, tracebacks of errors, and the third-party output (vLLM, torch, "
                        "transformers) hidden by default")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the input needs fixing: one line, exit status 2, no traceback
    (BlendUnavailableError too: the mode asked for cannot run on this model or host; the message
    names the mode that does).

    ``ragcache.index.pg_index`` (psycopg) is only consulted when it was imported: its errors cannot have
    been raised otherwise.
    """
    from ragcache.config import ConfigError
    from ragcache.engine.selfcheck import BlendUnavailableError
    from ragcache.conversation import EmptyQuestionError
    from ragcache.index.manifest import IndexMismatchError, IndexNameError, IndexNotFoundError, IngestError
    from ragcache.models import ModelNotFoundError
    from ragcache.options import QueryOptionsError
    from ragcache.pipeline import EmptyIndexError
    from ragcache.prompt import PromptTooLongError

    errors: tuple[type[BaseException], ...] = (
        ConfigError, ModelNotFoundError, IndexNotFoundError, IndexMismatchError, IndexNameError, EmptyIndexError,
        PromptTooLongError, EmptyQuestionError, BlendUnavailableError, IngestError, QueryOptionsError)
    pg = sys.modules.get("ragcache.index.pg_index")  # imported only with ingest.vector_store = "pgvector"
    return errors + ((pg.PgUnavailableError,) if pg is not None else ())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # a usage error: one line (app.help.Parser), SystemExit(2)
    configure_output(args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except user_errors() as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"ragcache: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ragcache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
