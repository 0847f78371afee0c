"""RAGPipeline: the SDK's front door: ingest documents, ask questions, get answers with metrics.

Owns: wiring settings, index (ingest + retrieval) and the BlendEngine together, and the
:class:`Answer` / :class:`Source` objects returned to apps (``Answer.metrics`` is a
:class:`~ragcache.engine.messages.RequestMetrics`). Data flows one way: app/ui -> pipeline ->
(ingest, retrieval, engine). Must not import app/ or ui/.

Example::

    from ragcache import RAGPipeline, Settings
    rag = RAGPipeline.open(Settings.load(), index="docs")
    rag.ingest(["./handbook"])
    answer = rag.query("How do I reset my password?")
    print(answer.text, answer.metrics.ttft_s, [s.title for s in answer.sources])
    from ragcache.conversation import Turn
    follow_up = rag.query("And if I lost my phone?", history=[Turn("user", answer.question),
                                                             Turn("assistant", answer.text)])

Options: how to answer is one :class:`~ragcache.options.QueryOptions` (mode, top_k, max_tokens,
recompute_ratio, selection, sampling, history), passed as ``options=`` or built here from keyword
arguments (``rag.query(q, mode="full", top_k=3)``), validated once either way and handed on
unchanged (the engine gets it with the recompute ratio the pipeline resolved, :meth:`RAGPipeline.recompute_ratio`).

Async: ``aquery`` / ``astream`` (and ``aprepare`` + ``astream_answer``, which let a server show the
sources before the answer) are native on an :class:`~ragcache.engine.async_engine.AsyncBlendEngine`
(concurrent requests are batched by vLLM). On a :class:`~ragcache.engine.BlendEngine` they run the
sync call in a worker thread, so an event loop is not blocked, but requests still take turns on
the engine's lock. Multi-turn: ``history`` (earlier turns) goes into the prompt after the chunks
(:mod:`ragcache.prompt`); retrieval uses :func:`ragcache.conversation.retrieval_query`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Literal, Sequence

from ragcache.config import BLENDING_MODES, Settings
from ragcache.conversation import Turn, check_question, retrieval_query
from ragcache.engine.messages import RequestMetrics, StoreStats
from ragcache.options import DEFAULTS, QueryOptions, check_request, choose_ratio, options_from

if TYPE_CHECKING:
    from ragcache.engine import AsyncBlendEngine, BlendEngine, Generation
    from ragcache.index.retrieval import RetrievedChunk, Retriever
    from ragcache.ingest.ingestor import IngestReport
    from ragcache.prompt import AssembledPrompt
    from ragcache.quality.records import Calibration
    from ragcache.quality.table import IndexQuality

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


@dataclass
class Answer:
    """An answer with its sources (in prompt order) and metrics.

    Attributes:
        finish_reason: ``"stop"`` (end of answer or a stop string) or ``"length"`` (``max_tokens``
            reached); None when unknown.
        prompt: the prompt the engine was given (token ids and spans); not part of :meth:`to_dict`.
    """

    question: str
    text: str
    sources: list[Source]
    metrics: RequestMetrics
    finish_reason: str | None = None
    prompt: "AssembledPrompt | None" = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.question, "answer": self.text,
                "sources": [asdict(s) for s in self.sources], "metrics": self.metrics.to_dict()}


@dataclass
class Retrieval:
    """What one question retrieved, and the prompt built over it (see :meth:`RAGPipeline.prepare`).

    Attributes:
        question: the question (the last user message).
        found: the retrieved chunks in stable order, with their scores.
        prompt: the assembled prompt (head, chunks, then history and question in the tail).
        history: the earlier turns that went into the prompt (the oldest ones are dropped when
            the whole conversation does not fit ``engine.max_model_len``).
        retrieval_s: seconds of question embedding + search.
        t0: ``time.perf_counter()`` when the question arrived.
        options: the request's options, as they were given (the answer uses the same).
    """

    question: str
    found: list["RetrievedChunk"]
    prompt: "AssembledPrompt"
    history: list[Turn]
    retrieval_s: float
    t0: float
    options: QueryOptions = DEFAULTS

    @property
    def sources(self) -> list[Source]:
        """The retrieved chunks as sources; ``tier`` is "" until the engine has served their KV."""
        return [Source(r.chunk.doc_id, r.chunk.title, r.chunk.text, r.score, r.chunk.chunk_id) for r in self.found]


class RAGPipeline:
    """Settings + index + engine, loaded once; thread-safe (one generation at a time on a BlendEngine).

    Use :meth:`open`. ``engine`` may be passed to share one engine between pipelines over
    different indexes (vLLM start-up costs seconds to a minute). With an
    :class:`~ragcache.engine.async_engine.AsyncBlendEngine`, use the async methods (``aquery``,
    ``astream``); the sync ones raise TypeError.
    """

    def __init__(self, settings: Settings, index: str | Path, engine: "BlendEngine | AsyncBlendEngine"):
        from ragcache.index.folder import resolve_index_path

        self.settings = settings
        self.index_name = str(index)
        self.index_path = resolve_index_path(index, settings.ingest.index_dir)
        self.engine = engine
        self._retriever: "Retriever | None" = None
        self._lock = threading.RLock()
        self._calibration: "tuple[int, Calibration | None] | None" = None  # (file mtime ns, calibration)

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
               kv: Literal["eager", "lazy"] | None = None, show_progress: bool = False,
               namespace: str | None = None, precompute_kv: bool | None = None) -> "IngestReport":
        """Add documents to the index; with ``kv = "eager"`` compute and store the KV of every new chunk now,
        with ``"lazy"`` leave it to the chunk's first retrieval (the request computes and stores it; its
        source's tier reads ``"computed"``). Default: ``ingest.kv``.

        ``namespace``: the index's own KV namespace, recorded at its first ingest (None = keep it;
        see :class:`~ragcache.ingest.ingestor.Ingestor`). ``precompute_kv``: the older spelling of ``kv``
        (True = eager, False = lazy). Returns the report; ``report.total_chunks == 0`` means nothing
        could be ingested.

        Raises:
            IngestError: the ingest failed (e.g. another ingest runs, or no path exists); the
                previous index stays usable.
            IndexMismatchError: the index was built with other chunking, models or namespace.
        """
        from ragcache.ingest.ingestor import Ingestor

        if kv is None:
            kv = self.settings.ingest.kv if precompute_kv is None else ("eager" if precompute_kv else "lazy")
        if kv not in ("eager", "lazy"):
            raise ValueError(f"kv {kv!r}: must be 'eager' or 'lazy' (the values of the setting ingest.kv)")
        if kv == "eager" and self.is_async:
            raise TypeError("KV precompute runs on a BlendEngine: ingest with `ragcache ingest` (a running "
                            "server picks the new index version up) or pass kv='lazy'")
        hook = (lambda chunks, ns: self.engine.precompute(chunks, show_progress=show_progress, namespace=ns)
                ) if kv == "eager" else None
        with self._lock:
            report = Ingestor(self.settings, self.index_path, kv_hook=hook, show_progress=show_progress,
                              namespace=namespace).ingest(paths, prune=prune)
            self._retriever = None  # reload the new index version on next use
        return report

    # ---- query -----------------------------------------------------------------------------

    @property
    def retriever(self) -> "Retriever":
        from ragcache.index.retrieval import Retriever

        if self._retriever is None:
            self._retriever = Retriever.from_settings(self.settings, self.index_path)
        return self._retriever

    @property
    def namespace(self) -> str:
        """The index's own KV namespace ("" = none), as its manifest records it."""
        return self.retriever.index.manifest.namespace

    def retrieve(self, question: str, options: QueryOptions | None = None, **fields: Any) -> list["RetrievedChunk"]:
        """Top-k chunks for ``question`` (``top_k`` of the options, as :meth:`query` takes them; default
        ``retrieval.top_k``), in stable order (same set -> same order).

        Raises:
            EmptyQuestionError: empty question. QueryOptionsError: an option out of range.
            IndexNotFoundError / EmptyIndexError: nothing ingested.
        """
        return self._search(check_question(question), options_from(options, fields).top_k)

    def _search(self, text: str, top_k: int | None) -> list["RetrievedChunk"]:
        from ragcache.index.retrieval import stable_order

        found = self.retriever.retrieve(text, self.settings.retrieval.top_k if top_k is None else top_k)
        if not found:
            raise EmptyIndexError(f"the index {self.index_path} has no chunks; run `ragcache ingest PATH "
                                  f"--index {self.index_name}` first")
        return stable_order(found)

    @property
    def is_async(self) -> bool:
        """Whether the engine is an AsyncBlendEngine (its calls are coroutines)."""
        return bool(getattr(self.engine, "is_async", False))

    def _require_sync(self, method: str) -> None:
        if self.is_async:
            raise TypeError(f"this pipeline runs on an AsyncBlendEngine: use `await a{method}(...)`")

    def prepare(self, question: str, options: QueryOptions = DEFAULTS) -> Retrieval:
        """Retrieve chunks for ``question`` (after ``options.history``) and assemble the prompt.

        Retrieval uses :func:`ragcache.conversation.retrieval_query` (the previous user message is
        added to a short or referring follow-up). When question, chunks and history exceed
        ``engine.max_model_len``, the oldest turns are dropped until the prompt fits. The question is
        checked here, once (:func:`~ragcache.conversation.check_question`), and so are the options
        against the settings, before retrieval (:func:`~ragcache.options.check_request`: a
        blend-only option when the request's mode, or ``engine.mode`` for a request without one,
        never blends; the adaptive budget with a selection that does not read the question).

        Raises:
            QueryOptionsError: an option these settings would ignore. EmptyQuestionError: empty
            question. PromptTooLongError: the question over the chunks alone does not fit.
            EmptyIndexError / IndexNotFoundError: nothing ingested.
        """
        from ragcache.prompt import PromptTooLongError

        t0 = time.perf_counter()
        check_request(options, self.settings.blend, default_mode=self.settings.engine.mode)
        question = check_question(question)
        turns = list(options.history)
        with self._lock:
            found = self._search(retrieval_query(question, turns), options.top_k)
        retrieval_s = time.perf_counter() - t0
        chunks = [r.chunk for r in found]
        while True:
            try:
                prompt = self.engine.prompts.build(question, chunks, history=turns, namespace=self.namespace)
                break
            except PromptTooLongError:
                if not turns:
                    raise
                turns = turns[1:]  # drop the oldest turn
                log.info("conversation does not fit engine.max_model_len: dropped its oldest turn")
        return Retrieval(question, found, prompt, turns, retrieval_s, t0, options)

    async def aprepare(self, question: str, options: QueryOptions = DEFAULTS) -> Retrieval:
        """:meth:`prepare` in a worker thread (question embedding and search are CPU work)."""
        return await asyncio.to_thread(self.prepare, question, options)

    def _answer(self, r: Retrieval, gen: "Generation", ratio_source: str) -> Answer:
        """The answer to ``r``: the sources with the tiers that served them, and the engine's metrics
        record finished with the pipeline's numbers (retrieval, the whole call, the ratio's source and note)."""
        m = gen.metrics
        tiers = m.chunk_tiers or [""] * len(r.found)
        sources = [Source(x.chunk.doc_id, x.chunk.title, x.chunk.text, x.score, x.chunk.chunk_id, tier)
                   for x, tier in zip(r.found, tiers)]
        blend = m.mode == "blend"
        metrics = m.replace(retrieval_s=r.retrieval_s, total_s=time.perf_counter() - r.t0,
                            ratio_source=ratio_source if blend else "",
                            ratio_note=self.ratio_note(ratio_source, m.recompute_ratio) if blend else "")
        return Answer(r.question, gen.text.strip(), sources, metrics, gen.finish_reason, r.prompt)

    def _streamed(self, r: Retrieval, item: "str | Generation", ratio_source: str) -> str | Answer:
        """One item of an engine's stream as the pipeline yields it: a text piece unchanged, the
        final :class:`~ragcache.engine.base.Generation` as the :class:`Answer` (:meth:`_answer`)."""
        return item if isinstance(item, str) else self._answer(r, item, ratio_source)

    def _engine_call(self, r: Retrieval, method: Literal["generate", "stream"]) -> tuple[Callable[[], Any], str]:
        """The engine call that answers ``r``, not made yet, and where the blend's ratio came from
        (:meth:`_for_engine`). Calling it calls the engine's ``method`` with ``r``'s prompt, the
        options as the engine gets them and the index's quality (:meth:`index_quality`, read now):
        on a BlendEngine it blocks (``generate``) or returns a sync iterator (``stream``), on an
        AsyncBlendEngine it returns a coroutine or an async iterator, for the caller to drive."""
        engine_opts, source = self._for_engine(r.options)
        quality = self.index_quality()
        return lambda: getattr(self.engine, method)(r.prompt, engine_opts, quality=quality), source

    # ---- recompute ratio ---------------------------------------------------------------------

    def calibration(self) -> "Calibration | None":
        """The index's calibration for the engine's model and ``blend.selection`` (``ragcache
        calibrate``), or None: none recorded, or one measured under other settings
        (:meth:`calibration_changes` lists them; ``"auto"`` then falls back). Re-read when the file
        changes."""
        cal = self._read_calibration()
        return None if cal is None or cal.changed(self.calibrated_settings()) else cal

    def calibration_changes(self) -> list[str]:
        """The settings changed since the index's calibration was measured (as
        :meth:`ragcache.quality.records.Calibration.changed` words them), or [] (none, or no calibration)."""
        cal = self._read_calibration()
        return [] if cal is None else cal.changed(self.calibrated_settings())

    def calibrated_settings(self, selection: str | None = None) -> dict[str, Any]:
        """What a calibration of this index is measured under and holds for: the blend settings that
        change what a blend at a ratio computes (:meth:`ragcache.config.BlendSettings.calibrated_settings`
        for ``selection``, None: ``blend.selection``), the KV context chunk KV is computed after
        (``prompt.kv_context_tokens``) and the engine's resolved ``engine.dtype``."""
        values = self.engine.settings.blend.calibrated_settings(selection or self.settings.blend.selection)
        values["prompt.kv_context_tokens"] = self.engine.settings.prompt.kv_context_tokens
        values["engine.dtype"] = str(self.engine.dtype.dtype)
        values["host"] = self.engine.router.host
        return values

    def index_quality(self) -> "IndexQuality":
        """The index's blend quality per class for ``engine.mode = "auto"`` (``ragcache calibrate``
        measures it): its :class:`~ragcache.quality.table.QualityTable`, or none with a note when the
        calibration was measured under other settings, another dtype or another kind of host (then
        the router uses its prior and says why)."""
        from ragcache.quality.table import IndexQuality

        cal = self._read_calibration()
        if cal is None or cal.quality is None:
            return IndexQuality()
        changes = cal.changed(self.calibrated_settings())
        if changes:
            return IndexQuality(None, f"the index's quality table was measured under other settings "
                                      f"({'; '.join(changes)})")
        return IndexQuality(cal.quality_table)

    def _read_calibration(self) -> "Calibration | None":
        from ragcache.index.folder import CALIBRATION, readable_path
        from ragcache.quality.records import read_calibration

        folder = readable_path(self.index_path)
        if folder is None:
            return None
        try:
            stamp = (folder / CALIBRATION).stat().st_mtime_ns
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
        ``blend.fallback_ratio``; :meth:`ratio_note` says so)."""
        ratio, _, source = choose_ratio(override, self.settings.blend, self.calibration)
        return ratio, source

    def ratio_note(self, source: str, ratio: float | None) -> str:
        """One sentence when a blend at ``ratio`` (from ``source``, see :meth:`recompute_ratio`) goes
        against this index's calibration, else "": ``"settings"`` over an index calibrated to another
        ratio or to full prefill, or ``"fallback"`` (``"auto"`` with no calibrated ratio, or with a
        calibration measured under other settings: :meth:`calibration_changes`). Every
        answer carries it in ``answer.metrics.ratio_note``; the CLI, the UI and the server show it
        (the pipeline does not log it: each front end says it once, in its own words)."""
        if source not in ("settings", "fallback") or ratio is None:
            return ""
        cal = self.calibration()
        name = self.index_name
        changes = self.calibration_changes()
        if changes and source == "fallback":
            return (f"the calibration of index {name} was measured under other settings ({'; '.join(changes)}): "
                    f"blend ran at blend.fallback_ratio = {ratio:g}; `ragcache calibrate --index {name}` measures "
                    f"it again")
        if source == "fallback":
            if cal is None:
                return (f"blend.recompute_ratio = 'auto' but index {name} is not calibrated: blend ran at "
                        f"blend.fallback_ratio = {ratio:g}; `ragcache calibrate --index {name}` measures a ratio")
            return (f"the calibration of index {name} recommends full prefill ({cal.reason}); blend ran at "
                    f"blend.fallback_ratio = {ratio:g}")
        if cal is None:
            return ""
        if cal.recommendation == "full" or cal.ratio is None:
            return (f"the calibration of index {name} recommends full prefill ({cal.reason}); blend ran at "
                    f"blend.recompute_ratio = {ratio:g} as set")
        if cal.ratio != ratio:
            return (f"index {name} is calibrated to ratio {cal.ratio:g}; blend ran at blend.recompute_ratio = "
                    f"{ratio:g} as set (recompute_ratio = 'auto' uses the calibration)")
        return ""

    def _for_engine(self, options: QueryOptions) -> tuple[QueryOptions, str]:
        """``options`` as the engine gets them, and where the blend's ratio came from: in blend mode
        (or ``auto``, which may blend) without a ratio of the request's own, the pipeline's
        (:func:`ragcache.options.choose_ratio`: the setting or the index's calibration, with the
        calibration's ``mass_left`` where the request set none) is filled in; everything else passes
        unchanged."""
        if (options.mode or self.settings.engine.mode) not in BLENDING_MODES:
            return options, ""
        ratio, mass_left, source = choose_ratio(options.recompute_ratio, self.settings.blend, self.calibration)
        return options.with_budget(ratio, mass_left), source

    def query(self, question: str, options: QueryOptions | None = None, **fields: Any) -> Answer:
        """Answer ``question`` from the index.

        Args:
            options: how to answer (:class:`~ragcache.options.QueryOptions`); or, instead, its fields
                as keyword arguments, validated here: ``mode`` (auto, full, prefix, reuse or blend; default
                ``engine.mode``), ``top_k`` (default ``retrieval.top_k``), ``max_tokens``,
                ``recompute_ratio`` (overrides ``blend.recompute_ratio``; see :meth:`recompute_ratio`
                for where the ratio comes from otherwise, ``answer.metrics.ratio_source`` says which),
                ``selection``, ``sampling`` (:class:`~ragcache.options.SamplingOptions`, default
                greedy) and ``history`` (earlier turns, oldest first; see :meth:`prepare`).

        Raises:
            QueryOptionsError: an option out of range, of another type, contradicting another, or
            one these settings would ignore (see :meth:`prepare`; a ValueError naming it). EmptyQuestionError:
            empty question. PromptTooLongError: the prompt does not fit ``engine.max_model_len``.
            EmptyIndexError / IndexNotFoundError: nothing ingested. TypeError: the engine is an
            AsyncBlendEngine (use :meth:`aquery`), or both ``options`` and keyword fields.
        """
        self._require_sync("query")
        with self._lock:
            r = self.prepare(question, options_from(options, fields))
            call, source = self._engine_call(r, "generate")
            gen = call()
        return self._answer(r, gen, source)

    def stream(self, question: str, options: QueryOptions | None = None,
               **fields: Any) -> Iterator[str | Answer]:
        """Yield the answer's text pieces as they are decoded, then the :class:`Answer` (arguments as
        :meth:`query`)."""
        self._require_sync("stream")
        with self._lock:
            r = self.prepare(question, options_from(options, fields))
            call, source = self._engine_call(r, "stream")
            for item in call():
                yield self._streamed(r, item, source)

    # ---- async -----------------------------------------------------------------------------

    async def aquery(self, question: str, options: QueryOptions | None = None, **fields: Any) -> Answer:
        """:meth:`query` as a coroutine: native on an AsyncBlendEngine (concurrent calls are batched by
        vLLM), a worker thread on a BlendEngine. Cancelling it aborts the vLLM request (on a
        BlendEngine the request runs to its end). Raises as :meth:`query`."""
        r = await self.aprepare(question, options_from(options, fields))
        return await self.aanswer(r)

    async def aanswer(self, r: Retrieval) -> Answer:
        """Answer a prepared :class:`Retrieval` (from :meth:`aprepare`) with the options it was prepared with."""
        call, source = self._engine_call(r, "generate")
        gen = await (call() if self.is_async else asyncio.to_thread(call))
        return self._answer(r, gen, source)

    async def astream(self, question: str, options: QueryOptions | None = None,
                      **fields: Any) -> AsyncIterator[str | Answer]:
        """:meth:`stream` as an async iterator: text pieces, then the :class:`Answer`."""
        r = await self.aprepare(question, options_from(options, fields))
        async with aclosing(self.astream_answer(r)) as items:
            async for item in items:
                yield item

    async def astream_answer(self, r: Retrieval) -> AsyncIterator[str | Answer]:
        """Stream the answer to a prepared :class:`Retrieval` (from :meth:`aprepare`, with its
        options): text pieces, then the :class:`Answer`. A consumer that stops early aborts the vLLM
        request (on a BlendEngine, after the next decoded piece)."""
        call, source = self._engine_call(r, "stream")
        items = call() if self.is_async else _iterate_in_thread(call)
        async with aclosing(items):
            async for item in items:
                yield self._streamed(r, item, source)

    # ---- cache -----------------------------------------------------------------------------

    def cache_stats(self) -> StoreStats:
        """Per-tier KV store stats (:class:`~ragcache.engine.messages.StoreStats`: hits, misses,
        hit_rate, entries, occupancy, capacity, ... per tier)."""
        self._require_sync("cache_stats")
        return self.engine.store_stats()

    async def acache_stats(self) -> StoreStats:
        """:meth:`cache_stats` as a coroutine (either engine)."""
        if self.is_async:
            return await self.engine.store_stats()
        return await asyncio.to_thread(self.engine.store_stats)


class _Failed:
    """An exception raised by the producer thread of :func:`_iterate_in_thread`."""

    def __init__(self, exc: BaseException):
        self.exc = exc


_DONE = object()


async def _iterate_in_thread(make: Callable[[], Iterator[Any]]) -> AsyncIterator[Any]:
    """The items of the sync iterator ``make()``, produced in a worker thread, as an async iterator.

    When the consumer stops early, the thread stops after its next item and closes the iterator
    (a BlendEngine stream then aborts its vLLM request).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    stop = threading.Event()

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening
            stop.set()

    def produce() -> None:
        it = make()
        try:
            for item in it:
                if stop.is_set():
                    return
                put(item)
            put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(_Failed(exc))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    loop.run_in_executor(None, produce)
    try:
        while (item := await queue.get()) is not _DONE:
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()
