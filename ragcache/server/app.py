"""The FastAPI application of ``ragcache serve``: OpenAI-compatible chat completions over RAG indexes.

Owns: the routes (POST /v1/chat/completions, GET /v1/models, /v1/models/{id}, /v1/cache, /health,
/metrics), the bearer-key check, the in-flight limit, the server-sent event stream and the mapping
of SDK errors to OpenAI's error shape. One :class:`~ragcache.engine.async_engine.AsyncBlendEngine`
serves every request and every index, without a lock (vLLM batches the requests in flight); one
:class:`~ragcache.pipeline.RAGPipeline` per index does retrieval and prompt assembly. Built on the
SDK (pipeline, engine); never imports app/ or ui/.

Request -> index: ``ragcache.index`` if given, else ``model`` when it names an index under
``ingest.index_dir``, else the server's default index (``serve.index``) when ``model`` is empty,
``"ragcache"`` or ``"default"``; anything else is a 404. A re-ingested index is picked up by the
next request (pipelines are keyed by the index's version on disk).

Streaming (``"stream": true``) sends, as ``data:`` lines: a first chunk with the assistant role and
``ragcache.sources`` (their ``tier`` is null: not served yet), one chunk per decoded text piece, a
chunk with ``finish_reason`` and the complete ``ragcache`` object (sources with tiers, metrics),
then ``data: [DONE]``. With ``stream_options: {"include_usage": true}`` (as OpenAI) a usage chunk
(``choices: []``) with ``usage`` comes after the finish chunk and carries the ``ragcache`` object
instead. An error after the stream started is sent as a ``data: {"error": ...}`` line. A client
that disconnects cancels its request: the vLLM request is aborted and its KV slots are freed.

Who may read what: :mod:`ragcache.server.keys` (the shared ``serve.api_key``, scoped keys from
``serve.keys_file``; 401 without a valid key, 403 for an index the key may not read, and for a
scoped key also for any name that is no index served here). How large a request may be:
:mod:`ragcache.server.limits` (413 for a body over ``serve.max_body_bytes``, answered before it is
parsed; 431 for a request line and headers over ``serve.max_header_bytes``). The mode a
request gets when it names none is the server's (:func:`serving_mode`): ``engine.mode``, or
``serve.blend_fallback`` when reuse/blend turned out unavailable at start. A request's blend-only
options (recompute_ratio, selection, budget, mass_left) are a 400 naming the option, the mode and
where it came from when that mode never blends, the server's default mode included
(:func:`ragcache.options.check_request`), before any work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragcache.config import Settings
from ragcache.engine.messages import CONNECTOR_MODES
from ragcache.engine.selfcheck import BlendUnavailableError
from ragcache.options import MODE_FROM_SETTING, QueryOptionsError, RequestOptions, check_request
from ragcache.server.keys import Access, KeyRing, KeySource, KeysUnavailableError
from ragcache.server.limits import BodyLimit
from ragcache.server.metrics import ServerMetrics
from ragcache.server.responses import (
    BlendAvailability,
    CacheReport,
    KeysFileHealth,
    ChatCompletionChunk,
    ChatCompletionResponse,
    Delta,
    Health,
    ModelCard,
    ModelList,
    RagcacheResult,
    Usage,
    completion_id,
    finish_reason,
)
from ragcache.server.schemas import (
    DEFAULT_MODEL_ALIASES,
    APIError,
    ChatCompletionRequest,
    RagcacheOptions,
    validation_error,
)

if TYPE_CHECKING:
    from ragcache.engine import AsyncBlendEngine, BlendSupport
    from ragcache.pipeline import Answer, RAGPipeline, Retrieval

log = logging.getLogger(__name__)

T = TypeVar("T")

#: pipelines kept (one per index version); older ones are dropped first
MAX_PIPELINES = 16

#: what a request's options are called in its error messages: the fields of its ``ragcache`` object
OPTION_NAMES = {name: f"ragcache.{name}" for name in RequestOptions.model_fields}


def serving_mode(settings: Settings, support: "BlendSupport | None") -> str:
    """The mode a request gets when it names none: ``engine.mode``, unless that needs reuse/blend
    and the engine's start-up found them unavailable; then ``serve.blend_fallback``.

    Raises:
        BlendUnavailableError: reuse/blend is unavailable, ``engine.mode`` needs it and
            ``serve.blend_fallback`` is ``"refuse"`` (the message says why and what to set).
    """
    mode = settings.engine.mode
    if mode not in CONNECTOR_MODES or support is None or support.available:
        return mode
    fallback = settings.serve.blend_fallback
    if fallback == "refuse":
        raise BlendUnavailableError(
            f"ragcache serve will not start in {mode} mode (engine.mode): {support.reason}. To serve anyway, set "
            "serve.blend_fallback = \"full\" or \"prefix\" (RAGCACHE_SERVE__BLEND_FALLBACK=full), or engine.mode = \"full\"")
    log.warning("%s mode is unavailable, serving in %s mode (serve.blend_fallback): %s", mode, fallback, support.reason)
    return fallback


class _Slot:
    """One request's place among ``serve.max_in_flight``; :meth:`release` is idempotent."""

    def __init__(self, state: "ServerState"):
        self._state = state
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._state.in_flight -= 1
            self._state.metrics.in_flight.set(self._state.in_flight)


