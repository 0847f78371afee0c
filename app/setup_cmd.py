"""`ragcache setup`: provision the configured models (convert the packaged GGUF once)."""

from __future__ import annotations

import argparse

from app.help import HelpFormatter


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("setup", help="provision the LLM and embedding model (run once)",
                       formatter_class=HelpFormatter)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ragcache.models import main

    main(args.settings)
    return 0
