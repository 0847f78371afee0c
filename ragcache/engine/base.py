"""What the sync and the async engine share: vLLM engine arguments, request building, results.

Owns: :class:`Generation` (one answer: text, token ids, metrics), :class:`PreparedRequest`,
:class:`StreamState` (a streamed request's pieces turned into a Generation), :class:`PrecomputeRun`
(one KV precompute's worker calls, progress and report) and :class:`EngineBase`,
the part of
:class:`~ragcache.engine.engine.BlendEngine` (over ``vllm.LLM``) and
:class:`~ragcache.engine.async_engine.AsyncBlendEngine` (over ``vllm.v1.engine.async_llm.AsyncLLM``)
that does not depend on how vLLM is driven: one set of engine arguments (the same connector and
worker extension), one way a prompt and its :class:`~ragcache.options.QueryOptions` become a vLLM
request in each mode, one way vLLM's output becomes a :class:`Generation` (or a scoring result, or a
precompute report, or the keys a store call names). The two engines differ only in
how they call vLLM and the worker (blocking, under a lock, or awaited: their ``_rpc``), so their
methods have the same names, arguments and results. vLLM is imported inside the methods
only, so importing this module costs nothing.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ragcache.chunks import KV_LAYOUT_VERSION
from ragcache.config import Settings
from ragcache.engine.dtype import DtypeChoice, resolve_dtype
from ragcache.engine.limits import check_engine_limits
from ragcache.engine.route import Route, Router, RouteInputs, host_class
from ragcache.engine.messages import (
    CONNECTOR_MODES, TRANSFER_KEY, BlendParams, PrecomputeItem, PrecomputeReport, RequestMetrics, SegmentRef,
    WorkerReady,
)
from ragcache.engine.selfcheck import BlendSupport, BlendUnavailableError, ContextBeyondWindowError
from ragcache.models import LLMInfo, resolve_llm
from ragcache.options import QueryOptions
from ragcache.prompt import AssembledPrompt, PromptBuilder
from ragcache.quality.table import IndexQuality
from ragcache.util import lifeline, logs
from ragcache.util.progress import progress

if TYPE_CHECKING:
    from ragcache.chunks import Chunk

log = logging.getLogger(__name__)

#: the start-up measurements' requests (:meth:`EngineBase._start_up_measurements`): full prefill, one token
MEASURE_OPTIONS = QueryOptions(mode="full", max_tokens=1)


def accelerator_blend_warning(device: str, attention: str) -> str | None:
    """The start-up warning for a blend that runs ragcache's torch path on an accelerator, or None.

    Where vLLM's FlashAttention backend is not in use (another backend, or ``blend.attention =
    "torch"``) the blend's layer-wise forward calls torch SDPA, one request at a time: on an NVIDIA H200
    that path was 3-8x slower than a full prefill, except for Llama-3-8B-size layers on 6k tokens
    (0.87-1.24x its speed; docs/benchmarks.md, "GPU"), so a user there is told to measure before
    relying on it.

    Args:
        device: the engine's device (``str(torch.device)``), e.g. ``"cuda:0"``.
        attention: the blend's attention path, ``"kernel"`` or ``"torch"``.
    """
    if device.split(":")[0] == "cpu" or attention != "torch":
        return None
    return (f"blend on {device} runs ragcache's own layer-wise forward with torch SDPA (not vLLM's FlashAttention "
            "backend); on an NVIDIA H200 that was 3-8x slower than a full prefill, except for 8B-size "
            "layers on 6k-token prompts (about even; docs/benchmarks.md, \"GPU\"): compare "
            "`ragcache bench ttft --modes full,blend` on your model and set engine.mode = \"full\" where blend is not "
            "sooner")


@dataclass
class Generation:
    """An answer: text, token ids and metrics.

    Attributes:
        first_token_logprobs: ``{token_id: logprob}`` (nats) of the first generated position when
            requested with ``logprobs`` (the whole vocabulary with ``logprobs=-1``), else None.
        finish_reason: vLLM's reason the request stopped: ``"stop"`` (end of sequence or a stop
            string), ``"length"`` (``max_tokens`` reached), ``"abort"``; None when unknown.
    """

    text: str
    token_ids: list[int]
    metrics: RequestMetrics
    first_token_logprobs: dict[int, float] | None = None
    finish_reason: str | None = None


@dataclass
class PreparedRequest:
    """One prepared vLLM request (ids, inputs, sampling params) and what its metrics need.

    Attributes:
        rid: the request id (also its ``cache_salt`` outside ``prefix`` mode).
        mode: the mode that runs (``auto`` resolved to ``blend`` or ``full``).
        recompute_ratio: the blend's ratio for this request; None outside blend mode.
        inputs: vLLM's prompt dict (``prompt_token_ids`` and ``cache_salt``).
        sampling: the ``vllm.SamplingParams``.
        route: why ``mode`` runs (:class:`~ragcache.engine.route.Route`).
    """

    rid: str
    prompt: AssembledPrompt
    mode: str
    recompute_ratio: float | None
    inputs: dict[str, Any]
    sampling: Any
    route: Route | None = None

    def finish(self, metrics: RequestMetrics) -> RequestMetrics:
        """``metrics`` with this request's route."""
        if self.route is None:
            return metrics
        return metrics.replace(route=self.route.mode, route_rule=self.route.rule, route_reason=self.route.reason,
                               route_s=self.route.decide_s)


