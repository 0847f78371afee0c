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
chunk with ``finish_reason``, a usage chunk (``choices: []``) with ``usage`` and the complete
``ragcache`` object (sources with tiers, metrics), then ``data: [DONE]``. An error after the stream
started is sent as a ``data: {"error": ...}`` line. A client that disconnects cancels its request:
the vLLM request is aborted and its KV slots are freed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragcache.config import Settings
from ragcache.server.metrics import ServerMetrics
from ragcache.server.schemas import (
    DEFAULT_MODEL_ALIASES,
    APIError,
    ChatCompletionRequest,
    RagcacheOptions,
    chunk_body,
    completion_body,
    completion_id,
    finish_reason,
    ragcache_body,
    usage_body,
    validation_error,
)

if TYPE_CHECKING:
    from ragcache.engine import AsyncBlendEngine
    from ragcache.pipeline import Answer, RAGPipeline, Retrieval

log = logging.getLogger(__name__)

T = TypeVar("T")

#: pipelines kept (one per index version); older ones are dropped first
MAX_PIPELINES = 16


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
        self.engine: "AsyncBlendEngine | None" = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics = ServerMetrics()
        self.in_flight = 0
        self._pipelines: dict[tuple[str, int], "RAGPipeline"] = {}

    def indexes(self) -> list[str]:
        """Names of the indexes served: every complete index under ``ingest.index_dir`` (or in
        the pgvector database, ``ingest.vector_store``)."""
        from ragcache.catalog import catalog

        return catalog(self.settings).names()

    def resolve_index(self, model: str, override: str | None) -> str:
        """The index a request asks for (see the module docstring).

        Raises:
            APIError: 404 when it names no index served here.
        """
        names = self.indexes()
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

    def pipeline(self, name: str) -> "RAGPipeline":
        """The pipeline over index ``name`` on the shared engine (new when the index was re-ingested)."""
        from ragcache.catalog import catalog
        from ragcache.index import resolve_index_path
        from ragcache.pipeline import RAGPipeline

        path = resolve_index_path(name, self.settings.ingest.index_dir)
        key = (name, catalog(self.settings).version(name))
        pipe = self._pipelines.get(key)
        if pipe is None:
            for old in [k for k in self._pipelines if k[0] == name]:
                del self._pipelines[old]
            while len(self._pipelines) >= MAX_PIPELINES:
                del self._pipelines[next(iter(self._pipelines))]
            pipe = self._pipelines[key] = RAGPipeline(self.settings, path, self.engine)
            pipe.index_name = name
        return pipe

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
    from ragcache.index import IndexMismatchError, IndexNotFoundError
    from ragcache.pipeline import EmptyIndexError
    from ragcache.prompt import PromptTooLongError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, (IndexNotFoundError, EmptyIndexError)):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, IndexMismatchError):
        return APIError(500, f"the index does not match the server's settings: {exc}", code="index_mismatch")
    if type(exc).__name__ == "PgUnavailableError":  # ragcache.pgindex (psycopg) is imported only with pgvector
        return APIError(503, str(exc), code="index_unavailable")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    log.error("request failed", exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}: {exc}); the details are in the server log",
                    code="internal_error")


class _ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so aborting its vLLM request) if the client disconnects.

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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _prompt_text(state: ServerState, answer: "Answer", opts: RagcacheOptions) -> str | None:
    """The prompt the model was given, as text, when the request asked for it (``return_prompt``)."""
    if not opts.return_prompt or answer.prompt is None:
        return None
    return state.engine.tokenizer.decode(answer.prompt.token_ids)


async def _events(state: ServerState, pipe: "RAGPipeline", r: "Retrieval", *, index: str, model: str, mode: str,
                  opts: RagcacheOptions, generate: dict[str, Any]) -> AsyncIterator[str]:
    """The SSE lines of one streamed chat completion (see the module docstring)."""
    cid, created = completion_id(), int(time.time())
    outcome = "error"
    try:
        yield _sse(chunk_body(cid, model, created, delta={"role": "assistant", "content": ""},
                              extra=ragcache_body(index, opts, sources=r.sources)))
        answer = None
        async with aclosing(pipe.astream_answer(r, mode, **generate)) as items:
            async for item in items:
                if isinstance(item, str):
                    yield _sse(chunk_body(cid, model, created, delta={"content": item}))
                else:
                    answer = item
        state.metrics.observe(index, answer)  # before the last lines: a client done reading sees it counted
        outcome = "completed"
        yield _sse(chunk_body(cid, model, created, finish=finish_reason(answer)))
        extra = ragcache_body(index, opts, answer=answer, prompt_text=_prompt_text(state, answer, opts))
        yield _sse(chunk_body(cid, model, created, usage=usage_body(answer), extra=extra))
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        if outcome != "completed":
            outcome = "aborted"
            log.info("stream %s aborted: the client went away; its vLLM request is aborted", cid)
        raise
    except Exception as exc:  # the status line is already sent: report the error in the stream
        err = api_error(exc)
        log.warning("stream %s ended by an error: %s", cid, err.message)
        yield _sse(err.body())
    finally:
        if outcome != "completed":
            state.metrics.count_outcome(index, mode, outcome)


