"""AsyncBlendEngine: the embedded engine on vLLM's ``AsyncLLM``, for many concurrent requests.

Owns: driving ``vllm.v1.engine.async_llm.AsyncLLM`` with the same KV connector, worker extension,
requests and metrics as :class:`~ragcache.engine.engine.BlendEngine` (all from
:class:`~ragcache.engine.base.EngineBase`), with the same methods awaited (precompute, generate,
generate_many, stream, continuation_logprobs, store stats and lookups, forget, flush, close),
without a lock: every ``generate`` / ``stream`` call is
a separate vLLM request, and vLLM's scheduler batches the ones in flight (chunk KV is still
loaded and blended per request in the connector, inside the engine core).

Facts this relies on (vLLM 0.32): ``AsyncLLM`` always runs its engine core in a child process
(start-up ~30 s on 2 CPU cores, against ~6 s for the in-process ``vllm.LLM``, which is why the
CLI, SDK and UI default to BlendEngine); it binds to the event loop it is first used in, so
create it with :meth:`AsyncBlendEngine.start` inside that loop; ``AsyncLLM.generate`` aborts its
request when the consuming task is cancelled or the generator is closed, which frees the
request's KV slots (an HTTP client that disconnects mid-stream cancels its task).

Example::

    engine = await AsyncBlendEngine.start(Settings.load())
    gen = await engine.generate(engine.prompts.build("Where is Velmora?", chunks), QueryOptions(mode="blend"))
    async for item in engine.stream(prompt):   # str pieces, then the Generation
        ...
    engine.close()
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Sequence

from ragcache.chunks import Chunk
from ragcache.config import Settings
from ragcache.engine.base import MEASURE_OPTIONS, EngineBase, Generation, PreparedRequest
from ragcache.engine.messages import OpsProbe, PrecomputeReport, Rpc, StoreStats
from ragcache.engine.selfcheck import arun_self_check
from ragcache.models import LLMInfo
from ragcache.options import DEFAULTS, QueryOptions
from ragcache.prompt import AssembledPrompt
from ragcache.quality.table import IndexQuality

log = logging.getLogger(__name__)


class AsyncBlendEngine(EngineBase):
    """Chunk-KV reuse and CacheBlend on vLLM's AsyncLLM; safe for concurrent coroutines of one event loop.

    Create with ``await AsyncBlendEngine.start(settings)``. Attributes as
    :class:`~ragcache.engine.base.EngineBase` (``prompts``, ``tokenizer``, ``device``, ``startup_s``...).

    Raises:
        ModelNotFoundError: the configured model cannot be found (see ragcache.models).
        ConfigError: engine settings vLLM would refuse for this model (see :mod:`ragcache.engine.limits`).
    """

    #: the pipeline calls this engine's coroutines natively (see RAGPipeline.aquery)
    is_async = True

    def __init__(self, settings: Settings, llm: LLMInfo | None = None):
        """Create the AsyncLLM (blocks for the engine core's start-up). Prefer :meth:`start`."""
        self._t0 = time.perf_counter()
        self._configure(settings, llm, in_process=False)  # AsyncLLM's engine core is always a child process

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_kwargs()))
        self._set_tokenizer(self.llm.get_tokenizer())
        self._closed = False

    @classmethod
    async def start(cls, settings: Settings, llm: LLMInfo | None = None) -> "AsyncBlendEngine":
        """Start vLLM, set up the worker's KV store, run the reuse/blend self-check
        (:func:`~ragcache.engine.selfcheck.arun_self_check`, which also warms the engine up).

        Blocks the running event loop while the engine core starts (~30 s on 2 CPU cores), then
        awaits the worker set-up. Call it inside the loop that will use the engine.
        """
        engine = cls(settings, llm)
        try:
            engine._worker_ready(await engine._rpc(Rpc.INIT, *engine._init_args()))
            engine.blend_support = await arun_self_check(engine)
            if engine.blend_support.check is None:
                await engine._warm_up()
            engine._measured([await engine.generate(p, MEASURE_OPTIONS) for p in engine._start_up_measurements()])
        except BaseException:
            engine.close()
            raise
        engine.startup_s = time.perf_counter() - engine._t0
        log.info("async %s", engine.ready_line())
        return engine

    async def _warm_up(self) -> None:
        """One tiny request (blend where available): the first one pays for lazy kernel and allocator set-up."""
        await self.generate(self._warm_up_prompt(), self._warm_up_options())

    # ---- KV precompute ---------------------------------------------------------------------

    async def precompute(self, chunks: Sequence[Chunk], *, show_progress: bool = False,
                         batch_size: int = 8, namespace: str = "") -> PrecomputeReport:
        """:meth:`BlendEngine.precompute <ragcache.engine.engine.BlendEngine.precompute>`, awaited: the
        worker computes and stores the KV of the head and of each chunk not stored yet. Each batch
        holds up vLLM's engine loop while it runs (requests in flight wait): precompute at ingest
        time, not beside live traffic.

        Raises:
            BlendUnavailableError: this model has no working DecoderOps adapter (see ``blend_support``).
        """
        run = self._precompute_run(chunks, namespace, batch_size, show_progress)
        with run:
            await self._rpc(Rpc.PRECOMPUTE, *run.head_args)
            for args, n in run.batches:
                run.done(await self._rpc(Rpc.PRECOMPUTE, *args), n)
        return run.report

    async def _rpc(self, method: str, *args: Any) -> Any:
        """The worker's reply to ``method`` (an :class:`~ragcache.engine.messages.Rpc` name) called with ``args``."""
        return (await self.llm.collective_rpc(method, args=args))[0]

    # ---- requests --------------------------------------------------------------------------

    async def generate(self, prompt: AssembledPrompt, options: QueryOptions = DEFAULTS, *,
                       logprobs: int | None = None, quality: IndexQuality | None = None) -> Generation:
        """Answer one prompt as ``options`` say; concurrent calls are batched by vLLM. Arguments as
        :meth:`BlendEngine.generate_many <ragcache.engine.engine.BlendEngine.generate_many>`.

        Cancelling the awaiting task aborts the request in vLLM.

        Raises:
            ValueError: sampling values vLLM rejects.
            BlendUnavailableError: reuse/blend on a model whose adapter is missing or failed the
                start-up self-check; ContextBeyondWindowError: a context beyond its sliding window.
        """
        req = self._request(prompt, options, logprobs=logprobs, quality=quality)
        t0 = time.perf_counter()
        final = await self._final_output(req)
        return self._generation(req, final, time.perf_counter() - t0)

    async def generate_many(self, prompts: Sequence[AssembledPrompt], options: QueryOptions = DEFAULTS, *,
                            logprobs: int | None = None, quality: IndexQuality | None = None) -> list[Generation]:
        """Several prompts at once (vLLM batches them), in order; arguments and errors as :meth:`generate`."""
        return list(await asyncio.gather(*(self.generate(p, options, logprobs=logprobs, quality=quality)
                                           for p in prompts)))

    async def continuation_logprobs(self, prompt: AssembledPrompt, continuation: Sequence[int],
                                    options: QueryOptions = DEFAULTS) -> list[float]:
        """:meth:`BlendEngine.continuation_logprobs <ragcache.engine.engine.BlendEngine.continuation_logprobs>`,
        awaited: teacher-forced log-probabilities (nats) of ``continuation`` right after ``prompt``.

        Raises:
            ValueError: empty continuation.
            RuntimeError: the continuation's first token was served from cache (not scored).
        """
        req = self._scoring_request(prompt, continuation, options)
        return self._continuation_logprobs(await self._final_output(req), prompt, continuation)

    async def _final_output(self, req: PreparedRequest) -> Any:
        """Run ``req`` (FINAL_ONLY) to its end and return vLLM's last output."""
        final = None
        try:
            async for out in self.llm.generate(req.inputs, req.sampling, req.rid):
                final = out
        except Exception:
            await self._forget_request(req.rid)
            raise
        return final

    async def _forget_request(self, rid: str) -> None:
        """Abort ``rid`` after vLLM raised on it: vLLM aborts what it knows to have started, but a
        request that fails while being added (e.g. a value its engine core cannot carry) stays
        registered and would count as unfinished forever."""
        try:
            await self.llm.abort(rid)
        except Exception:  # the original error is the one to report
            log.debug("aborting request %s after its failure failed", rid, exc_info=True)

    async def stream(self, prompt: AssembledPrompt, options: QueryOptions = DEFAULTS, *,
                     quality: IndexQuality | None = None) -> AsyncIterator[str | Generation]:
        """Yield text pieces as they are decoded, then the final :class:`Generation` (``options`` as
        :meth:`generate`).

        A consumer that stops early (``aclose()``, or its task is cancelled) aborts the request in
        vLLM, which frees its KV slots.
        """
        state = self._stream_state(prompt, options, quality)
        req = state.req
        outputs = self.llm.generate(req.inputs, req.sampling, req.rid)
        try:
            async for out in outputs:
                piece = state.add(out)
                if piece:
                    yield piece
        except Exception:
            await self._forget_request(req.rid)
            raise
        finally:
            await outputs.aclose()  # no-op when finished; aborts the vLLM request otherwise
        yield self._stream_done(state)

    async def ops_probe(self, token_ids: Sequence[int]) -> OpsProbe:
        """The worker's report on the model's DecoderOps adapter, exercised on ``token_ids`` (the
        self-check's first step)."""
        return OpsProbe.from_dict(await self._rpc(Rpc.OPS_PROBE, list(token_ids)))

    @property
    def num_unfinished_requests(self) -> int:
        """Requests vLLM holds now (waiting or running); 0 once every stream finished or was aborted."""
        return 0 if self._closed else int(self.llm.get_num_unfinished_requests())

    # ---- store -----------------------------------------------------------------------------

    async def store_stats(self) -> StoreStats:
        """Per-tier stats of the worker's KV store (:class:`~ragcache.engine.messages.StoreStats`)."""
        return StoreStats.from_dict(await self._rpc(Rpc.STORE_STATS))

    async def stored_tiers(self, chunks: Sequence[Chunk], namespace: str = "") -> list[str | None]:
        """For each chunk, the highest tier holding its KV (in index namespace ``namespace``), or None."""
        return await self._rpc(Rpc.STORE_CONTAINS, self._chunk_keys(chunks, namespace))

    async def stored_where(self, chunks: Sequence[Chunk], namespace: str = "") -> list[list[str]]:
        """For each chunk, every tier holding its KV now (in index namespace ``namespace``), top-down."""
        return await self.store_holders(self._chunk_keys(chunks, namespace))

    async def store_holders(self, keys: Sequence[str]) -> list[list[str]]:
        """For each KV store key, every tier holding it now, top-down ([] for none)."""
        return await self._rpc(Rpc.STORE_HOLDERS, list(keys))

    async def forget(self, chunks: Sequence[Chunk], namespace: str = "", *, head: bool = False) -> int:
        """Delete the stored KV of ``chunks`` (in index namespace ``namespace``) from every tier, and
        with ``head`` the prompt head's entry in that namespace too; returns how many entries were
        removed."""
        return await self._rpc(Rpc.STORE_DELETE, self._chunk_keys(chunks, namespace, head=head))

    async def forget_prompt(self, prompt: AssembledPrompt) -> int:
        """Delete the stored KV of every cached segment of ``prompt`` (its head and chunks, under
        the keys it was built with) from every tier; returns how many entries were removed."""
        return await self._rpc(Rpc.STORE_DELETE, [s.key for s in prompt.segments])

    async def reset_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache (for fair side-by-side measurements)."""
        await self.llm.reset_prefix_cache()

    async def flush(self) -> None:
        """Write the store's lookup counts to its counter file now (``close`` does it too)."""
        if not self._closed:
            await self._rpc(Rpc.STORE_FLUSH)

    def close(self) -> None:
        """Shut the engine core and its worker down; the engine is unusable afterwards. Idempotent.
        The worker writes the store's lookup counts to its counter file as it shuts down (the KV
        connector's ``shutdown``), as in :class:`~ragcache.engine.engine.BlendEngine`."""
        if not self._closed:
            self._closed = True
            self.llm.shutdown()
            self.llm = None  # collected now, not at interpreter exit (where AsyncLLM.__del__ fails noisily)
