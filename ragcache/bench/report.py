"""Presentation of benchmark results: text and markdown tables, plots, and the result files.

Owns: the tables of each benchmark kind (``TABLES``) and its plot where it has one (``PLOTS``),
the targets table, :func:`render` (every table as text or markdown), :func:`write_result`
(RESULT.json, RESULT.md, RESULT.png) and the generated sections of a markdown document
(:func:`regenerate`: docs/benchmarks.md's tables, each rendered from the committed JSON it names, so
a figure there cannot drift from its run). Works on the plain result dicts the runners return:
imports no runner, no engine, no vLLM; matplotlib only inside :func:`plot`; never app/ or ui/.

A new benchmark kind adds one function to ``TABLES`` (and one to ``PLOTS`` if it has a plot).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

Table = tuple[str, list[str], list[list[Any]]]


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.1f}" if abs(v) >= 100 else f"{v:.{nd}f}"
    return str(v)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned table (numbers right-aligned)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    for r in cells:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same table as GitHub markdown (a ``|`` inside a cell is escaped so it does not split it)."""
    def cell(v: Any) -> str:
        return _fmt(v).replace("|", "\\|")

    out = ["| " + " | ".join(map(cell, headers)) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(out)


def _pct(v: float | None) -> float | None:
    return None if v is None else round(100.0 * v, 2)


# ---- tables per benchmark kind -----------------------------------------------------------------


def _ttft_tables(result: Mapping[str, Any]) -> list[Table]:
    h = ["mode", "TTFT med (s)", "TTFT p90 (s)", "speedup", "vs best", "KL vs full", "answer NLL vs full %",
         "gold NLL", "NLL vs full %", "F1", "Rouge-L", "agree EM", "agree prefix %", "agree Rouge-L", "loops %",
         "recomputed %"]

    def row(name: str, s: Mapping[str, Any]) -> list[Any]:
        return [name, s["ttft_median_s"], s["ttft_p90_s"], s["speedup_median"], s.get("speedup_vs_best_median"),
                s["kl_mean"], _pct(s.get("answer_nll_rel_full")), s["gold_nll_mean"], _pct(s["gold_nll_rel_full"]),
                s["f1_mean"], s["rouge_l_mean"], s["agree_em_mean"], _pct(s.get("agree_prefix_mean")),
                s["agree_rouge_l_mean"], _pct(s.get("loop_share")), _pct(s["recomputed_frac_mean"])]
    main = [row(k if k != "blend" else s["variant"], s) for k, s in result["modes"].items()]
    sweep = [row(s["variant"], s) for s in result["sweep"]]
    if "reuse" in result["modes"]:
        sweep.insert(0, row("reuse", result["modes"]["reuse"]))
    out = [(f"TTFT and quality by mode (n={result['n']}, {result['passages']} passages; 'vs best' = "
            f"min(TTFT full, TTFT plain vLLM) / TTFT; speedups are medians of per-example ratios)", h, main)]
    if len(result["sweep"]) > 1:
        out.append(("recompute-ratio sweep (blend, per selection strategy)", h, sweep))
    st = result.get("stages")
    if st:
        out.append(_stage_table(st))
    if result.get("routes"):
        out.append(_route_table(result["routes"]))
    return out


def _route_table(routes: Mapping[str, Any]) -> Table:
    """``auto`` per prompt-length class: the routes taken, its TTFT against full prefill's and blend's,
    answers equal to full's, and the gold NLL of the requests it blended."""
    rows = [[name, r["n"], r["prompt_tokens_mean"], ", ".join(f"{k} {v}" for k, v in sorted(r["routes"].items())),
             r["auto_over_full_median"], r["auto_over_full_p90"], r["auto_over_blend_median"],
             f"{r['agree_tokens_n']}/{r['n']}", _pct(r["blended_gold_nll_rel_full"]), r["route_s_max"]]
            for name, r in routes.items() if r]
    return ("auto: the path each request took (route:rule), per prompt length; TTFT ratios are medians of "
            "per-request ratios",
            ["prompts", "n", "tokens", "routes", "auto/full med", "auto/full p90", "auto/blend med",
             "equal to full", "blended gold NLL vs full %", "route s max"], rows)


def _stage_table(st: Mapping[str, Any]) -> Table:
    """The blend worker's stage medians beside reuse's, and beside blend at ratio 1 (same selection)
    only where the run had one (``--ratios ...,1``); the title says which."""
    one = st["worker_s_ratio_one"] is not None
    names = sorted(set(st["stages_s"]) | set(st["stages_s_ratio_one"]) | set(st["stages_s_reuse"]))

    def line(label: str, main: Any, ratio_one: Any, reuse: Any) -> list[Any]:
        return [label, main, ratio_one, reuse] if one else [label, main, reuse]

    rows = [line(k, st["stages_s"].get(k), st["stages_s_ratio_one"].get(k), st["stages_s_reuse"].get(k))
            for k in names]
    rows.append(line("worker total", st["worker_s"], st["worker_s_ratio_one"], st["worker_s_reuse"]))
    if st.get("ttft_s_plain") is not None:
        rows.append(line("plain vLLM prefill (TTFT)", st["ttft_s_plain"], st.get("ttft_s_ratio_one"), None))
    if st.get("floor_s") is not None:
        depth = st.get("depth_layers") or st["num_layers"]
        where = f"c={st['check_layer']}, L={st['num_layers']}" + (f", D={depth}" if depth != st["num_layers"] else "")
        if st.get("full_layers") is not None:
            where += f", F={st['full_layers']}"
        share = st.get("recomputed_frac") or st.get("ratio")
        where += "" if share is None else f", r={share:.2f}"
        rows.append(line(f"compute floor vs plain ({where})", st["floor_s"],
                         None, None))
        rows.append(line("worker / floor", st["worker_vs_floor"], None, None))
    if st.get("pair_floor_s") is not None:
        rows.append(line(f"floor by query-key pairs (attention a={st['attention_share_ratio_one']:.2f} of ratio 1's)",
                         st["pair_floor_s"], None, None))
        rows.append(line("worker / pair floor", st["worker_vs_pair_floor"], None, None))
    if st.get("attention_ns_per_pair") is not None:
        rows.append(line("selective attention ns per query-key pair", st["attention_ns_per_pair"],
                         st.get("attention_ns_per_pair_ratio_one"), None))
    if st.get("attention_pairs_vs_ratio_one") is not None:
        rows.append(line("selective attention pairs / ratio 1's", st["attention_pairs_vs_ratio_one"], None, None))
    if st.get("attention_per_pair_vs_ratio_one") is not None:
        rows.append(line("attention per pair / ratio 1's", st["attention_per_pair_vs_ratio_one"], None, None))
    if one:
        return (f"worker seconds by stage, medians ({st['variant']} vs ratio 1 vs reuse)",
                ["stage", st["variant"], "ratio 1", "reuse"], rows)
    return (f"worker seconds by stage, medians ({st['variant']} vs reuse; add 1 to --ratios for a ratio-1 column)",
            ["stage", st["variant"], "reuse"], rows)


def _eval_tables(result: Mapping[str, Any]) -> list[Table]:
    h = ["mode", "n", "KL vs full", "gold NLL", "NLL vs full %", "F1", "Rouge-L", "EM", "agree EM",
         "agree Rouge-L", "loops %"]
    rows = []
    for name, s in (("full", result["full"]), (result["mode"], result["quality"])):
        rows.append([name, s["n"], s["kl_mean"], s["gold_nll_mean"], _pct(s["gold_nll_rel_full"]), s["f1_mean"],
                     s["rouge_l_mean"], s["em_mean"], s["agree_em_mean"], s["agree_rouge_l_mean"],
                     _pct(s.get("loop_share"))])
    return [(f"quality (n={result['n']})", h, rows)]


def _hotset_tables(result: Mapping[str, Any]) -> list[Table]:
    w = result["window"]
    h = ["mode", "TTFT med (s)", "TTFT p90 (s)", "speedup", f"first-{w} speedup", f"last-{w} speedup",
         "last/first", "agree Rouge-L"]
    rows = [[k, s["ttft_median_s"], s["ttft_p90_s"], s["speedup_median"], s["speedup_first_median"],
             s["speedup_last_median"], s["last_vs_first"], s["agree_rouge_l_mean"]]
            for k, s in result["modes"].items()]
    th = ["tier", "hits", "misses", "hit rate", "entries", "share of chunk loads"]
    served = result.get("served_by_tier", {})
    trows = [[k, t["hits"], t["misses"], t["hit_rate"], t["entries"], _pct(served.get(k, 0.0))]
             for k, t in result["tier_hit_rates"].items()]
    if served.get("computed"):
        trows.append(["computed (miss)", None, None, None, None, _pct(served["computed"])])
    return [(f"hotset (n={result['n']} questions, {result['passages']} passages, "
             f"{_pct(result['overlap_seen_before_mean'])}% of each set seen before)", h, rows),
            ("store hit rates over the sequence (lookups reaching each tier) and the tiers that served "
             "reuse/blend chunk loads (%)", th, trows)]


def _throughput_tables(result: Mapping[str, Any]) -> list[Table]:
    h = ["C", "mode", "req/s", "prompt tok/s", "output tok/s", "TTFT med (s)", "wall (s)"]
    rows = [[r["concurrency"], r["mode"], r["requests_per_s"], r["prompt_tokens_per_s"], r["output_tokens_per_s"],
             r["ttft_median_s"], r["wall_s"]] for r in result["rows"]]
    rh = ["C", "blend/full req/s"]
    rr = [[r["concurrency"], r["blend_vs_full_requests_per_s"]] for r in result["blend_vs_full"]]
    return [(f"throughput ({result['prompt_tokens_mean']:.0f}-token prompts)", h, rows),
            ("blend over full", rh, rr)]


def _tiers_tables(result: Mapping[str, Any]) -> list[Table]:
    h = ["tier", "overlap", "n", "TTFT med (s)", "TTFT p90 (s)", "load (s)", "worker (s)", "vs cpu"]
    # worker_s_median: blend_s_median in results written before 2026-12-01 (docs/bench/bench_tier_ttft.json)
    rows = [[s["tier"], s["pipeline_overlap"], s["n"], s["ttft_median_s"], s["ttft_p90_s"], s["load_s_median"],
             s.get("worker_s_median", s.get("blend_s_median")), s["vs_cpu_median"]] for s in result["summary"]]
    return [(f"blend TTFT by tier (n={result['n']}, full TTFT median {result['full_ttft_median_s']} s)", h, rows)]


def _ingest_tables(result: Mapping[str, Any]) -> list[Table]:
    h = ["path", "tokens/s", "seconds"]
    rows = [["KV precompute (ragcache)", result["precompute"]["tokens_per_s"], result["precompute"]["seconds"]],
            ["vLLM prefill, one chunk at a time", result["vllm_prefill_sequential"]["tokens_per_s"],
             result["vllm_prefill_sequential"]["ttft_sum_s"]],
            ["vLLM prefill, one batch", result["vllm_prefill_batch"]["tokens_per_s"],
             result["vllm_prefill_batch"]["wall_s"]]]
    return [(f"ingest ({result['chunks']} chunks, {result['unit_tokens']} tokens)", h, rows)]


def _serve_tables(result: Mapping[str, Any]) -> list[Table]:
    h = ["C", "mode", "req/s", "output tok/s", "client TTFT p50 (s)", "client TTFT p90 (s)", "server TTFT p50 (s)",
         "e2e p50 (s)", "cached tok", "errors"]
    rows = [[r["concurrency"], r["mode"], r["requests_per_s"], r["output_tokens_per_s"], r["ttft_p50_s"],
             r["ttft_p90_s"], r["server_ttft_p50_s"], r["e2e_p50_s"], r["cached_tokens_mean"], r["errors"]]
            for r in result["rows"]]
    prompt = next((r["prompt_tokens_mean"] for r in result["rows"] if r["prompt_tokens_mean"]), 0) or 0
    rr = [[r["concurrency"], r["requests_per_s"], r["ttft_p50_speedup"]] for r in result["blend_vs_full"]]
    return [(f"bench serve: {result['n']} questions, top_k {result['top_k']}, ~{prompt:.0f}-token prompts, "
             f"{result['max_tokens']} tokens out, in-process SDK TTFT p50 {result['sdk']['ttft_p50_s']} s", h, rows),
            ("blend over full", ["C", "req/s ratio", "client TTFT p50 speedup"], rr)]


def _scale_tables(r: Mapping[str, Any]) -> list[Table]:
    ing = r.get("ingest", {})
    ingest_rows = [[name, row.get("chunks"), row.get("kv_tokens"), row.get("wall_s"), row.get("chunks_per_s"),
                    row.get("kv_tokens_per_s")] if "wall_s" in row else [name, row.get("skipped"), "", "", "", ""]
                   for name, row in ing.items()]
    fa = r.get("first_ask", {})
    first_rows = [[fa.get("questions"), fa.get("tiers"), fa.get("again_tiers"), fa.get("remote_ttft_p50_s"),
                   fa.get("cpu_ttft_p50_s"), fa.get("remote_vs_cpu_ttft_median")]]
    load_rows = [[row["replicas"], row["requests"], row["requests_per_s"], row["client_ttft_p50_s"],
                  row["client_ttft_p90_s"], row["redis_bytes_read_per_request"],
                  "; ".join(f"{k}: {v['requests']} req, hit {v['hit_rate']}" for k, v in row["per_replica"].items())]
                 for row in r.get("load", [])]
    fo = r.get("failover", {})
    out = [("ingest (local vs Ray)", ["executor", "chunks", "KV tokens", "wall s", "chunks/s", "KV tokens/s"],
            ingest_rows),
           ("first ask on a replica that never saw the chunks", ["questions", "tiers (first ask)", "tiers (again)",
                                                                 "remote TTFT p50 s", "cpu TTFT p50 s",
                                                                 "remote/cpu (median)"], first_rows),
           ("same client load, 1 vs 2 replicas", ["replicas", "requests", "req/s", "client TTFT p50 s",
                                                  "p90 s", "Redis bytes/req", "per replica"], load_rows)]
    if fo:
        out.append(("failover", ["killed", "stream broke", "next status", "next replica", "answered"],
                    [[fo.get("killed"), fo.get("stream_broke"), fo.get("next_status"), fo.get("next_replica"),
                      fo.get("answered")]]))
    if r.get("services"):
        out.append(("services", ["name", "version", "nodes"],
                    [[s["name"], s["version"], s["nodes"]] for s in r["services"]]))
    return out


def _bandwidth_tables(r: Mapping[str, Any]) -> list[Table]:
    e, raw = r["entry"], r["raw_disk"]
    rows = [[t["dtype"], t["tier"], round(t["entry_bytes"] / 1e6, 1), t["get_mb_s"], round(t["get_s"] * 1e3, 1),
             t["layers_mb_s"], round(t["layers_s"] * 1e3, 1)] for t in r["tiers"]]
    raw_rows = [[round(raw["bytes"] / 1e6, 1), raw["dd_cold_mb_s"], raw["dd_direct_mb_s"], raw["dd_page_cache_mb_s"]]]
    return [(f"KV entry read bandwidth ({e['layers']} layers x {e['tokens']} tokens x {e['kv_heads']} KV heads x "
             f"{e['head_dim']}, K+V; median of {r['reads']} reads; MB = 1e6 bytes)",
             ["dtype", "tier", "entry MB", "get MB/s", "get ms", "layers MB/s", "layers ms"], rows),
            ("raw disk, same folder (dd)", ["file MB", "cold MB/s", "O_DIRECT MB/s", "page cache MB/s"], raw_rows)]


def _retrieval_tables(r: Mapping[str, Any]) -> list[Table]:
    paths = ("faiss", "faiss1", "search", "e2e")
    rows = [[x["chunks"], x["build_s"], *(f"{x[p + '_p50_ms']:.2f} / {x[p + '_p99_ms']:.2f}" for p in paths)]
            for x in r["results"]]
    return [(f"retrieval latency, top_k {r['top_k']}, p50 / p99 ms (query embedding alone: p50 "
             f"{r['query_embedding_p50_ms']:.1f} ms, p99 {r['query_embedding_p99_ms']:.1f} ms)",
             ["chunks", "build s", "faiss", "faiss 1 thread", "search", "e2e"], rows)]


def _coldstart_tables(r: Mapping[str, Any]) -> list[Table]:
    rows = [[mode, m["first_s"], m["steady_median_s"], m["first_vs_steady"]] for mode, m in r["modes"].items()]
    # start_s and no repeats: the results of scripts/cold_start.py, before this benchmark (docs/bench/cold_start_*)
    repeats = r.get("repeats") or max(len(m.get("ttft_s", ())) for m in r["modes"].values())
    return [(f"cold start: engine start {r.get('startup_s', r.get('start_s'))} s, {r['prompt_tokens']}-token prompt, "
             f"{repeats} requests per mode", ["mode", "first TTFT (s)", "later TTFT median (s)", "first / later"], rows)]


def _plain_tables(r: Mapping[str, Any]) -> list[Table]:
    return [(f"plain vLLM full prefill, {r['prompt_tokens']} tokens", ["dtype", "runs", "TTFT median (s)", "TTFTs (s)"],
             [[r["dtype"], r["runs"], r["ttft_median_s"], ", ".join(f"{t:g}" for t in r["ttft_s"])]])]


def _storage_tables(r: Mapping[str, Any]) -> list[Table]:
    h = ["form", "bytes/token", "vs fp32", "KL blend", "vs none", "KL reuse", "vs none", "gold NLL blend", "vs none",
         "TTFT cpu (s)", "vs none", "TTFT disk cold (s)", "vs none", "TTFT Redis (s)", "vs none"]
    rows = [[s["form"], s["bytes_per_token"], s["vs_fp32"], s["blend_kl_mean"], s["blend_kl_vs_none"],
             s["reuse_kl_mean"], s["reuse_kl_vs_none"], s["blend_gold_nll_mean"], s["blend_gold_nll_vs_none"],
             s["cpu_ttft_median_s"], s["cpu_ttft_vs_none"], s["disk-cold_ttft_median_s"], s["disk-cold_ttft_vs_none"],
             s["remote_ttft_median_s"], s["remote_ttft_vs_none"]] for s in r["summary"]]
    out = [(f"stored forms of chunk KV (n={r['n']}, {r['passages']} passages, engine dtype {r['dtype']}; none = "
            f"{r['dtype']} floats; TTFT: blend medians over {r['repeats']} repeats; KL: mean first-token KL from full)",
            h, rows)]
    codec = [[c["form"], c["model_dtype_mb"], c["compress_mb_s"], c["decompress_mb_s"], c["zlib_size_vs_quantised"],
              c["zlib_decode_mb_s"]] for c in r["codec"]]
    out.append((f"codec rates on real KV (MB of {r['dtype']} K/V per second; zlib level 1 over the quantised bytes)",
                ["form", "MB", "compress MB/s", "decompress MB/s", "zlib size", "zlib decode MB/s"], codec))
    cost = [[c["model"], c["form"], c["bytes_per_token"], c["vs_fp32"], c["gb_per_million_tokens"]]
            for c in r["cost_table"]]
    out.append(("what a corpus costs (512-token chunks: header, values, scales)",
                ["model", "form", "bytes/token", "vs fp32", "GB per 1M tokens"], cost))
    return out


def _span(values: Sequence[float], unit: str = "") -> str:
    """``"lo-hi unit"`` of ``values`` (one value when they are equal)."""
    lo, hi = min(values), max(values)
    return (f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}") + unit


def _accelerator_tables(r: Mapping[str, Any]) -> list[Table]:
    """scripts/accelerator_blend.py's rows (one run, or many with a ``run`` each): per shape and
    context length, the range over runs of the prefill's and the blend's milliseconds."""
    groups: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for row in r["rows"]:
        groups.setdefault((row.get("shape", r.get("shape", "?")), row["context_tokens"]), []).append(row)
    rows = [[shape, tokens, len({x.get("run", 0) for x in g}), _span([x["hf_prefill_ms"] for x in g], " ms"),
             _span([x["blend_ms"] for x in g], " ms"), _span([x["reuse_ms"] for x in g], " ms"),
             _span([x["blend_vs_hf_prefill"] for x in g], "x")] for (shape, tokens), g in groups.items()]
    return [(f"blend/'s torch path against transformers' prefill, torch {r['torch']} (random weights; 'vs prefill' "
             "= prefill ms / blend ms; a range is over runs)",
             ["shape", "context tokens", "runs", "transformers prefill", "blend", "reuse", "blend vs prefill"], rows)]


def _diverge_tables(r: Mapping[str, Any]) -> list[Table]:
    sm = r["summary"]
    head = (f"blend vs full prefill ({r['dtype']}, KV {r['kv_compression']}): {sm['answers_equal']}/{sm['questions']} "
            f"answers equal, {sm['divergences']} divergences, mean recompute share {sm['mean_recompute_share']}")
    out: list[Table] = [(head, ["cause", "divergences", "share"],
                         [[c["label"], c["count"], c["share"]] for c in sm.get("causes", {}).values()])]
    if sm.get("counterfactuals"):
        out.append(("counterfactual reruns (forced into the recompute set; patch = full prefill's KV for those rows)",
                    ["rerun", "extra tokens (mean)", "token restored", "answer restored"],
                    [[name, c["extra_tokens_mean"], c["token_restored"], c["answer_restored"]]
                     for name, c in sm["counterfactuals"].items()]))
        out.append((f"the {r['top_k']} context tokens each diverging step attends to most ({r['attention']})",
                    ["kind", "tokens", "attention mass (mean)", "K rel. error", "V rel. error"],
                    [[kind, t["count"], t["mass_mean"], t["k_error_mean"], t["v_error_mean"]]
                     for kind, t in sm["top_tokens"].items()]))
    rows = []
    for rec in r["records"]:
        d = rec.get("divergence")
        rows.append([rec.get("index", ""), rec["recomputed"], rec["ctx_tokens"], "-" if d is None else f"{d['step']}/{d['full_len']}",
                     "" if d is None else f"{d['full_token']!r} vs {d['blend_token']!r}",
                     "" if d is None else d["full_margin"], "equal" if d is None else d["cause"]])
    out.append(("per question", ["example", "recomputed", "context", "step", "full vs blend token",
                                 "full margin (nats)", "cause"], rows))
    return out


def _transcribed_tables(r: Mapping[str, Any]) -> list[Table]:
    """Tables kept as numbers only (their run's own JSON was not kept): as the file gives them."""
    return [(t["title"], list(t["headers"]), [list(row) for row in t["rows"]]) for t in r["tables"]]


#: ``result["benchmark"]`` -> its tables
TABLES: dict[str, Callable[[Mapping[str, Any]], list[Table]]] = {
    "ttft": _ttft_tables, "eval": _eval_tables, "hotset": _hotset_tables, "throughput": _throughput_tables,
    "tiers": _tiers_tables, "ingest": _ingest_tables, "serve": _serve_tables, "scale": _scale_tables,
    "bandwidth": _bandwidth_tables, "retrieval": _retrieval_tables, "coldstart": _coldstart_tables,
    "plain": _plain_tables, "storage": _storage_tables, "accelerator": _accelerator_tables,
    "transcribed": _transcribed_tables, "diverge": _diverge_tables,
}


def tables(result: Mapping[str, Any]) -> list[Table]:
    """``(title, headers, rows)`` for a result of any benchmark."""
    kind = result["benchmark"]
    if kind not in TABLES:
        raise ValueError(f"unknown benchmark {kind!r}")
    return TABLES[kind](result)


def targets_table(result: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]] | None:
    """Headers and rows of a result's targets (value, limit, met, how measured); None without targets."""
    t = result.get("targets") or {}
    if not t:
        return None
    # max_abs (|value| <= limit): the gold-NLL target of results written before 2026-12-04 (docs/bench/)
    limit = {"min": "\u2265 {}", "max": "\u2264 {}", "max_abs": "|x| \u2264 {}"}
    rows = [[k, v["value"], next(limit[kind].format(_fmt(v[kind])) for kind in limit if kind in v), v["met"], v["note"]]
            for k, v in t.items()]
    return ["target", "value", "limit", "met", "measured as"], rows


