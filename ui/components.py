"""Pieces of the chat page: an answer's metrics strip and sources, the TTFT chart, the cache panel.

Pure rendering from SDK result objects (Answer, RequestMetrics, StoreStats); no engine calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import streamlit as st

if TYPE_CHECKING:
    from ragcache.engine.messages import RequestMetrics, StoreStats
    from ragcache.pipeline import Answer, Source

#: tiers top-down, as the store names them; others are appended in the order seen
TIER_ORDER = ("device", "cpu", "disk", "remote", "computed")


def seconds(x: float) -> str:
    return f"{x:.3f} s"


def tier_hits_text(hits: dict[str, int]) -> str:
    """``{"cpu": 3, "disk": 1}`` -> ``cpu 3 · disk 1`` (top tier first); ``-`` when empty."""
    order = [t for t in TIER_ORDER if t in hits] + sorted(t for t in hits if t not in TIER_ORDER)
    return " · ".join(f"{t} {hits[t]}" for t in order if hits[t]) or "-"


def speedup(answer: "Answer", full: "Answer | None") -> float | None:
    """full-prefill TTFT / this answer's TTFT, or None without a comparison."""
    if full is None or answer.metrics.ttft_s <= 0:
        return None
    return full.metrics.ttft_s / answer.metrics.ttft_s


def metrics_strip(answer: "Answer", full: "Answer | None" = None) -> None:
    """TTFT, mode, reused / recomputed tokens and tier hits of one answer (plus the speedup over
    full prefill when it was compared), then a caption with the remaining numbers."""
    m: RequestMetrics = answer.metrics
    up = speedup(answer, full)
    cols = st.columns([1.1, 0.9, 1.1, 1.2, 1.4] + ([1.1] if up is not None else []))
    delta = None
    if full is not None:
        delta = f"{m.ttft_s - full.metrics.ttft_s:+.3f} s vs full"
    cols[0].metric("TTFT", seconds(m.ttft_s), delta=delta, delta_color="inverse",
                   help="time to first token: loading/blending chunk KV + prefill of the question")
    cols[1].metric("Mode", m.mode)
    cols[2].metric("Reused tokens", f"{m.reused_tokens:,}", help="context tokens whose KV came from the cache")
    cols[3].metric("Recomputed tokens", f"{m.recomputed_tokens:,}",
                   help="context tokens recomputed (HKVD tokens in blend; all of them in full/prefix)")
    cols[4].metric("Tier hits", tier_hits_text(m.tier_hits), help="chunks served per KV tier")
    if up is not None:
        cols[5].metric("Speedup vs full", f"{up:.1f}×", help=f"full prefill TTFT {seconds(full.metrics.ttft_s)} "
                       f"/ {m.mode} TTFT {seconds(m.ttft_s)}")
    parts = [f"retrieval {seconds(m.retrieval_s)}", f"total {m.total_s:.2f} s",
             f"prompt {m.prompt_tokens:,} tokens", f"{m.output_tokens} tokens out"]
    if m.worker_s:
        parts[1:1] = [f"KV load {seconds(m.load_s)}", f"context ready in {seconds(m.worker_s)}"]
    if m.recompute_ratio is not None:
        depth = f", recomputed {m.recompute_note}" if m.recompute_note else ""
        parts.insert(0, f"recompute {m.ratio_text}{depth}")
    st.caption(" · ".join(parts))
    if m.route_rule and m.route_rule != "explicit":  # engine.mode = auto: the path it took, and why
        st.caption(f":material/alt_route: route {_escape(m.route_reason)}")
    if m.budget_mode == "adaptive":  # the recompute budget this question got, and why
        st.caption(f"budget {_escape(m.budget_reason)}")
    if m.load_error:  # the worker could not serve the cached context: vLLM prefilled it in full
        st.caption(f":material/warning: the cached context could not be served ({_escape(m.load_error)}); "
                   "full prefill answered")
    if m.ratio_note:  # the ratio goes against the index's calibration
        st.caption(f":material/info: {_escape(m.ratio_note)}")


