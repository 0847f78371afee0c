"""`ragcache ask` and `ragcache chat`: answer questions from an index on the embedded engine."""

from __future__ import annotations

import argparse
import json
import sys
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from app.help import HelpFormatter
from ragcache.options import QueryOptions, check_request


def _ratio(text: str) -> float | str:
    """``--recompute-ratio``: a number (range-checked with the other flags) or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number in [0, 1] or 'auto'") from None


#: the query flags, by the QueryOptions field they set: every option but sampling and history
#: (``top_k`` -> ``--top-k``), declared once in :class:`~ragcache.options.RequestOptions` / QueryOptions
QUERY_FLAGS = {name: "--" + name.replace("_", "-") for name in QueryOptions.model_fields
               if name not in ("sampling", "history")}

#: what a flag takes beyond its option's field: ``--recompute-ratio auto`` (the index's calibrated ratio)
FLAG_EXTRAS: dict[str, dict[str, Any]] = {
    "recompute_ratio": {"type": _ratio, "help": "share of context tokens recomputed in blend mode, or auto (the "
                        "index's calibrated ratio, `ragcache calibrate`) (default blend.recompute_ratio)"},
}


def _plain(annotation: Any) -> Any:
    """The type under ``X | None`` and ``Annotated[X, ...]``: ``Optional[Annotated[int, ...]]`` -> int."""
    while True:
        if get_origin(annotation) in (Union, types.UnionType):
            annotation = next(a for a in get_args(annotation) if a is not type(None))
        elif get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
        else:
            return annotation


def flag_kwargs(info: FieldInfo) -> dict[str, Any]:
    """``add_argument`` keywords for an option's field: a Literal's values as choices, int and float
    as the type (the range is checked with the other flags by :func:`query_options`), anything else a
    string the options parse (``question/16``); the field's description as the help."""
    kind = _plain(info.annotation)
    if get_origin(kind) is Literal:
        typed: dict[str, Any] = {"choices": get_args(kind)}
    elif kind in (int, float):
        typed = {"type": kind}
    else:
        typed = {}
    return {"default": None, "help": info.description, **typed}


def _add_query_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", default="default", help="index name under ingest.index_dir, or a folder")
    for name, flag in QUERY_FLAGS.items():
        p.add_argument(flag, **{**flag_kwargs(QueryOptions.model_fields[name]), **FLAG_EXTRAS.get(name, {})})


def register(sub: argparse._SubParsersAction) -> None:
    fmt = HelpFormatter
    p = sub.add_parser("ask", help="answer one question from an index", formatter_class=fmt)
    p.add_argument("question", help="the question")
    _add_query_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object: answer, sources, metrics")
    p.set_defaults(func=run_ask)

    c = sub.add_parser("chat", help="interactive conversation over an index (empty line or Ctrl-D ends)",
                       description="Each answer sees the conversation so far (after the retrieved chunks; "
                       "a short or referring follow-up also retrieves with the previous question). "
                       "/new starts a new conversation.", formatter_class=fmt)
    _add_query_options(c)
    c.set_defaults(func=run_chat)


def query_options(args: argparse.Namespace) -> QueryOptions:
    """The flags as one :class:`~ragcache.options.QueryOptions`, validated here, before the engine
    starts (the same ranges as the settings they override).

    Raises:
        QueryOptionsError: a flag out of range, e.g. ``--top-k 0: must be in [1, 100] (the range of
            the setting retrieval.top_k)``.
    """
    values = {field: getattr(args, field) for field in QUERY_FLAGS}
    if values["recompute_ratio"] == "auto":  # the setting's value, not a per-request ratio: see open_pipeline
        values["recompute_ratio"] = None
    return QueryOptions.parse(values, QUERY_FLAGS)


def run_settings(args: argparse.Namespace):
    """Settings from --settings; ``--recompute-ratio auto`` sets ``blend.recompute_ratio = "auto"``
    for this run (the index's calibrated ratio, else ``blend.fallback_ratio``).

    Raises:
        ConfigError: the settings are invalid.
    """
    from ragcache.config import Settings

    settings = Settings.load(args.settings)
    if getattr(args, "recompute_ratio", None) == "auto":
        settings = settings.model_copy(update={"blend": settings.blend.model_copy(update={"recompute_ratio": "auto"})})
    return settings


def open_pipeline(args: argparse.Namespace):
    """The query flags and the question checked, then :func:`open_index`; every check that needs no
    model (flags, the question, settings, the flags against the settings, the index) runs before the
    engine starts. Sets ``args.options`` (the query flags as QueryOptions) and, for ``ask``,
    ``args.question`` (checked).

    Raises:
        QueryOptionsError: a flag out of range or contradicting another, or one the settings would
            ignore (:func:`~ragcache.options.check_request`, e.g. ``--recompute-ratio`` when
            ``engine.mode = "full"`` and no ``--mode`` is given). And as :func:`open_index`.
    """
    from ragcache.conversation import check_question

    args.options = query_options(args)
    if getattr(args, "question", None) is not None:
        args.question = check_question(args.question)  # checked once: the pipeline takes it as checked
    settings = run_settings(args)
    auto = {"recompute_ratio": "auto"} if args.recompute_ratio == "auto" else None  # a setting for this run
    check_request(args.options, settings.blend, default_mode=settings.engine.mode, names=QUERY_FLAGS, given=auto)
    return open_index(args, settings)


