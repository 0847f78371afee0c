"""`ragcache demo`: the main job on embedded defaults, end to end, on real documentation.

Renders the standard-library documentation of a few Python modules with pydoc (text that ships
with the installed Python, ~32k LLM tokens), ingests it into the index ``demo`` with KV
precompute, calibrates it, then answers questions whose answers are in those pages as a user's
default request does (``engine.mode = "auto"``: blend or full prefill per request, with the reason)
and again in full prefill, plus one long-context question (many more chunks retrieved), and prints
a table: the route taken, TTFT of both, speedup, reused/recomputed tokens, tier hits. A second run
reuses the index and the stored KV (nothing is ingested or precomputed again).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pydoc
import re
import statistics
import sys
from pathlib import Path

from app.help import HelpFormatter

#: stdlib modules whose pydoc pages form the demo corpus
DEMO_MODULES = ["json", "itertools", "functools", "shutil", "csv", "heapq", "bisect", "textwrap", "statistics"]

#: questions answered in those pages, with a word the answer should mention
DEMO_QUESTIONS = [
    ("What does heapq.heappush do?", "heap"),
    ("What does json.dumps return?", "JSON"),
    ("What does shutil.rmtree do?", "directory"),
    ("What does itertools.chain return?", "chain"),
    ("What does statistics.median return?", "median"),
    ("What does bisect.insort do?", "insert"),
]
#: the long-context question: asked with LONG_TOP_K chunks retrieved (a prompt of ~6k tokens), where
#: blend's savings are largest
LONG_QUESTION = "How do functools.lru_cache and functools.cache differ?"
LONG_TOP_K = 12


def render_corpus(folder: Path) -> list[Path]:
    """Write one pydoc text page per module in DEMO_MODULES into ``folder`` (idempotent)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in DEMO_MODULES:
        path = folder / f"{name}.txt"
        text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        text = re.sub(r" at 0x[0-9a-f]+", "", text)  # object addresses change per process
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="ingest Python's stdlib docs and answer questions by the default route and by full prefill",
                       formatter_class=HelpFormatter)
    p.add_argument("--index", default="demo", help="index name for the demo corpus")
    p.add_argument("--questions", type=int, default=len(DEMO_QUESTIONS), help="how many demo questions to ask")
    p.add_argument("--json", dest="json_out", default=None, help="also write the rows as JSON to this file")
    p.add_argument("--no-long-context", dest="long_context", action="store_false",
                   help=f"skip the long-context question ({LONG_TOP_K} chunks retrieved)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="skip calibrating the demo index (then blend uses blend.recompute_ratio as set); "
                   "without it the demo calibrates an index that has no calibration yet")
    p.set_defaults(func=run)


#: the demo's calibration: a few probe questions, three ratios around the default (~40 s on 2 cores)
CALIBRATION_PROBES = 3
CALIBRATION_RATIOS = (0.1, 0.15, 0.2)
#: with the adaptive budget (blend.budget), the thresholds (blend.mass_left) tried instead
CALIBRATION_MASSES = (0.05, 0.03, 0.02)


