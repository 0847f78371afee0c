"""BlendEngine: the embedded vLLM engine with ragcache's KV connector and worker extension.

Owns: creating ``vllm.LLM`` with the connector (by module path) and the worker extension, the
four query modes, KV precompute calls, scoring (first-token distributions, teacher-forced
continuation log-probabilities) and per-request metrics. Streaming and batches go through the
same engine (``LLMEngine.add_request`` / ``step`` with DELTA outputs), so one engine serves
``generate``, ``generate_many`` and ``stream``; a lock keeps callers from stepping it concurrently.

Modes (one prompt, four ways):
  ``full``   normal prefill, no reuse (a unique ``cache_salt`` defeats prefix caching);
  ``prefix`` vLLM's own prefix caching only (exact prefixes of earlier prompts);
  ``reuse``  every chunk's KV moved to its new position, nothing recomputed;
  ``blend``  CacheBlend: reuse plus recompute of the HKVD tokens (default).

What crosses to the worker and back is typed in :mod:`ragcache.engine.messages`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ragcache.chunks import KV_LAYOUT_VERSION, Chunk
from ragcache.config import MODES, Settings
from ragcache.engine.dtype import resolve_dtype
from ragcache.engine.limits import check_engine_limits
from ragcache.engine.messages import CONNECTOR_MODES, TRANSFER_KEY, BlendParams, RequestMetrics, Rpc, SegmentRef
from ragcache.engine.selfcheck import BlendSupport, run_self_check
from ragcache.models import LLMInfo, resolve_llm
from ragcache.prompt import AssembledPrompt, PromptBuilder

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """An answer: text, token ids and metrics.

    Attributes:
        first_token_logprobs: ``{token_id: logprob}`` (nats) of the first generated position when
            requested with ``logprobs`` (the whole vocabulary with ``logprobs=-1``), else None.
    """

    text: str
    token_ids: list[int]
    metrics: RequestMetrics
    first_token_logprobs: dict[int, float] | None = None


@dataclass
class _Request:
    """One prepared vLLM request (ids, inputs, sampling params) and what metrics need of it."""

    rid: str
    prompt: AssembledPrompt
    mode: str
    recompute_ratio: float | None
    inputs: dict[str, Any]
    sampling: Any  # vllm.SamplingParams


def _first_position(logprobs: Any) -> dict[int, float] | None:
    """``{token_id: logprob}`` of the first generated position, from vLLM flat or per-position logprobs."""
    if not logprobs:
        return None
    if hasattr(logprobs, "start_indices"):  # vllm.logprobs.FlatLogprobs
        a, b = logprobs.start_indices[0], logprobs.end_indices[0]
        return dict(zip(logprobs.token_ids[a:b], logprobs.logprobs[a:b]))
    return {tok: lp.logprob for tok, lp in logprobs[0].items()}


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


def _set_engine_environment(settings: Settings) -> None:
    """Environment that vLLM reads when an engine is created (``vllm.envs`` is evaluated lazily)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if settings.engine.in_process else "1"
    # vLLM lowers torch to one thread per worker unless OMP_NUM_THREADS is set (10x slower on CPU)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))


