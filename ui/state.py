"""Process-wide resources of the UI: settings, the one BlendEngine, a RAGPipeline per index.

Owns: creating the engine once per server process (``st.cache_resource``, shared by every browser
session), the pipelines over it, the list of indexes under ``ingest.index_dir``, the session-state
keys and records the pages share (:class:`ChatRecord`), and turning SDK errors into messages that
say what to do. Must not render anything except spinners.

Concurrency: Streamlit runs each session's script in its own thread. The engine is created under a
lock (and st.cache_resource computes one value per key at a time); queries on one pipeline are
serialized by RAGPipeline, and the BlendEngine serializes generation, KV precompute and stats
across pipelines, so sessions simply wait for each other. With ``ui.server_url`` set, questions go
to that running ``ragcache serve`` instead (:class:`ragcache.server.client.RemotePipeline`): its
one engine batches the questions of every browser, and this process starts no engine for chat.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import streamlit as st

from ragcache.config import ConfigError, Settings

if TYPE_CHECKING:
    from ragcache.engine import BlendEngine
    from ragcache.pipeline import Answer, RAGPipeline
    from ragcache.server.client import RemotePipeline

log = logging.getLogger(__name__)

_ENGINE_LOCK = threading.Lock()

#: what a new index may be called (a folder name under ingest.index_dir)
INDEX_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
UPLOADS_SUFFIX = "-uploads"
#: session-state key: an index name for the sidebar to select on the next run (set after an ingest)
PENDING_INDEX = "_select_index"
#: session-state key: the index chosen in the sidebar for this run (None when there is none)
ACTIVE_INDEX = "active_index"


@dataclass
class ChatRecord:
    """One entry of the chat's conversation (the chat page's session state): a question, or the
    answer to it.

    Defined here, not in the page script, which Streamlit runs again (and so defines again) on every
    rerun, while the records live on in the session.

    Attributes:
        role: ``"user"`` (a question) or ``"assistant"`` (its answer).
        question: the question as typed (user records).
        index: the index that was asked (assistant records).
        answer: the SDK's answer, or None when there is none (see ``error``).
        full: the same question answered with full prefill, when the sidebar asked to compare.
        error: why there is no answer, in words that say what to do; "" when there is one.
        compare_error: why the full-prefill comparison is missing; "" when there is none to report.
    """

    role: Literal["user", "assistant"]
    question: str = ""
    index: str = ""
    answer: "Answer | None" = None
    full: "Answer | None" = None
    error: str = ""
    compare_error: str = ""


def load_settings() -> Settings:
    """Settings for this script run: ./settings.toml < RAGCACHE_* environment (see ragcache.config).

    Raises:
        ConfigError: an invalid setting (the message names the key and the allowed values).
    """
    return Settings.load()


@st.cache_resource(show_spinner=False)
def shared_engine(_settings: Settings, _existing: "BlendEngine | None" = None) -> "BlendEngine":
    """The one BlendEngine of this server process, shared by every session and every index.

    Created on the first call (vLLM start-up: 30-70 s on 2 CPU cores) and kept for the life of the
    process. The arguments are not part of the cache key, so the first call decides: a program
    that already holds an engine (a test, an app embedding this UI) hands it over with
    ``shared_engine(settings, engine)`` before the first script run.

    Raises:
        ModelNotFoundError: the configured model is not provisioned (``make setup``).
    """
    if _existing is not None:
        return _existing
    from ragcache.engine import BlendEngine

    with _ENGINE_LOCK:
        log.info("starting the BlendEngine for the UI")
        return BlendEngine(_settings)


@st.cache_resource(show_spinner=False, max_entries=32)
def _pipeline(index: str, index_dir: str, version: int, _settings: Settings, _engine: "BlendEngine") -> "RAGPipeline":
    from ragcache.pipeline import RAGPipeline

    # Always a path under index_dir: a bare name that matches a folder in the working directory
    # would be taken as that folder by ragcache.index.folder.resolve_index_path.
    return RAGPipeline(_settings, index_path(_settings, index), _engine)


def pipeline_for(settings: Settings, index: str) -> "RAGPipeline | RemotePipeline":
    """The pipeline over ``index`` on the shared engine (starts the engine on first use), or the
    client of the server at ``ui.server_url`` when one is set.

    Keyed by the index's version on disk, so an ingest from another session or from the CLI is
    picked up by the next question.
    """
    if settings.ui.server_url:
        from ragcache.server.client import RemotePipeline

        return RemotePipeline(settings.ui.server_url, index, api_key=settings.serve.api_key)
    engine = shared_engine(settings)
    return _pipeline(index, str(index_dir(settings)), index_version(settings, index), settings, engine)


def index_dir(settings: Settings) -> Path:
    return Path(settings.ingest.index_dir).expanduser()


def index_path(settings: Settings, index: str) -> Path:
    """Folder of the index named ``index`` (always under ``ingest.index_dir``; absolute)."""
    from ragcache.index.folder import resolve_index_path

    return resolve_index_path(index, index_dir(settings)).absolute()


def index_version(settings: Settings, index: str) -> int:
    """Changes whenever the index is replaced (see :func:`ragcache.index.folder.index_version`; a
    pgvector index's registry version); 0: none."""
    from ragcache.index.catalog import catalog

    if settings.ingest.vector_store == "pgvector":
        return catalog(settings).version(index)
    return catalog(settings).version(index_path(settings, index))


def list_indexes(settings: Settings) -> list[str]:
    """Names of the complete indexes under ``ingest.index_dir``, sorted (those the server at
    ``ui.server_url`` offers, when one is set).

    Raises:
        httpx.HTTPError / ServerError: the server cannot be reached or refused.
    """
    if settings.ui.server_url:
        from ragcache.server.client import server_indexes

        return server_indexes(settings.ui.server_url, settings.serve.api_key)
    from ragcache.index.catalog import catalog

    return catalog(settings).names()


def check_index_name(name: str) -> str | None:
    """Why ``name`` cannot be a new index name, or None when it can."""
    if not name:
        return "Type a name for the new index."
    if not INDEX_NAME.fullmatch(name):
        return ("Index names use letters, digits, '.', '_' and '-' (at most 64 characters) and start "
                "with a letter or digit.")
    if name.endswith(UPLOADS_SUFFIX):
        return f"Names ending in {UPLOADS_SUFFIX!r} are reserved for the folders that keep uploaded files."
    return None


def uploads_dir(settings: Settings, index: str) -> Path:
    """Where files uploaded into ``index`` are kept: ``<index_dir>/<index>-uploads``."""
    return index_dir(settings) / f"{index}{UPLOADS_SUFFIX}"


def describe_error(exc: BaseException, index: str | None = None) -> str:
    """A message for users that names the problem and the fix (never a traceback)."""
    from ragcache.index.manifest import IndexMismatchError, IndexNotFoundError
    from ragcache.ingest.ingestor import IngestError
    from ragcache.models import ModelNotFoundError
    from ragcache.pipeline import EmptyIndexError
    from ragcache.prompt import PromptTooLongError

    name = index or "NAME"
    if type(exc).__module__.startswith(("httpx", "httpcore")):
        return (f"Cannot reach the ragcache server at {load_settings().ui.server_url} ({type(exc).__name__}: {exc}). "
                "Start it with `ragcache serve`, or empty ui.server_url to use the embedded engine.")
    if isinstance(exc, PromptTooLongError):
        return f"The prompt is too long: {exc}. In the sidebar, lower **top_k**."
    if isinstance(exc, (EmptyIndexError, IndexNotFoundError)):
        return (f"The index {name!r} has no documents yet ({exc}). Upload files on the **Ingest** page, "
                f"or run `ragcache ingest PATH --index {name}`.")
    if isinstance(exc, IndexMismatchError):
        return f"The index does not match the settings: {exc}."
    if isinstance(exc, ModelNotFoundError):
        return f"The model is not available: {exc}. Run `make setup` first."
    if isinstance(exc, ConfigError):
        return f"Invalid settings: {exc}. Fix settings.toml or the RAGCACHE_* environment variable."
    if isinstance(exc, IngestError):
        text = str(exc).rstrip(".")
        return f"The ingest did not complete: {text}." + ("" if "unchanged" in text else " The previous index is unchanged.")
    if isinstance(exc, ValueError):
        return f"{str(exc)[:1].upper()}{str(exc)[1:]}."
    return (f"Unexpected error: {type(exc).__name__}: {exc}. The details are in the server log "
            f"(pid {os.getpid()}).")