def _calibrate(rag) -> bool:
    """Calibrate the demo index once (kept in the index folder) and answer with ``recompute_ratio = "auto"``:
    the calibrated ratio, or ``blend.fallback_ratio`` when no ratio was good enough and faster.
    Returns whether it calibrated now (False: the index's calibration was read)."""
    from app.calibrate_cmd import print_calibration
    from ragcache.calibrate import DEFAULT_MASSES, DEFAULT_RATIOS, calibrate, probe_questions, write_calibration
    from ragcache.index.folder import readable_path

    cal = rag.calibration()
    calibrated_now = cal is None
    adaptive = rag.settings.blend.adapts()
    tried = (f"at mass_left {', '.join(f'{m:g}' for m in CALIBRATION_MASSES)} (the adaptive budget)" if adaptive
             else f"at ratios {', '.join(f'{r:g}' for r in CALIBRATION_RATIOS)}")
    if cal is None:
        changes = rag.calibration_changes()
        if changes:
            print(f"the demo index's calibration was measured under other settings ({'; '.join(changes)})")
        print(f"calibrating the demo index: {CALIBRATION_PROBES} probe questions, blend {tried} against "
              f"full prefill", flush=True)
        cal = calibrate(rag, probe_questions(list(rag.retriever.index.chunks()), CALIBRATION_PROBES),
                        ratios=None if adaptive else CALIBRATION_RATIOS, max_tokens=16,
                        masses=CALIBRATION_MASSES if adaptive else None)  # adaptive: around the settings' ratio
        write_calibration(readable_path(rag.index_path), cal)
    print_calibration(cal, rag.settings.blend.min_recompute_tokens)
    if calibrated_now and cal.recommendation == "full":
        grid = DEFAULT_MASSES if adaptive else DEFAULT_RATIOS
        print(f"(the demo tries {tried.removeprefix('at ')} only; `ragcache calibrate --index {rag.index_name}` tries "
              f"{min(grid):g} to {max(grid):g})")
    rag.settings.blend.recompute_ratio = "auto"
    return calibrated_now


def busy_note(load: float | None = None, cores: int | None = None) -> str:
    """A line saying the CPU was shared, or "" on a quiet machine: the demo's own work keeps about
    one runnable thread per core, so a 1-minute load average above 1.5x the cores means other
    processes ran beside it and its TTFTs are slower and noisier than a quiet machine's."""
    load = os.getloadavg()[0] if load is None else load
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    if load <= 1.5 * cores:
        return ""
    return (f"note: load average {load:.1f} on {cores} cores as the demo ended (its own work accounts for about "
            f"{cores}): other processes shared the CPU, so these TTFTs are slower and noisier than on a quiet "
            f"machine; run it again alone to compare blend and full prefill")