def create_app(settings: Settings, *, engine: "AsyncBlendEngine | None" = None) -> FastAPI:
    """The ASGI app. The engine starts in the app's lifespan (in uvicorn's event loop) unless one
    is passed, and is closed at shutdown when the app started it.

    Attributes of ``app.state``: ``server`` (:class:`ServerState`: ``engine``, ``loop``, ``metrics``).
    """
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from ragcache.engine import AsyncBlendEngine

        state.loop = asyncio.get_running_loop()
        state.engine = engine or await AsyncBlendEngine.start(settings)
        try:
            state.metrics.set_tiers(list(await state.engine.store_stats()))
            if settings.serve.index in state.indexes():  # load the embedder and the index now
                try:
                    await state.pipeline(settings.serve.index).aprepare("warm up")
                except Exception as exc:  # noqa: BLE001 - requests will report it with the fix
                    log.warning("index %s is not usable yet: %s", settings.serve.index, exc)
            yield
        finally:
            if engine is None:
                await state.engine.flush()
                state.engine.close()

    app = FastAPI(title="ragcache", version="1", lifespan=lifespan,
                  description="OpenAI-compatible RAG with chunk KV reuse (CacheBlend) on vLLM")
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            msg += "; the routes are /v1/chat/completions, /v1/models, /v1/cache, /health and /metrics"
        return JSONResponse(APIError(exc.status_code, msg).body(), status_code=exc.status_code)

    def authorized(request: Request) -> None:
        key = settings.serve.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer KEY` with the key in "
                           "serve.api_key (openai client: api_key=KEY)", code="invalid_api_key")

    guarded = [Depends(authorized)]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness and load: the engine, requests in flight, the default index."""
        eng = state.engine
        return {"status": "ok", "device": eng.device, "startup_s": round(eng.startup_s, 2),
                "in_flight": state.in_flight, "engine_unfinished_requests": eng.num_unfinished_requests,
                "default_index": settings.serve.index, "model": settings.models.model}

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        """One model per index (its name is the ``model`` to send)."""
        return {"object": "list", "data": [_model(n) for n in state.indexes()]}

    @app.get("/v1/models/{name}", dependencies=guarded)
    async def model(name: str) -> dict[str, Any]:
        return _model(state.resolve_index(name, None))

    def _model(name: str) -> dict[str, Any]:
        from ragcache.catalog import catalog

        created = catalog(settings).created(name)
        return {"id": name, "object": "model", "created": created, "owned_by": "ragcache"}

    @app.get("/v1/cache", dependencies=guarded)
    async def cache() -> dict[str, Any]:
        """Per-tier KV store stats (hits, misses, hit_rate, entries, occupancy_bytes, capacity_bytes...)."""
        return {"object": "ragcache.cache", "tiers": await state.engine.store_stats()}

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        """Prometheus text exposition (see ragcache.server.metrics)."""
        try:
            stats = await state.engine.store_stats()
        except Exception as exc:  # noqa: BLE001 - the request metrics are still worth serving
            log.warning("store stats unavailable for /metrics: %s", exc)
            stats = None
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """A chat completion answered from an index (see the module docstring)."""
        opts = body.options
        index = state.resolve_index(body.model, opts.index)
        question, history = body.conversation()
        generate = dict(max_tokens=body.answer_tokens, recompute_ratio=opts.recompute_ratio,
                        sampling=body.sampling())
        mode = opts.mode or settings.engine.mode
        slot = state.acquire()
        try:
            pipe = state.pipeline(index)
            r = await pipe.aprepare(question, opts.top_k, history=history)
            if body.stream:
                events = _events(state, pipe, r, index=index, model=body.model, mode=mode, opts=opts,
                                 generate=generate)
                response, slot = _EventStream(events, slot), None  # the stream frees the slot
                return response
            answer = await _unless_disconnected(request, pipe.aanswer(r, mode, **generate))
            state.metrics.observe(index, answer)
            extra = ragcache_body(index, opts, answer=answer, prompt_text=_prompt_text(state, answer, opts))
            return JSONResponse(completion_body(completion_id(), body.model, answer, extra))
        except _ClientGone:
            state.metrics.count_outcome(index, mode, "aborted")
            return Response(status_code=499)  # nobody reads it
        except Exception as exc:
            state.metrics.count_outcome(index, mode, "error")
            raise api_error(exc) from exc
        finally:
            if slot is not None:
                slot.release()

    return app
