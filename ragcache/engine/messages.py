"""What crosses the engine's driver/worker boundary: per-request blend parameters, per-request stats, RPC names.

Owns the typed messages of ragcache's vLLM adapter and their one conversion to and from plain
data. vLLM carries ``SamplingParams.extra_args["kv_transfer_params"]`` and ``collective_rpc``
arguments between processes as plain Python data (dicts, lists, str, numbers), so every message
here has exactly one ``to_dict`` and one ``from_dict``; nothing else builds or reads those dicts.

Flow of one reuse/blend request::

    driver (BlendEngine)  --BlendParams.to_dict()-->  kv_transfer_params["ragcache"]
    scheduler connector   --LoadRequest(params=BlendParams)-->  worker connector
    worker (WorkerRuntime.load_request)  --ContextStats-->  worker connector
    worker connector  --build_connector_worker_meta-->  scheduler connector
    scheduler connector.request_finished  --ContextStats.to_dict()-->  RequestOutput.kv_transfer_params
    driver  --RequestMetrics.from_output(...)-->  Generation.metrics / Answer.metrics

Imports only ragcache.config, ragcache.quality and pydantic (no vLLM, no torch), so the pipeline, the UI and the tests can use
these types without starting an engine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from pydantic import ValidationError

from ragcache.config import BlendSettings
from ragcache.quality import repetition_loop

#: key of ragcache's entry inside vLLM's ``kv_transfer_params`` (request in, stats out)
TRANSFER_KEY = "ragcache"

#: modes whose context KV the connector serves (``full`` and ``prefix`` never reach it)
CONNECTOR_MODES = ("reuse", "blend")


class Rpc:
    """Names of the worker-extension methods the driver calls with ``collective_rpc``.

    Each is a method of :class:`ragcache.engine.worker.RagcacheWorkerExtension` (a test checks it).
    """

    INIT = "ragcache_init"
    PRECOMPUTE = "ragcache_precompute"
    STORE_STATS = "ragcache_store_stats"
    STORE_CONTAINS = "ragcache_store_contains"
    STORE_HOLDERS = "ragcache_store_holders"
    STORE_DELETE = "ragcache_store_delete"
    STORE_FLUSH = "ragcache_store_flush"
    OPS_PROBE = "ragcache_ops_probe"

    ALL = (INIT, PRECOMPUTE, STORE_STATS, STORE_CONTAINS, STORE_HOLDERS, STORE_DELETE, STORE_FLUSH, OPS_PROBE)


#: the [blend] settings every reuse/blend request carries
_BLEND_KNOBS = {"recompute_ratio", "check_layer", "deviation", "selection", "chunk_head_tokens", "question_weight",
                "max_chunk_share", "granule", "probe_layers", "pipeline_overlap"}


def _pick(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``data`` that are fields of dataclass ``cls`` (unknown keys are ignored)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class SegmentRef:
    """One cached span of the prompt: the KV entry ``key`` covers tokens ``[start, start + length)``."""

    key: str
    start: int
    length: int


def parse_selection(spec: str) -> tuple[str, int | None]:
    """``"question"`` -> ``("question", None)``; ``"question/16"`` -> ``("question", 16)``: a selection
    strategy with an optional granule (tokens per recomputed run; the settings' ``blend.granule``
    when absent). Values are range-checked where they are used (:class:`~ragcache.config.BlendSettings`).

    Raises:
        ValueError: a granule that is not an integer.
    """
    strategy, sep, granule = spec.partition("/")
    if not sep:
        return spec, None
    try:
        return strategy, int(granule)
    except ValueError:
        raise ValueError(f"selection {spec!r}: the granule after '/' must be an integer (e.g. question/16)") from None


@dataclass(frozen=True, kw_only=True)
class BlendParams:
    """What one reuse/blend request asks of the KV connector.

    Attributes:
        mode: ``"reuse"`` (cached KV moved to its positions) or ``"blend"`` (CacheBlend).
        ctx_len: tokens ``[0, ctx_len)`` of the prompt are served from cached KV; the rest (the
            question tail) is prefilled by vLLM.
        lead_in_len: tokens of the prompt head; chunk KV is computed right after them.
        segments: the cached spans covering ``[0, ctx_len)`` in order; ``segments[0]`` is the head.
        question_end: the question tail that question-aware selection reads is
            ``[ctx_len, question_end)``; 0 = the rest of the prompt. Scoring requests set it so that
            the continuation they score (a gold answer) is not seen by the selection.
        recompute_ratio, check_layer, deviation, selection, chunk_head_tokens, question_weight,
            max_chunk_share, granule, probe_layers, pipeline_overlap: the ``[blend]`` settings in force for this request
            (see :class:`ragcache.config.BlendSettings`).
    """

    mode: str
    ctx_len: int
    lead_in_len: int
    segments: tuple[SegmentRef, ...]
    question_end: int = 0
    recompute_ratio: float
    check_layer: int
    deviation: str
    selection: str
    chunk_head_tokens: int
    question_weight: float
    max_chunk_share: float
    granule: int
    probe_layers: int
    pipeline_overlap: bool

    @classmethod
    def from_settings(cls, blend: BlendSettings, *, mode: str, ctx_len: int, lead_in_len: int,
                      segments: tuple[SegmentRef, ...], recompute_ratio: float | None = None,
                      selection: str | None = None, question_end: int = 0) -> "BlendParams":
        """Parameters for one request from the ``[blend]`` settings, with optional per-request
        ratio and selection (a strategy, or ``strategy/granule`` such as ``question/16``, see
        :func:`parse_selection`).

        Raises:
            ValueError: ``mode`` is not reuse/blend, ``recompute_ratio`` is outside [0, 1], or
                ``selection`` is not a known strategy with a granule in range.
        """
        if mode not in CONNECTOR_MODES:
            raise ValueError(f"the KV connector serves modes {CONNECTOR_MODES}, not {mode!r}")
        # validated like the settings themselves (same ranges, same messages)
        ratio = blend.static_ratio if recompute_ratio is None else recompute_ratio
        strategy, granule = parse_selection(selection) if selection is not None else (None, None)
        knobs = blend.model_copy(update={k: v for k, v in (("recompute_ratio", ratio), ("selection", strategy),
                                                           ("granule", granule)) if v is not None})
        try:
            knobs = BlendSettings.model_validate(knobs.model_dump())
            if knobs.recompute_ratio == "auto":
                raise ValueError("recompute ratio 'auto' must be resolved before a request (see ragcache.calibrate)")
        except ValidationError as exc:
            raise ValueError("; ".join(
                f"{'.'.join(map(str, e['loc']))} = {e.get('input')!r}: {e['msg']}" if e["loc"]
                else e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
        values = knobs.model_dump(include=_BLEND_KNOBS)
        values["check_layer"] = knobs.resolved_check_layer
        return cls(mode=mode, ctx_len=ctx_len, lead_in_len=lead_in_len, segments=tuple(segments),
                   question_end=question_end, **values)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``kv_transfer_params[TRANSFER_KEY]`` (segments as ``[key, start, length]``)."""
        d = asdict(self)
        d["segments"] = [[s.key, s.start, s.length] for s in self.segments]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BlendParams":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: a field is missing or has the wrong type.
        """
        try:
            return cls(
                mode=str(data["mode"]), ctx_len=int(data["ctx_len"]), lead_in_len=int(data["lead_in_len"]),
                segments=tuple(SegmentRef(str(k), int(s), int(n)) for k, s, n in data["segments"]),
                question_end=int(data.get("question_end", 0)),
                recompute_ratio=float(data["recompute_ratio"]), check_layer=int(data["check_layer"]),
                deviation=str(data["deviation"]), selection=str(data["selection"]),
                chunk_head_tokens=int(data["chunk_head_tokens"]), question_weight=float(data["question_weight"]),
                max_chunk_share=float(data["max_chunk_share"]), granule=int(data["granule"]),
                probe_layers=int(data["probe_layers"]),
                pipeline_overlap=bool(data["pipeline_overlap"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed ragcache transfer params ({type(exc).__name__}: {exc}): {dict(data)!r}") from None


@dataclass(frozen=True)
class WorkerReady:
    """What the worker says once its runtime is set up (worker -> driver, the reply to ``Rpc.INIT``).

    Attributes:
        device: where vLLM loaded the model (``str(torch.device)``).
        attention: the blend's attention path: ``"kernel"`` (vLLM's own attention kernel over the
            paged cache) or ``"torch"`` (torch SDPA); see :mod:`ragcache.engine.paged_attention`.
        attention_reason: why that path (one phrase, for the engine's start line).
    """

    device: str
    attention: str = "torch"
    attention_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``collective_rpc``'s return value."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "WorkerReady":
        """Inverse of :meth:`to_dict` (unknown keys are ignored)."""
        return cls(**_pick(cls, data))


@dataclass(frozen=True)
class OpsProbe:
    """What the worker says about the loaded model's DecoderOps adapter (worker -> driver, at start).

    Attributes:
        architecture: the loaded vLLM model class name (the adapter registry's key).
        hf_architectures: the checkpoint's ``config.architectures``.
        adapter: the adapter class name, or None when no adapter serves the model.
        error: why reuse/blend cannot run (no adapter, or the adapter raised on a short prompt),
            or None.
        sliding_window: the smallest attention window of the model's layers (tokens), or None.
        probe_s: seconds the worker spent exercising the adapter (:func:`ragcache.engine.ops.exercise`).
    """

    architecture: str
    hf_architectures: tuple[str, ...] = ()
    adapter: str | None = None
    error: str | None = None
    sliding_window: int | None = None
    probe_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``collective_rpc``'s return value."""
        d = asdict(self)
        d["hf_architectures"] = list(self.hf_architectures)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "OpsProbe":
        """Inverse of :meth:`to_dict` (unknown keys are ignored)."""
        d = _pick(cls, data)
        d["hf_architectures"] = tuple(d.get("hf_architectures") or ())
        return cls(**d)


@dataclass
class LoadRequest:
    """One request whose context KV the worker fills before a step's forward (scheduler -> worker).

    Attributes:
        req_id: vLLM's request id.
        params: the request's blend parameters.
        token_ids: the whole prompt: context ``[0, params.ctx_len)`` then the tail.
        block_ids: the request's paged-cache block ids (first KV cache group), in order.
    """

    req_id: str
    params: BlendParams
    token_ids: list[int]
    block_ids: list[int]


@dataclass(kw_only=True)
class ContextStats:
    """What the worker did to serve one request's context ``[0, ctx_len)``. Tokens and seconds.

    Attributes:
        ctx_tokens: context tokens served by the connector (0 in full/prefix mode).
        reused_tokens: context tokens whose cached KV was used as is (moved to its position).
        recomputed_tokens: context tokens whose KV was recomputed with the whole context in view
            (the blend's HKVD tokens, plus every token of the layers before the check layer).
        missing_computed_tokens: tokens of chunks whose KV was missing (never ingested, evicted,
            damaged) and was computed during the request at their canonical place.
        chunk_tiers: per retrieved chunk, in prompt order, the tier that served its KV
            ("device", "cpu", "disk", "remote", or "computed" when it was missing).
        head_tier: the tier that served the prompt head's KV (not a retrieved chunk).
        load_s: seconds the worker waited for chunk KV (store lookups plus the layer reads that
            were not hidden behind compute).
        compute_s: seconds of the blend (or reuse) computation itself, missing chunks included.
        write_s: seconds writing the final K/V into vLLM's paged KV cache.
        worker_s: wall seconds of the whole context load in the worker (load + compute + write).
        stages: finer seconds per stage of ``worker_s`` (see :class:`ragcache.blend.BlendResult`).
    """

    ctx_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    missing_computed_tokens: int = 0
    chunk_tiers: list[str] = field(default_factory=list)
    head_tier: str = ""
    load_s: float = 0.0
    compute_s: float = 0.0
    write_s: float = 0.0
    worker_s: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def tier_hits(self) -> dict[str, int]:
        """Retrieved chunks served per tier, e.g. ``{"cpu": 3, "disk": 2}`` (the head is not counted)."""
        return dict(Counter(self.chunk_tiers))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the worker's stats travel back in ``kv_transfer_params``); includes ``tier_hits``."""
        d = asdict(self)
        d["tier_hits"] = self.tier_hits
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ContextStats":
        """Inverse of :meth:`to_dict` (derived and unknown keys are ignored)."""
        return cls(**_pick(cls, data))


@dataclass(kw_only=True)
class RequestMetrics(ContextStats):
    """Everything measured for one request: the worker's :class:`ContextStats` plus the driver's numbers.

    The one definition of per-request metrics: returned by the engine (``Generation.metrics``), the
    pipeline (``Answer.metrics``, which also fills ``retrieval_s`` and ``total_s``), shown by the CLI
    and the UI, and recorded by the benchmarks (``to_dict``).

    Attributes:
        mode: full, prefix, reuse or blend.
        ttft_s: vLLM's time to first token (``RequestOutput.metrics.first_token_latency``): queueing,
            the connector's context load (``worker_s``) and the prefill of the tail. Seconds.
        total_s: wall seconds of the whole call (the pipeline's includes retrieval).
        retrieval_s: seconds of question embedding + search (set by the pipeline; 0 otherwise).
        prompt_tokens: tokens of the whole prompt.
        output_tokens: tokens decoded.
        num_cached_tokens: prompt tokens vLLM did not prefill (local prefix-cache hits plus the
            connector's context).
        recompute_ratio: the blend's recompute ratio for this request (None outside blend mode).
        ratio_source: where that ratio came from (set by the pipeline): ``"request"``, ``"settings"``,
            ``"calibration"`` (the index's calibrated ratio) or ``"fallback"``; empty otherwise.
        repetition_loop: the answer repeats an n-gram of >= 2 tokens >= 3 times in a row
            (:func:`ragcache.quality.repetition_loop`): a degenerate answer.
    """

    mode: str
    ttft_s: float = 0.0
    total_s: float = 0.0
    retrieval_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    num_cached_tokens: int = 0
    recompute_ratio: float | None = None
    ratio_source: str = ""
    repetition_loop: bool = False

    @classmethod
    def from_output(cls, *, mode: str, prompt_tokens: int, output: Any, total_s: float,
                    recompute_ratio: float | None = None) -> "RequestMetrics":
        """Metrics of one finished request from vLLM's ``RequestOutput`` (None: nothing came back).

        The worker's stats are read from ``output.kv_transfer_params[TRANSFER_KEY]`` (present for
        reuse/blend requests).
        """
        ttft, cached, ids, stats = 0.0, 0, [], {}
        if output is not None:
            m = getattr(output, "metrics", None)
            ttft = float(getattr(m, "first_token_latency", 0.0) or 0.0) if m is not None else 0.0
            cached = int(getattr(output, "num_cached_tokens", 0) or 0)
            outs = getattr(output, "outputs", None) or []
            ids = list(outs[0].token_ids) if outs else []
            stats = (getattr(output, "kv_transfer_params", None) or {}).get(TRANSFER_KEY) or {}
        return cls(mode=mode, ttft_s=ttft, total_s=total_s, prompt_tokens=prompt_tokens, output_tokens=len(ids),
                   num_cached_tokens=cached, recompute_ratio=recompute_ratio if mode == "blend" else None,
                   repetition_loop=repetition_loop(ids), **ContextStats.from_dict(stats).__dict__)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RequestMetrics":
        """Inverse of :meth:`to_dict` (derived and unknown keys are ignored)."""
        return cls(**_pick(cls, data))