def render(result: Mapping[str, Any], markdown: bool = False) -> str:
    """All tables of a result (and its targets), as text or markdown."""
    fn = markdown_table if markdown else text_table
    parts = []
    for title, h, rows in tables(result):
        parts.append((f"**{title}**\n\n" if markdown else f"{title}\n") + fn(h, rows))
    tt = targets_table(result)
    if tt:
        parts.append(("**targets**\n\n" if markdown else "targets\n") + fn(*tt))
    return "\n\n".join(parts)


# ---- generated sections of a markdown document ------------------------------------------------

#: a generated section of a markdown document: the marker names what is rendered there, the body is
#: rewritten by :func:`regenerate`. ``FILE [tables=1,2] [targets]`` renders those tables (1-based, in
#: :func:`tables`' order; default all) of one result, ``summary FILE ...`` one row per ttft result
SECTION = re.compile(r"^<!-- bench report: (?P<spec>[^\n]*?) -->\n(?P<body>.*?)^<!-- end bench report -->$",
                     re.S | re.M)


def _dataset(result: Mapping[str, Any]) -> str:
    """The QA set of a ttft result by its short name, with the examples' first and last index."""
    path = str(result.get("dataset") or "")
    name = next((label for key, label in (("musique", "MuSiQue"), ("hotpot", "HotpotQA"), ("demo", "demo"))
                 if key in Path(path).name), Path(path).name or "?")
    idx = [e["index"] for e in result.get("examples", []) if "index" in e]
    return f"{name} {min(idx)}-{max(idx)}" if idx else name