class ServerState:
    """What the routes share: settings, the engine, one pipeline per index, metrics, requests in flight."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.keys = KeySource(settings.serve)  # a missing or invalid keys file fails here, at start
        self.engine: "AsyncBlendEngine | None" = None
        self.mode = settings.engine.mode
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics = ServerMetrics()
        self.metrics.watch_keys(lambda: self.keys.status)
        self.in_flight = 0
        self._pipelines: dict[tuple[str, int], "RAGPipeline"] = {}
        self._noted: set[tuple[str, str]] = set()  # (index, ratio note) logged once

    def keyring(self) -> KeyRing:
        """The keys accepted now (:class:`~ragcache.server.keys.KeySource`: ``serve.api_key`` and
        ``serve.keys_file``, read again on every call: a key added or revoked counts from the next
        request, whatever the file's mtime).

        Raises:
            APIError: 503 naming the keys file while it is missing, or invalid with
                ``serve.keys_invalid = "refuse"`` (every key is refused).
        """
        try:
            return self.keys.keyring()
        except KeysUnavailableError as exc:
            raise APIError(503, str(exc), code="keys_unavailable") from None

    def keys_health(self) -> KeysFileHealth | None:
        """The keys file's state for /health, read now (None: no keys file)."""
        try:
            self.keys.keyring()
        except KeysUnavailableError:
            pass  # the state says it
        status = self.keys.status
        return None if status is None else KeysFileHealth(state=status.state, since=status.since)

    @property
    def mode_from(self) -> str:
        """Where :attr:`mode` (the mode of a request that names none) comes from, in words for
        error messages: the setting ``engine.mode``, or ``serve.blend_fallback``."""
        if self.mode == self.settings.engine.mode:
            return MODE_FROM_SETTING
        return (f"no mode given: serve.blend_fallback = {self.mode!r}, as {self.settings.engine.mode} mode "
                "(engine.mode) is unavailable on this server")

    def check_options(self, opts: RequestOptions) -> None:
        """Refuse options this server would ignore (:func:`ragcache.options.check_request` against
        the server's default mode and ``[blend]`` settings).

        Raises:
            APIError: 400 naming the option (``param``), the mode and where that mode came from.
        """
        try:
            check_request(opts, self.settings.blend, default_mode=self.mode, mode_from=self.mode_from,
                          names=OPTION_NAMES)
        except QueryOptionsError as exc:
            raise APIError(400, str(exc), param=exc.name, code="option_not_applicable") from None

    def readable_indexes(self, access: Access) -> list[str]:
        """The indexes served here that ``access`` may read."""
        names = self.indexes()
        return names if access.every_index else [n for n in names if access.may_read(n, self.namespace_of(n))]

    def index_path(self, name: str) -> Path:
        """The folder of index ``name`` under ``ingest.index_dir`` (a pgvector index has none; its
        name stands in), resolved once per request and handed on."""
        from ragcache.index.folder import resolve_index_path

        return resolve_index_path(name, self.settings.ingest.index_dir)

    def namespace_of(self, name: str) -> str | None:
        """The own KV namespace of served index ``name`` ("" = none), or None when it cannot be read
        (a damaged index, its database down): then no key reads it by namespace."""
        from ragcache.index.catalog import catalog
        from ragcache.index.folder import readable_path
        from ragcache.index.manifest import Manifest

        try:
            cat = catalog(self.settings)
            if cat.backend != "faiss":
                return cat.manifest(name).namespace
            folder = readable_path(self.index_path(name))  # read now, not cached
            return None if folder is None else Manifest.read(folder).namespace
        except Exception:  # noqa: BLE001 - unreadable: the namespace grants nothing
            return None

    def check_access(self, access: Access, name: str, param: str, names: list[str]) -> None:
        """Refuse an index the caller may not read. ``names``: the indexes served (listed for this
        request). For a key scoped to some indexes, a name that is no served index (a path, an
        index that does not exist) gets the same answer as a served index it may not read, before
        anything is looked up on disk: the answer tells nothing about what exists.

        Raises:
            APIError: 403 naming the tenant, the index and what the key may read.
        """
        if access.every_index or (name in names and access.may_read(name, self.namespace_of(name))):
            return
        raise APIError(403, f"{param} {name!r}: the API key of tenant {access.tenant!r} may not read this index "
                       f"(it may read {access.describe()}); ask the server's operator to add it to the key's entry "
                       "in serve.keys_file", param=param, code="index_not_allowed")

    def indexes(self) -> list[str]:
        """Names of the indexes served: every complete index under ``ingest.index_dir`` (or in
        the pgvector database, ``ingest.vector_store``)."""
        from ragcache.index.catalog import catalog

        return catalog(self.settings).names()

    def resolve_index(self, model: str, override: str | None, names: list[str] | None = None) -> str:
        """The index a request asks for (see the module docstring); ``names``: the indexes served,
        when already listed for this request.

        Raises:
            APIError: 404 when it names no index served here.
        """
        names = self.indexes() if names is None else names
        if override is not None:
            name, param = override, "ragcache.index"
        elif model in names:
            return model
        elif model in DEFAULT_MODEL_ALIASES:
            name, param = self.settings.serve.index, "model"
        else:
            name, param = model, "model"
        if name not in names:
            listed = ", ".join(names) or f"none yet (run `ragcache ingest PATH --index {name}`)"
            raise APIError(404, f"{param} {name!r} names no index served here; indexes: {listed} "
                           "(GET /v1/models lists them)", param=param, code="model_not_found")
        return name

    def pipeline(self, name: str, path: Path | None = None) -> "RAGPipeline":
        """The pipeline over index ``name`` (at ``path``, when already resolved) on the shared engine
        (new when the index was re-ingested)."""
        from ragcache.index.catalog import catalog
        from ragcache.pipeline import RAGPipeline

        path = path or self.index_path(name)
        cat = catalog(self.settings)
        key = (name, cat.version(path if cat.backend == "faiss" else name))
        pipe = self._pipelines.get(key)
        if pipe is None:
            for old in [k for k in self._pipelines if k[0] == name]:
                del self._pipelines[old]
            while len(self._pipelines) >= MAX_PIPELINES:
                del self._pipelines[next(iter(self._pipelines))]
            pipe = self._pipelines[key] = RAGPipeline(self.settings, path, self.engine)
            pipe.index_name = name
        return pipe

    def answered(self, index: str, answer: "Answer", tenant: str) -> None:
        """Count a finished answer in the metrics, and log its ratio note (the blend's ratio goes
        against the index's calibration, :meth:`~ragcache.pipeline.RAGPipeline.ratio_note`) once per
        index and note; clients get the note in every answer's ``ragcache.metrics.ratio_note``."""
        self.metrics.observe(index, answer, tenant)
        note = answer.metrics.ratio_note
        if note and (index, note) not in self._noted:
            self._noted.add((index, note))
            log.warning("%s", note)

    def acquire(self) -> _Slot:
        """A place for one more request.

        Raises:
            APIError: 429 when ``serve.max_in_flight`` requests are being answered.
        """
        limit = self.settings.serve.max_in_flight
        if self.in_flight >= limit:
            raise APIError(429, f"{self.in_flight} requests are in flight, the server's limit "
                           f"(serve.max_in_flight = {limit}); retry shortly", code="too_many_requests")
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        return _Slot(self)


def api_error(exc: BaseException) -> APIError:
    """The OpenAI-shaped error for an exception raised while answering (unexpected ones are 500)."""
    from ragcache.index.manifest import IndexMismatchError, IndexNotFoundError
    from ragcache.pipeline import EmptyIndexError
    from ragcache.prompt import PromptTooLongError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, BlendUnavailableError) and not isinstance(exc, ValueError):  # the mode, not the input
        return APIError(400, f"ragcache.mode: {exc}", param="ragcache.mode", code="mode_unavailable")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, (IndexNotFoundError, EmptyIndexError)):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, IndexMismatchError):
        return APIError(500, f"the index does not match the server's settings: {exc}", code="index_mismatch")
    if type(exc).__name__ == "PgUnavailableError":  # ragcache.index.pg_index (psycopg) is imported only with pgvector
        return APIError(503, str(exc), code="index_unavailable")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    log.error("request failed", exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}: {exc}); the details are in the server log",
                    code="internal_error")


