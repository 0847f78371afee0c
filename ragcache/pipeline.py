"""RAGPipeline: the SDK's front door: ingest documents, ask questions, get answers with metrics.

Owns: wiring settings, index (ingest + retrieval) and the BlendEngine together, and the
:class:`Answer` / :class:`Source` / :class:`QueryMetrics` objects returned to apps. Data flows one
way: app/ui -> pipeline -> (ingest, retrieval, engine). Must not import app/ or ui/.

Example::

    from ragcache import RAGPipeline, Settings
    rag = RAGPipeline.open(Settings.load(), index="docs")
    rag.ingest(["./handbook"])
    answer = rag.query("How do I reset my password?")
    print(answer.text, answer.metrics.ttft_s, [s.title for s in answer.sources])
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ragcache.config import Settings
from ragcache.engine.messages import RequestMetrics

if TYPE_CHECKING:
    from ragcache.calibrate import Calibration
    from ragcache.engine import BlendEngine, Generation
    from ragcache.ingest import IngestReport
    from ragcache.retrieval import RetrievedChunk, Retriever

log = logging.getLogger(__name__)


class EmptyIndexError(RuntimeError):
    """The index has no chunks yet: ingest documents first."""


@dataclass
class Source:
    """A retrieved chunk used as context for an answer.

    Attributes:
        doc_id, title, text, chunk_id: the chunk. score: retrieval similarity (cosine, higher is
        closer). tier: the KV tier that served its KV ("device", "cpu", "disk", "remote",
        "computed" when it was missing and computed during the request, or "" in full/prefix mode).
    """

    doc_id: str
    title: str
    text: str
    score: float
    chunk_id: str
    tier: str = ""


#: the SDK's name for the per-request metrics (one definition: :class:`ragcache.engine.messages.RequestMetrics`)
QueryMetrics = RequestMetrics


@dataclass
class Answer:
    """An answer with its sources (in prompt order) and metrics."""

    question: str
    text: str
    sources: list[Source]
    metrics: RequestMetrics

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.question, "answer": self.text,
                "sources": [asdict(s) for s in self.sources], "metrics": self.metrics.to_dict()}


class RAGPipeline:
    """Settings + index + engine, loaded once; thread-safe (one generation at a time).

    Use :meth:`open`. ``engine`` may be passed to share one BlendEngine between pipelines over
    different indexes (vLLM start-up costs seconds to a minute).
    """

    def __init__(self, settings: Settings, index: str | Path, engine: "BlendEngine"):
        from ragcache.index import resolve_index_path

        self.settings = settings
        self.index_name = str(index)
        self.index_path = resolve_index_path(index, settings.ingest.index_dir)
        self.engine = engine
        self._retriever: "Retriever | None" = None
        self._lock = threading.RLock()
        self._calibration: "tuple[int, Calibration | None] | None" = None  # (file mtime ns, calibration)
        self._warned_fallback = False

    @classmethod
    def open(cls, settings: Settings | None = None, index: str | Path = "default",
             engine: "BlendEngine | None" = None) -> "RAGPipeline":
        """Load the model, embedder, index and KV store once.

        Raises:
            ConfigError: invalid settings. ModelNotFoundError: model not provisioned.
        """
        from ragcache.engine import BlendEngine

        settings = settings or Settings.load()
        return cls(settings, index, engine or BlendEngine(settings))

    # ---- ingest ----------------------------------------------------------------------------

    def ingest(self, paths: Sequence[str | Path], *, prune: bool = False,
               precompute_kv: bool | None = None, show_progress: bool = False,
               namespace: str | None = None) -> "IngestReport":
        """Add documents to the index and precompute the KV of new chunks (``ingest.precompute_kv``).

        ``namespace``: the index's own KV namespace, recorded at its first ingest (None = keep it;
        see :class:`~ragcache.ingest.Ingestor`). Returns the report; ``report.total_chunks == 0``
        means nothing could be ingested.

        Raises:
            IngestError: the ingest failed (e.g. another ingest runs, or no path exists); the
                previous index stays usable.
            IndexMismatchError: the index was built with other chunking, models or namespace.
        """
        from ragcache.ingest import Ingestor

        kv = self.settings.ingest.precompute_kv if precompute_kv is None else precompute_kv
        hook = (lambda chunks, ns: self.engine.precompute(chunks, show_progress=show_progress, namespace=ns)
                ) if kv else None
        with self._lock:
            report = Ingestor(self.settings, self.index_path, kv_hook=hook, show_progress=show_progress,
                              namespace=namespace).ingest(paths, prune=prune)
            self._retriever = None  # reload the new index version on next use
        return report

    # ---- query -----------------------------------------------------------------------------

    @property
    def retriever(self) -> "Retriever":
        from ragcache.retrieval import Retriever

        if self._retriever is None:
            self._retriever = Retriever.from_settings(self.settings, self.index_path)
        return self._retriever

    @property
    def namespace(self) -> str:
        """The index's own KV namespace ("" = none), as its manifest records it."""
        return self.retriever.index.manifest.namespace

    def retrieve(self, question: str, top_k: int | None = None) -> list["RetrievedChunk"]:
        """Top-k chunks for ``question``, in stable order (same set -> same order).

        Raises:
            EmptyQuestionError: empty question. IndexNotFoundError / EmptyIndexError: nothing ingested.
        """
        from ragcache.prompt import check_question
        from ragcache.retrieval import stable_order

        check_question(question)
        found = self.retriever.retrieve(question, self.settings.retrieval.top_k if top_k is None else top_k)
        if not found:
            raise EmptyIndexError(f"the index {self.index_path} has no chunks; run `ragcache ingest PATH "
                                  f"--index {self.index_name}` first")
        return stable_order(found)

    def _prepare(self, question: str, top_k: int | None):
        t0 = time.perf_counter()
        found = self.retrieve(question, top_k)
        retrieval_s = time.perf_counter() - t0
        prompt = self.engine.prompts.build(question, [r.chunk for r in found], namespace=self.namespace)
        return t0, found, retrieval_s, prompt

    @staticmethod
    def _answer(question: str, found: Sequence["RetrievedChunk"], gen: "Generation", retrieval_s: float,
                t0: float, ratio_source: str) -> Answer:
        m = gen.metrics
        tiers = m.chunk_tiers or [""] * len(found)
        sources = [Source(r.chunk.doc_id, r.chunk.title, r.chunk.text, r.score, r.chunk.chunk_id, tier)
                   for r, tier in zip(found, tiers)]
        m.retrieval_s = retrieval_s
        m.total_s = time.perf_counter() - t0
        m.ratio_source = ratio_source if m.mode == "blend" else ""
        return Answer(question, gen.text.strip(), sources, m)

    # ---- recompute ratio ---------------------------------------------------------------------

    def calibration(self) -> "Calibration | None":
        """The index's calibration for the engine's model and ``blend.selection`` (``ragcache
        calibrate``), or None; re-read when the file changes."""
        from ragcache.calibrate import CALIBRATION_FILE, read_calibration
        from ragcache.index import readable_path

        folder = readable_path(self.index_path)
        if folder is None:
            return None
        try:
            stamp = (folder / CALIBRATION_FILE).stat().st_mtime_ns
        except OSError:
            return None
        if self._calibration is None or self._calibration[0] != stamp:
            cal = read_calibration(folder, self.engine.llm_info.fingerprint, self.settings.blend.selection)
            self._calibration = (stamp, cal)
        return self._calibration[1]

    def recompute_ratio(self, override: float | None = None) -> tuple[float, str]:
        """The blend ratio for a query and where it came from: ``"request"`` (``override``),
        ``"settings"`` (a number in ``blend.recompute_ratio``), ``"calibration"`` (``"auto"`` and
        the index is calibrated) or ``"fallback"`` (``"auto"`` without a usable calibration:
        ``blend.fallback_ratio``, with a warning once)."""
        b = self.settings.blend
        if override is not None:
            return float(override), "request"
        if b.recompute_ratio != "auto":
            return float(b.recompute_ratio), "settings"
        cal = self.calibration()
        if cal is not None and cal.ratio is not None:
            return cal.ratio, "calibration"
        if not self._warned_fallback:
            self._warned_fallback = True
            why = ("its calibration found no ratio within max_kl; consider --mode full" if cal is not None
                   else f"run `ragcache calibrate --index {self.index_name}`")
            log.warning("blend.recompute_ratio = 'auto' but the index %s has no calibrated ratio (%s); using "
                        "blend.fallback_ratio = %g", self.index_name, why, b.fallback_ratio)
        return b.fallback_ratio, "fallback"

    def query(self, question: str, mode: str | None = None, top_k: int | None = None, *,
              max_tokens: int | None = None, recompute_ratio: float | None = None) -> Answer:
        """Answer ``question`` from the index.

        Args:
            mode: full, prefix, reuse or blend (default ``engine.mode``).
            top_k: chunks to retrieve (default ``retrieval.top_k``).
            recompute_ratio: override ``blend.recompute_ratio`` for this query (see :meth:`recompute_ratio`
                for where the ratio comes from otherwise; ``answer.metrics.ratio_source`` says which).

        Raises:
            ValueError: empty question or unknown mode. PromptTooLongError: the prompt does not fit
            ``engine.max_model_len``. EmptyIndexError / IndexNotFoundError: nothing ingested.
        """
        with self._lock:
            t0, found, retrieval_s, prompt = self._prepare(question, top_k)
            ratio, source = self.recompute_ratio(recompute_ratio)
            gen = self.engine.generate(prompt, mode, max_tokens=max_tokens, recompute_ratio=ratio)
        return self._answer(question, found, gen, retrieval_s, t0, source)

    def stream(self, question: str, mode: str | None = None, top_k: int | None = None, *,
               max_tokens: int | None = None, recompute_ratio: float | None = None) -> Iterator[str | Answer]:
        """Yield the answer's text pieces as they are decoded, then the :class:`Answer`."""
        with self._lock:
            t0, found, retrieval_s, prompt = self._prepare(question, top_k)
            ratio, source = self.recompute_ratio(recompute_ratio)
            for item in self.engine.stream(prompt, mode, max_tokens=max_tokens, recompute_ratio=ratio):
                if isinstance(item, str):
                    yield item
                else:
                    yield self._answer(question, found, item, retrieval_s, t0, source)

    # ---- cache -----------------------------------------------------------------------------

    def cache_stats(self) -> dict[str, Any]:
        """Per-tier KV store stats (hits, misses, hit_rate, occupancy, capacity, ...)."""
        return self.engine.store_stats()