def _command(result: Mapping[str, Any]) -> str:
    """The run's command without its ``--out`` (where that run wrote is no part of what it measured)."""
    return re.sub(r"\s+--out\s+\S+", "", str(result.get("command") or "")).strip()


def source_line(result: Mapping[str, Any], link: str) -> str:
    """Where a generated table comes from: its JSON, its command, when and on what it ran."""
    m, eng = result.get("machine") or {}, result.get("engine") or {}
    parts = [f"From [{Path(link).name}]({link})"]
    if _command(result):
        parts.append(f"`{_command(result)}`")
    when = str(result.get("started") or result.get("date") or "")[:16].replace("T", " ")
    where = (f"{m.get('cpu_count', '?')} cores ({m.get('cpu_model', 'unknown CPU')})" if m
             else str(result.get("device") or "unknown machine"))
    dtype = eng.get("dtype") or result.get("dtype")
    load = m.get("load_avg_1_5_15")
    return (", ".join(parts) + f": {when + ' ' if when else ''}on {where}" + (f", {dtype}" if dtype else "")
            + (f", load average {load[0]:g} at the start" if load else "") + ".")


def overridden_settings(result: Mapping[str, Any]) -> str | None:
    """The settings a run's environment overrode, ``section.name=value`` each, space-separated (read
    from the ``RAGCACHE_<SECTION>__<NAME>=value`` words its ``command`` starts with), or None: the
    run used the defaults (or its command predates the record)."""
    try:
        words = shlex.split(str(result.get("command") or ""))
    except ValueError:  # an unbalanced quote: no record to read
        return None
    found = []
    for word in words:
        m = re.fullmatch(r"RAGCACHE_([A-Z0-9_]+?)__([A-Z0-9_]+)=(.*)", word, re.S)
        if m is None:
            break
        found.append(f"{m[1].lower()}.{m[2].lower()}={m[3]}")
    return " ".join(found) or None