def first_position(logprobs: Any) -> dict[int, float] | None:
    """``{token_id: logprob}`` of the first generated position, from vLLM flat or per-position logprobs."""
    if not logprobs:
        return None
    if hasattr(logprobs, "start_indices"):  # vllm.logprobs.FlatLogprobs
        a, b = logprobs.start_indices[0], logprobs.end_indices[0]
        return dict(zip(logprobs.token_ids[a:b], logprobs.logprobs[a:b]))
    return {tok: lp.logprob for tok, lp in logprobs[0].items()}


def set_engine_environment(*, in_process: bool) -> None:
    """Environment that vLLM reads when an engine is created (``vllm.envs`` is evaluated lazily),
    and the lifeline that makes the engine's processes die with this one (:mod:`ragcache.util.lifeline`)."""
    lifeline.arm()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    # vLLM lowers torch to one thread per worker unless OMP_NUM_THREADS is set (10x slower on CPU)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))


class StreamState:
    """The DELTA outputs of one streamed request, collected into a :class:`Generation`.

    vLLM's last DELTA output carries the connector's stats (``kv_transfer_params``), the metrics
    and the finish reason, but only the last piece's token ids: the output token count is summed here.
    """

    def __init__(self, req: PreparedRequest):
        self.req = req
        self.t0 = time.perf_counter()
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.last: Any = None

    def add(self, out: Any) -> str:
        """Take one DELTA ``RequestOutput``; returns its new text ("" when it decoded no text)."""
        comp = out.outputs[0]
        self.token_ids.extend(comp.token_ids)
        self.last = out
        if comp.text:
            self.text.append(comp.text)
        return comp.text

    def generation(self) -> Generation:
        """The finished request: all text, all token ids, metrics (``total_s`` since the state was made)."""
        req = self.req
        metrics = req.finish(RequestMetrics.from_output(
            mode=req.mode, prompt_tokens=len(req.prompt.token_ids), output=self.last,
            total_s=time.perf_counter() - self.t0, recompute_ratio=req.recompute_ratio, token_ids=self.token_ids))
        reason = self.last.outputs[0].finish_reason if self.last is not None else None
        return Generation("".join(self.text), self.token_ids, metrics, finish_reason=reason)