def open_index(args: argparse.Namespace, settings=None):
    """The pipeline over --index, whose manifest is checked before the engine starts, with
    ``settings`` (None: from --settings, :func:`run_settings`).

    Raises:
        ConfigError: invalid settings. IndexNotFoundError / IndexMismatchError: --index is no usable index.
    """
    from ragcache.index.catalog import catalog
    from ragcache.pipeline import RAGPipeline

    settings = settings or run_settings(args)
    catalog(settings).manifest(args.index)  # exists, readable, same embedding model
    return RAGPipeline.open(settings, index=args.index)


def format_answer(answer) -> str:
    """An :class:`~ragcache.pipeline.Answer` for the terminal: the text, a blank line, a note when the
    answer was cut at ``max_tokens``, the sources in prompt order, and one line of metrics."""
    m = answer.metrics
    lines = [answer.text or "(empty answer)", ""]
    if getattr(answer, "finish_reason", None) == "length":
        lines.append(f"(cut at {m.output_tokens} tokens, the max_tokens limit: --max-tokens N for a longer answer)")
    lines.append("Sources (in prompt order):")
    for i, s in enumerate(answer.sources, 1):
        snippet = " ".join(s.text.split())[:90]
        title = f"{s.title}: " if s.title else ""
        lines.append(f"  [{i}] {title}{snippet}...  (score {s.score:.3f}, kv: {s.tier or '-'})")
    hits = ", ".join(f"{t} {n}" for t, n in sorted(m.tier_hits.items())) or "-"
    lines.append("")
    depth = f" ({m.recompute_note})" if m.recompute_note else ""
    mode = f"{m.mode} ({m.ratio_text})" if m.ratio_text else m.mode
    lines.append(f"mode {mode} | TTFT {m.ttft_s:.3f} s | retrieval {m.retrieval_s:.3f} s | total {m.total_s:.2f} s | "
                 f"prompt {m.prompt_tokens} tok | reused {m.reused_tokens} | recomputed {m.recomputed_tokens}{depth} | "
                 f"tier hits: {hits}")
    if m.route_rule and m.route_rule != "explicit":  # engine.mode = auto: the path it took, and why
        lines.append(f"route {m.route_reason}")
    if m.budget_mode == "adaptive":  # the recompute budget this question got, and why
        lines.append(f"budget {m.budget_reason}")
    return "\n".join(lines)


def note_line(metrics, ratio_note: bool = True) -> str:
    """The answer's notes as lines for stderr, or "" when there is nothing to say: the cached context
    could not be served (``load_error``: full prefill answered), and with ``ratio_note`` the ratio note
    (:meth:`ragcache.pipeline.RAGPipeline.ratio_note`: the blend's ratio goes against the index's
    calibration)."""
    notes = []
    if metrics.load_error:
        notes.append(f"note: the cached context could not be served ({metrics.load_error}); full prefill answered "
                     f"(the engine's log has the traceback)")
    if ratio_note and metrics.ratio_note:
        notes.append(f"note: {metrics.ratio_note}")
    return "\n".join(notes)


def run_ask(args: argparse.Namespace) -> int:
    rag = open_pipeline(args)
    answer = rag.query(args.question, args.options)
    if args.json:
        print(json.dumps({k: v for k, v in answer.to_dict().items() if k != "question"}, ensure_ascii=False))
    else:
        print(format_answer(answer))
    note = note_line(answer.metrics)
    if note:
        print(note, file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from ragcache.conversation import Turn

    rag = open_pipeline(args)
    print(f"ragcache chat over index {args.index!r} (mode {args.mode or rag.settings.engine.mode}); "
          "/new starts a new conversation; empty line or Ctrl-D to quit", file=sys.stderr)
    history: list[Turn] = []
    noted = False  # the ratio note is said once per session
    while True:
        try:
            question = input("you> ").strip()
        except EOFError:
            break
        if not question:
            break
        if question == "/new":
            history = []
            print("(new conversation)", file=sys.stderr)
            continue
        answer = None
        print("ragcache> ", end="", flush=True)
        for item in rag.stream(question, args.options.model_copy(update={"history": tuple(history)})):
            if isinstance(item, str):
                print(item, end="", flush=True)
            else:
                answer = item
        print()
        if answer is not None:
            history += [Turn("user", question), Turn("assistant", answer.text)]
            print(format_answer(answer).split("\n\n", 1)[1], file=sys.stderr)
            note = note_line(answer.metrics, ratio_note=not noted)
            noted = noted or bool(answer.metrics.ratio_note)
            if note:
                print(note, file=sys.stderr)
    return 0
