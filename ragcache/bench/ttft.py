"""``bench ttft`` and ``eval``: every mode side by side on the same prompts, with the recompute-ratio sweep.

Owns: the ttft runner (timed greedy requests per variant, first-token KL from full prefill,
gold-answer NLL, F1 / Rouge-L / EM and agreement with full), its per-variant summaries and the
targets it measures, and the quality-only ``eval`` built on it. Uses the engine it is handed
through its public methods; imports ragcache.bench's metrics/datasets/common; never app/ or ui/.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ragcache.bench.common import (
    TARGETS, Checkpoint, Progress, Variant, answer_ids, make_variants, ratio_name, request_record, rotated, speedup,
    target, warm_prefix_cache, warm_up,
)
from ragcache.bench.datasets import QAExample, make_chunks
from ragcache.bench.metrics import (
    exact_match, kl_divergence, mean, mean_nll, median, percentile, rouge_l, rounded, token_f1,
)
from ragcache.config import MODES

if TYPE_CHECKING:
    from ragcache.engine import BlendEngine, Generation
    from ragcache.prompt import AssembledPrompt


def run_ttft(engine: "BlendEngine", examples: Sequence[QAExample], *, modes: Sequence[str] = MODES,
             ratios: Sequence[float] = (0.0, 0.05, 0.1, 0.15, 0.3, 1.0), default_ratio: float | None = None,
             passages: int = 10, max_tokens: int = 32, prefix_warmup: str = "chunks", nll: bool = True,
             progress: Progress | None = None, checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """TTFT and quality of every mode on the same prompts, asked in a rotated order per example.

    Per example: chunks from its first ``passages`` passages (file order), KV precomputed once
    (before the first example, :func:`~ragcache.bench.common.warm_up`); vLLM's prefix cache reset;
    then one timed greedy request per variant (``max_tokens`` decoded, first-token distribution
    over the whole vocabulary); ``prefix`` is preceded by an untimed warm-up (see
    :func:`~ragcache.bench.common.warm_prefix_cache`). After the timed requests, the gold answer's
    mean NLL is scored per variant with ``engine.continuation_logprobs`` (``full`` and ``prefix``
    both serve exact KV, so one exact score, taken in ``prefix`` mode over the warm cache, stands
    for both).

    Returns a dict with ``modes`` (summary of full/prefix/reuse/blend at ``default_ratio``),
    ``sweep`` (one summary per blend ratio), ``variants`` (every variant's summary), ``targets`` and
    ``examples`` (per-example records of every variant). ``checkpoint``, when given, receives the
    result so far (``"partial": True``) after every example, so an interrupted run keeps its data.
    """
    say = progress or (lambda _msg: None)
    default_ratio = engine.settings.blend.recompute_ratio if default_ratio is None else default_ratio
    variants = make_variants(modes, ratios, default_ratio)
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for i, ex in enumerate(examples):
        t_ex = time.perf_counter()
        chunks = make_chunks(engine.tokenizer, ex.passages[:passages])
        pre = engine.precompute(chunks)
        prompt = engine.prompts.build(ex.question, chunks)
        if i == 0:
            warm_up(engine, chunks, [v.mode for v in variants])
        engine.reset_prefix_cache()
        gens: dict[str, Generation] = {}
        order = rotated(variants, i)
        for v in order:
            if v.mode == "prefix":
                warm_prefix_cache(engine, chunks, prefix_warmup)
            gens[v.name] = engine.generate(prompt, v.mode, recompute_ratio=v.ratio, max_tokens=max_tokens,
                                           logprobs=-1)
        gold_ids = answer_ids(engine, ex.answers[0]) if (nll and ex.answers) else []
        nlls = _gold_nlls(engine, prompt, gold_ids, variants)
        results = {v.name: _quality_record(gens[v.name], gens["full"], v, ex.answers, nlls[v.name])
                   for v in variants}
        records.append({
            "index": ex.index, "question": ex.question, "answers": ex.answers,
            "passages": len(chunks), "prompt_tokens": len(prompt.token_ids), "ctx_tokens": prompt.ctx_len,
            "gold_answer_tokens": len(gold_ids), "precompute": pre, "order": [v.name for v in order],
            "results": results,
        })
        brief = "  ".join(f"{v.name} {results[v.name]['ttft_s']:.2f}s" for v in variants)
        say(f"[{i + 1}/{len(examples)}] example {ex.index}: {len(prompt.token_ids)} tokens | {brief} "
            f"| {time.perf_counter() - t_ex:.0f} s")
        if checkpoint is not None and i + 1 < len(examples):
            checkpoint({**_ttft_result(variants, records, default_ratio, passages, max_tokens, prefix_warmup,
                                       time.perf_counter() - t_start), "partial": True})
    return _ttft_result(variants, records, default_ratio, passages, max_tokens, prefix_warmup,
                        time.perf_counter() - t_start)


def _gold_nlls(engine: "BlendEngine", prompt: "AssembledPrompt", gold_ids: Sequence[int],
               variants: Sequence[Variant]) -> dict[str, float | None]:
    """Mean gold-answer NLL per variant (None without gold ids); one exact score for full and prefix."""
    nlls: dict[str, float | None] = {}
    exact_nll: float | None = None
    for v in variants:
        if not gold_ids:
            nlls[v.name] = None
        elif v.mode in ("full", "prefix"):
            if exact_nll is None:
                exact_nll = mean_nll(engine.continuation_logprobs(prompt, gold_ids, "prefix"))
            nlls[v.name] = exact_nll
        else:
            nlls[v.name] = mean_nll(engine.continuation_logprobs(prompt, gold_ids, v.mode, recompute_ratio=v.ratio))
    return nlls


def _quality_record(g: "Generation", full: "Generation", v: Variant, answers: Sequence[str],
                    nll: float | None) -> dict[str, Any]:
    """The request record of ``g`` with its quality against the gold answers and against ``full``."""
    rec = request_record(g)
    p_full = full.first_token_logprobs or {}
    q = g.first_token_logprobs or {}
    rec.update(
        recompute_ratio=v.ratio,
        first_token=g.token_ids[0] if g.token_ids else None,
        kl_from_full=rounded(kl_divergence(p_full, q), 6) if (p_full and q) else None,
        gold_nll=rounded(nll),
        f1=rounded(token_f1(g.text, answers)), rouge_l=rounded(rouge_l(g.text, answers)),
        em=exact_match(g.text, answers),
        agree_em=exact_match(g.text, full.text), agree_rouge_l=rounded(rouge_l(g.text, full.text)),
        agree_tokens=float(g.token_ids == full.token_ids),
        speedup=speedup(full, g),
    )
    return rec


def _ttft_result(variants: Sequence[Variant], records: list[dict[str, Any]], default_ratio: float, passages: int,
                 max_tokens: int, prefix_warmup: str, run_s: float) -> dict[str, Any]:
    summaries = {v.name: summarize_variant(v, records) for v in variants}
    main = {"full": summaries["full"]}
    for m in ("prefix", "reuse"):
        if m in summaries:
            main[m] = summaries[m]
    if ratio_name(default_ratio) in summaries:
        main["blend"] = summaries[ratio_name(default_ratio)]
    sweep = [summaries[v.name] for v in variants if v.mode == "blend"]
    return {
        "benchmark": "ttft", "n": len(records), "passages": passages, "max_tokens": max_tokens,
        "prefix_warmup": prefix_warmup, "default_ratio": default_ratio,
        "ratios": sorted({v.ratio for v in variants if v.ratio is not None}),
        "modes": main, "sweep": sweep, "variants": summaries, "targets": ttft_targets(main),
        "run_s": round(run_s, 1), "examples": records,
    }


def summarize_variant(v: Variant, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians, p90 and means of one variant over the examples (seconds, nats, fractions)."""
    rs = [r["results"][v.name] for r in records]
    fulls = [r["results"]["full"] for r in records]
    ttft = [x["ttft_s"] for x in rs]
    nll = mean(x["gold_nll"] for x in rs)
    nll_full = mean(x["gold_nll"] for x in fulls)
    return {
        "variant": v.name, "mode": v.mode, "recompute_ratio": v.ratio, "n": len(rs),
        "ttft_median_s": rounded(median(ttft)), "ttft_p90_s": rounded(percentile(ttft, 90)),
        "ttft_mean_s": rounded(mean(ttft)),
        "speedup_median": rounded(median([x["speedup"] for x in rs]), 3),
        "load_s_median": rounded(median([x["load_s"] for x in rs])),
        "worker_s_median": rounded(median([x["worker_s"] for x in rs])),
        "kl_mean": rounded(mean(x["kl_from_full"] for x in rs), 5),
        "kl_median": rounded(median([x["kl_from_full"] for x in rs]), 5),
        "gold_nll_mean": rounded(nll),
        "gold_nll_rel_full": rounded(nll / nll_full - 1.0) if (nll and nll_full) else None,
        "f1_mean": rounded(mean(x["f1"] for x in rs)), "rouge_l_mean": rounded(mean(x["rouge_l"] for x in rs)),
        "em_mean": rounded(mean(x["em"] for x in rs)),
        "agree_em_mean": rounded(mean(x["agree_em"] for x in rs)),
        "agree_rouge_l_mean": rounded(mean(x["agree_rouge_l"] for x in rs)),
        "agree_tokens_mean": rounded(mean(x["agree_tokens"] for x in rs)),
        "recomputed_frac_mean": rounded(mean(x["recomputed_tokens"] / x["ctx_tokens"] if x["ctx_tokens"] else 0.0
                                             for x in rs)),
        "prompt_tokens_mean": rounded(mean(x["prompt_tokens"] for x in rs), 1),
    }


def ttft_targets(main: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The issue's targets that a ttft run measures (met is None where a mode was not run)."""
    blend, reuse = main.get("blend"), main.get("reuse")
    out: dict[str, Any] = {}
    if blend:
        out["blend_ttft_speedup"] = target(blend["speedup_median"], TARGETS["blend_ttft_speedup_min"], "min",
                                           "median per-example TTFT(full)/TTFT(blend)")
        out["blend_nll_within"] = target(blend["gold_nll_rel_full"], TARGETS["blend_nll_rel_max"], "max_abs",
                                         "mean gold NLL(blend) / mean gold NLL(full) - 1 (below 0: blend finds "
                                         "the gold answer likelier)")
        if reuse and blend["kl_mean"] is not None and reuse["kl_mean"]:
            out["blend_kl_vs_reuse"] = target(blend["kl_mean"] / reuse["kl_mean"], TARGETS["blend_kl_vs_reuse_max"],
                                              "max", "mean KL(full||blend) / mean KL(full||reuse)")
    return out


#: the quality fields of a variant's summary that ``eval`` reports
_EVAL_SUMMARY = ("n", "kl_mean", "kl_median", "gold_nll_mean", "gold_nll_rel_full", "f1_mean", "rouge_l_mean",
                 "em_mean", "agree_em_mean", "agree_rouge_l_mean", "agree_tokens_mean", "recomputed_frac_mean")
#: the quality fields of a request record that ``eval`` reports per example
_EVAL_RECORD = ("kl_from_full", "gold_nll", "f1", "rouge_l", "em", "agree_em", "agree_rouge_l", "agree_tokens")


def run_eval(engine: "BlendEngine", examples: Sequence[QAExample], *, mode: str, recompute_ratio: float | None = None,
             passages: int = 10, max_tokens: int = 32, progress: Progress | None = None) -> dict[str, Any]:
    """Quality only: KL(full || mode) of the first token, gold-answer NLL, F1, Rouge-L, EM, agreement.

    ``full`` is always run as the reference. No prefix warm-up (``prefix`` serves exact KV; its
    quality equals full's, only its speed depends on the cache).
    """
    ratio = engine.settings.blend.recompute_ratio if recompute_ratio is None else recompute_ratio
    res = run_ttft(engine, examples, modes=[mode], ratios=[], default_ratio=ratio, passages=passages,
                   max_tokens=max_tokens, prefix_warmup="none", progress=progress)
    name = ratio_name(ratio) if mode == "blend" else mode

    def pick(s: Mapping[str, Any]) -> dict[str, Any]:
        return {k: s[k] for k in _EVAL_SUMMARY}

    examples_out = [{
        "index": r["index"], "question": r["question"], "answers": r["answers"],
        "answer": r["results"][name]["answer"], "full_answer": r["results"]["full"]["answer"],
        **{k: r["results"][name][k] for k in _EVAL_RECORD},
        "full_gold_nll": r["results"]["full"]["gold_nll"],
    } for r in res["examples"]]
    return {
        "benchmark": "eval", "mode": mode, "recompute_ratio": ratio if mode == "blend" else None,
        "n": res["n"], "passages": passages, "max_tokens": max_tokens,
        "quality": pick(res["variants"][name]), "full": pick(res["variants"]["full"]),
        "run_s": res["run_s"], "examples": examples_out,
    }
