"""`ragcache calibrate`: the smallest recompute ratio whose blend answers like full prefill, sooner, per index.

Thin flag parsing over :mod:`ragcache.calibrate`. Every input check runs before the engine starts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from app.help import HelpFormatter
from ragcache import strategies
from ragcache.calibrate import DEFAULT_MASSES, DEFAULT_MAX_KL, DEFAULT_MAX_NLL_REL, DEFAULT_MIN_SPEEDUP, DEFAULT_RATIOS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="measure blend against full prefill on an index and record the ratio for "
        "blend.recompute_ratio = \"auto\"", formatter_class=HelpFormatter,
        description="Runs N prompts drawn from the index (your questions, or probe questions about the index's "
        "own chunks) in full prefill and in blend at several ratios, and records in the index the smallest ratio "
        "that answers like full prefill (mean first-token KL(full || blend) at most --max-kl, the NLL of full's "
        "answer at most --max-nll above full's, no more repetition loops than full) and is at least "
        "--min-speedup times faster. With blend.recompute_ratio = \"auto\" queries then use that ratio; when no "
        "ratio qualifies it says so and recommends --mode full.")
    p.add_argument("--index", default="default", help="index name under ingest.index_dir, or a folder")
    p.add_argument("--questions", type=Path, default=None,
                   help="file of your own questions (one per line, or a JSON list of strings or of {question}, "
                   "or of {question, answers: [str]}: with gold answers the quality table is judged by their NLL); "
                   "default: probe questions about the index's chunks")
    p.add_argument("--n", type=int, default=20, help="prompts to measure")
    p.add_argument("--max-kl", type=float, default=DEFAULT_MAX_KL,
                   help="quality target: mean first-token KL(full || blend) in nats")
    p.add_argument("--max-nll", type=float, default=DEFAULT_MAX_NLL_REL,
                   help="quality target: NLL of full prefill's answer under blend at most this share above full's")
    p.add_argument("--min-speedup", type=float, default=DEFAULT_MIN_SPEEDUP,
                   help="speed target: blend's median TTFT at least this many times below full prefill's")
    p.add_argument("--ratios", default=None,
                   help="recompute ratios to try, comma-separated: under a fixed budget (blend.budget = \"fixed\", or "
                   "a selection without the question's attention) the budgets themselves (default "
                   f"{','.join(f'{r:g}' for r in DEFAULT_RATIOS)}); under the adaptive budget the ratios its budgets "
                   "are centred on, each tried with every --masses threshold (default blend.recompute_ratio)")
    p.add_argument("--masses", default=",".join(f"{m:g}" for m in DEFAULT_MASSES),
                   help="adaptive budget (blend.budget = \"adaptive\"): blend.mass_left thresholds to try around "
                   "each ratio; per ratio the largest that meets the targets is a candidate, and the candidate that "
                   "recomputes the least is recorded")
    p.add_argument("--selection", choices=strategies.names(), default=None,
                   help="token selection to calibrate (default: blend.selection), under the other blend settings "
                   "in force (granule, recompute_depth, ...); the record holds only while they and the dtype stay "
                   "the same")
    p.add_argument("--top-ks", default="",
                   help="comma-separated top_k values the quality table of engine.mode = \"auto\" is measured at "
                   "(prompts of several lengths; default: retrieval.top_k alone)")
    p.add_argument("--seed", type=int, default=0, help="seed of the probe-question draw")
    p.add_argument("--json", action="store_true", help="print the calibration as JSON")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> list[float] | None:
    """Flags checked before the engine starts; returns the ratios given (None: ``--ratios`` not given)."""
    from ragcache.config import ConfigError

    if not args.max_kl > 0:
        raise ConfigError(f"--max-kl {args.max_kl}: must be > 0 nats (e.g. 0.05)")
    if not args.max_nll >= 0:
        raise ConfigError(f"--max-nll {args.max_nll}: must be >= 0 (e.g. 0.05 for 5%)")
    if not args.min_speedup > 0:
        raise ConfigError(f"--min-speedup {args.min_speedup}: must be > 0 (e.g. 1.2)")
    if args.n < 1:
        raise ConfigError(f"--n {args.n}: must be >= 1")
    from ragcache.calibrate import CalibrationError, blend_options

    ratios = None
    if args.ratios is not None:
        try:
            ratios = list(blend_options([float(x) for x in args.ratios.split(",") if x.strip()], args.selection))
        except (ValueError, CalibrationError) as exc:  # not numbers, or out of range (checked as every ratio is)
            raise ConfigError(f"--ratios {args.ratios!r}: expected comma-separated numbers in [0, 1] ({exc})") \
                from None
    try:
        from ragcache.calibrate import budget_options

        args.mass_values = [m for _, m in budget_options(0.15, [float(x) for x in args.masses.split(",") if x.strip()])]
    except (ValueError, CalibrationError) as exc:
        raise ConfigError(f"--masses {args.masses!r}: expected comma-separated numbers in (0, 1) ({exc})") from None
    if args.questions is not None and not args.questions.is_file():
        raise ConfigError(f"--questions {args.questions}: no such file")
    try:
        args.top_k_values = [int(x) for x in args.top_ks.split(",") if x.strip()] or [None]
    except ValueError:
        raise ConfigError(f"--top-ks {args.top_ks!r}: expected comma-separated integers, e.g. 5,10") from None
    bad = [k for k in args.top_k_values if k is not None and not 1 <= k <= 100]
    if bad:
        raise ConfigError(f"--top-ks {bad[0]}: must be in [1, 100] (the range of the setting retrieval.top_k)")
    return ratios


def read_answers(path: Path) -> list[list[str]] | None:
    """The gold answers of a JSON list of ``{question, answers: [str]}`` objects (one list per question
    :func:`read_questions` returns), or None when the file gives no answers for some question."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return None
    if not isinstance(data, list):
        return None
    out = []
    for q in data:
        if isinstance(q, dict) and str(q.get("question", "")).strip():
            answers = q.get("answers")
            if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
                return None
            out.append(answers)
    return out or None


