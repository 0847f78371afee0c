"""The ingest page: upload files and ingest them into a new or an existing index, with progress.

A page script of ui/app.py's st.navigation (run as ``__main__``); importable for its parts.

Uploaded files are kept under ``<index_dir>/<index>-uploads/`` (beside the index, so re-ingesting
the folder from the CLI works too) and ingested through ``RAGPipeline.ingest`` on the shared
engine, which also computes each new chunk's KV. Large uploads are ingested in up to
``MAX_BATCHES`` batches so the progress bar moves; each batch publishes a complete index version.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import streamlit as st

from ragcache.config import Settings
from ui import state

if TYPE_CHECKING:
    from ragcache.ingest.ingestor import IngestReport

log = logging.getLogger("ui.ingest_page")  # run as __main__ by st.navigation

FILE_TYPES = ["txt", "md", "html", "htm", "pdf", "json", "jsonl"]
NEW_INDEX = "New index…"
MAX_BATCHES = 10
RESULT = "ingest_result"
PENDING_TARGET = "_ingest_target_pending"


def render(settings: Settings, active_index: str | None) -> None:
    st.title("Ingest documents")
    root = state.index_dir(settings)
    st.caption(f"Uploaded files are saved under `{root}/<index>-uploads/`, split into chunks of at most "
               f"{settings.ingest.chunk_size} LLM tokens, embedded, and each chunk's KV is computed once "
               "and stored. Re-ingesting a file that did not change costs nothing.")

    existing = state.list_indexes(settings)
    options = existing + [NEW_INDEX]
    if PENDING_TARGET in st.session_state:
        st.session_state["ingest_target"] = st.session_state.pop(PENDING_TARGET)
    if st.session_state.get("ingest_target") not in options:
        st.session_state["ingest_target"] = active_index if active_index in existing else NEW_INDEX
    target = st.selectbox("Ingest into", options, key="ingest_target",
                          help="an existing index to add to, or a new one")
    problem = None
    if target == NEW_INDEX:
        name = st.text_input("New index name", key="ingest_new_name", placeholder="docs").strip()
        problem = state.check_index_name(name)
        if name and problem:
            st.warning(problem)
    else:
        name = target

    st.session_state.setdefault("uploader_generation", 0)
    files = st.file_uploader(
        "Documents (txt, md, html, pdf, json, jsonl)", type=FILE_TYPES, accept_multiple_files=True,
        key=f"uploader_{st.session_state['uploader_generation']}",
        max_upload_size=max(1, math.ceil(settings.ingest.max_file_mb)),
        help=f"at most {settings.ingest.max_file_mb:g} MB per file (ingest.max_file_mb)",
    )
    if st.button("Ingest", type="primary", icon=":material/upload:", disabled=not files or problem is not None):
        st.session_state[RESULT] = ingest_uploads(settings, name, files)
        if st.session_state[RESULT]["ok"]:
            st.session_state["uploader_generation"] += 1  # a fresh, empty uploader
            st.session_state[PENDING_TARGET] = name
            st.session_state[state.PENDING_INDEX] = name  # the sidebar picks the new index
            st.rerun()
    show_result(st.session_state.get(RESULT))


def show_result(result: dict[str, Any] | None) -> None:
    if not result:
        return
    if result.get("error"):
        st.error(result["error"], icon=":material/error:")
    else:
        st.success(f"Index **{result['index']}**: {result['summary']}", icon=":material/check_circle:")
    if result.get("skipped"):
        st.warning(f"{len(result['skipped'])} file(s) skipped:")
        st.table([{"file": f, "reason": r} for f, r in result["skipped"]])


def safe_filename(name: str) -> str:
    """A plain file name for an uploaded file (no folders, no leading dot)."""
    base = re.sub(r"[^\w.\- ]", "_", Path(name).name).strip()
    if not base or base.startswith("."):
        base = f"upload{base}"
    return base


def batches(items: Sequence[Path], max_batches: int = MAX_BATCHES) -> list[list[Path]]:
    size = max(1, math.ceil(len(items) / max_batches))
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def merge_reports(reports: Sequence["IngestReport"]) -> "IngestReport":
    """One report for several consecutive ingests into the same index."""
    from ragcache.ingest.ingestor import IngestReport

    last = reports[-1]
    return IngestReport(
        index_path=last.index_path,
        files_ingested=sum(r.files_ingested for r in reports),
        files_unchanged=sum(r.files_unchanged for r in reports),
        files_pruned=sum(r.files_pruned for r in reports),
        skipped=[s for r in reports for s in r.skipped],
        chunks_added=sum(r.chunks_added for r in reports),
        chunks_removed=sum(r.chunks_removed for r in reports),
        tokens_added=sum(r.tokens_added for r in reports),
        total_chunks=last.total_chunks,
        seconds=sum(r.seconds for r in reports),
        written=any(r.written for r in reports),
    )


def ingest_uploads(settings: Settings, name: str, files: Sequence[Any]) -> dict[str, Any]:
    """Save ``files`` (Streamlit UploadedFile) beside the index ``name`` and ingest them.

    Returns the result shown on the page: ``{index, ok, summary, skipped: [(file, reason)], error}``.
    """
    result: dict[str, Any] = {"index": name, "ok": False, "summary": "", "skipped": [], "error": None}
    folder = state.uploads_dir(settings, name)
    n = len(files)
    with st.status(f"Ingesting {n} file(s) into {name!r}…", expanded=True) as status:
        bar = st.progress(0.0, text="Saving the uploaded files")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            saved: dict[Path, str] = {}
            for i, f in enumerate(files, 1):
                path = folder / safe_filename(f.name)
                path.write_bytes(f.getbuffer())
                saved[path.resolve()] = f.name
                bar.progress(0.05 * i / n, text=f"Saved {i}/{n} files")
            st.caption(f"Saved {len(saved)} file(s) to `{folder}`.")
            bar.progress(0.05, text="Starting the engine (it computes the chunks' KV)…")
            pipe = state.pipeline_for(settings, name)
            reports, done = [], 0
            for batch in batches(list(saved)):
                bar.progress(0.05 + 0.95 * done / len(saved),
                             text=f"Reading, chunking, embedding, computing KV: {done}/{len(saved)} files")
                reports.append(pipe.ingest(batch))
                done += len(batch)
            bar.progress(1.0, text=f"Done: {done}/{len(saved)} files")
            report = merge_reports(reports)
            result["summary"] = report.summary()
            result["skipped"] = [(saved.get(Path(s.path).resolve(), Path(s.path).name), s.reason)
                                 for s in report.skipped]
            if report.total_chunks == 0:
                result["error"] = (f"Nothing could be ingested into {name!r}: every file was skipped "
                                   "(see the reasons below). Upload text, Markdown, HTML, PDF or JSON files.")
                status.update(label=f"Nothing ingested into {name!r}", state="error", expanded=True)
            else:
                result["ok"] = True
                status.update(label=f"Ingested {n} file(s) into {name!r}", state="complete", expanded=False)
        except Exception as exc:
            log.warning("ingest into %s failed", name, exc_info=True)
            result["error"] = state.describe_error(exc, name)
            status.update(label=f"Ingest into {name!r} failed", state="error", expanded=True)
    return result


if __name__ == "__main__":
    render(state.load_settings(), st.session_state.get(state.ACTIVE_INDEX))