def _drop_empty_columns(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> tuple[list[str], list[list[Any]]]:
    """The table without the columns no row has a value in (a run without plain, NLL or stages)."""
    keep = [i for i in range(len(headers)) if i == 0 or any(r[i] is not None for r in rows)]
    return [headers[i] for i in keep], [[r[i] for i in keep] for r in rows]


def summary_table(results: Sequence[tuple[str, Mapping[str, Any]]]) -> Table:
    """One row per ttft result ``(link, result)``: TTFT of full prefill, plain vLLM and the blend
    (as the result's ``engine`` record names it; the ``settings`` column: what the run's environment
    overrode, :func:`overridden_settings`), blend's speedup over the faster of the two, and its
    quality against full prefill."""
    h = ["run", "dtype", "set", "settings", "n", "prompt tokens", "full (s)", "plain vLLM (s)", "blend (s)",
         "blend vs best",
         "KL blend", "KL blend / reuse", "gold NLL vs full %", "agree EM", "floor agree EM", "agree Rouge-L",
         "recomputed %"]
    rows = []
    for link, r in results:
        md, blend, reuse = r["modes"], r["modes"]["blend"], r["modes"].get("reuse") or {}
        kl_ratio = (blend["kl_mean"] / reuse["kl_mean"]) if reuse.get("kl_mean") else None
        rows.append([f"[{Path(link).stem}]({link})", (r.get("engine") or {}).get("dtype"), _dataset(r),
                     overridden_settings(r), r["n"],
                     round(md["full"]["prompt_tokens_mean"]) if md["full"].get("prompt_tokens_mean") else None,
                     md["full"]["ttft_median_s"], (md.get("plain") or {}).get("ttft_median_s"), blend["ttft_median_s"],
                     blend.get("speedup_vs_best_median") or blend["speedup_median"], blend.get("kl_mean"), kl_ratio,
                     _pct(blend.get("gold_nll_rel_full")), blend.get("agree_em_mean"),
                     (md.get("floor") or {}).get("agree_em_mean"), blend["agree_rouge_l_mean"],
                     _pct(blend["recomputed_frac_mean"])])
    floor = "; 'floor agree EM': full prefill in the other dtype against full, the noise floor" \
        if any(r[h.index("floor agree EM")] is not None for r in rows) else ""
    blend = "the blend as its JSON's engine record names it" + (
        ", 'settings' the run's overrides" if any(r[h.index("settings")] is not None for r in rows) else "")
    return ("TTFT medians and blend's quality against full prefill, one run per row "
            f"({blend}: 'vs best' = median per example of min(full, plain vLLM) / blend{floor})", h, rows)


def section(spec: str, base: Path) -> str:
    """The markdown body of the generated section ``spec`` (paths relative to ``base``, the document's folder).

    Raises:
        ValueError: a malformed spec, a table number the result does not have, or a summary of
            something other than ttft results.
        FileNotFoundError: a named JSON file does not exist.
    """
    words = spec.split()
    if not words:
        raise ValueError("an empty bench report marker")
    if words[0] == "summary":
        results = [(w, json.loads((base / w).read_text(encoding="utf-8"))) for w in words[1:]]
        if not results or any(r.get("benchmark") != "ttft" for _, r in results):
            raise ValueError(f"summary takes ttft results: {spec!r}")
        title, h, rows = summary_table(results)
        return f"**{title}**\n\n" + markdown_table(*_drop_empty_columns(h, rows))
    link, options = words[0], words[1:]
    result = json.loads((base / link).read_text(encoding="utf-8"))
    every = tables(result)
    picked, with_targets = list(range(len(every))), False
    for opt in options:
        if opt == "targets":
            with_targets = True
        elif opt.startswith("tables="):
            picked = [int(i) - 1 for i in opt.removeprefix("tables=").split(",")]
            if any(not 0 <= i < len(every) for i in picked):
                raise ValueError(f"{spec!r}: {link} has tables 1-{len(every)}")
        else:
            raise ValueError(f"{spec!r}: unknown option {opt!r} (tables=1,2 or targets)")
    parts = [source_line(result, link)]
    for i in picked:
        title, h, rows = every[i]
        parts.append(f"**{title}**\n\n" + markdown_table(*_drop_empty_columns(h, rows)))
    tt = targets_table(result) if with_targets else None
    if tt:
        parts.append("**targets**\n\n" + markdown_table(*tt))
    return "\n\n".join(parts)


def regenerate(text: str, base: Path) -> str:
    """``text`` (a markdown document in folder ``base``) with every generated section rendered anew
    from the JSON its marker names; the rest of the document is kept as it is.

    Raises:
        ValueError, FileNotFoundError: as :func:`section`.
    """
    return SECTION.sub(lambda m: f"<!-- bench report: {m['spec']} -->\n{section(m['spec'], base)}\n"
                       "<!-- end bench report -->", text)


def stale_sections(text: str, base: Path) -> list[str]:
    """The specs of the generated sections of ``text`` that differ from what their JSON renders."""
    return [m["spec"] for m in SECTION.finditer(text)
            if m["body"] != section(m["spec"], base) + "\n"]


# ---- plots per benchmark kind ------------------------------------------------------------------


def _log_axis(axis: Any) -> None:
    """Log scale with plain tick labels at 1, 2, 5 x 10^k."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.axes.set_xscale("log") if axis.axis_name == "x" else axis.axes.set_yscale("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _label(ax: Any, xlabel: str, ylabel: str, *, legend: bool = False, title: str | None = None) -> None:
    """Axis labels and a light grid, and optionally the legend and a title."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend()
    if title is not None:
        ax.set_title(title)


def _ttft_plot(plt: Any, result: Mapping[str, Any]) -> Any:
    """Quality (first-token KL, NLL of full's own answer, gold NLL) against median TTFT: one blend
    curve per token-selection strategy over the ratio sweep, and the other modes as points."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    curves: dict[str, list[Mapping[str, Any]]] = {}
    for s in result["sweep"]:
        curves.setdefault(s.get("selection") or "blend", []).append(s)
    colors = ["tab:blue", "tab:orange", "tab:purple", "tab:olive", "tab:cyan"]
    for ax, key, label in ((axes[0], "kl_mean", "first-token KL(full || mode), nats"),
                           (axes[1], "answer_nll_mean", "NLL of full prefill's answer, nats/token"),
                           (axes[2], "gold_nll_mean", "gold-answer NLL, nats/token")):
        for (name, sweep), color in zip(curves.items(), colors):
            sweep = [s for s in sweep if s.get(key) is not None]
            ax.plot([s["ttft_median_s"] for s in sweep], [s[key] for s in sweep], "o-", color=color,
                    label=f"blend: {name}")
            for s in sweep:
                ax.annotate(f"{s['recompute_ratio']:g}", (s["ttft_median_s"], s[key]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=color)
        for name, marker, color in (("full", "s", "black"), ("plain", "D", "tab:gray"), ("prefix", "^", "tab:green"),
                                    ("reuse", "x", "tab:red")):
            s = result["modes"].get(name)
            if s and s.get(key) is not None:
                ax.plot([s["ttft_median_s"]], [s[key]], marker, color=color, markersize=8, label=name)
        _log_axis(ax.xaxis)
        _label(ax, "median TTFT (s, log scale)", label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"quality vs TTFT, n={result['n']} ({result['passages']} passages per prompt); "
                 "numbers: recompute ratio")
    return fig


def _hotset_plot(plt: Any, result: Mapping[str, Any]) -> Any:
    """TTFT of every mode over the question sequence."""
    fig, ax = plt.subplots(figsize=(9, 4))
    for name in result["modes"]:
        ax.plot(range(1, result["n"] + 1), [q["results"][name]["ttft_s"] for q in result["questions"]], ".-",
                label=name)
    _log_axis(ax.yaxis)
    _label(ax, "question in sequence", "TTFT (s, log scale)", legend=True,
           title="hotset: TTFT over the question sequence")
    return fig


def _throughput_plot(plt: Any, result: Mapping[str, Any]) -> Any:
    """Requests/s against the batch size, one line per mode."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in dict.fromkeys(r["mode"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["mode"] == m]
        ax.plot([r["concurrency"] for r in rows], [r["requests_per_s"] for r in rows], "o-", label=m)
    _label(ax, "concurrent requests", "requests/s", legend=True, title="throughput: generate_many batches")
    return fig


def _serve_plot(plt: Any, result: Mapping[str, Any]) -> Any:
    """Requests/s and client TTFT p50 against the number of concurrent clients, one line per mode."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in dict.fromkeys(r["mode"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["mode"] == m]
        cs = [r["concurrency"] for r in rows]
        axes[0].plot(cs, [r["requests_per_s"] for r in rows], "o-", label=m)
        axes[1].plot(cs, [r["ttft_p50_s"] for r in rows], "o-", label=m)
    _label(axes[0], "concurrent streaming clients", "requests/s", legend=True)
    _log_axis(axes[1].yaxis)
    _label(axes[1], "concurrent streaming clients", "client TTFT p50 (s, log scale)", legend=True)
    fig.suptitle("bench serve: one ragcache server, concurrent OpenAI-style streaming clients")
    return fig


#: ``result["benchmark"]`` -> its figure, drawn with ``matplotlib.pyplot``
PLOTS: dict[str, Callable[[Any, Mapping[str, Any]], Any]] = {
    "ttft": _ttft_plot, "hotset": _hotset_plot, "throughput": _throughput_plot, "serve": _serve_plot,
}


def plot(result: Mapping[str, Any], path: Path) -> Path | None:
    """A PNG for ttft (quality vs TTFT), hotset (TTFT over the sequence), throughput and serve; None otherwise."""
    draw = PLOTS.get(result["benchmark"])
    if draw is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt, result)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- files -------------------------------------------------------------------------------------


def write_result(result: dict[str, Any], out: Path, *, with_plot: bool = True) -> dict[str, Path]:
    """Write ``out`` (JSON), ``out`` with .md (the tables) and, where there is one, .png (the plot)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = {"json": out}
    png = out.with_suffix(".png")
    if with_plot and plot(result, png) is not None:
        result["plot"] = png.name
        paths["png"] = png
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    md = out.with_suffix(".md")
    eng = result.get("engine") or {}
    dtype = f", dtype {eng['dtype']} ({eng.get('dtype_reason')})" if eng.get("dtype") else ""
    header = (f"Measured {result.get('started', '')} on {result.get('machine', {}).get('cpu_count', '?')} cores "
              f"({result.get('machine', {}).get('cpu_model', 'unknown CPU')}){dtype}, load average at start "
              f"{result.get('machine', {}).get('load_avg_1_5_15')}.\n\n")
    md.write_text(header + render(result, markdown=True) + "\n", encoding="utf-8")
    paths["md"] = md
    return paths
