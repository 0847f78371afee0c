"""What crosses the engine's driver/worker boundary: per-request blend parameters, per-request stats,
the store's stats, KV precompute items and reports, RPC names.

Owns the typed messages of ragcache's vLLM adapter and their one conversion to and from plain
data. vLLM carries ``SamplingParams.extra_args["kv_transfer_params"]`` and ``collective_rpc``
arguments between processes as plain Python data (dicts, lists, str, numbers), so every message
here has exactly one ``to_dict`` (``to_list``) and one ``from_dict`` (``from_list``); nothing else
builds or reads those dicts: :class:`BlendParams`, :class:`ContextStats` and :class:`RequestMetrics`
(per request; RequestMetrics also travels over HTTP whole, see ragcache.server), :class:`WorkerReady`
and :class:`OpsProbe` (at start), :class:`PrecomputeItem` / :class:`PrecomputeReport` (ingest),
:class:`StoreStats` / :class:`TierStats` (the KV store's stats, also read by the server's metrics,
the CLI and the benchmarks).

Flow of one reuse/blend request (its options validated once upstream, :mod:`ragcache.options`)::

    driver (BlendEngine)  --BlendParams.from_options(...).to_dict()-->  kv_transfer_params["ragcache"]
    scheduler connector   --LoadRequest(params=BlendParams)-->  worker connector
    worker (WorkerRuntime.load_step)  --ContextStats-->  worker connector
    worker connector  --build_connector_worker_meta-->  scheduler connector
    scheduler connector.request_finished  --ContextStats.to_dict()-->  RequestOutput.kv_transfer_params
    driver  --RequestMetrics.from_output(...)-->  Generation.metrics / Answer.metrics

Imports only ragcache.config, ragcache.options, ragcache.quality, ragcache.kvstore.stats and pydantic
(no vLLM, no torch), so the pipeline, the server, the UI and the tests can use these types without
starting an engine.
"""

from __future__ import annotations

import dataclasses
import typing
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Sequence

from pydantic import BaseModel

from ragcache.config import BlendKnobs, BlendSettings
from ragcache.kvstore.stats import TierCounters
from ragcache.options import QueryOptions, blend_knobs
from ragcache.quality.measures import repetition_loop

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
    OP_COUNTS = "ragcache_op_counts"

    ALL = (INIT, PRECOMPUTE, STORE_STATS, STORE_CONTAINS, STORE_HOLDERS, STORE_DELETE, STORE_FLUSH, OPS_PROBE,
           OP_COUNTS)


