"""The chat page: streamed answers with their sources and metrics, TTFT over the session, KV cache.

A page script of ui/app.py's st.navigation (run as ``__main__``); importable for its parts.

Session state owned here: ``messages`` (the conversation: :class:`ui.state.ChatRecord` entries,
user questions and assistant records holding the SDK's Answer objects or an error message) and
``ttft_log`` (one row per generation: query number, mode, TTFT).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import streamlit as st

from ragcache.config import BLENDING_MODES, MODES, Settings
from ragcache.conversation import Turn
from ragcache.options import QueryOptions
from ui import components, state
from ui.state import ChatRecord

if TYPE_CHECKING:
    from ragcache.pipeline import Answer, RAGPipeline
    from ragcache.server.client import RemotePipeline

log = logging.getLogger("ui.chat_page")  # run as __main__ by st.navigation

MESSAGES = "messages"
TTFT_LOG = "ttft_log"

MODE_HELP = ("auto: blend where it is predicted sooner at full prefill's quality, else full prefill (each answer says "
             "which and why) · blend: reuse chunk KV and recompute the HKVD tokens (CacheBlend) · reuse: reuse chunk KV, "
             "recompute nothing · prefix: vLLM prefix caching only · full: normal prefill, no reuse")


@dataclass(frozen=True)
class ChatControls:
    """The sidebar's choices: the query's options (recompute_ratio None: the pipeline's own,
    ``blend.recompute_ratio``, "auto" = calibrated) and whether to compare with full prefill."""

    options: QueryOptions
    compare: bool


def sidebar_controls(settings: Settings) -> ChatControls:
    """Mode, recompute ratio, top_k and the comparison toggle (kept across page switches), as the
    SDK's QueryOptions (the widgets keep to the options' ranges)."""
    with st.sidebar:
        st.subheader("Query")
        mode = st.selectbox("Mode", MODES, index=MODES.index(settings.engine.mode), key="mode",
                            persist_state="session", help=MODE_HELP)
        auto = settings.blend.recompute_ratio == "auto" and st.toggle(
            "Calibrated ratio (auto)", value=True, key="ratio_auto", persist_state="session", disabled=mode not in BLENDING_MODES,
            help="use the ratio `ragcache calibrate` recorded for this index (blend.fallback_ratio without one)")
        ratio = st.slider("Recompute ratio", 0.0, 1.0, float(settings.blend.static_ratio), 0.01,
                          key="recompute_ratio", persist_state="session", disabled=mode not in BLENDING_MODES or auto,
                          help="share of context tokens recomputed in blend mode")
        top_k = st.number_input("top_k", 1, 100, int(settings.retrieval.top_k), 1, key="top_k",
                                persist_state="session", help="chunks retrieved per question")
        compare = st.toggle("Compare with full prefill", key="compare", persist_state="session",
                            disabled=mode == "full",
                            help="also run each question with full prefill and show the TTFT speedup")
        if st.button("Clear conversation", icon=":material/delete_sweep:", disabled=not st.session_state[MESSAGES]):
            st.session_state[MESSAGES] = []
            st.session_state[TTFT_LOG] = []
    ratio = None if auto or mode not in BLENDING_MODES else float(ratio)
    options = QueryOptions(mode=mode, top_k=int(top_k), recompute_ratio=ratio)
    return ChatControls(options, bool(compare) and mode != "full")


def render(settings: Settings, index: str | None) -> None:
    st.session_state.setdefault(MESSAGES, [])
    st.session_state.setdefault(TTFT_LOG, [])
    controls = sidebar_controls(settings)

    st.title("ragcache chat")
    if index:
        where = (f"the ragcache server at {settings.ui.server_url} (one batched engine for every browser)"
                 if settings.ui.server_url else "the embedded vLLM engine")
        st.caption(f"Index **{index}** · answers come from {where}, which reuses each chunk's stored KV instead of "
                   "prefilling it again. Each answer sees the conversation so far.")
    # The overview sits above the conversation but is drawn again once this run's question is
    # answered, so its chart and cache numbers include it.
    left, right = st.container(border=True).columns([1, 1], gap="medium")
    left.markdown("**TTFT per query**")
    chart_slot = left.empty()
    with chart_slot.container():
        components.ttft_chart(st.session_state[TTFT_LOG])
    right.markdown("**KV cache per tier**")
    cache_slot = right.empty()
    cache_slot.caption("Shown once the engine runs" + ("." if index else " (ingest an index first)."))

    for record in st.session_state[MESSAGES]:
        with st.chat_message(record.role):
            if record.role == "user":
                st.text(record.question)
            else:
                show_answer(record)

    question = st.chat_input("Ask a question about the documents" if index else "Ingest documents first",
                             submit_mode="disable", disabled=not index)
    pipe = None
    if not index:
        st.info(f"There is no index under `{state.index_dir(settings)}` yet. Upload files on the Ingest page, "
                "or run `ragcache ingest PATH --index NAME` and reload.", icon=":material/info:")
        st.page_link("ingest_page.py", label="Go to the Ingest page", icon=":material/upload_file:")
    else:
        try:
            with st.spinner("Loading the index; the first time, starting the vLLM engine (once per server "
                            "process, 30-70 s on 2 CPU cores)…", show_time=True):
                pipe = state.pipeline_for(settings, index)
                if hasattr(pipe, "retriever"):
                    _ = pipe.retriever  # load the index and the embedding model now, not in the first question
        except Exception as exc:
            log.exception("cannot open index %s", index)
            st.error(state.describe_error(exc, index))
    if question is not None and pipe is not None:
        ask(pipe, index, question, controls)
        with chart_slot.container():
            components.ttft_chart(st.session_state[TTFT_LOG])
    if pipe is not None:
        with cache_slot.container():
            try:
                components.cache_table(pipe.cache_stats())
            except Exception as exc:
                log.exception("cache stats failed")
                st.caption(f"Cache stats unavailable: {type(exc).__name__}: {exc}")


def show_answer(record: ChatRecord, streamed: bool = False) -> None:
    """One assistant turn: the text (unless it was just streamed), metrics, comparison, sources."""
    answer = record.answer
    if record.error or answer is None:
        st.error(record.error, icon=":material/error:")
        return
    if not streamed:
        st.markdown(answer.text or "_(empty answer)_")
    elif not answer.text:
        st.markdown("_(empty answer)_")
    components.metrics_strip(answer, record.full)
    if record.compare_error:
        st.warning(f"No comparison with full prefill: {record.compare_error}")
    if record.full is not None:
        components.comparison_expander(record.full)
    components.sources_expander(answer.sources)


def _text_pieces(stream: Iterator["str | Answer"], record: ChatRecord) -> Iterator[str]:
    """The text pieces of ``pipeline.stream``; the final Answer goes into ``record.answer``.

    If the page is rerun mid-answer (another widget changed), closing this generator drains the
    rest of the stream, so the engine finishes the request and the answer still reaches the history.
    """
    try:
        for item in stream:
            if isinstance(item, str):
                yield item
            else:
                record.answer = item
    finally:
        for item in stream:
            if not isinstance(item, str):
                record.answer = item


def conversation(records: list[ChatRecord]) -> list[Turn]:
    """The earlier turns of the chat as :class:`~ragcache.conversation.Turn` objects: each question
    with its answer (questions whose answer failed are left out)."""
    turns: list[Turn] = []
    question = None
    for record in records:
        if record.role == "user":
            question = record.question
        elif record.answer is not None and question is not None:
            turns += [Turn("user", question), Turn("assistant", record.answer.text)]
            question = None
    return turns


def ask(pipe: "RAGPipeline | RemotePipeline", index: str, question: str, controls: ChatControls) -> None:
    """Answer ``question`` (streamed) with the conversation so far, record it, show it; errors become
    an st.error with the fix."""
    history = st.session_state[MESSAGES]
    turns = conversation(history)
    history.append(ChatRecord("user", question=question))
    with st.chat_message("user"):
        st.text(question)
    record = ChatRecord("assistant", index=index)
    with st.chat_message("assistant"):
        try:
            if not question.strip():
                raise ValueError("the question is empty: type a question in the box below")
            options = controls.options.model_copy(update={"history": tuple(turns)})
            pieces = _text_pieces(pipe.stream(question, options), record)
            try:
                st.write_stream(pieces)
            finally:
                pieces.close()
            if controls.compare:
                try:
                    with st.spinner("Running the same question with full prefill…"):
                        record.full = pipe.query(question, options.model_copy(
                            update={"mode": "full", "recompute_ratio": None}))
                except Exception as exc:
                    log.warning("full-prefill comparison failed: %s", exc)
                    record.compare_error = state.describe_error(exc, index)
            show_answer(record, streamed=True)
        except Exception as exc:  # ScriptControlException (rerun/stop) is a BaseException: not caught
            log.warning("question failed: %s: %s", type(exc).__name__, exc, exc_info=not isinstance(exc, ValueError))
            record.answer = None
            record.error = state.describe_error(exc, index)
            st.error(record.error, icon=":material/error:")
        finally:
            if record.answer is None and not record.error:
                record.error = "Stopped before the answer came back (the page was rerun). Ask again."
            history.append(record)
            if record.answer is not None:
                _log_ttft(record.answer, record.full)


def _log_ttft(answer: "Answer", full: "Answer | None") -> None:
    rows = st.session_state[TTFT_LOG]
    n = (rows[-1]["query"] + 1) if rows else 1
    rows.append({"query": n, "mode": answer.metrics.mode, "ttft_s": answer.metrics.ttft_s})
    if full is not None:
        rows.append({"query": n, "mode": full.metrics.mode, "ttft_s": full.metrics.ttft_s})


if __name__ == "__main__":
    render(state.load_settings(), st.session_state.get(state.ACTIVE_INDEX))