def _cut(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def run(args: argparse.Namespace) -> int:
    from ragcache.config import Settings
    from ragcache.engine.messages import RATIO_SOURCES
    from ragcache.index.folder import resolve_index_path
    from ragcache.pipeline import RAGPipeline

    settings = Settings.load(args.settings)
    corpus = resolve_index_path(args.index, settings.ingest.index_dir).parent / f"{args.index}-docs"
    paths = render_corpus(corpus)
    print(f"demo corpus: pydoc pages of {', '.join(DEMO_MODULES)} in {corpus}", flush=True)

    rag = RAGPipeline.open(settings, index=args.index)
    report = rag.ingest(paths, show_progress=True)
    print(report.summary(), flush=True)
    calibrated_now = _calibrate(rag) if args.calibrate else False

    asked = [(q, None) for q, _ in DEMO_QUESTIONS[: args.questions]]
    if args.long_context:
        asked.append((LONG_QUESTION, LONG_TOP_K))
    rows = []
    for question, top_k in asked:
        auto = rag.query(question, top_k=top_k)  # the default request: engine.mode decides the path
        full = rag.query(question, mode="full", top_k=top_k)
        m = auto.metrics
        rows.append({
            "question": question, "top_k": top_k or settings.retrieval.top_k, "answer": auto.text,
            "full_answer": full.text, "route": m.route or m.mode, "route_rule": m.route_rule,
            "route_reason": m.route_reason, "ttft_s": m.ttft_s, "ttft_full_s": full.metrics.ttft_s,
            "speedup": full.metrics.ttft_s / max(m.ttft_s, 1e-9),
            "prompt_tokens": m.prompt_tokens, "reused_tokens": m.reused_tokens,
            "recomputed_tokens": m.recomputed_tokens, "tier_hits": m.tier_hits,
            "recompute_ratio": m.recompute_ratio, "ratio_source": m.ratio_source,
            "loop": m.repetition_loop, "loop_full": full.metrics.repetition_loop,
            "same_as_full": auto.text == full.text,
            "sources": [s.title or s.doc_id for s in auto.sources],
        })
        r = rows[-1]
        print(f"- {question} ({r['top_k']} chunks, {r['prompt_tokens']} tokens)\n    route: {r['route_reason']}\n"
              f"    auto ({r['route']}): {_cut(r['answer'], 90)}\n    full prefill: {_cut(r['full_answer'], 90)}",
              flush=True)
        if top_k is not None and r["route"] != "blend" and r["route_rule"] != "unavailable":
            # the long-context question answered by full prefill: what blend would have done, for comparison
            blend = rag.query(question, mode="blend", top_k=top_k)
            r.update(blend_ttft_s=blend.metrics.ttft_s, blend_answer=blend.text,
                     blend_same_as_full=blend.text == full.text)
            print(f"    blend (asked explicitly, for comparison): TTFT {blend.metrics.ttft_s:.3f} s against full "
                  f"prefill's {full.metrics.ttft_s:.3f} s, answer {'equal to' if r['blend_same_as_full'] else 'unlike'} "
                  f"full prefill's: {_cut(blend.text, 70)}", flush=True)

    header = f"{'question':<38} {'route':>5} {'TTFT':>8} {'TTFT full':>9} {'speedup':>7} {'prompt':>6} " \
             f"{'reused':>6} {'recomp':>6} {'=full':>5}  tier hits"
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        hits = ",".join(f"{t}:{n}" for t, n in sorted(r["tier_hits"].items())) or "-"
        # a full-prefill route against full prefill compares two equal computations: no speedup to show
        up = f"{r['speedup']:>6.1f}x" if r["route"] == "blend" else f"{'-':>7}"
        print(f"{_cut(r['question'], 38):<38} {r['route']:>5} {r['ttft_s']:>7.3f}s {r['ttft_full_s']:>8.3f}s "
              f"{up} {r['prompt_tokens']:>6} {r['reused_tokens']:>6} {r['recomputed_tokens']:>6} "
              f"{'yes' if r['same_as_full'] else 'no':>5}  {hits}")
    if rows:
        blended = [r for r in rows if r["route"] == "blend"]
        say = (f"\nroutes (engine.mode = {settings.engine.mode}): {len(blended)} of {len(rows)} questions blended, "
               f"{len(rows) - len(blended)} answered by full prefill")
        if blended:
            med = statistics.median(r["speedup"] for r in blended)
            source = RATIO_SOURCES.get(blended[0]["ratio_source"], blended[0]["ratio_source"])
            cal = rag.calibration()
            if blended[0]["ratio_source"] == "fallback" and cal is not None and cal.recommendation == "full":
                source = "blend.fallback_ratio: the calibration above found no budget both as good and faster"
            say += (f"; the blended ones {med:.1f}x sooner than full prefill (median), at recompute ratio "
                    f"{blended[0]['recompute_ratio']:g} ({source}), {sum(r['same_as_full'] for r in blended)}/"
                    f"{len(blended)} answers equal to full prefill's")
        print(say + f"; answers with a repetition loop: {sum(r['loop'] for r in rows)}/{len(rows)} "
              f"(full prefill {sum(r['loop_full'] for r in rows)}/{len(rows)})")
        busy = busy_note()
        if busy:
            print(busy)
    stats = rag.cache_stats()
    served = ", ".join(f"{name} {t.hits}" for name, t in stats.tiers.items() if t.hits) or "none"
    what = " (the calibration's included)" if calibrated_now else ""
    print(f"KV store: {stats.lookups} chunk lookups this run{what}, hit rate "
          f"{stats.hit_rate:.0%} (served by {served}; "
          f"{stats.misses} computed); " + ", ".join(f"{name} {t.entries} entries" for name, t in stats.tiers.items()))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(settings=None, index="demo", questions=len(DEMO_QUESTIONS), json_out=None,
                                    calibrate=True, long_context=True)))
