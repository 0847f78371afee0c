"""The set-up the reference screens share: scripts/layer_screen.py, scripts/propagate_screen.py and
scripts/kv_context_screen.py each replay full prefill and blend on the plain-torch reference
(:mod:`ragcache.bench.reference`) of a QA slice and change one thing in between.

Owns: :func:`screen_parser` (the arguments every screen takes) and :func:`open_screen` (the slice
and a :class:`~ragcache.bench.diverge.Diagnosis` on the reference model); the screens' KV error is
:func:`ragcache.bench.reference.token_relative_error`, what ``bench diverge`` reports. Scratch
measurement for choosing what to build, not a benchmark: torch and transformers are imported only
when a screen opens.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ragcache.bench.datasets import QAExample
    from ragcache.bench.diverge import Diagnosis


def screen_parser(doc: str, *, n: int, out: str) -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first paragraph, with the arguments every screen
    takes: ``--dataset`` (required: a QA file, or musique / hotpotqa), ``--offset``, ``--n`` (default
    ``n``), ``--passages`` (10), ``--dtype`` (float32), ``--max-tokens`` (16, answer tokens) and
    ``--out`` (default ``out``, a JSON path). The screen adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--dataset", required=True, help="QA file (or musique / hotpotqa)")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--n", type=int, default=n)
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path(out))
    return ap


def open_screen(args: argparse.Namespace) -> "tuple[list[QAExample], Diagnosis]":
    """The slice ``--offset``, ``--n`` of ``--dataset`` and a
    :class:`~ragcache.bench.diverge.Diagnosis` on the reference model in ``--dtype`` (``--passages``,
    ``--max-tokens``; the top 8 attended tokens, 4 head tokens per chunk), for ``args`` from
    :func:`screen_parser`. The diagnosis carries the settings (the defaults, environment overrides
    applied), the model's ops and its tokenizer.

    Raises:
        ragcache.models.ModelNotFoundError: the configured model cannot be provided.
        ValueError: an unknown ``--dtype``.
        ragcache.bench.datasets.DatasetNotFoundError: ``--dataset`` names no QA file.
    """
    from ragcache.bench.datasets import load_qa
    from ragcache.bench.diverge import Diagnosis
    from ragcache.bench.reference import load_reference
    from ragcache.config import Settings

    settings = Settings()
    examples = load_qa(args.dataset, n=args.n, offset=args.offset)
    _, tokenizer, ops = load_reference(settings.models.model, settings.models.cache_dir, args.dtype)
    return examples, Diagnosis(settings, ops, tokenizer, passages=args.passages, max_tokens=args.max_tokens, top_k=8,
                               head_tokens=4)
