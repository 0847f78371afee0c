"""`ragcache setup`: provision the configured models (convert the packaged GGUF once)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("setup", help="provision the LLM and embedding model (run once)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ragcache.config import Settings
    from ragcache.models import resolve_embedding_model, resolve_llm

    settings = Settings.load(args.settings)
    llm = resolve_llm(settings.models.model, settings.models.cache_dir)
    emb = resolve_embedding_model(settings.models.embedding_model)
    print(f"LLM:       {llm.path} (fingerprint {llm.fingerprint}, {'converted now' if llm.converted else 'reused'})")
    print(f"embedding: {emb}")
    return 0