def _pick(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``data`` that are fields of dataclass ``cls`` (unknown keys are ignored)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def _plain(value: Any) -> Any:
    """``value`` as plain data: a dataclass as a dict of its fields, a pydantic model as its
    ``model_dump()``, a tuple or list as a list, anything else as is."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _typed(hint: Any, value: Any) -> Any:
    """Plain data ``value`` as type ``hint``: a dataclass from the dict of its fields, a pydantic model
    validated (``model_validate``, every field present), ``tuple[X, ...]`` item by item, ``int``, ``float``, ``str`` and
    ``bool`` checked (an int is taken for a float).

    Raises:
        ValueError: a value of another type, a dict without a field it needs, a model's field out of
            its range.
    """
    if dataclasses.is_dataclass(hint):
        names = {f.name for f in fields(hint)}
        if not isinstance(value, Mapping) or not names >= set(value):
            raise ValueError(f"{hint.__name__} must be a dict of its fields, got {value!r}")
        hints = typing.get_type_hints(hint)
        missing = [f.name for f in fields(hint) if f.name not in value and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{hint.__name__} lacks {', '.join(missing)}")
        return hint(**{k: _typed(hints[k], v) for k, v in value.items()})
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        missing = sorted(set(hint.model_fields) - set(value)) if isinstance(value, Mapping) else []
        if missing:  # a record travels whole: no field falls back to a default on the way
            raise ValueError(f"{hint.__name__} lacks {', '.join(missing)}")
        return hint.model_validate(value)
    if typing.get_origin(hint) is tuple:
        (item, _) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected a list, got {value!r}")
        return tuple(_typed(item, v) for v in value)
    if hint in (int, float, str, bool):
        ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool)) or (
            hint is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"expected {hint.__name__}, got {value!r}")
        return hint(value)
    return value


@dataclass(frozen=True)
class SegmentRef:
    """One cached span of the prompt: the KV entry ``key`` covers tokens ``[start, start + length)``."""

    key: str
    start: int
    length: int


@dataclass(frozen=True, kw_only=True)
class BlendParams:
    """What one reuse/blend request asks of the KV connector.

    Attributes:
        mode: ``"reuse"`` (cached KV moved to its positions) or ``"blend"`` (CacheBlend).
        ctx_len: tokens ``[0, ctx_len)`` of the prompt are served from cached KV; the rest (the
            question tail) is prefilled by vLLM.
        lead_in_len: tokens of the prompt head; chunk KV is computed right after them and ``kv_context``.
        segments: the cached spans covering ``[0, ctx_len)`` in order; ``segments[0]`` is the head.
        question_end: the question tail that question-aware selection reads is
            ``[ctx_len, question_end)``; 0 = the rest of the prompt. Scoring requests set it so that
            the continuation they score (a gold answer) is not seen by the selection.
        blend: the request's blend parameters (:class:`ragcache.config.BlendKnobs`, built by
            :func:`ragcache.options.blend_knobs`), carried as they are; the worker hands them to
            the blend unchanged.
        kv_context: token ids of the KV context the prompt's chunk KV is computed after
            (:attr:`ragcache.prompt.PromptBuilder.context_ids`; :func:`ragcache.prompt.lead_in_for`):
            what the worker computes a missing chunk after, and whether any chunk is exact.
    """

    mode: str
    ctx_len: int
    lead_in_len: int
    segments: tuple[SegmentRef, ...]
    question_end: int = 0
    blend: BlendKnobs
    kv_context: tuple[int, ...] = ()

    @classmethod
    def from_options(cls, blend: BlendSettings, options: QueryOptions, *, mode: str, ctx_len: int, lead_in_len: int,
                     segments: tuple[SegmentRef, ...], question_end: int = 0,
                     kv_context: tuple[int, ...] = ()) -> "BlendParams":
        """Parameters for one request: the ``[blend]`` settings with the request's options applied
        (:func:`ragcache.options.blend_knobs`; nothing is range-checked again).

        Raises:
            ValueError: ``mode`` is not reuse or blend (the caller's mistake, not the user's), or the
                request's selection measures KV deviation while ``blend.check_layer`` is 0.
        """
        if mode not in CONNECTOR_MODES:
            raise ValueError(f"the KV connector serves modes {CONNECTOR_MODES}, not {mode!r}")
        return cls(mode=mode, ctx_len=ctx_len, lead_in_len=lead_in_len, segments=tuple(segments),
                   question_end=question_end, blend=blend_knobs(blend, options), kv_context=tuple(kv_context))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``kv_transfer_params[TRANSFER_KEY]``: each field as :func:`_plain` writes it
        (segments as dicts of their fields, ``blend`` as its ``model_dump()``)."""
        return _plain(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BlendParams":
        """Inverse of :meth:`to_dict`, field by field from the fields' types (:func:`_typed`).

        Raises:
            ValueError: a field is missing or has the wrong type, or ``blend`` is not valid (a
                setting missing or out of its range, an unregistered strategy).
        """
        try:
            return _typed(cls, data)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
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


@dataclass(frozen=True)
class PrecomputeItem:
    """One segment whose KV the worker computes and stores at ingest (driver -> worker, ``Rpc.PRECOMPUTE``).

    Attributes:
        key: the KV store key (``str(ChunkKey)``).
        start: the segment's canonical start position (0 for the head, the head's length for a chunk).
        unit_ids: the segment's token ids.
    """

    key: str
    start: int
    unit_ids: tuple[int, ...]

    def to_list(self) -> list[Any]:
        """Plain data for ``collective_rpc``: ``[key, start, unit_ids]``."""
        return [self.key, self.start, list(self.unit_ids)]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> "PrecomputeItem":
        """Inverse of :meth:`to_list`."""
        key, start, unit = data
        return cls(str(key), int(start), tuple(int(t) for t in unit))


@dataclass
class PrecomputeReport:
    """What one or more precompute calls did (worker -> driver; summed by the engine over its batches).

    Attributes:
        computed: segments computed and stored. skipped: segments some tier held already.
        tokens: tokens of the computed segments. seconds: worker compute seconds.
        stored: per tier of the store, how many of the computed entries it took when written (fewer
            than ``computed`` when it was full or down; later entries may evict them again).
        computed_keys: the keys computed, in order (ask the store what it still holds of them).
    """

    computed: int = 0
    skipped: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stored: dict[str, int] = field(default_factory=dict)
    computed_keys: list[str] = field(default_factory=list)

    def add(self, other: "PrecomputeReport") -> "PrecomputeReport":
        """Add ``other``'s counts to this report (in place); returns self."""
        self.computed += other.computed
        self.skipped += other.skipped
        self.tokens += other.tokens
        self.seconds += other.seconds
        for tier, n in other.stored.items():
            self.stored[tier] = self.stored.get(tier, 0) + n
        self.computed_keys.extend(other.computed_keys)
        return self

    @property
    def tokens_per_s(self) -> float:
        """Computed tokens per worker second (0.0 before any)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``collective_rpc``'s return value."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PrecomputeReport":
        """Inverse of :meth:`to_dict` (unknown keys are ignored)."""
        d = _pick(cls, data)
        d["stored"] = dict(d.get("stored") or {})
        d["computed_keys"] = list(d.get("computed_keys") or [])
        return cls(**d)


def _fields_of(counters: type) -> Any:
    """Class decorator, applied under ``@dataclass``: the fields of dataclass ``counters`` (their
    names, types and defaults) become the class's first fields, before its own."""

    def add(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        cls.__annotations__ = {**{f.name: f.type for f in fields(counters)}, **own}
        for f in fields(counters):
            setattr(cls, f.name, f.default)
        return cls

    return add


@dataclass(frozen=True)
@_fields_of(TierCounters)
class TierStats:
    """One tier's row of the KV store's stats (``TieredStore.stats()``, see :mod:`ragcache.kvstore.stats`).

    Its first fields are :class:`~ragcache.kvstore.stats.TierCounters`' (``hits``, ``unavailable``,
    ``corrupt``, ``foreign``, ``read_errors``, ``bytes_read``, ``bytes_written``, ``evictions``,
    ``write_errors``, ``not_stored``; ints, 0 by default), declared there once, then the row's own.
    Lookup counters are this process's since the store was created: ``lookups`` is the store's chunk
    lookups (the prompt head's are not counted), ``hits + misses == lookups`` and ``hit_rate`` =
    hits / lookups, so the tiers' rates add up to the overall hit rate. ``entries`` and
    ``occupancy_bytes`` describe what the tier holds now; ``capacity_bytes`` what it may hold now
    (None: unbounded), ``configured_capacity_bytes`` the setting's, ``free_bytes`` the medium's free
    space (None where unknown). Bytes are bytes.
    """

    lookups: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    entries: int = 0
    occupancy_bytes: int = 0
    capacity_bytes: int | None = None
    configured_capacity_bytes: int | None = None
    free_bytes: int | None = None
    up: bool = True

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TierStats":
        """One row of ``TieredStore.stats()`` (unknown keys are ignored)."""
        return cls(**_pick(cls, data))


@dataclass(frozen=True)
class StoreStats:
    """The KV store's stats per tier, top-down (worker -> driver, ``Rpc.STORE_STATS``; also what
    ``RAGPipeline.cache_stats()``, ``GET /v1/cache`` and ``ragcache cache stats`` show).

    Attributes:
        tiers: tier name -> :class:`TierStats`, top-down (``device``, ``cpu``, ``disk``, ``remote``).
    """

    tiers: dict[str, TierStats] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """The tiers, top-down."""
        return list(self.tiers)

    @property
    def lookups(self) -> int:
        """Chunk lookups (every tier's denominator)."""
        return max((t.lookups for t in self.tiers.values()), default=0)

    @property
    def hits(self) -> int:
        """Chunk lookups some tier served."""
        return sum(t.hits for t in self.tiers.values())

    @property
    def misses(self) -> int:
        """Chunk lookups no tier served (the chunk was computed during its request)."""
        return max(0, self.lookups - self.hits)

    @property
    def hit_rate(self) -> float:
        """Share of chunk lookups some tier served (0.0 before any)."""
        return self.hits / self.lookups if self.lookups else 0.0

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{tier: row}`` as plain data (the worker's reply, the body of ``GET /v1/cache``)."""
        return {name: asdict(t) for name, t in self.tiers.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, Any]]) -> "StoreStats":
        """Inverse of :meth:`to_dict`; also reads ``TieredStore.stats()`` directly."""
        return cls({name: TierStats.from_dict(row) for name, row in data.items()})


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


@dataclass(frozen=True, kw_only=True)
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
        recomputed_layers: blend: how many of the model's layers, from the first, the recomputed
            tokens went through (``blend.recompute_depth``; later layers kept their reused KV); 0
            when nothing was recomputed. model_layers: the model's layers (0 in full/prefix mode).
        load_error: why the worker could not serve the context (the exception, one line), or "": vLLM
            then prefilled the whole prompt itself, so the answer is full prefill's.
        recompute_budget: blend: the context tokens the budget chose for recompute (besides tokens
            with no cached KV), 0 otherwise. budget_reason: blend: what set that budget, one line
            (the adaptive budget: the question's attention left on reused KV; or the ratio).
        attention_pairs: blend: the query-key pairs its selective attention computed, summed over
            layers (each recomputed query with the keys at or before it; ``stages
            ["selective_attention_s"]`` over it is the attention's seconds per pair); 0 otherwise.
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
    recomputed_layers: int = 0
    model_layers: int = 0
    load_error: str = ""
    recompute_budget: int = 0
    budget_reason: str = ""
    attention_pairs: int = 0

    @property
    def partial_depth(self) -> str:
        """``"in 27 of 30 layers"`` when the recomputed tokens stopped before the last layer
        (``blend.recompute_depth`` < 1), else ""."""
        if 0 < self.recomputed_layers < self.model_layers:
            return f"in {self.recomputed_layers} of {self.model_layers} layers"
        return ""

    @property
    def budget_mode(self) -> str:
        """The recompute budget a blend used: ``"adaptive"`` or ``"fixed"`` (the word
        :attr:`budget_reason` starts with, as :class:`ragcache.blend.Budget` writes it), "" without one."""
        mode = self.budget_reason.split(":", 1)[0]
        return mode if mode in ("adaptive", "fixed") else ""

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


#: why a blend ran at its ratio, by :attr:`RequestMetrics.ratio_source`, in the words the CLI, the UI and the
#: demo show
RATIO_SOURCES = {"settings": "set in blend.recompute_ratio", "calibration": "calibrated for this index",
                 "fallback": "blend.fallback_ratio: the index has no calibrated ratio", "request": "asked per request"}


@dataclass(frozen=True, kw_only=True)
class RequestMetrics(ContextStats):
    """Everything measured for one request: the worker's :class:`ContextStats` plus the driver's numbers.

    The one definition of per-request metrics: returned by the engine (``Generation.metrics``), the
    pipeline (``Answer.metrics``: the engine's record with ``retrieval_s``, ``total_s`` and the
    ratio's source and note, :meth:`replace`), shown by the CLI and the UI, and recorded by the
    benchmarks (``to_dict``). Frozen: a layer that adds what it measured makes a new record.

    Attributes:
        mode: full, prefix, reuse or blend.
        ttft_s: vLLM's time to first token (``RequestOutput.metrics.first_token_latency``): queueing,
            the connector's context load (``worker_s``) and the prefill of the tail. Seconds.
        total_s: wall seconds of the whole call (the pipeline's includes retrieval).
        retrieval_s: seconds of question embedding + search (set by the pipeline; 0 otherwise).
        prompt_tokens: tokens of the whole prompt.
        output_tokens: tokens decoded.
        num_cached_tokens: prompt tokens vLLM did not prefill (local prefix-cache hits plus the
            connector's context; 0 after a ``load_error``).
        recompute_ratio: the blend's recompute ratio for this request (None outside blend mode).
        ratio_source: where that ratio came from (set by the pipeline): ``"request"``, ``"settings"``,
            ``"calibration"`` (the index's calibrated ratio) or ``"fallback"``; empty otherwise.
        ratio_note: one sentence when that ratio goes against the index's calibration (set by the
            pipeline, :meth:`ragcache.pipeline.RAGPipeline.ratio_note`): the calibration recommends
            full prefill or another ratio, or ``"auto"`` found no calibration; empty otherwise.
        repetition_loop: the answer repeats an n-gram of >= 2 tokens >= 3 times in a row
            (:func:`ragcache.quality.measures.repetition_loop`): a degenerate answer.
        route: the path that ran: ``"blend"`` or ``"full"`` under ``engine.mode = "auto"``, else the
            mode asked; "" where no engine said. route_rule: why, as a short code (``explicit``,
            ``faster``, ``slower``, ``quality``, ``no_context``, ``unavailable``; see
            :class:`ragcache.engine.route.Route`). route_reason: why, in one sentence, e.g. "full
            prefill: blend predicted 1.2x for a 1,300-token prompt on this host, below
            route.min_speedup 1.5". route_s: seconds the routing decision took (0 for an explicit mode).
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
    ratio_note: str = ""
    repetition_loop: bool = False
    route: str = ""
    route_rule: str = ""
    route_reason: str = ""
    route_s: float = 0.0

    @classmethod
    def from_output(cls, *, mode: str, prompt_tokens: int, output: Any, total_s: float,
                    recompute_ratio: float | None = None, token_ids: Sequence[int] | None = None) -> "RequestMetrics":
        """Metrics of one finished request from vLLM's ``RequestOutput`` (None: nothing came back).

        The worker's stats are read from ``output.kv_transfer_params[TRANSFER_KEY]`` (present for
        reuse/blend requests). ``token_ids``: the whole answer's token ids, where ``output`` holds
        only the last piece (a DELTA stream); by default the output's own.
        """
        ttft, cached, ids, stats = 0.0, 0, [], {}
        if output is not None:
            m = getattr(output, "metrics", None)
            ttft = float(getattr(m, "first_token_latency", 0.0) or 0.0) if m is not None else 0.0
            cached = int(getattr(output, "num_cached_tokens", 0) or 0)
            outs = getattr(output, "outputs", None) or []
            ids = list(outs[0].token_ids) if outs else []
            stats = (getattr(output, "kv_transfer_params", None) or {}).get(TRANSFER_KEY) or {}
            if stats.get("load_error"):  # vLLM counted the connector's claim, then prefilled it all
                cached = 0
        if token_ids is not None:
            ids = list(token_ids)
        return cls(mode=mode, ttft_s=ttft, total_s=total_s, prompt_tokens=prompt_tokens, output_tokens=len(ids),
                   num_cached_tokens=cached, recompute_ratio=recompute_ratio if mode == "blend" else None,
                   repetition_loop=repetition_loop(ids), **ContextStats.from_dict(stats).__dict__)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RequestMetrics":
        """Inverse of :meth:`to_dict` (derived and unknown keys are ignored)."""
        return cls(**_pick(cls, data))

    def replace(self, **changes: Any) -> "RequestMetrics":
        """This record with ``changes`` (field names) applied, as a new record (``dataclasses.replace``).

        Raises:
            TypeError: a name that is no field.
        """
        return dataclasses.replace(self, **changes)

    @property
    def ratio_text(self) -> str:
        """``"ratio 0.15, set in blend.recompute_ratio"``: the blend's ratio and where it came from
        (:data:`RATIO_SOURCES`; "as set" when no pipeline said), or "" outside blend mode."""
        if self.recompute_ratio is None:
            return ""
        return f"ratio {self.recompute_ratio:g}, {RATIO_SOURCES.get(self.ratio_source, 'as set')}"

    @property
    def recompute_note(self) -> str:
        """What to say beside the recomputed tokens: :attr:`partial_depth` ("in 27 of 30 layers"),
        or "the whole context: blend.min_recompute_tokens covers it" when a blend below ratio 1
        recomputed every context token of stored chunks (a short context under the floor: full
        prefill through the blend's path), else ""."""
        if self.partial_depth:
            return self.partial_depth
        if (self.mode == "blend" and self.recompute_ratio is not None and self.recompute_ratio < 1
                and self.recomputed_tokens and not self.reused_tokens and not self.missing_computed_tokens):
            return "the whole context: blend.min_recompute_tokens covers it"
        return ""
