"""BlendEngine: the embedded vLLM engine with ragcache's KV connector and worker extension.

Owns: driving ``vllm.LLM`` (created with the connector and worker extension of
:class:`~ragcache.engine.base.EngineBase`, which also builds each request and its metrics), KV
precompute calls and scoring (first-token distributions, teacher-forced continuation
log-probabilities). :class:`~ragcache.engine.async_engine.AsyncBlendEngine` has the same methods
(awaited). Streaming and batches go through the same engine (``LLMEngine.add_request`` /
``step`` with DELTA outputs), so one engine serves ``generate``, ``generate_many`` and ``stream``;
a lock keeps callers from stepping it concurrently. For concurrent callers (a server), use
:class:`~ragcache.engine.async_engine.AsyncBlendEngine`: same requests, no lock, vLLM batches them.

Modes (one prompt, four ways):
  ``full``   normal prefill, no reuse (a unique ``cache_salt`` defeats prefix caching);
  ``prefix`` vLLM's own prefix caching only (exact prefixes of earlier prompts);
  ``reuse``  every chunk's KV moved to its new position, nothing recomputed;
  ``blend``  CacheBlend: reuse plus recompute of the HKVD tokens (default).

What crosses to the worker and back is typed in :mod:`ragcache.engine.messages`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Iterator, Sequence

from ragcache.chunks import Chunk
from ragcache.config import Settings
from ragcache.engine.base import MEASURE_OPTIONS, EngineBase, Generation
from ragcache.engine.messages import OpsProbe, PrecomputeReport, Rpc, StoreStats
from ragcache.engine.selfcheck import run_self_check
from ragcache.models import LLMInfo
from ragcache.options import DEFAULTS, QueryOptions, SamplingOptions
from ragcache.prompt import AssembledPrompt
from ragcache.quality.table import IndexQuality

log = logging.getLogger(__name__)

__all__ = ["BlendEngine", "Generation", "QueryOptions", "SamplingOptions"]

#: the in-process engine of this process, if any (vLLM's KV connector agent is process-global)
_IN_PROCESS: "weakref.ref[BlendEngine] | None" = None


def _claim_in_process_slot(engine: "BlendEngine", settings: Settings) -> None:
    """Allow one live in-process engine per process.

    In-process, vLLM keeps the KV connector of the worker in a process-global slot, so a second
    in-process engine would take over the first one's connector and serve it the wrong model's KV.

    Raises:
        RuntimeError: another in-process BlendEngine is alive in this process.
    """
    global _IN_PROCESS
    if not settings.engine.in_process:
        return
    other = _IN_PROCESS() if _IN_PROCESS is not None else None
    if other is not None and other is not engine:
        raise RuntimeError("another in-process BlendEngine is running in this process: close() it first, share it "
                           "(RAGPipeline.open(..., engine=...)), or set engine.in_process = false for this one")
    _IN_PROCESS = weakref.ref(engine)


def _release_in_process_slot(engine: "BlendEngine") -> None:
    global _IN_PROCESS
    if _IN_PROCESS is not None and _IN_PROCESS() is engine:
        _IN_PROCESS = None


class BlendEngine(EngineBase):
    """Embedded vLLM with chunk-KV reuse and CacheBlend.

    Attributes:
        prompts: the :class:`~ragcache.prompt.PromptBuilder` of this model and ``[prompt]`` settings
            (prompts longer than ``engine.max_model_len`` are refused there).
        tokenizer: the model's Hugging Face tokenizer.
        device: the device the model runs on (``str(torch.device)``), as vLLM loaded it.
        dtype: the compute dtype and why (:class:`~ragcache.engine.dtype.DtypeChoice`).
        blend_support: whether reuse/blend may run on this model (the start-up self-check's verdict,
            :class:`~ragcache.engine.selfcheck.BlendSupport`).
        startup_s: seconds from creating vLLM to ready (warm-up included).

    Args:
        settings: ragcache settings (engine, blend, store, prompt sections are used).
        llm: an already provisioned model; resolved from ``settings.models`` when None.

    Raises:
        ModelNotFoundError: the configured model cannot be found (see ragcache.models).
        ConfigError: engine settings vLLM would refuse for this model (checked before vLLM starts,
            see :mod:`ragcache.engine.limits`).
        RuntimeError: another in-process BlendEngine is alive in this process.
    """

    def __init__(self, settings: Settings, llm: LLMInfo | None = None):
        self._lock = threading.RLock()
        self._configure(settings, llm, in_process=settings.engine.in_process)  # refuses bad limits before vLLM

        from vllm import LLM

        t0 = time.perf_counter()
        _claim_in_process_slot(self, settings)
        self.llm = LLM(**self._engine_kwargs())
        self._worker_ready(self._rpc(Rpc.INIT, *self._init_args()))
        self._set_tokenizer(self.llm.get_tokenizer())
        self.blend_support = run_self_check(self)  # its two requests warm vLLM and the layer-wise forward up
        if self.blend_support.check is None:
            self._warm_up()
        self._measured([self.generate(p, MEASURE_OPTIONS) for p in self._start_up_measurements()])
        self.startup_s = time.perf_counter() - t0
        log.info("%s", self.ready_line())

    def _warm_up(self) -> None:
        """One tiny request (blend where available): the first one pays for lazy kernel and allocator set-up."""
        self.generate(self._warm_up_prompt(), self._warm_up_options())

    # ---- KV precompute ---------------------------------------------------------------------

    def precompute(self, chunks: Sequence[Chunk], *, show_progress: bool = False,
                   batch_size: int = 8, namespace: str = "") -> PrecomputeReport:
        """Compute and store the KV of the head and of each chunk's unit not stored yet.

        Every unit is computed where the placement rule puts it (:func:`ragcache.prompt.lead_in_for`)
        and keyed in the index namespace ``namespace`` (see :meth:`ragcache.prompt.PromptBuilder.key`).
        Blocks the engine while it runs: call it at ingest time, not beside live requests.
        Chunks go to the worker ``batch_size`` at a time (with ``show_progress``, a bar on a
        terminal's stderr, a line every few seconds in a log). Returns what was computed (the head
        is not counted; :class:`~ragcache.engine.messages.PrecomputeReport`).

        Raises:
            BlendUnavailableError: this model has no working DecoderOps adapter (see ``blend_support``).
        """
        run = self._precompute_run(chunks, namespace, batch_size, show_progress)
        with self._lock, run:
            self._rpc(Rpc.PRECOMPUTE, *run.head_args)
            for args, n in run.batches:
                run.done(self._rpc(Rpc.PRECOMPUTE, *args), n)
        return run.report

    def _rpc(self, method: str, *args: Any) -> Any:
        """The worker's reply to ``method`` (an :class:`~ragcache.engine.messages.Rpc` name) called
        with ``args``, under the engine's lock."""
        with self._lock:
            return self.llm.collective_rpc(method, args=args)[0]

    # ---- requests --------------------------------------------------------------------------

    def generate_many(self, prompts: Sequence[AssembledPrompt],
                      options: QueryOptions | Sequence[QueryOptions] = DEFAULTS, *,
                      logprobs: int | None = None, quality: IndexQuality | None = None) -> list[Generation]:
        """Run several prompts as one batch (concurrent in vLLM), each answered as ``options`` say
        (mode, max_tokens, recompute ratio, selection, sampling; the settings' defaults where unset;
        greedy decoding unless ``options.sampling`` says otherwise); one options per prompt, or one
        for all.

        Args:
            logprobs: when set, the first generated token's top-``logprobs`` log-probabilities are
                returned (-1 = the whole vocabulary), for quality measurements.
            quality: the index's blend quality, which ``auto`` routes by (None: the prior).

        Raises:
            ValueError: sampling values vLLM rejects.
            BlendUnavailableError: reuse/blend on a model whose adapter is missing or failed the
                start-up self-check; ContextBeyondWindowError: a context beyond its sliding window.
        """
        per_prompt = [options] * len(prompts) if isinstance(options, QueryOptions) else list(options)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} options for {len(prompts)} prompts: give one per prompt, or one")
        reqs = [self._request(p, o, logprobs=logprobs, quality=quality) for p, o in zip(prompts, per_prompt)]
        t0 = time.perf_counter()
        with self._lock:
            outs = self.llm.generate([r.inputs for r in reqs], [r.sampling for r in reqs], use_tqdm=False)
        total = time.perf_counter() - t0
        return [self._generation(r, out, total) for r, out in zip(reqs, outs)]

    def generate(self, prompt: AssembledPrompt, options: QueryOptions = DEFAULTS, *,
                 logprobs: int | None = None, quality: IndexQuality | None = None) -> Generation:
        """One prompt; see :meth:`generate_many`."""
        return self.generate_many([prompt], options, logprobs=logprobs, quality=quality)[0]

    def count_load_ops(self, prompts: Sequence[AssembledPrompt],
                       options: QueryOptions | Sequence[QueryOptions] = DEFAULTS) -> list[dict[str, Any]]:
        """The operators the worker dispatched to serve the contexts of ``prompts``, run as one batch
        (:meth:`generate_many`, one token each) with the worker's operator count armed
        (:meth:`WorkerRuntime.count_ops <ragcache.engine.worker.WorkerRuntime.count_ops>`).

        Returns one record per engine step that loaded contexts (``requests``, ``modes``,
        ``ctx_tokens``, ``layers``, ``ops``); the requests' answers are discarded. The profiler
        slows these requests down: do not time them.
        """
        each = [options] * len(prompts) if isinstance(options, QueryOptions) else list(options)
        one_token = [o.model_copy(update={"max_tokens": 1}) for o in each]
        with self._lock:
            self._rpc(Rpc.OP_COUNTS, len(prompts))
            try:
                self.generate_many(prompts, one_token)
            finally:
                counts = self._rpc(Rpc.OP_COUNTS, 0)
        return counts

    def continuation_logprobs(self, prompt: AssembledPrompt, continuation: Sequence[int],
                              options: QueryOptions = DEFAULTS) -> list[float]:
        """Teacher-forced log-probabilities (nats) of ``continuation`` token ids right after ``prompt``.

        One request over ``prompt + continuation`` in ``options.mode`` with vLLM prompt logprobs: the
        context is served exactly as in a normal request of that mode (the connector loads/blends
        ``[0, ctx_len)``; the tail and the continuation are prefilled over it).

        Raises:
            ValueError: empty continuation.
            RuntimeError: the continuation's first token was served from cache (not scored).
        """
        req = self._scoring_request(prompt, continuation, options)
        with self._lock:
            out = self.llm.generate([req.inputs], [req.sampling], use_tqdm=False)[0]
        return self._continuation_logprobs(out, prompt, continuation)

    def stream(self, prompt: AssembledPrompt, options: QueryOptions = DEFAULTS, *,
               quality: IndexQuality | None = None) -> Iterator[str | Generation]:
        """Yield text pieces as they are decoded, then the final :class:`Generation` (``options`` as
        :meth:`generate_many`).

        A reader that stops early aborts the request in vLLM (its KV slots are freed).
        """
        state = self._stream_state(prompt, options, quality)
        req = state.req
        engine = self.llm.llm_engine
        with self._lock:
            req_id = engine.add_request(req.rid, req.inputs, req.sampling)  # internal id = rid + random suffix
            finished = False
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.request_id not in (req.rid, req_id):
                            continue
                        piece = state.add(out)
                        if piece:
                            yield piece
                finished = True
            finally:
                if not finished:  # the reader stopped early: free the request's slots in vLLM
                    engine.abort_request([req_id], internal=True)
        yield self._stream_done(state)

    def ops_probe(self, token_ids: Sequence[int]) -> OpsProbe:
        """The worker's report on the model's DecoderOps adapter, exercised on ``token_ids``
        (:meth:`WorkerRuntime.probe <ragcache.engine.worker.WorkerRuntime.probe>`; the self-check's first step)."""
        return OpsProbe.from_dict(self._rpc(Rpc.OPS_PROBE, list(token_ids)))

    @property
    def num_unfinished_requests(self) -> int:
        """Requests vLLM holds now (waiting or running); 0 once every stream finished or was aborted."""
        return int(self.llm.llm_engine.get_num_unfinished_requests())

    # ---- store -----------------------------------------------------------------------------

    def store_stats(self) -> StoreStats:
        """Per-tier stats of the worker's KV store (:class:`~ragcache.engine.messages.StoreStats`)."""
        return StoreStats.from_dict(self._rpc(Rpc.STORE_STATS))

    def stored_tiers(self, chunks: Sequence[Chunk], namespace: str = "") -> list[str | None]:
        """For each chunk, the highest tier holding its KV (in index namespace ``namespace``), or None."""
        return self._rpc(Rpc.STORE_CONTAINS, self._chunk_keys(chunks, namespace))

    def stored_where(self, chunks: Sequence[Chunk], namespace: str = "") -> list[list[str]]:
        """For each chunk, every tier holding its KV now (in index namespace ``namespace``), top-down."""
        return self.store_holders(self._chunk_keys(chunks, namespace))

    def store_holders(self, keys: Sequence[str]) -> list[list[str]]:
        """For each KV store key, every tier holding it now, top-down ([] for none)."""
        return self._rpc(Rpc.STORE_HOLDERS, list(keys))

    def forget(self, chunks: Sequence[Chunk], namespace: str = "", *, head: bool = False) -> int:
        """Delete the stored KV of ``chunks`` (in index namespace ``namespace``) from every tier, and
        with ``head`` the prompt head's entry in that namespace too; returns how many entries were
        removed."""
        return self._rpc(Rpc.STORE_DELETE, self._chunk_keys(chunks, namespace, head=head))

    def forget_prompt(self, prompt: AssembledPrompt) -> int:
        """Delete the stored KV of every cached segment of ``prompt`` (its head and chunks, under
        the keys it was built with) from every tier; returns how many entries were removed."""
        return self._rpc(Rpc.STORE_DELETE, [s.key for s in prompt.segments])

    def flush(self) -> None:
        """Write the store's lookup counts to its counter file now (``close`` does it too)."""
        self._rpc(Rpc.STORE_FLUSH)

    def close(self) -> None:
        """Shut the engine core (and its worker processes) down; the engine is unusable afterwards.
        The worker writes the store's lookup counts to its counter file as it shuts down (the KV
        connector's ``shutdown``), as in :class:`~ragcache.engine.async_engine.AsyncBlendEngine`."""
        with self._lock:
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()
        _release_in_process_slot(self)

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache (for fair side-by-side measurements)."""
        with self._lock:
            self.llm.reset_prefix_cache()