def read_questions(path: Path) -> list[str]:
    """Questions from a text file (one per line) or a JSON list of strings or of ``{question}`` objects.

    Raises:
        ConfigError: the file holds no question.
    """
    from ragcache.config import ConfigError

    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, list):
        qs = [q if isinstance(q, str) else str(q.get("question", "")) for q in data if isinstance(q, (str, dict))]
    else:
        qs = text.splitlines()
    qs = [q.strip() for q in qs if q and q.strip()]
    if not qs:
        raise ConfigError(f"--questions {path}: no questions found (one per line, or a JSON list)")
    return qs


def run(args: argparse.Namespace) -> int:
    from app.ask_cmd import open_index
    from ragcache.calibrate import calibrate, probe_questions, write_calibration
    from ragcache.config import ConfigError, Settings
    from ragcache.index.folder import readable_path
    from ragcache.util.progress import progress

    ratios = _check(args)
    if Settings.load(args.settings).ingest.vector_store == "pgvector":
        raise ConfigError("ragcache calibrate writes calibration.json into a FAISS index folder; pgvector indexes "
                          "are not calibrated yet: set blend.recompute_ratio to a number")
    questions = read_questions(args.questions)[: args.n] if args.questions else None
    answers = read_answers(args.questions) if args.questions else None
    if answers is not None:
        answers = answers[: args.n]
    rag = open_index(args)
    source = "questions"
    if questions is None:
        questions = probe_questions(list(rag.retriever.index.chunks()), args.n, args.seed)
        source = "probes"
    with progress(total=len(questions) * (1 + len(args.top_k_values)), unit="prompt", desc="calibrate") as bar:
        cal = calibrate(rag, questions, ratios=ratios, max_kl=args.max_kl, max_nll_rel=args.max_nll,
                        min_speedup=args.min_speedup, selection=args.selection, source=source, progress=bar.update,
                        masses=args.mass_values if rag.settings.blend.adapts(args.selection) else None,
                        answers=answers, quality_top_ks=args.top_k_values)
    path = write_calibration(readable_path(rag.index_path), cal)
    if args.json:
        from dataclasses import asdict

        print(json.dumps(asdict(cal), indent=2))
        return 0
    print_calibration(cal, rag.settings.blend.min_recompute_tokens)
    if cal.ratio is None:
        print(f"recorded in {path}; with blend.recompute_ratio = \"auto\" queries use blend.fallback_ratio")
    elif cal.mass_left is not None:
        print(f"recorded mass_left {cal.mass_left:g} around ratio {cal.ratio:g} ({cal.selection} selection) in {path}; "
              "queries use it with blend.recompute_ratio = \"auto\"")
    else:
        print(f"recorded ratio {cal.ratio:g} ({cal.selection} selection) in {path}; "
              "queries use it with blend.recompute_ratio = \"auto\"")
    return 0