class _ClientGone(Exception):
    """The client disconnected before its retrieval or its (non-streamed) answer was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects (a vLLM request is aborted; a
    retrieval running in a thread finishes there, but nothing follows it).

    Raises:
        _ClientGone: the client disconnected first.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone.is_set():
            raise _ClientGone() from None
        raise
    finally:
        watcher.cancel()


class _EventStream(StreamingResponse):
    """A server-sent event stream that, however it ends (finished, client gone, error), closes its
    event generator (aborting the vLLM request if unfinished) and frees the request's slot."""

    def __init__(self, events: AsyncIterator[str], slot: _Slot):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._slot = slot

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._slot.release()


def _sse(body: BaseModel) -> str:
    """One server-sent event: ``data: `` and the body's JSON."""
    return f"data: {body.model_dump_json()}\n\n"


def _prompt_text(state: ServerState, answer: "Answer", opts: RagcacheOptions) -> str | None:
    """The prompt the model was given, as text, when the request asked for it (``return_prompt``)."""
    if not opts.return_prompt or answer.prompt is None:
        return None
    return state.engine.tokenizer.decode(answer.prompt.token_ids)


async def _events(state: ServerState, pipe: "RAGPipeline", r: "Retrieval", *, index: str, model: str, mode: str,
                  opts: RagcacheOptions, include_usage: bool, tenant: str) -> AsyncIterator[str]:
    """The SSE lines of one streamed chat completion (see the module docstring)."""
    cid, created = completion_id(), int(time.time())
    outcome = "error"
    try:
        first = RagcacheResult.of(index, sources=r.sources, with_sources=opts.return_sources)
        yield _sse(ChatCompletionChunk.of(cid, model, created, delta=Delta(role="assistant", content=""), extra=first))
        answer = None
        async with aclosing(pipe.astream_answer(r)) as items:
            async for item in items:
                if isinstance(item, str):
                    yield _sse(ChatCompletionChunk.of(cid, model, created, delta=Delta(content=item)))
                else:
                    answer = item
        state.answered(index, answer, tenant)  # before the last lines: a client done reading sees it counted
        outcome = "completed"
        extra = RagcacheResult.of(index, answer=answer, prompt=_prompt_text(state, answer, opts),
                                  with_sources=opts.return_sources)
        if include_usage:  # OpenAI sends the usage chunk only when asked
            yield _sse(ChatCompletionChunk.of(cid, model, created, finish=finish_reason(answer)))
            yield _sse(ChatCompletionChunk.of(cid, model, created, usage=Usage.of(answer), extra=extra))
        else:
            yield _sse(ChatCompletionChunk.of(cid, model, created, finish=finish_reason(answer), extra=extra))
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        if outcome != "completed":
            outcome = "aborted"
            log.info("stream %s aborted: the client went away; its vLLM request is aborted", cid)
        raise
    except Exception as exc:  # the status line is already sent: report the error in the stream
        err = api_error(exc)
        log.warning("stream %s ended by an error: %s", cid, err.message)
        yield _sse(err.response())
    finally:
        if outcome != "completed":
            state.metrics.count_outcome(index, mode, outcome, tenant)