def sources_expander(sources: Sequence["Source"]) -> None:
    """The retrieved chunks in prompt order: title, score, the KV tier that served them, text."""
    with st.expander(f"Sources ({len(sources)})", icon=":material/description:"):
        if not sources:
            st.caption("No sources.")
        for i, s in enumerate(sources, 1):
            title = s.title or s.doc_id or s.chunk_id
            st.markdown(f"**{i}. {_escape(title)}** &nbsp; score `{s.score:.3f}` &nbsp; KV tier "
                        f"`{s.tier or '-'}`")
            st.text(s.text)
            st.caption(f"{s.doc_id} · chunk {s.chunk_id}")


def comparison_expander(full: "Answer") -> None:
    """The full-prefill answer that was run for comparison."""
    with st.expander(f"Full prefill answer (TTFT {seconds(full.metrics.ttft_s)})", icon=":material/compare:"):
        st.text(full.text or "(empty answer)")
        st.caption(f"prompt {full.metrics.prompt_tokens:,} tokens · recomputed "
                   f"{full.metrics.recomputed_tokens:,} · total {full.metrics.total_s:.2f} s")


def ttft_chart(rows: Sequence[dict[str, Any]]) -> None:
    """TTFT per query over the session, one series per mode (rows: query, mode, ttft_s)."""
    if not rows:
        st.caption("TTFT per query appears here after the first question.")
        return
    import altair as alt
    import pandas as pd

    df = pd.DataFrame(rows)
    chart = (
        alt.Chart(df)
        .mark_line(point=alt.OverlayMarkDef(size=60))
        .encode(
            x=alt.X("query:O", title="query", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("ttft_s:Q", title="TTFT (s)"),
            color=alt.Color("mode:N", title="mode", sort=["blend", "reuse", "prefix", "full"]),
            tooltip=["query", "mode", alt.Tooltip("ttft_s:Q", format=".3f", title="TTFT (s)")],
        )
        .properties(height=200)
    )
    st.altair_chart(chart, width="stretch")


def cache_table(stats: "StoreStats") -> None:
    """Per KV tier: the share of chunk lookups it served (bar), hits / lookups, entries, bytes
    stored of its capacity; then the misses (chunks computed), so the rates add up to 100%."""
    import pandas as pd

    if not stats.tiers:
        st.caption("The KV store reports no tiers.")
        return
    rows = []
    lookups = stats.lookups
    for tier, s in stats.tiers.items():
        cap = s.capacity_bytes
        rows.append({
            "tier": tier + ("" if s.up else " (down)"),
            "hit rate": s.hit_rate,
            "hits": f"{s.hits}/{lookups}",
            "entries": s.entries,
            "stored": f"{_size(s.occupancy_bytes)} / {_size(cap) if cap else 'unbounded'}",
        })
    missed = stats.misses
    rows.append({"tier": "miss", "hit rate": missed / lookups if lookups else 0.0, "hits": f"{missed}/{lookups}",
                 "entries": 0, "stored": "computed on use"})
    st.dataframe(
        pd.DataFrame(rows), hide_index=True, width="stretch",
        column_config={
            "tier": st.column_config.TextColumn("tier", width=70),
            "hit rate": st.column_config.ProgressColumn(
                "hit rate", format="percent", min_value=0.0, max_value=1.0, width=120,
                help="share of chunk lookups this tier served since the server started (with the miss "
                     "row they add up to 100%; the prompt head is not counted)"),
            "hits": st.column_config.TextColumn("hits", width=60, help="chunk lookups served / chunk lookups"),
            "entries": st.column_config.NumberColumn("entries", width=65, help="chunk KV entries held now"),
            "stored": st.column_config.TextColumn("stored", help="bytes held now / capacity (GB = 10^9 bytes)"),
        },
    )


def _size(n: int | float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _escape(text: str) -> str:
    """``text`` with Markdown's special characters escaped."""
    return "".join("\\" + c if c in "\\`*_{}[]()#+-.!|<>~$" else c for c in text)