def print_calibration(cal, min_recompute_tokens: int | None = None) -> None:
    """The calibration's table (one row per ratio, with its speedup over full prefill) and its verdict;
    ``min_recompute_tokens`` (``blend.min_recompute_tokens``), when given, is named where it raised a ratio."""
    adaptive = any(s.mass_left is not None for s in cal.scores)
    centres = sorted({s.ratio for s in cal.scores}) if adaptive else []
    first = "mass_left" if adaptive else "ratio"
    lead = f"{'ratio':>6} " if len(centres) > 1 else ""  # several centre ratios: each row names its own
    print(f"{lead}{first:>9} {'recomputed':>11} {'KL(full||blend)':>16} {'answer NLL vs full':>19} {'loops':>6} "
          f"{'TTFT med (s)':>13} {'speedup':>8} {'meets':>6}")
    for s in cal.scores:
        nll = f"{100 * s.answer_nll_rel:+.1f}%" if s.answer_nll_rel is not None else "-"
        speed = f"{s.speedup:.2f}x" if s.speedup is not None else "-"
        share = f"{100 * s.recomputed_share:.1f}%" if s.recomputed_share is not None else "-"
        point = s.mass_left if adaptive else s.ratio
        lead = f"{s.ratio:>6g} " if len(centres) > 1 else ""
        print(f"{lead}{point:>9g} {share:>11} {s.kl_mean:>16.4f} {nll:>19} {100 * s.loop_share:>5.0f}% "
              f"{s.ttft_median_s:>13.3f} {speed:>8} {'yes' if s.meets else 'no':>6}")
    if adaptive:
        around = f"ratio {centres[0]:g}" if len(centres) == 1 else "the ratio of its row"
        print(f"mass_left: the adaptive budget's threshold (the question's attention left on reused KV), around "
              f"{around}; recomputed: the share of each context it chose")
    if any(s.raised_by_floor for s in cal.scores):
        floor = f" ({min_recompute_tokens} tokens)" if min_recompute_tokens is not None else ""
        print(f"recomputed: the share of each context actually recomputed. Where it exceeds the ratio, "
              f"blend.min_recompute_tokens{floor} set a floor: every ratio below that floor recomputes the same tokens")
    if any(s.whole_context for s in cal.scores):
        print("100%: the ratio recomputed the whole context, which is full prefill through the blend's path: never "
              "recorded, whatever its speedup (then load noise)")
    prompts = cal.source if cal.n != 1 else cal.source.rstrip("s")  # "1 probe", "3 probes"
    print(f"full prefill: TTFT median {cal.full_ttft_median_s:.3f} s, loops {100 * cal.full_loop_share:.0f}%, over "
          f"{cal.n} {prompts}; targets: KL <= {cal.max_kl:g}, answer NLL <= +{100 * cal.max_nll_rel:g}%, "
          f"speedup >= {cal.min_speedup:g}x")
    if cal.settings:
        print("measured under " + ", ".join(f"{name.removeprefix('blend.')} = {value}"
                                            for name, value in cal.settings.items()))
    table = cal.quality_table
    if table is not None and table.cells:
        print("quality table (engine.mode = \"auto\" blends only where it passes):")
        print(f"{'prompts':>8} {'passages':>9} {'n':>3} {'tokens':>7} {'passage tok':>11} {'Rouge-L':>7} {'KL':>7} "
              f"{'gold NLL':>9}  verdict")
        for c in table.cells:
            gold = f"{100 * c.gold_nll_rel:+.1f}%" if c.gold_nll_rel is not None else "-"
            print(f"{c.prompt_class:>8} {c.passage_class:>9} {c.n:>3} {c.prompt_tokens:>7.0f} {c.passage_tokens:>11.0f} "
                  f"{c.rouge_l:>7.2f} {c.kl_mean:>7.4f} {gold:>9}  {'blend' if c.passes else 'full'}: {c.why}")
    if cal.recommendation == "full":
        print(f"recommendation: full prefill (--mode full): {cal.reason}")
    else:
        print(f"recommendation: {cal.reason}")
    if cal.n < FEW_PROMPTS:
        print(f"note: measured on {cal.n} prompt{'s' if cal.n != 1 else ''} only: TTFT and KL vary from prompt to "
              f"prompt, so this verdict is noisy; --n {FEW_PROMPTS * 3} or more gives one to rely on")


#: fewer prompts than this and the calibration's verdict is called noisy
FEW_PROMPTS = 3