def create_app(settings: Settings, *, engine: "AsyncBlendEngine | None" = None, mode: str | None = None,
               close_engine: bool | None = None) -> FastAPI:
    """The ASGI app. The engine starts in the app's lifespan (in uvicorn's event loop) unless one
    is passed, and is flushed and closed at shutdown when the app started it (or ``close_engine``).
    ``mode``: the mode requests get by default, when already settled (see :func:`serving_mode`).

    Raises:
        ConfigError: an invalid ``serve.keys_file``.

    Attributes of ``app.state``: ``server`` (:class:`ServerState`: ``engine``, ``loop``, ``metrics``).
    At start-up (the lifespan) :func:`serving_mode` may raise BlendUnavailableError.
    """
    state = ServerState(settings)
    if close_engine is None:
        close_engine = engine is None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from ragcache.engine import AsyncBlendEngine

        state.loop = asyncio.get_running_loop()
        state.engine = engine or await AsyncBlendEngine.start(settings)
        try:
            state.mode = mode or serving_mode(settings, state.engine.blend_support)
            state.metrics.set_tiers((await state.engine.store_stats()).names)
            if settings.serve.index in state.indexes():  # load the embedder and the index now
                try:
                    await state.pipeline(settings.serve.index).aprepare("warm up")
                except Exception as exc:  # noqa: BLE001 - requests will report it with the fix
                    log.warning("index %s is not usable yet: %s", settings.serve.index, exc)
            yield
        finally:
            if close_engine:
                state.engine.close()  # the worker writes the store's counters as it shuts down

    app = FastAPI(title="ragcache", version="1", lifespan=lifespan,
                  description="OpenAI-compatible RAG with chunk KV reuse (CacheBlend) on vLLM")
    app.state.server = state
    app.add_middleware(BodyLimit, limit=lambda: settings.serve.max_body_bytes)  # 413 before FastAPI parses

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.response().model_dump(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        return JSONResponse(err.response().model_dump(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            msg += "; the routes are /v1/chat/completions, /v1/models, /v1/cache, /health and /metrics"
        return JSONResponse(APIError(exc.status_code, msg).response().model_dump(), status_code=exc.status_code)

    def authorized(request: Request) -> Access:
        """The caller's access (see :mod:`ragcache.server.keys`).

        Raises:
            APIError: 401 without a key this server accepts.
        """
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        access = state.keyring().authenticate(token.strip() if scheme.lower() == "bearer" else None)
        if access is None:
            where = " or serve.keys_file" if settings.serve.keys_file else ""
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer KEY` with a key of "
                           f"serve.api_key{where} (openai client: api_key=KEY)", code="invalid_api_key")
        return access

    def server_wide(access: Access = Depends(authorized)) -> Access:
        """A caller that may read every index: the server-wide routes show every index's numbers.

        Raises:
            APIError: 403 for a key scoped to some indexes.
        """
        if not access.every_index:
            raise APIError(403, f"the API key of tenant {access.tenant!r} may read only {access.describe()}; "
                           "/v1/cache and /metrics cover every index and need a key that may read all of them "
                           "(serve.api_key, or indexes = [\"*\"] in serve.keys_file)", code="index_not_allowed")
        return access

    @app.get("/health")
    async def health() -> Health:
        """Liveness and load: the engine, the mode requests get by default (and whether reuse/blend is
        available), requests in flight, the default index, the keys file's state (read now)."""
        eng = state.engine
        support = eng.blend_support
        return Health(device=eng.device, startup_s=round(eng.startup_s, 2), mode=state.mode,
                      blend=BlendAvailability(available=support is None or support.available,
                                              reason=None if support is None else support.reason),
                      dtype=eng.dtype.dtype, in_flight=state.in_flight,
                      engine_unfinished_requests=eng.num_unfinished_requests, default_index=settings.serve.index,
                      model=settings.models.model, keys_file=state.keys_health())

    @app.get("/v1/models")
    async def models(access: Access = Depends(authorized)) -> ModelList:
        """One model per index the caller may read (its name is the ``model`` to send)."""
        return ModelList(data=[_model(n) for n in state.readable_indexes(access)])

    @app.get("/v1/models/{name}")
    async def model(name: str, access: Access = Depends(authorized)) -> ModelCard:
        names = state.indexes()
        state.check_access(access, name, "model", names)
        return _model(state.resolve_index(name, None, names))

    def _model(name: str) -> ModelCard:
        from ragcache.index.catalog import catalog

        return ModelCard(id=name, created=catalog(settings).created(name))

    @app.get("/v1/cache", dependencies=[Depends(server_wide)])
    async def cache() -> CacheReport:
        """Per-tier KV store stats (hits, misses, hit_rate, entries, occupancy_bytes, capacity_bytes...)."""
        return CacheReport(tiers=(await state.engine.store_stats()).tiers)

    @app.get("/metrics", dependencies=[Depends(server_wide)])
    async def metrics() -> Response:
        """Prometheus text exposition (see ragcache.server.metrics)."""
        try:
            stats = await state.engine.store_stats()
        except Exception as exc:  # noqa: BLE001 - the request metrics are still worth serving
            log.warning("store stats unavailable for /metrics: %s", exc)
            stats = None
        state.metrics.engine_unfinished.set(state.engine.num_unfinished_requests)
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               access: Access = Depends(authorized)) -> Response:
        """A chat completion answered from an index (see the module docstring)."""
        opts = body.options
        names = state.indexes()  # listed once per request
        asked, param = _asked_index(state, body.model, opts.index, names)
        state.check_access(access, asked, param, names)
        index = state.resolve_index(body.model, opts.index, names)
        path = state.index_path(index)  # resolved once per request
        question, history = body.conversation()
        state.check_options(opts)
        mode = opts.mode or state.mode
        options = body.query_options(history).model_copy(update={"mode": mode})  # the server's default mode
        if state.engine.blend_support is not None:
            try:
                state.engine.blend_support.require(mode)  # refused before any work, not mid-stream
            except BlendUnavailableError as exc:
                raise api_error(exc) from None
        tenant = access.tenant
        slot = state.acquire()
        try:
            pipe = state.pipeline(index, path)
            r = await _unless_disconnected(request, pipe.aprepare(question, options))
            if body.stream:
                events = _events(state, pipe, r, index=index, model=body.model, mode=mode, opts=opts,
                                 include_usage=body.include_usage, tenant=tenant)
                response, slot = _EventStream(events, slot), None  # the stream frees the slot
                return response
            answer = await _unless_disconnected(request, pipe.aanswer(r))
            state.answered(index, answer, tenant)
            extra = RagcacheResult.of(index, answer=answer, prompt=_prompt_text(state, answer, opts),
                                      with_sources=opts.return_sources)
            return JSONResponse(ChatCompletionResponse.of(completion_id(), body.model, answer, extra).model_dump())
        except _ClientGone:
            state.metrics.count_outcome(index, mode, "aborted", tenant)
            return Response(status_code=499)  # nobody reads it
        except Exception as exc:
            state.metrics.count_outcome(index, mode, "error", tenant)
            raise api_error(exc) from exc
        finally:
            if slot is not None:
                slot.release()

    return app


def _asked_index(state: ServerState, model: str, override: str | None, names: list[str]) -> tuple[str, str]:
    """The index name a request asks for and the field that names it, before checking it exists
    (access is checked first, so a key learns nothing about indexes it may not read, nor about
    folders on the server's disk)."""
    if override is not None:
        return override, "ragcache.index"
    if model in DEFAULT_MODEL_ALIASES and model not in names:
        return state.settings.serve.index, "model"
    return model, "model"
