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
    FLOOR, PLAIN, TARGETS, other_dtype, prompt_length, Checkpoint, Progress, Variant, answer_ids, main_blend, make_variants, ratio_name, request_record,
    speedup, target, warm_prefix_cache, warm_up,
)
from ragcache.bench.plain import PlainVLLM
from ragcache.bench.datasets import QAExample, make_chunks
from ragcache.bench.metrics import (
    agreed_prefix, exact_match, kl_divergence, mean, mean_nll, median, percentile, rouge_l, rounded, token_f1,
)
from ragcache.calibrate import EXACT  # the exact modes' NLL is scored as calibrate scores full's answer
from ragcache.config import MODES
from ragcache.models import num_hidden_layers
from ragcache.options import QueryOptions
from ragcache.quality.measures import rotated


if TYPE_CHECKING:
    from ragcache.engine import BlendEngine, Generation
    from ragcache.prompt import AssembledPrompt


def run_ttft(engine: "BlendEngine", examples: Sequence[QAExample], *, modes: Sequence[str] = MODES,
             ratios: Sequence[float] = (0.0, 0.05, 0.1, 0.15, 0.3, 1.0), default_ratio: float | None = None,
             selections: Sequence[str] = (), budgets: Sequence[str] = (), passages: int = 10, max_tokens: int = 32,
             prefix_warmup: str = "chunks", nll: bool = True, progress: Progress | None = None,
             checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """TTFT and quality of every mode on the same prompts, asked in a rotated order per example.

    Per example: chunks from its first ``passages`` passages (file order), KV precomputed once
    (before the first example, :func:`~ragcache.bench.common.warm_up`); vLLM's prefix cache reset;
    then one timed greedy request per variant (``max_tokens`` decoded, first-token distribution
    over the whole vocabulary); ``prefix`` is preceded by an untimed warm-up (see
    :func:`~ragcache.bench.common.warm_prefix_cache`); ``plain`` goes to a plain vLLM engine in a
    child process (:class:`~ragcache.bench.plain.PlainVLLM`: same model, dtype and limits, no
    connector); ``floor`` to another such child in the other dtype (float32 beside a 16-bit engine,
    bfloat16 beside a float32 one): its agreement with ``full`` is the noise floor every other
    mode's agreement is read against. After the timed requests, two teacher-forced scores per variant (with
    ``engine.continuation_logprobs``): the mean NLL of full prefill's own greedy answer (gold-free:
    works on any corpus) and of the gold answer (``full`` and ``prefix`` both serve exact KV, so one
    exact score, taken in ``prefix`` mode over the warm cache, stands for both).

    ``selections`` runs the blend ratio sweep once per token-selection strategy (default: only
    ``blend.selection``), and ``budgets`` once per recompute budget (``fixed``, ``adaptive`` or the
    adaptive budget's ``mass_left``; default: only ``blend.budget``).

    Returns a dict with ``modes`` (summary of full/plain/floor/prefix/reuse/blend at ``default_ratio``),
    ``sweep`` (one summary per blend variant), ``variants`` (every variant's summary), ``stages``
    (the blend's worker time by stage, with its compute floor), ``targets`` and ``examples``
    (per-example records of every variant). ``checkpoint``, when given, receives the result so far
    (``"partial": True``) after every example, so an interrupted run keeps its data.
    """
    say = progress or (lambda _msg: None)
    blend_settings = engine.settings.blend
    default_ratio = blend_settings.recompute_ratio if default_ratio is None else default_ratio
    variants = make_variants(modes, ratios, default_ratio, selections, blend_settings.selection, budgets)
    main = main_blend(variants, default_ratio, blend_settings.selection, blend_settings.granule)
    main_name = main.name if main is not None else None
    plain = PlainVLLM.like(engine) if any(v.mode == PLAIN for v in variants) else None
    floor = (PlainVLLM.like(engine, other_dtype(engine.dtype.dtype)) if any(v.mode == FLOOR for v in variants)
             else None)
    children = {PLAIN: plain, FLOOR: floor}
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()

    strategy = main.spec.strategy if main is not None and main.spec is not None else blend_settings.selection
    from ragcache.blend.forward import recompute_layers
    from ragcache.blend.plan import layers_for_every_token

    check_layer, num_layers = blend_settings.check_layer_for(strategy), num_hidden_layers(engine.llm_info.path)
    layers = (check_layer, num_layers, recompute_layers(blend_settings.recompute_depth, num_layers, check_layer),
              layers_for_every_token(check_layer, blend_settings.measures_deviation(strategy)))

    def result(partial: bool = False) -> dict[str, Any]:
        out = _ttft_result(variants, records, default_ratio, main_name, passages, max_tokens, prefix_warmup,
                           time.perf_counter() - t_start, layers)
        out["floor_dtype"] = floor.dtype if floor is not None else None  # the noise floor's (the other) dtype
        return {**out, "partial": True} if partial else out

    try:
        for i, ex in enumerate(examples):
            t_ex = time.perf_counter()
            chunks = make_chunks(engine.tokenizer, ex.passages[:passages])
            pre = engine.precompute(chunks)
            prompt = engine.prompts.build(ex.question, chunks)
            if i == 0:
                warm_up(engine, chunks, [v.mode for v in variants if v.mode not in children])
                for child in children.values():
                    if child is not None:
                        child.generate(prompt.token_ids, 2)  # its own one-time costs, untimed
            engine.reset_prefix_cache()
            gens: dict[str, Generation] = {}
            order = rotated(variants, i)
            for v in order:
                if v.mode in children:
                    gens[v.name] = _plain_generation(engine, children[v.mode], prompt, max_tokens, v.mode)
                    continue
                if v.mode == "prefix":
                    warm_prefix_cache(engine, chunks, prefix_warmup)
                gens[v.name] = engine.generate(prompt, v.options(max_tokens), logprobs=-1)
            ops = _blend_ops(engine, prompt, main) if main is not None else None
            gold_ids = answer_ids(engine, ex.answers[0]) if (nll and ex.answers) else []
            ran = {name: g.metrics.route or g.metrics.mode for name, g in gens.items()}
            gold = _continuation_nlls(engine, prompt, gold_ids, variants, ran)
            own = _continuation_nlls(engine, prompt, gens["full"].token_ids if nll else [], variants, ran)
            results = {v.name: _quality_record(gens[v.name], gens, v, ex.answers, gold[v.name], own[v.name])
                       for v in variants}
            records.append({
                "index": ex.index, "question": ex.question, "answers": ex.answers,
                "passages": len(chunks), "prompt_tokens": len(prompt.token_ids), "ctx_tokens": prompt.ctx_len,
                "gold_answer_tokens": len(gold_ids), "full_answer_tokens": len(gens["full"].token_ids),
                "precompute": pre.to_dict(), "order": [v.name for v in order], "results": results,
                "blend_ops": ops,
            })
            brief = "  ".join(f"{v.name} {results[v.name]['ttft_s']:.2f}s" for v in variants)
            say(f"[{i + 1}/{len(examples)}] example {ex.index}: {len(prompt.token_ids)} tokens | {brief} "
                f"| {time.perf_counter() - t_ex:.0f} s")
            if checkpoint is not None and i + 1 < len(examples):
                checkpoint(result(partial=True))
    finally:
        for child in children.values():
            if child is not None:
                child.close()
    return result()


def _blend_ops(engine: "BlendEngine", prompt: "AssembledPrompt", main: Variant) -> dict[str, Any] | None:
    """The operators the worker dispatched for one untimed ``main`` blend of ``prompt`` (the whole load:
    store reads, the blend, the paged-cache writes): ``total``, ``per_layer``, ``aten``, ``own`` (called
    by ragcache's code; the rest inside the engine's modules) and the ten most frequent by name; None
    when the worker counted nothing (e.g. the load failed)."""
    steps = engine.count_load_ops([prompt], main.options())
    if not steps:
        return None
    step = steps[-1]
    ops, layers = step["ops"], max(int(step["layers"]), 1)
    return {"total": ops["total"], "per_layer": round(ops["total"] / layers, 1), "aten": ops["aten"],
            "own": ops["own"], "layers": layers, "top": dict(list(ops["by_name"].items())[:10])}


def _plain_generation(engine: "BlendEngine", plain: PlainVLLM, prompt: "AssembledPrompt",
                      max_tokens: int, mode: str = PLAIN) -> "Generation":
    """A plain vLLM child's answer (the baseline, or the noise floor) as a Generation (TTFT measured
    by its own vLLM; no distribution)."""
    from ragcache.engine import Generation, RequestMetrics

    out = plain.generate(prompt.token_ids, max_tokens)
    metrics = RequestMetrics(mode=mode, ttft_s=out["ttft_s"], prompt_tokens=len(prompt.token_ids),
                             output_tokens=len(out["token_ids"]))
    text = engine.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    return Generation(text, list(out["token_ids"]), metrics, None)


def _continuation_nlls(engine: "BlendEngine", prompt: "AssembledPrompt", continuation: Sequence[int],
                       variants: Sequence[Variant], ran: Mapping[str, str]) -> dict[str, float | None]:
    """Mean teacher-forced NLL (nats/token) of ``continuation`` per variant (None without tokens, and
    for ``plain``); one exact score for full and prefix. ``ran``: the mode each variant's request
    ran in (``auto`` scored on the path it took)."""
    nlls: dict[str, float | None] = {}
    exact_nll: float | None = None
    for v in variants:
        mode = ran.get(v.name, v.mode)
        if not continuation or v.mode in (PLAIN, FLOOR):
            nlls[v.name] = None
        elif mode in ("full", "prefix"):
            if exact_nll is None:
                exact_nll = mean_nll(engine.continuation_logprobs(prompt, continuation, EXACT))
            nlls[v.name] = exact_nll
        else:
            options = v.options().model_copy(update={"mode": mode})
            nlls[v.name] = mean_nll(engine.continuation_logprobs(prompt, continuation, options))
    return nlls


def _quality_record(g: "Generation", gens: Mapping[str, "Generation"], v: Variant, answers: Sequence[str],
                    gold_nll: float | None, answer_nll: float | None) -> dict[str, Any]:
    """The request record of ``g`` with its quality against the gold answers and against ``full``."""
    full = gens["full"]
    rec = request_record(g)
    p_full = full.first_token_logprobs or {}
    q = g.first_token_logprobs or {}
    best = min(full.metrics.ttft_s, gens[PLAIN].metrics.ttft_s) if PLAIN in gens else full.metrics.ttft_s
    rec.update(
        recompute_ratio=v.ratio, selection=v.selection, budget=v.budget or g.metrics.budget_mode or None,
        first_token=g.token_ids[0] if g.token_ids else None,
        kl_from_full=rounded(kl_divergence(p_full, q), 6) if (p_full and q) else None,
        gold_nll=rounded(gold_nll), answer_nll=rounded(answer_nll),
        f1=rounded(token_f1(g.text, answers)), rouge_l=rounded(rouge_l(g.text, answers)),
        em=exact_match(g.text, answers),
        agree_em=exact_match(g.text, full.text), agree_rouge_l=rounded(rouge_l(g.text, full.text)),
        agree_tokens=float(g.token_ids == full.token_ids),
        agree_prefix=rounded(agreed_prefix(g.token_ids, full.token_ids)),
        speedup=speedup(full, g),
        speedup_vs_best=rounded(best / g.metrics.ttft_s) if g.metrics.ttft_s > 0 else None,
    )
    return rec


def _ttft_result(variants: Sequence[Variant], records: list[dict[str, Any]], default_ratio: float,
                 main_name: str | None, passages: int, max_tokens: int, prefix_warmup: str, run_s: float,
                 layers: tuple[int, int, int, int]) -> dict[str, Any]:
    summaries = {v.name: summarize_variant(v, records) for v in variants}
    routes = route_table(records, main_name) if "auto" in summaries else None
    main = {"full": summaries["full"]}
    for m in (PLAIN, FLOOR, "prefix", "reuse"):
        if m in summaries:
            main[m] = summaries[m]
    if main_name in summaries:
        main["blend"] = summaries[main_name]
    if "auto" in summaries:
        main["auto"] = summaries["auto"]
    sweep = [summaries[v.name] for v in variants if v.mode == "blend"]
    stages = with_floor(stage_table(summaries, main_name), *layers)
    counted = [r["blend_ops"] for r in records if r.get("blend_ops")]
    blend_ops = ({"total_median": median([c["total"] for c in counted]),
                  "per_layer_median": median([c["per_layer"] for c in counted]),
                  "aten_median": median([c["aten"] for c in counted]),
                  "own_median": median([c["own"] for c in counted]), "n": len(counted)} if counted else None)
    return {
        # the passages a prompt had (--passages caps them; the demo set has 5 per question)
        "benchmark": "ttft", "n": len(records), "passages": max((r["passages"] for r in records), default=passages),
        "max_tokens": max_tokens,
        "prefix_warmup": prefix_warmup, "default_ratio": default_ratio,
        "ratios": sorted({v.ratio for v in variants if v.ratio is not None}),
        "selections": sorted({v.selection for v in variants if v.selection}),
        "modes": main, "sweep": sweep, "variants": summaries, "stages": stages,
        "blend_ops": blend_ops, "targets": {**ttft_targets(main, stages, blend_ops), **auto_targets(routes)},
        "routes": routes,
        "run_s": round(run_s, 1), "examples": records,
    }


def route_table(records: Sequence[dict[str, Any]], blend_name: str | None) -> dict[str, Any]:
    """``auto`` against full prefill and blend, per prompt-length class (:func:`prompt_length`) and
    over all: requests routed to each path and why, auto's TTFT over full's (median, p90) and over
    blend's, answers equal to full's (tokens), and the gold NLL of the requests it blended against
    full's on the same prompts."""
    def summary(rs: Sequence[dict[str, Any]]) -> dict[str, Any]:
        autos = [r["results"]["auto"] for r in rs]
        fulls = [r["results"]["full"] for r in rs]
        over_full = [a["ttft_s"] / f["ttft_s"] for a, f in zip(autos, fulls) if f["ttft_s"] > 0]
        over_blend = ([a["ttft_s"] / r["results"][blend_name]["ttft_s"] for a, r in zip(autos, rs)
                       if r["results"][blend_name]["ttft_s"] > 0] if blend_name else [])
        blended = [(a, f) for a, f in zip(autos, fulls) if a.get("route") == "blend"]
        nll = mean(a["gold_nll"] for a, _ in blended)
        nll_full = mean(f["gold_nll"] for _, f in blended)
        rules: dict[str, int] = {}
        for a in autos:
            key = f"{a.get('route')}:{a.get('route_rule')}"
            rules[key] = rules.get(key, 0) + 1
        return {
            "n": len(rs), "prompt_tokens_mean": rounded(mean(r["prompt_tokens"] for r in rs), 1),
            "blended": len(blended), "routes": rules,
            "auto_over_full_median": rounded(median(over_full), 3),
            "auto_over_full_p90": rounded(percentile(over_full, 90), 3),
            "auto_over_blend_median": rounded(median(over_blend), 3) if over_blend else None,
            "agree_tokens": rounded(mean(a["agree_tokens"] for a in autos)),
            "agree_tokens_n": int(sum(a["agree_tokens"] for a in autos)),
            "blended_gold_nll_rel_full": rounded(nll / nll_full - 1.0) if (nll and nll_full) else None,
            "route_s_max": rounded(max((a.get("route_s") or 0.0) for a in autos), 5),
        }

    classes: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        classes.setdefault(prompt_length(r["prompt_tokens"]), []).append(r)
    return {"all": summary(records) if records else None,
            **{c: summary(rs) for c, rs in sorted(classes.items())}}


def auto_targets(routes: Mapping[str, Any] | None) -> dict[str, Any]:
    """The targets of ``auto`` (:func:`route_table`): never slower than full prefill (median TTFT
    ratio <= 1.05 and p90 <= 1.15 over all requests), blended requests' gold NLL at most +5% of
    full's, and on long prompts as fast as blend (median <= 1.05x blend's)."""
    if not routes or not routes.get("all"):
        return {}
    every = routes["all"]
    out = {
        "auto_vs_full_median": target(every["auto_over_full_median"], 1.05, "max",
                                      "median per-request TTFT(auto)/TTFT(full) over every prompt"),
        "auto_vs_full_p90": target(every["auto_over_full_p90"], 1.15, "max",
                                   "p90 per-request TTFT(auto)/TTFT(full) over every prompt"),
        "auto_blended_gold_nll": target(every["blended_gold_nll_rel_full"], TARGETS["blend_nll_rel_max"], "max",
                                        "gold NLL of the requests auto blended / full prefill's on them - 1"),
    }
    out["auto_route_cost"] = target(every["route_s_max"], 0.005, "max",
                                    "longest routing decision of a request, seconds")
    if routes.get("long") and routes["long"]["auto_over_blend_median"] is not None:
        out["auto_vs_blend_long"] = target(routes["long"]["auto_over_blend_median"], 1.05, "max",
                                           "median per-request TTFT(auto)/TTFT(blend) on long prompts")
    return out


def _reported(results: Sequence[dict[str, Any]], key: str) -> Any:
    """The one value of ``key`` every result reported (e.g. the blends' budget), or None when they
    reported none or differ."""
    values = {r.get(key) for r in results}
    return values.pop() if len(values) == 1 else None


def summarize_variant(v: Variant, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians, p90 and means of one variant over the examples (seconds, nats, fractions)."""
    rs = [r["results"][v.name] for r in records]
    fulls = [r["results"]["full"] for r in records]
    ttft = [x["ttft_s"] for x in rs]
    nll = mean(x["gold_nll"] for x in rs)
    nll_full = mean(x["gold_nll"] for x in fulls)
    own = mean(x.get("answer_nll") for x in rs)
    own_full = mean(x.get("answer_nll") for x in fulls)
    stages = sorted({k for x in rs for k in (x.get("stages") or {})})
    per_pair = [1e9 * x["stages"]["selective_attention_s"] / x["attention_pairs"] for x in rs
                if x.get("attention_pairs") and "selective_attention_s" in (x.get("stages") or {})]
    return {
        "variant": v.name, "mode": v.mode, "recompute_ratio": v.ratio,
        # a variant on the settings' own budget: what its blends reported using
        "selection": v.selection, "budget": v.budget or _reported(rs, "budget"),
        "n": len(rs),
        "ttft_median_s": rounded(median(ttft)), "ttft_p90_s": rounded(percentile(ttft, 90)),
        "ttft_mean_s": rounded(mean(ttft)),
        "speedup_median": rounded(median([x["speedup"] for x in rs]), 3),
        "speedup_vs_best_median": rounded(median([x.get("speedup_vs_best") for x in rs]), 3),
        "load_s_median": rounded(median([x["load_s"] for x in rs])),
        "worker_s_median": rounded(median([x["worker_s"] for x in rs])),
        "stages_median_s": {k: rounded(median([(x.get("stages") or {}).get(k, 0.0) for x in rs])) for k in stages},
        "attention_ns_per_pair_median": rounded(median(per_pair)) if per_pair else None,
        "attention_pairs_median": median([x["attention_pairs"] for x in rs]) if per_pair else None,
        "kl_mean": rounded(mean(x["kl_from_full"] for x in rs), 5),
        "kl_median": rounded(median([x["kl_from_full"] for x in rs]), 5),
        "gold_nll_mean": rounded(nll),
        "gold_nll_rel_full": rounded(nll / nll_full - 1.0) if (nll and nll_full) else None,
        "answer_nll_mean": rounded(own),
        "answer_nll_rel_full": rounded(own / own_full - 1.0) if (own is not None and own_full) else None,
        "f1_mean": rounded(mean(x["f1"] for x in rs)), "rouge_l_mean": rounded(mean(x["rouge_l"] for x in rs)),
        "f1_full_mean": rounded(mean(x["f1"] for x in fulls)),
        "em_mean": rounded(mean(x["em"] for x in rs)),
        "agree_em_mean": rounded(mean(x["agree_em"] for x in rs)),
        "agree_rouge_l_mean": rounded(mean(x["agree_rouge_l"] for x in rs)),
        "agree_tokens_mean": rounded(mean(x["agree_tokens"] for x in rs)),
        "agree_prefix_mean": rounded(mean(x.get("agree_prefix") for x in rs)),
        "loop_share": rounded(mean(float(bool(x.get("repetition_loop"))) for x in rs)),
        "recomputed_frac_mean": rounded(mean(x["recomputed_tokens"] / x["ctx_tokens"] if x["ctx_tokens"] else 0.0
                                             for x in rs)),
        "prompt_tokens_mean": rounded(mean(x["prompt_tokens"] for x in rs), 1),
    }


def stage_table(summaries: Mapping[str, Mapping[str, Any]], main_name: str | None) -> dict[str, Any] | None:
    """The blend's worker time by stage, beside blend at ratio 1 (same selection) and reuse, and the
    plain vLLM prefill the floor is measured against (:func:`with_floor`).

    None when the run lacks blend or reuse; the ratio-1 and plain columns are None when those
    variants were not run.
    """
    blend = summaries.get(main_name) if main_name else None
    if not blend or "reuse" not in summaries:
        return None
    one = next((s for s in summaries.values() if s["mode"] == "blend" and s["recompute_ratio"] == 1.0
                and s["selection"] == blend["selection"]), None)
    plain = summaries.get(PLAIN)
    return {"variant": blend["variant"], "ratio": blend["recompute_ratio"],
            "recomputed_frac": blend.get("recomputed_frac_mean"), "worker_s": blend["worker_s_median"],
            "worker_s_ratio_one": one["worker_s_median"] if one else None,
            "worker_s_reuse": summaries["reuse"]["worker_s_median"],
            "ttft_s_ratio_one": one["ttft_median_s"] if one else None,
            "ttft_s_plain": plain["ttft_median_s"] if plain else None,
            "stages_s": blend["stages_median_s"], "stages_s_ratio_one": one["stages_median_s"] if one else {},
            "stages_s_reuse": summaries["reuse"]["stages_median_s"],
            "attention_ns_per_pair": blend.get("attention_ns_per_pair_median"),
            "attention_ns_per_pair_ratio_one": one.get("attention_ns_per_pair_median") if one else None,
            "attention_pairs": blend.get("attention_pairs_median"),
            "attention_pairs_ratio_one": one.get("attention_pairs_median") if one else None}


def with_floor(stages: dict[str, Any] | None, check_layer: int, num_layers: int,
               depth_layers: int | None = None, full_layers: int | None = None) -> dict[str, Any] | None:
    """``stages`` plus the blend's compute floor against plain vLLM's prefill.

    floor = F / L x t(plain) + r x (D - F) / L x t(plain) + t(reuse), with t(plain) the median TTFT
    of plain vLLM's full prefill of the same prompts (what a user would run instead), r the share of
    context tokens the blend recomputed (mean over the examples: the ratio, or more where
    ``blend.min_recompute_tokens`` raised a short context's budget), L the layers, D the layers the
    recomputed tokens go through (``blend.recompute_depth``; default L: every layer), F the layers
    every context token goes through (``full_layers``, :func:`ragcache.blend.plan.layers_for_every_token`:
    c + 1 for check layer c, 0 on the plan's fast path; default c + 1) and t(reuse)
    reuse's median worker seconds (moving and writing the reused KV).

    That floor prices the recomputed tokens at their share of the prefill. Their attention costs
    more where the selection favours late tokens, which see more keys, so with a ratio-1 run beside
    it a second floor prices the prefill's attention by query-key pairs: with a = the ratio-1 path's
    attention share of its selective stages and p = the blend's pairs over the ratio-1 path's,
    pair floor = F / L x t(plain) + (D - F) / L x t(plain) x ((1 - a) x r + a x p) + t(reuse). The
    first ratio says what the blend costs against its share of tokens, the second what its execution
    costs against the work its selection implies.

    Adds ``full_layers``, ``floor_s``, ``worker_vs_floor``, ``pair_floor_s``, ``worker_vs_pair_floor``,
    ``attention_share_ratio_one`` (a), ``ratio_one_vs_plain`` (median TTFT of the own ratio-1 path over
    plain's), ``attention_per_pair_vs_ratio_one`` (the selective attention's median seconds per
    query-key pair over the ratio-1 path's, whose attention is a full prefill's: 1.0 means the
    recomputed queries cost what a prefill's do per pair) and ``attention_pairs_vs_ratio_one`` (p);
    each None when its inputs were not run.
    """
    if not stages:
        return stages
    t_plain, one = stages["ttft_s_plain"], stages["ttft_s_ratio_one"]
    r = stages.get("recomputed_frac") or stages["ratio"]
    depth = num_layers if depth_layers is None else depth_layers
    full = check_layer + 1 if full_layers is None else full_layers
    pairs = (rounded(stages["attention_pairs"] / stages["attention_pairs_ratio_one"], 3)
             if (stages.get("attention_pairs") and stages.get("attention_pairs_ratio_one")) else None)
    selective_one = stages.get("stages_s_ratio_one") or {}
    attention_one, layers_one = selective_one.get("selective_attention_s"), selective_one.get("selective_layers_s")
    share = (rounded(attention_one / (attention_one + layers_one), 3)
             if (attention_one and layers_one is not None) else None)
    floor = pair_floor = None
    if t_plain:
        every_token = full / num_layers * t_plain + stages["worker_s_reuse"]  # layers for all tokens, reused KV
        selective = (depth - full) / num_layers * t_plain  # the selective layers at ratio 1
        floor = every_token + r * selective
        if pairs is not None and share is not None:
            pair_floor = every_token + selective * ((1 - share) * r + share * pairs)
    return {**stages, "check_layer": check_layer, "num_layers": num_layers, "depth_layers": depth,
            "full_layers": full, "floor_s": rounded(floor),
            "worker_vs_floor": rounded(stages["worker_s"] / floor, 3) if floor else None,
            "pair_floor_s": rounded(pair_floor), "attention_share_ratio_one": share,
            "worker_vs_pair_floor": rounded(stages["worker_s"] / pair_floor, 3) if pair_floor else None,
            "ratio_one_vs_plain": rounded(one / t_plain, 3) if (one and t_plain) else None,
            "attention_per_pair_vs_ratio_one": rounded(stages["attention_ns_per_pair"]
                                                       / stages["attention_ns_per_pair_ratio_one"], 3)
            if (stages.get("attention_ns_per_pair") and stages.get("attention_ns_per_pair_ratio_one")) else None,
            "attention_pairs_vs_ratio_one": pairs}


def ttft_targets(main: Mapping[str, Mapping[str, Any]], stages: Mapping[str, Any] | None = None,
                 blend_ops: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The targets a ttft run measures, by the prompts' length class (:func:`~ragcache.bench.common.
    prompt_length`); ``met`` is None where a mode was not run.

    Every length: TTFT speedup against the faster full prefill (ragcache's or plain vLLM's), gold NLL
    at most +5%, Rouge-L agreement with full prefill's answer, no more repetition loops than full
    prefill on the same prompts. Short prompts add answers equal to full's and gold F1 against
    full's; mid-length ones answers equal to full's and first-token KL; long ones KL. The worker's
    compute floor and the question probe's share are reported in the stage table, not judged here.
    With ``blend_ops`` (the operators one blend dispatched in the worker, :func:`_blend_ops`), their
    median is judged against a constant: a blend's size must not grow with its prompt.
    """
    blend, reuse, plain, full = main.get("blend"), main.get("reuse"), main.get(PLAIN), main.get("full")
    out: dict[str, Any] = {}
    if blend:
        length = prompt_length(blend.get("prompt_tokens_mean"))
        tokens = blend.get("prompt_tokens_mean")
        where = f"{length} prompts" + ("" if tokens is None else f" (mean {tokens:.0f} tokens)")

        def limit(name: str) -> float | None:
            return TARGETS[name].get(length)

        speed = limit("blend_ttft_speedup_min")
        out["blend_ttft_speedup"] = target(blend["speedup_median"], speed, "min",
                                           f"median per-example TTFT(full)/TTFT(blend); {speed}x on {where}")
        if plain:
            out["blend_ttft_speedup_vs_best"] = target(
                blend["speedup_vs_best_median"], speed, "min",
                f"median per-example min(TTFT(full), TTFT(plain vLLM))/TTFT(blend); {speed}x on {where}")
        out["blend_gold_nll_vs_full"] = target(blend["gold_nll_rel_full"], TARGETS["blend_nll_rel_max"], "max",
                                               "mean gold NLL(blend) / mean gold NLL(full) - 1, a fraction (0.05 = "
                                               "+5%; below 0: blend finds the gold answer likelier)")
        kl = limit("blend_kl_vs_reuse_max")
        if kl is not None and reuse and blend["kl_mean"] is not None and reuse["kl_mean"]:
            out["blend_kl_vs_reuse"] = target(blend["kl_mean"] / reuse["kl_mean"], kl, "max",
                                              f"mean KL(full||blend) / mean KL(full||reuse) of the first token; {where}")
        if limit("blend_agree_em_min") is not None:
            out["blend_agree_em"] = target(blend["agree_em_mean"], limit("blend_agree_em_min"), "min",
                                           f"share of blend's answers equal to full prefill's (normalised text); {where}")
        out["blend_agree_rouge_l"] = target(blend["agree_rouge_l_mean"], limit("blend_agree_rouge_l_min"), "min",
                                            f"mean Rouge-L of blend's answer against full prefill's; {where}")
        f1, f1_full = blend.get("f1_mean"), blend.get("f1_full_mean")
        if limit("blend_f1_vs_full_min") is not None and f1 is not None and f1_full:
            out["blend_f1_vs_full"] = target(f1 / f1_full, limit("blend_f1_vs_full_min"), "min",
                                             f"mean gold F1 of blend / of full prefill ({f1:.3f} / {f1_full:.3f}); {where}")
    if blend and blend.get("loop_share") is not None and full and full.get("loop_share") is not None:
        out["blend_loops"] = target(blend["loop_share"], full["loop_share"], "max",
                                    "share of blend answers with a repetition loop (an n-gram of >= 2 tokens "
                                    "repeated >= 3 times in a row), at most full prefill's share on the same prompts")
    if plain and full and plain.get("speedup_median"):
        # paired per example, like every speedup here: plain's "speedup" is TTFT(full) / TTFT(plain)
        out["full_vs_plain"] = target(plain["speedup_median"], TARGETS["full_vs_plain_max"], "max",
                                      "median per-example TTFT(full, ragcache's engine) / TTFT(plain vLLM)")
    if blend_ops:
        out["blend_aten_ops"] = target(
            blend_ops["total_median"], TARGETS["blend_ops_max"], "max",
            f"median operators (aten:: and the engine's own, top-level, torch profiler) one blend dispatched in the "
            f"worker: {blend_ops['per_layer_median']:g} per layer"
            + (f"; {blend_ops['own_median']:g} called by ragcache's code, the rest inside the engine's modules as "
               f"its build runs them" if blend_ops.get("own_median") is not None else ""))
    if stages and stages.get("ratio_one_vs_plain") is not None:
        out["ratio_one_vs_plain"] = target(stages["ratio_one_vs_plain"], TARGETS["ratio_one_vs_plain_max"], "max",
                                           "median TTFT of blend at ratio 1 (own layer-wise path) / plain vLLM's")
    return out


#: the quality fields of a variant's summary that ``eval`` reports
_EVAL_SUMMARY = ("n", "kl_mean", "kl_median", "gold_nll_mean", "gold_nll_rel_full", "answer_nll_mean",
                 "answer_nll_rel_full", "f1_mean", "rouge_l_mean", "em_mean", "agree_em_mean", "agree_rouge_l_mean",
                 "agree_tokens_mean", "agree_prefix_mean", "loop_share", "recomputed_frac_mean")
#: the quality fields of a request record that ``eval`` reports per example
_EVAL_RECORD = ("kl_from_full", "gold_nll", "answer_nll", "f1", "rouge_l", "em", "agree_em", "agree_rouge_l",
                "agree_tokens", "agree_prefix", "repetition_loop")


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
        "n": res["n"], "passages": res["passages"], "max_tokens": max_tokens,
        "quality": pick(res["variants"][name]), "full": pick(res["variants"]["full"]),
        "run_s": res["run_s"], "examples": examples_out,
    }