class BlendEngine:
    """Embedded vLLM with chunk-KV reuse and CacheBlend.

    Attributes:
        prompts: the :class:`~ragcache.prompt.PromptBuilder` of this model and ``[prompt]`` settings
            (prompts longer than ``engine.max_model_len`` are refused there).
        tokenizer: the model's Hugging Face tokenizer.
        device: the device the model runs on (``str(torch.device)``), as vLLM loaded it.
        dtype: the compute dtype and why (:class:`~ragcache.engine.dtype.DtypeChoice`).
        startup_s: seconds from creating vLLM to ready (warm-up included).
        blend_support: whether reuse/blend (and KV precompute) are available for this model, from
            the start-up self-check (:mod:`ragcache.engine.selfcheck`); full and prefix always are.

    Args:
        settings: ragcache settings (engine, blend, store, prompt sections are used).
        llm: an already provisioned model; resolved from ``settings.models`` when None.

    Raises:
        ModelNotFoundError: the configured model cannot be found (see ragcache.models).
        ConfigError: engine settings vLLM would refuse for this model (checked before vLLM starts,
            see :mod:`ragcache.engine.limits`).
    """

    blend_support: BlendSupport | None = None  # None until the self-check has run

    def __init__(self, settings: Settings, llm: LLMInfo | None = None):
        self.settings = settings
        self._lock = threading.RLock()
        self.llm_info = llm or resolve_llm(settings.models.model, settings.models.cache_dir)
        eng = settings.engine
        self.dtype = resolve_dtype(eng.dtype)
        check_engine_limits(eng, self.llm_info.path, self.dtype.dtype)

        from vllm import LLM
        from vllm.config import KVTransferConfig

        t0 = time.perf_counter()
        _claim_in_process_slot(self, settings)
        _set_engine_environment(settings)
        kv_config = KVTransferConfig(
            kv_connector="RagcacheConnector",
            kv_connector_module_path="ragcache.engine.connector",
            kv_role="kv_both",
        )
        self.llm = LLM(
            model=str(self.llm_info.path),
            dtype=self.dtype.dtype,
            max_model_len=eng.max_model_len,
            kv_cache_memory_bytes=eng.kv_cache_memory_bytes,
            enforce_eager=eng.enforce_eager,
            enable_prefix_caching=True,
            disable_log_stats=False,
            max_logprobs=-1,  # full first-token distributions for quality checks (KL)
            kv_transfer_config=kv_config,
            worker_extension_cls="ragcache.engine.worker.RagcacheWorkerExtension",
            use_tqdm_on_load=os.environ.get("RAGCACHE_QUIET_LOADING") != "1",  # the CLI shows its own lines
            seed=0,
        )
        self.device = self.llm.collective_rpc(
            Rpc.INIT, args=(settings.store.model_dump(mode="json"), self.llm_info.fingerprint, KV_LAYOUT_VERSION),
        )[0]
        self.tokenizer = self.llm.get_tokenizer()
        self.prompts = PromptBuilder(self.tokenizer, settings.prompt, self.llm_info.fingerprint,
                                     max_len=eng.max_model_len, store_namespace=settings.store.namespace)
        self.blend_support = run_self_check(self)  # its two requests warm vLLM and the layer-wise forward up
        if self.blend_support.check is None:
            # one tiny request: the first one pays for lazy kernel and allocator set-up
            self.generate(self.prompts.build("warm up", []), "blend" if self.blend_support.available else "full",
                          max_tokens=1)
        self.startup_s = time.perf_counter() - t0
        log.info("engine ready on %s in %.1f s; dtype %s (%s)", self.device, self.startup_s, self.dtype.dtype,
                 self.dtype.reason)

    # ---- KV precompute ---------------------------------------------------------------------

    def precompute(self, chunks: Sequence[Chunk], *, show_progress: bool = False,
                   batch_size: int = 8, namespace: str = "") -> dict[str, Any]:
        """Compute and store the KV of the head and of each chunk's unit not stored yet.

        Every unit is computed where the placement rule puts it (:func:`ragcache.prompt.lead_in_for`)
        and keyed in the index namespace ``namespace`` (see :meth:`PromptBuilder.key`).
        Blocks the engine while it runs: call it at ingest time, not beside live requests.
        Chunks go to the worker ``batch_size`` at a time (a tqdm bar on stderr when
        ``show_progress``). Returns ``{"computed", "skipped", "tokens", "seconds", "stored"}``
        (seconds of worker compute, tokens of the computed units, ``stored``: per tier, how many
        of the computed entries it took; the head is not counted).

        Raises:
            BlendUnavailableError: this model has no working DecoderOps adapter (see ``blend_support``).
        """
        from tqdm import tqdm

        self.blend_support.require("precompute")
        head_ids = self.prompts.head_ids
        head = self.prompts.head_segment(namespace)
        items = []
        for c in chunks:
            seg = self.prompts.canonical_segment(c, namespace)
            items.append([seg.key, seg.start, self.prompts.unit_ids(c)])
        total: dict[str, Any] = {"computed": 0, "skipped": 0, "tokens": 0, "seconds": 0.0, "stored": {}}
        bar = tqdm(total=len(chunks), unit="chunk", desc="KV precompute", disable=not show_progress)
        with self._lock, bar:
            self.llm.collective_rpc(Rpc.PRECOMPUTE, args=(head_ids, [[head.key, head.start, head_ids]]))
            for i in range(0, len(items), batch_size):
                batch = items[i:i + batch_size]
                out = self.llm.collective_rpc(Rpc.PRECOMPUTE, args=(head_ids, batch))[0]
                for k in ("computed", "skipped", "tokens", "seconds"):
                    total[k] += out[k]
                for tier, n in out["stored"].items():
                    total["stored"][tier] = total["stored"].get(tier, 0) + n
                bar.update(len(batch))
                bar.set_postfix_str(f"{total['tokens'] / max(total['seconds'], 1e-9):,.0f} tok/s")
        return total

    # ---- requests --------------------------------------------------------------------------

    def _request(self, prompt: AssembledPrompt, mode: str, *, max_tokens: int | None = None,
                 recompute_ratio: float | None = None, selection: str | None = None,
                 logprobs: int | None = None, delta: bool = False) -> _Request:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        if self.blend_support is not None:
            self.blend_support.require(mode, prompt.ctx_len)
        rid = uuid.uuid4().hex
        extra = None
        ratio = None
        if mode in CONNECTOR_MODES:
            params = BlendParams.from_settings(
                self.settings.blend, mode=mode, ctx_len=prompt.ctx_len, lead_in_len=prompt.lead_in_len,
                segments=tuple(SegmentRef(s.key, s.start, s.length) for s in prompt.segments),
                recompute_ratio=recompute_ratio, selection=selection,
            )
            ratio = params.recompute_ratio if mode == "blend" else None
            extra = {"kv_transfer_params": {TRANSFER_KEY: params.to_dict()}}
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens or self.settings.engine.max_tokens,
            logprobs=logprobs,
            extra_args=extra,
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
        )
        if logprobs is not None:
            # vLLM decodes the token of every logprob entry (~49k tokenizer.decode calls for the whole
            # vocabulary) at every step, seconds per token on CPU: return ids, decode the answer here
            sp.detokenize = False
            sp.flat_logprobs = True
        inputs: dict[str, Any] = {"prompt_token_ids": list(prompt.token_ids)}
        if mode != "prefix":
            inputs["cache_salt"] = rid  # never share (or reuse) exact-prefix blocks with others
        return _Request(rid, prompt, mode, ratio, inputs, sp)

    def _generation(self, req: _Request, out: Any, total_s: float) -> Generation:
        comp = out.outputs[0]
        token_ids = list(comp.token_ids)
        text = comp.text if req.sampling.detokenize else self.tokenizer.decode(token_ids, skip_special_tokens=True)
        first = _first_position(comp.logprobs) if req.sampling.logprobs is not None else None
        metrics = RequestMetrics.from_output(mode=req.mode, prompt_tokens=len(req.prompt.token_ids), output=out,
                                             total_s=total_s, recompute_ratio=req.recompute_ratio)
        return Generation(text, token_ids, metrics, first)

    def generate_many(self, prompts: Sequence[AssembledPrompt], mode: str | None = None, *,
                      max_tokens: int | None = None, recompute_ratio: float | None = None,
                      selection: str | None = None, logprobs: int | None = None) -> list[Generation]:
        """Run several prompts as one batch (concurrent in vLLM); greedy decoding.

        Args:
            mode: full, prefix, reuse or blend (default ``engine.mode``).
            max_tokens: tokens to decode (default ``engine.max_tokens``).
            recompute_ratio: blend's ratio for these requests (default ``blend.recompute_ratio``).
            selection: blend's token selection for these requests (default ``blend.selection``).
            logprobs: when set, the first generated token's top-``logprobs`` log-probabilities are
                returned (-1 = the whole vocabulary), for quality measurements.

        Raises:
            ValueError: unknown mode, or a ratio outside [0, 1].
            BlendUnavailableError: reuse/blend on a model whose adapter is missing or failed the
                start-up self-check; ContextBeyondWindowError: a context beyond its sliding window.
        """
        mode = mode or self.settings.engine.mode
        reqs = [self._request(p, mode, max_tokens=max_tokens, recompute_ratio=recompute_ratio, selection=selection,
                              logprobs=logprobs) for p in prompts]
        t0 = time.perf_counter()
        with self._lock:
            outs = self.llm.generate([r.inputs for r in reqs], [r.sampling for r in reqs], use_tqdm=False)
        total = time.perf_counter() - t0
        return [self._generation(r, out, total) for r, out in zip(reqs, outs)]

    def generate(self, prompt: AssembledPrompt, mode: str | None = None, **kwargs: Any) -> Generation:
        """One prompt; see :meth:`generate_many`."""
        return self.generate_many([prompt], mode, **kwargs)[0]

    def continuation_logprobs(self, prompt: AssembledPrompt, continuation: Sequence[int], mode: str, *,
                              recompute_ratio: float | None = None, selection: str | None = None) -> list[float]:
        """Teacher-forced log-probabilities (nats) of ``continuation`` token ids right after ``prompt``.

        One request over ``prompt + continuation`` in ``mode`` with vLLM prompt logprobs: the context
        is served exactly as in a normal request of that mode (the connector loads/blends
        ``[0, ctx_len)``; the tail and the continuation are prefilled over it). Two vLLM settings make
        this work beside the connector: ``skip_reading_prefix_cache=False`` (with prompt logprobs vLLM
        otherwise skips every cache hit, the connector's claimed tokens included) and
        ``detokenize=False`` (rows of claimed tokens hold uninitialised ids that must not be decoded).

        Raises:
            ValueError: empty continuation, unknown mode.
            RuntimeError: the continuation's first token was served from cache (not scored).
        """
        if not continuation:
            raise ValueError("empty continuation: nothing to score")
        extended = AssembledPrompt(list(prompt.token_ids) + list(continuation), prompt.segments, prompt.ctx_len,
                                   prompt.lead_in_len)
        req = self._request(extended, mode, max_tokens=1, recompute_ratio=recompute_ratio, selection=selection)
        req.sampling.prompt_logprobs = 0
        req.sampling.skip_reading_prefix_cache = False
        req.sampling.detokenize = False
        with self._lock:
            out = self.llm.generate([req.inputs], [req.sampling], use_tqdm=False)[0]
        n_prompt = len(prompt.token_ids)
        if int(out.num_cached_tokens or 0) > n_prompt - 1:
            raise RuntimeError(f"{out.num_cached_tokens} cached tokens cover the continuation's first position "
                               f"({n_prompt}); its log-probability was not computed")
        rows = out.prompt_logprobs[n_prompt:]
        return [float(row[tok].logprob) for row, tok in zip(rows, continuation)]

    def stream(self, prompt: AssembledPrompt, mode: str | None = None, *, max_tokens: int | None = None,
               recompute_ratio: float | None = None, selection: str | None = None) -> Iterator[str | Generation]:
        """Yield text pieces as they are decoded, then the final :class:`Generation`.

        A reader that stops early aborts the request in vLLM (its KV slots are freed).
        """
        mode = mode or self.settings.engine.mode
        req = self._request(prompt, mode, max_tokens=max_tokens, recompute_ratio=recompute_ratio, selection=selection,
                            delta=True)
        engine = self.llm.llm_engine
        t0 = time.perf_counter()
        text, token_ids, last = [], [], None
        with self._lock:
            req_id = engine.add_request(req.rid, req.inputs, req.sampling)  # internal id = rid + random suffix
            finished = False
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.request_id not in (req.rid, req_id):
                            continue
                        piece = out.outputs[0].text
                        token_ids.extend(out.outputs[0].token_ids)
                        last = out
                        if piece:
                            text.append(piece)
                            yield piece
                finished = True
            finally:
                if not finished:  # the reader stopped early: free the request's slots in vLLM
                    engine.abort_request([req_id], internal=True)
        metrics = RequestMetrics.from_output(mode=mode, prompt_tokens=len(prompt.token_ids), output=last,
                                             total_s=time.perf_counter() - t0, recompute_ratio=req.recompute_ratio)
        metrics.output_tokens = len(token_ids)
        yield Generation("".join(text), token_ids, metrics)

    # ---- store -----------------------------------------------------------------------------

    def store_stats(self) -> dict[str, Any]:
        """Per-tier stats of the worker's KV store (see ragcache.kvstore.TieredStore.stats)."""
        with self._lock:
            return self.llm.collective_rpc(Rpc.STORE_STATS)[0]

    def stored_tiers(self, chunks: Sequence[Chunk], namespace: str = "") -> list[str | None]:
        """For each chunk, the highest tier holding its KV (in index namespace ``namespace``), or None."""
        keys = [self.prompts.key(c, namespace) for c in chunks]
        with self._lock:
            return self.llm.collective_rpc(Rpc.STORE_CONTAINS, args=(keys,))[0]

    def forget(self, chunks: Sequence[Chunk], namespace: str = "") -> int:
        """Delete the stored KV of ``chunks`` (in index namespace ``namespace``) from every tier;
        returns how many entries were removed."""
        keys = [self.prompts.key(c, namespace) for c in chunks]
        with self._lock:
            return self.llm.collective_rpc(Rpc.STORE_DELETE, args=(keys,))[0]

    def close(self) -> None:
        """Shut the engine core (and its worker processes) down; the engine is unusable afterwards.
        The store's lookup counts are written to its counter file first (workers are killed)."""
        with self._lock:
            try:
                self.llm.collective_rpc(Rpc.STORE_FLUSH)
            except Exception:  # closing must not fail the caller
                log.debug("flushing the store's counters failed", exc_info=True)
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()
        _release_in_process_slot(self)

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache (for fair side-by-side measurements)."""
        with self._lock:
            self.llm.reset_prefix_cache()