class EngineBase:
    """Engine arguments, the KV connector's per-request parameters and results, for both engines.

    Attributes (set by the subclass's start-up):
        settings: ragcache settings. llm_info: the provisioned model. dtype: the compute dtype and
        why. tokenizer: the model's tokenizer. prompts: the :class:`~ragcache.prompt.PromptBuilder`
        of this model and ``[prompt]`` settings. device: where vLLM loaded the model.
        startup_s: seconds from creating vLLM to ready (warm-up included). blend_support: the
        start-up self-check's verdict on reuse/blend (None until it has run). worker: what the
        worker reported at start (device, the blend's attention path and why).
    """

    settings: Settings
    llm_info: LLMInfo
    dtype: DtypeChoice
    tokenizer: Any
    prompts: PromptBuilder
    device: str
    worker: WorkerReady | None = None
    startup_s: float = 0.0
    blend_support: BlendSupport | None = None
    _router: Router | None = None

    @property
    def router(self) -> Router:
        """The router of ``engine.mode = "auto"`` (:class:`~ragcache.engine.route.Router`), made at
        first use once the device is known: its cost model is this host's."""
        if self._router is None:
            self._router = Router(self.settings.route, host_class(self.device, self.dtype.cpu_flags))
        return self._router

    def _configure(self, settings: Settings, llm: LLMInfo | None, *, in_process: bool) -> None:
        """Settings, model and dtype; the environment vLLM reads at creation (and the quiet default for
        third-party output, :func:`ragcache.util.logs.quiet_unless_configured`).

        Raises:
            ModelNotFoundError: the model cannot be found. ConfigError: engine settings vLLM would
                refuse for this model (:func:`~ragcache.engine.limits.check_engine_limits`), or a
                ``blend.check_layer`` past its layers (:meth:`~ragcache.config.BlendSettings.check_model_layers`,
                whose warnings are logged).
        """
        logs.quiet_unless_configured(settings.engine.verbose)  # before vLLM is imported and its processes start
        self.settings = settings
        self.llm_info = llm or resolve_llm(settings.models.model, settings.models.cache_dir)
        self.dtype = resolve_dtype(settings.engine.dtype)
        shape = check_engine_limits(settings.engine, self.llm_info.path, self.dtype.dtype)
        for warning in settings.blend.check_model_layers(shape.num_layers):
            log.warning("%s", warning)
        set_engine_environment(in_process=in_process)

    def _engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` and ``AsyncEngineArgs``: the model, the paged cache, the
        KV connector (by module path) and the worker extension."""
        from vllm.config import KVTransferConfig

        eng = self.settings.engine
        return dict(
            model=str(self.llm_info.path),
            dtype=self.dtype.dtype,
            max_model_len=eng.max_model_len,
            kv_cache_memory_bytes=eng.kv_cache_memory_bytes,
            enforce_eager=eng.enforce_eager,
            enable_prefix_caching=True,
            disable_log_stats=False,  # else RequestOutput.metrics (TTFT) is None
            max_logprobs=-1,  # full first-token distributions for quality checks (KL)
            kv_transfer_config=KVTransferConfig(
                kv_connector="RagcacheConnector",
                kv_connector_module_path="ragcache.engine.connector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",  # a context the connector fails to serve is prefilled
                kv_connector_extra_config={"step_tokens": eng.connector_step_tokens},
            ),
            worker_extension_cls="ragcache.engine.worker.RagcacheWorkerExtension",
            use_tqdm_on_load=logs.is_verbose(),  # vLLM's "Loading weights" bar only when verbose
            seed=0,
        )

    def _init_args(self) -> tuple[Any, ...]:
        """Arguments of the worker's ``Rpc.INIT``: store settings, model fingerprint, KV layout version,
        the ``blend.attention`` setting."""
        return (self.settings.store.model_dump(mode="json"), self.llm_info.fingerprint, KV_LAYOUT_VERSION,
                self.settings.blend.attention)

    def _worker_ready(self, reply: Any) -> None:
        """Take the worker's reply to ``Rpc.INIT`` (:class:`~ragcache.engine.messages.WorkerReady`);
        warn when the blend will run its torch path on an accelerator (:func:`accelerator_blend_warning`)."""
        self.worker = WorkerReady.from_dict(reply)
        self.device = self.worker.device
        warning = accelerator_blend_warning(self.device, self.worker.attention)
        if warning:
            log.warning("%s", warning)

    def ready_line(self) -> str:
        """One line for logs and the CLI: device, start-up seconds, dtype and blend attention, with reasons."""
        worker = getattr(self, "worker", None)
        attention = f"; blend attention {worker.attention} ({worker.attention_reason})" if worker else ""
        return (f"engine ready on {self.device} in {self.startup_s:.1f} s; dtype {self.dtype.dtype} "
                f"({self.dtype.reason}){attention}")

    def _set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer, self.settings.prompt, self.llm_info.fingerprint,
                                     max_len=self.settings.engine.max_model_len,
                                     store_namespace=self.settings.store.namespace,
                                     compute_dtype=self.dtype.dtype,
                                     kv_compression=self.settings.store.kv_compression)

    def _warm_up_prompt(self) -> AssembledPrompt:
        """The tiny prompt of the start-up request (the first request pays for lazy kernel and
        allocator set-up, seconds on CPU)."""
        return self.prompts.build("warm up", [])

    def _warm_up_options(self) -> QueryOptions:
        """One decoded token, in blend when the self-check left it available, else full."""
        mode = "blend" if self.blend_support is None or self.blend_support.available else "full"
        return QueryOptions(mode=mode, max_tokens=1)

    def _stream_state(self, prompt: AssembledPrompt, options: QueryOptions,
                      quality: IndexQuality | None) -> StreamState:
        """A streamed request of ``prompt`` (DELTA outputs; see :meth:`_request`) and the state its
        pieces are collected in (its clock starts now)."""
        return StreamState(self._request(prompt, options, delta=True, quality=quality))

    def _stream_done(self, state: StreamState) -> Generation:
        """The finished stream's :class:`Generation`, fed to the router's cost model (:meth:`_observe`)."""
        gen = state.generation()
        self._observe(state.req, gen.metrics)
        return gen

    def _request(self, prompt: AssembledPrompt, options: QueryOptions, *, logprobs: int | None = None,
                 delta: bool = False, question_end: int = 0, quality: IndexQuality | None = None) -> PreparedRequest:
        """The vLLM request of ``prompt`` answered as ``options`` say (mode default ``engine.mode``,
        ``max_tokens`` default ``engine.max_tokens``). The options were validated where the request
        entered; nothing is checked again here. ``question_end``: see
        :class:`~ragcache.engine.messages.BlendParams` (scoring requests hide their continuation from
        the selection). ``quality``: the index's blend quality, which ``auto`` routes by (None: the
        prior, :meth:`ragcache.quality.table.QualityTable.prior`).

        Raises:
            BlendUnavailableError / ContextBeyondWindowError: see :meth:`BlendSupport.require
                <ragcache.engine.selfcheck.BlendSupport.require>` (an explicit reuse or blend; ``auto``
                then routes to full prefill).
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        asked = options.mode or self.settings.engine.mode
        params = None
        if asked in (*CONNECTOR_MODES, "auto"):
            params = BlendParams.from_options(
                self.settings.blend, options, mode="reuse" if asked == "reuse" else "blend", ctx_len=prompt.ctx_len,
                lead_in_len=prompt.lead_in_len,
                segments=tuple(SegmentRef(s.key, s.start, s.length) for s in prompt.segments),
                question_end=question_end, kv_context=prompt.kv_context,
            )
        if asked == "auto":
            route = self.route(prompt, params, quality)
        else:
            if self.blend_support is not None:
                self.blend_support.require(asked, prompt.ctx_len)
            route = Route(asked, "explicit", f"{asked}: asked by the request" if options.mode
                          else f"{asked}: engine.mode = {asked!r}")
        mode = route.mode
        rid = uuid.uuid4().hex
        extra = None
        ratio = None
        if mode in CONNECTOR_MODES:
            ratio = params.blend.recompute_ratio if mode == "blend" else None
            extra = {"kv_transfer_params": {TRANSFER_KEY: params.to_dict()}}
        opts = options.sampling
        sp = SamplingParams(
            temperature=opts.temperature, top_p=opts.top_p, stop=list(opts.stop) or None, seed=opts.seed,
            ignore_eos=opts.ignore_eos, min_tokens=opts.min_tokens,
            max_tokens=options.max_tokens or self.settings.engine.max_tokens,
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
        return PreparedRequest(rid, prompt, mode, ratio, inputs, sp, route)

    def route(self, prompt: AssembledPrompt, params: BlendParams, quality: IndexQuality | None = None) -> Route:
        """Blend or full prefill for ``prompt`` under ``engine.mode = "auto"``
        (:meth:`ragcache.engine.route.Router.decide`): full prefill where blend is unavailable for it
        (the start-up self-check, a context beyond the model's window), else as the cost model and
        the index's quality (``quality``; None: the prior) say."""
        if self.blend_support is not None:
            try:
                self.blend_support.require("blend", prompt.ctx_len)
            except (BlendUnavailableError, ContextBeyondWindowError) as exc:
                return Route("full", "unavailable", f"full prefill: blend is unavailable ({exc})")
        chunks = prompt.segments[1:]
        lengths = [s.length for s in chunks]
        ctx = prompt.ctx_len
        router = self.router
        knobs = params.blend
        recompute = router.recompute_tokens(
            ctx, len(prompt.token_ids), ratio=knobs.recompute_ratio, adaptive=knobs.budget == "adaptive",
            min_tokens=knobs.min_recompute_tokens, max_ratio=knobs.max_recompute_ratio,
            max_tokens=knobs.max_recompute_tokens)
        inp = RouteInputs(prompt_tokens=len(prompt.token_ids), ctx_tokens=ctx, tail_tokens=prompt.tail_len,
                          chunks=len(chunks), passage_tokens=sum(lengths) / len(lengths) if lengths else 0.0,
                          recompute_tokens=recompute, tier_tokens=router.tier_tokens([s.key for s in chunks], lengths))
        quality = quality or IndexQuality()
        return router.decide(inp, quality.table, stale=quality.note)

    def _observe(self, req: PreparedRequest, metrics: RequestMetrics) -> None:
        """Feed a finished request to the router's cost model (after start-up)."""
        if self._measuring:
            self.router.observe(metrics, [s.key for s in req.prompt.segments[1:]])

    #: whether finished requests feed the cost model (off during start-up's one-off costs)
    _measuring: bool = False

    def _start_up_measurements(self) -> list[AssembledPrompt]:
        """The synthetic prompts timed at start (``route.measure_at_start``): one untimed, then two
        lengths, so the first routed requests know this host's prefill speed. Empty when off."""
        if not self.settings.route.measure_at_start:
            return []
        ids = self.tokenizer.encode(" The quick brown fox jumps over the lazy dog near the river bank.",
                                    add_special_tokens=False) or [1]
        longest = min(1024, self.settings.engine.max_model_len // 2)
        out = []
        for n in (longest, 256, longest):
            token_ids = (ids * (n // len(ids) + 1))[:n]
            out.append(AssembledPrompt(token_ids, [], 0, 0))
        return out

    def _measured(self, generations: Sequence["Generation"]) -> None:
        """Take the start-up measurements' results (the first is a warm-up) and start measuring."""
        for g in generations[1:]:
            self.router.add_full(g.metrics.prompt_tokens, g.metrics.prompt_tokens, g.metrics.ttft_s)
        self._measuring = True
        model = self.router.model
        if model is not None:
            log.info("route: %s; blend where predicted >= %gx sooner (route.min_speedup) and the index's quality "
                     "table (or, uncalibrated, chunks of >= %d tokens) passes", model.describe(),
                     self.settings.route.min_speedup, self.settings.route.min_passage_tokens)

    def _generation(self, req: PreparedRequest, out: Any, total_s: float) -> Generation:
        """A finished (FINAL_ONLY) ``RequestOutput`` as a :class:`Generation`."""
        comp = out.outputs[0]
        token_ids = list(comp.token_ids)
        text = comp.text if req.sampling.detokenize else self.tokenizer.decode(token_ids, skip_special_tokens=True)
        first = first_position(comp.logprobs) if req.sampling.logprobs is not None else None
        metrics = req.finish(RequestMetrics.from_output(mode=req.mode, prompt_tokens=len(req.prompt.token_ids),
                                                        output=out, total_s=total_s,
                                                        recompute_ratio=req.recompute_ratio))
        self._observe(req, metrics)
        return Generation(text, token_ids, metrics, first, comp.finish_reason)

    # ---- scoring (continuation_logprobs on both engines) -----------------------------------

    def _scoring_request(self, prompt: AssembledPrompt, continuation: Sequence[int],
                         options: QueryOptions) -> PreparedRequest:
        """One request over ``prompt + continuation`` with vLLM prompt logprobs, the context served as in
        a normal request of ``options.mode``. Two vLLM settings make this work beside the connector:
        ``skip_reading_prefix_cache=False`` (with prompt logprobs vLLM otherwise skips every cache
        hit, the connector's claimed tokens included) and ``detokenize=False`` (rows of claimed tokens
        hold uninitialised ids that must not be decoded). It never reads vLLM's prefix cache, prefix
        mode included (a cache salt of its own): the scores come from a fresh pass.

        Raises:
            ValueError: empty continuation.
        """
        if not continuation:
            raise ValueError("empty continuation: nothing to score")
        extended = AssembledPrompt(list(prompt.token_ids) + list(continuation), prompt.segments, prompt.ctx_len,
                                   prompt.lead_in_len, prompt.kv_context)
        # the blend's question-aware selection reads the question, never the continuation it scores
        req = self._request(extended, options.model_copy(update={"max_tokens": 1}),
                            question_end=len(prompt.token_ids))
        req.sampling.prompt_logprobs = 0
        req.sampling.skip_reading_prefix_cache = False
        req.sampling.detokenize = False
        # in prefix mode too, no exact-prefix block of another request: one over the same prompt and
        # continuation (a question asked twice) would cover the positions this request must score
        req.inputs["cache_salt"] = req.rid
        return req

    @staticmethod
    def _continuation_logprobs(out: Any, prompt: AssembledPrompt, continuation: Sequence[int]) -> list[float]:
        """The continuation's log-probabilities (nats) from the finished scoring request's output.

        Raises:
            RuntimeError: the continuation's first token was served from cache (not scored).
        """
        n_prompt = len(prompt.token_ids)
        if int(out.num_cached_tokens or 0) > n_prompt - 1:
            raise RuntimeError(f"{out.num_cached_tokens} cached tokens cover the continuation's first position "
                               f"({n_prompt}); its log-probability was not computed")
        rows = out.prompt_logprobs[n_prompt:]
        return [float(row[tok].logprob) for row, tok in zip(rows, continuation)]

    # ---- KV precompute (precompute on both engines) ----------------------------------------

    def _precompute_run(self, chunks: Sequence["Chunk"], namespace: str, batch_size: int,
                        show_progress: bool) -> PrecomputeRun:
        """The KV precompute of the head and of ``chunks`` (see :class:`PrecomputeRun`): every unit
        keyed in index namespace ``namespace`` and placed where the placement rule puts it
        (:func:`ragcache.prompt.lead_in_for`), the chunks sent ``batch_size`` at a time.

        Raises:
            BlendUnavailableError: this model has no working DecoderOps adapter.
        """
        if self.blend_support is not None:
            self.blend_support.require("precompute")
        head_ids = self.prompts.head_ids
        head = self.prompts.head_segment(namespace)
        items = []
        for c in chunks:
            seg = self.prompts.canonical_segment(c, namespace)
            items.append(PrecomputeItem(seg.key, seg.start, tuple(self.prompts.unit_ids(c))))
        return PrecomputeRun(head_ids, PrecomputeItem(head.key, head.start, tuple(head_ids)), items, batch_size,
                             show_progress, self.prompts.context_ids)

    # ---- the KV store (its RPCs on both engines) -------------------------------------------

    def _chunk_keys(self, chunks: Sequence["Chunk"], namespace: str, *, head: bool = False) -> list[str]:
        """The KV store keys of ``chunks`` in index namespace ``namespace``, and with ``head`` the
        prompt head's key in that namespace last."""
        keys = [self.prompts.key(c, namespace) for c in chunks]
        if head:
            keys.append(self.prompts.head_segment(namespace).key)
        return keys


class PrecomputeRun:
    """One KV precompute: the worker RPCs' arguments (``Rpc.PRECOMPUTE``: the head's own call, then
    one per batch of chunks), the progress display and the report the batches' replies add up to.
    Both engines make the same calls (blocking or awaited) inside ``with run:`` (which shows and
    closes the progress display).

    Attributes:
        head_args: the arguments of the head's call (its reply is not counted).
        batches: ``(arguments, number of chunks)`` of each batch's call, in order.
        report: what the batches computed so far (:class:`~ragcache.engine.messages.PrecomputeReport`;
            the head is not counted).
    """

    def __init__(self, head_ids: list[int], head: PrecomputeItem, items: Sequence[PrecomputeItem],
                 batch_size: int, show_progress: bool, context_ids: Sequence[int] = ()):
        context = list(context_ids)
        self.head_args = (head_ids, [head.to_list()], context)
        self.batches = [((head_ids, [i.to_list() for i in items[j:j + batch_size]], context), len(items[j:j + batch_size]))
                        for j in range(0, len(items), batch_size)]
        self.report = PrecomputeReport()
        self._total, self._show = len(items), show_progress
        self._bar: Any = None

    def __enter__(self) -> "PrecomputeRun":
        """Show the progress display (chunks; a bar on a terminal, a line every few seconds in a log;
        :func:`ragcache.util.progress.progress`)."""
        self._bar = progress(total=self._total, unit="chunk", desc="KV precompute", disable=not self._show)
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._bar.__exit__(*exc)

    def done(self, reply: Any, n: int) -> None:
        """Take one batch's reply (``PrecomputeReport.to_dict()``) for its ``n`` chunks."""
        self.report.add(PrecomputeReport.from_dict(reply))
        self._bar.update(n)
        if self.report.tokens:  # nothing computed yet (every chunk was stored): no rate to show
            self._bar.set_postfix_str(f"{self.report.tokens_per_s:,.0f} tok/s", refresh=False)
