"""Settings for ragcache: one tree, read from settings.toml < RAGCACHE_* environment < explicit args.

This module owns every tunable and its validation. It imports nothing else from ragcache but
:mod:`ragcache.strategies` (the selection strategies' records, torch-free).

Sources, lowest precedence first (pydantic-settings, ``settings_customise_sources``):

1. ``settings.toml``: the file named by ``RAGCACHE_SETTINGS_FILE``, else ``./settings.toml``
   when it exists (the repository's top-level file documents every default);
2. environment variables ``RAGCACHE_<SECTION>__<KEY>``, e.g. ``RAGCACHE_STORE__CPU_KV_POOL_GB=2``;
3. keyword arguments, e.g. ``Settings.load(store={"cpu_kv_pool_gb": 2})``.

Invalid values raise :class:`ConfigError` at start, naming the key, the value and what is allowed.
"""

from __future__ import annotations

import os
import re
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    BaseModel, ConfigDict, Field, PlainValidator, TypeAdapter, ValidationError, field_validator, model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from ragcache import strategies

SETTINGS_FILE_ENV = "RAGCACHE_SETTINGS_FILE"
DEFAULT_CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ragcache"

Mode = Literal["full", "prefix", "reuse", "blend", "auto"]
MODES: tuple[str, ...] = ("full", "prefix", "reuse", "blend", "auto")
#: the modes under which a request may blend, so blend-only options apply (``auto`` routes each request to
#: blend or full prefill)
BLENDING_MODES: tuple[str, ...] = ("blend", "auto")
#: a token-selection strategy's name: one registered in :mod:`ragcache.strategies` when validated
#: (deviation, question, hybrid, and any registered since)
SelectionName = Annotated[str, PlainValidator(strategies.check_name, json_schema_input_type=str)]


#: ranges shared by a setting and the per-request option that overrides it (ragcache.options):
#: defined once, so a flag, an SDK argument and an HTTP field keep to the setting's range
Ratio = Annotated[float, Field(ge=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=1, le=100)]
MaxTokens = Annotated[int, Field(ge=1)]
#: the longest run of recomputed tokens ``blend.granule`` (and a request's ``strategy/granule``) may ask for
GRANULE_MAX = 256
Granule = Annotated[int, Field(ge=1, le=GRANULE_MAX)]
#: the question's attention an adaptive blend budget may leave on reused KV (``blend.mass_left``)
MassLeft = Annotated[float, Field(gt=0.0, lt=1.0)]
#: how a blend's recompute budget is set: from the request's question (adaptive) or the ratio alone (fixed)
BudgetMode = Literal["adaptive", "fixed"]


class ConfigError(ValueError):
    """A setting has an invalid value or the settings file cannot be read."""


#: a KV namespace name (``store.namespace``, ``ragcache ingest --namespace``): it becomes part of
#: every chunk key, disk file name and Redis key, so it is kept short and plain
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")


def check_namespace(name: str, what: str = "namespace") -> str:
    """Return ``name`` when it is a valid KV namespace name.

    Raises:
        ConfigError: not 1-32 characters from ``[A-Za-z0-9_-]`` starting with a letter or digit;
            the message names ``what`` (e.g. ``"--namespace"``).
    """
    if not isinstance(name, str) or not NAMESPACE_PATTERN.fullmatch(name):
        raise ConfigError(f"{what} {name!r}: use 1-32 letters, digits, '_' or '-', starting with a letter or digit")
    return name


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSettings(_Section):
    """Which models to run and where converted copies are cached."""

    model: str = Field("smollm2-135m-instruct", description="LLM: packaged alias or a local HF model folder")
    embedding_model: str = Field(
        "all-minilm-l6-v2", description="sentence-transformers model: packaged alias or a local folder"
    )
    cache_dir: Path = Field(DEFAULT_CACHE_HOME / "models", description="where converted models are kept")


class EngineSettings(_Section):
    """The embedded vLLM engine."""

    max_model_len: int = Field(8192, ge=128, description="context length in tokens")
    kv_cache_memory_bytes: int = Field(
        2 * 1024**3, ge=16 * 1024**2, description="bytes of vLLM's paged KV cache"
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="model dtype; auto = bfloat16 on CUDA, and on CPUs with AMX-BF16/AVX512-BF16 where a "
        "bf16 matmul is measured >= 1.2x faster than float32 (once per host, recorded in ~/.cache/ragcache/host/dtype.json), "
        "else float32"
    )
    enforce_eager: bool = Field(True, description="skip torch.compile/CUDA graphs (start-up minutes on CPU)")
    in_process: bool = Field(
        True, description="run vLLM's engine core in this process (starts faster than a separate engine process)"
    )
    mode: Mode = Field(
        "auto", description="default query mode: auto (each request blends where blend is predicted sooner at full "
        "prefill's quality, else full prefill; see [route]), full, prefix, reuse or blend")
    max_tokens: MaxTokens = Field(64, description="tokens to decode per answer")
    self_check: bool = Field(
        True, description="at start, check that reuse/blend reproduce vLLM's prefill on a short prompt "
        "(disables them on a mismatch)")
    verbose: bool = Field(
        False, description="show vLLM's, torch's and transformers' own notices, warnings and loading bars (in this "
        "process and the engine's); false: ragcache's lines only (the CLI's -v does the same)")
    connector_step_tokens: int = Field(
        2048, ge=0, description="context tokens the KV connector loads (reuse/blend) per engine step; another "
        "request waits for the next step (the first of a step always goes); 0 = no limit")


#: ``blend.mass_left``'s default
MASS_LEFT_DEFAULT = 0.03


class BlendSettings(_Section):
    """CacheBlend selective recompute (Yao et al., EuroSys'25) and how its tokens are selected."""

    recompute_ratio: float | Literal["auto"] = Field(
        0.15, description="share of context tokens recomputed, in [0, 1], or 'auto': the index's calibrated ratio "
        "(`ragcache calibrate`), else fallback_ratio")
    budget: BudgetMode = Field(
        "adaptive", description="adaptive: each request's recompute budget follows its question's attention "
        "(recompute until at most mass_left of it stays on reused KV, within [recompute_ratio / 2, "
        "max_recompute_ratio and max_recompute_tokens]); fixed: every request recomputes recompute_ratio")
    mass_left: MassLeft = Field(
        MASS_LEFT_DEFAULT, description="adaptive budget: the share of the question's attention that may stay on "
        "reused (not recomputed) context tokens; smaller recomputes more (recompute_ratio = 'auto' uses the index's "
        "calibrated value)")
    max_recompute_ratio: Ratio = Field(
        0.5, description="adaptive budget: at most this share of the context is recomputed (never less than "
        "recompute_ratio gives): the cost one request may take")
    max_recompute_tokens: int = Field(
        768, ge=1, description="adaptive budget: and at most this many context tokens (never less than "
        "recompute_ratio gives): short contexts get more than the ratio where their question reads more, long ones "
        "keep the ratio's budget, which holds what their question reads")
    min_recompute_tokens: int = Field(
        384, ge=0, description="a blend recomputes at least this many context tokens (all of a shorter context), "
        "whatever the ratio gives: on short prompts the ratio alone is too few for the passage an answer reads, and "
        "answers loop "
        "(0 = the ratio alone; a ratio of 0 stays plain reuse)")
    recompute_depth: float = Field(
        1.0, gt=0.0, le=1.0, description="share of the model's layers, from the first, in which the selected tokens "
        "are recomputed; the later layers keep their reused KV (1 = every layer; ratio 1.0 always recomputes every "
        "layer)")
    fallback_ratio: Ratio = Field(
        0.15, description="ratio used when recompute_ratio = 'auto' and the index has no calibration")
    check_layer: int | Literal["auto"] = Field(
        "auto", description="layer where the recomputed tokens are selected: every token is computed in full up to it; "
        "auto = 0 for question selection (its scores come from the question probe; layer 0's KV moves exactly), 1 "
        "for deviation and hybrid (KV deviation needs a layer where tokens have seen each other)")
    deviation: Literal["value", "key"] = Field("value", description="KV deviation measured on V or K")
    selection: SelectionName = Field(
        "question", description="how tokens are selected: question attention (default), KV deviation "
        "(CacheBlend's), or a hybrid")
    chunk_head_tokens: int = Field(
        0, ge=0, le=64, description="the first k tokens of every moved chunk are always recomputed")
    question_weight: float = Field(
        0.5, ge=0.0, le=1.0, description="hybrid: weight of question attention against KV deviation")
    max_chunk_share: float = Field(
        1.0, gt=0.0, le=1.0, description="largest share of the budget one chunk may take")
    granule: Granule = Field(
        8, description="tokens are recomputed in aligned runs of this many tokens within each chunk "
        "(1 = token by token)")
    probe_layers: int = Field(
        -1, ge=-1, description="question scores: layers after the check layer the question is probed through over "
        "the reused KV (0 = only the layers up to the check layer; -1 = all)")
    question_heads: Literal["mean", "max"] = Field(
        "mean", description="question scores: each layer's attention from the question is pooled over the query heads "
        "by mean, or by max (a token scores what its most attentive head gives it; it can concentrate the budget on a "
        "repeated name)")
    candidates: float = Field(
        2.0, ge=1.0, le=8.0, description="question selection: the question's attention picks this many times the "
        "budget, those tokens go through the layers before refine_layer, and the budget is kept among them by "
        "impact: the question's attention times the error of their reused V summed over layers 1 .. refine_layer "
        "(gradual filtering, CacheBlend §4.3); 1 = by the question's attention alone")
    refine_layer: int = Field(
        1, ge=1, le=64, description="question selection with candidates > 1: the layer at which the budget is kept "
        "among the candidates, by their V error summed over layers 1 .. refine_layer (deeper sees a stale token's "
        "growing error but sends the extra candidates through that many layers)")
    propagate: Ratio = Field(
        0.0, description="share of the recomputed tokens' KV corrections (fresh minus reused K and V, per layer) "
        "that the tokens left reused take, weighted by how alike their keys are (softmax of the cosine of the "
        "pre-RoPE keys over propagate_temperature, per KV head); 0 = off: the reused tokens keep their cached KV "
        "(see docs/fidelity.md)")
    propagate_temperature: float = Field(
        0.05, gt=0.0, le=1.0, description="propagate: the softmax temperature over key cosines (smaller: each reused "
        "token takes the corrections of its most alike recomputed tokens only)")
    propagate_scope: Literal["chunk", "context"] = Field(
        "chunk", description="propagate: which recomputed tokens a reused token takes corrections from: only those of "
        "its own chunk (the weights are computed chunk by chunk), or any in its request's context (as faithful in "
        "docs/fidelity.md, three times the cost there)")
    propagate_from_depth: Ratio = Field(
        0.5, description="propagate: the share of the model's layers, from the first, in which the reused tokens take "
        "no corrections (0 = every selective layer; 0.5 = the deeper half only, where full prefill's KV restores "
        "most answers and propagating keeps more of them at a third less cost, docs/fidelity.md)")
    pipeline_overlap: bool | Literal["auto"] = Field(
        "auto", description="load layer i+1 in a background thread while computing layer i; auto = on when the blend "
        "computes on an accelerator or reads a chunk from the remote tier, off for CPU compute over KV in RAM or on "
        "local disk (there the thread's copies compete with the compute for the same cores)")
    attention: Literal["auto", "kernel", "torch"] = Field(
        "auto", description="the blend's attention: vLLM's own kernel over the paged KV cache (kernel), torch SDPA "
        "(torch), or auto (the kernel where vLLM's backend offers one, unless torch measures faster on this host)")

    @field_validator("recompute_ratio", mode="before")
    @classmethod
    def _check_ratio(cls, v: Any) -> float | str:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        try:
            ratio = float(v)
        except (TypeError, ValueError):
            raise ValueError("must be a number in [0, 1] or 'auto'") from None
        if not 0.0 <= ratio <= 1.0:  # Ratio's range
            raise ValueError(f"{range_text(Ratio)} (or 'auto')")
        return ratio

    @field_validator("check_layer", mode="before")
    @classmethod
    def _check_layer(cls, v: Any) -> int | str:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        try:
            layer = int(v)
        except (TypeError, ValueError):
            raise ValueError("must be a layer index >= 0 or 'auto'") from None
        if layer < 0 or (isinstance(v, float) and v != layer):
            raise ValueError("must be a layer index >= 0 or 'auto'")
        return layer

    @model_validator(mode="after")
    def _deviation_needs_a_mixed_layer(self) -> "BlendSettings":
        if self.check_layer == 0 and self.measures_deviation(self.selection):
            raise ValueError(f"check_layer = 0 with selection {self.selection!r}: the KV deviation at layer 0 is zero "
                             f"(a token's layer-0 KV does not depend on the other tokens); use check_layer >= 1 or "
                             f"'auto'")
        return self

    @property
    def resolved_check_layer(self) -> int:
        """``check_layer``, with ``"auto"`` resolved for ``selection`` (0 for question, 1 otherwise)."""
        return self.check_layer_for(self.selection)

    def measures_deviation(self, selection: str) -> bool:
        """Whether ``selection`` scores tokens by KV deviation under these settings (its record says:
        deviation, or hybrid with some weight on it).

        Raises:
            ValueError: ``selection`` is not a registered strategy.
        """
        return strategies.get(selection).needs_deviation(self)

    def check_layer_for(self, selection: str) -> int:
        """The check layer for a request that selects by ``selection`` (its own, or the settings'):
        ``"auto"`` is the strategy's own (:attr:`ragcache.strategies.Strategy.check_layer`: 0 for
        question, 1 for deviation and hybrid).

        Raises:
            ValueError: ``check_layer`` is 0 and ``selection`` measures KV deviation (zero at layer 0),
                or ``selection`` is not a registered strategy.
        """
        if self.check_layer == "auto":
            return strategies.get(selection).check_layer
        if self.check_layer == 0 and self.measures_deviation(selection):
            raise ValueError(f"selection {selection!r} with blend.check_layer = 0: the KV deviation at layer 0 is "
                             "zero; use check_layer >= 1 or 'auto'")
        return int(self.check_layer)

    def check_model_layers(self, num_layers: int) -> list[str]:
        """Check the layer settings against a model of ``num_layers`` decoder layers, at engine start
        (without it a bad ``check_layer`` only failed inside the first blend request).

        Returns:
            warnings, one sentence each: settings the model makes moot (``refine_layer`` at or past the
            last layer the recomputed tokens go through, so no cut is made: the question's choice is
            kept as with ``candidates = 1``).

        Raises:
            ConfigError: ``check_layer`` is not below ``num_layers`` for some selection a request may
                pick (``"auto"`` resolves to 0 or 1).
        """
        for selection in strategies.names():
            try:
                layer = self.check_layer_for(selection)
            except ValueError:  # check_layer 0 with a deviation selection: refused per request, with its fix
                continue
            if layer >= num_layers:
                what = (f"blend.check_layer = 'auto' is layer {layer} for selection {selection!r}"
                        if self.check_layer == "auto" else f"blend.check_layer = {layer}")
                raise ConfigError(f"{what}, but the model has {num_layers} layers (0 .. {num_layers - 1}); set "
                                  f"blend.check_layer below {num_layers}")
        warnings = []
        last = strategies.recompute_layers(self.recompute_depth, num_layers, 0)
        if self.candidates > 1 and self.refine_layer >= last:
            warnings.append(f"blend.refine_layer = {self.refine_layer} is at or past the last layer the recomputed "
                            f"tokens go through ({last} of the model's {num_layers}): no cut is made there, the "
                            f"question's choice is kept as with blend.candidates = 1; set refine_layer below {last}")
        return warnings

    def calibrated_settings(self, selection: str | None = None) -> dict[str, Any]:
        """The settings that change what a blend at a given ratio computes, for ``selection`` (None:
        ``selection``): a calibration (``ragcache calibrate``) measured under other values does not
        hold. Only the settings ``selection`` reads are included (its record's
        :meth:`~ragcache.strategies.Strategy.reads`, e.g. ``question_weight`` for hybrid only), so
        changing an unused one keeps the calibration; ``check_layer`` resolved.

        Returns:
            ``{"blend.<name>": value}``, JSON-serialisable.

        Raises:
            ValueError: as :meth:`check_layer_for`.
        """
        selection = selection or self.selection
        names = list(strategies.get(selection).reads(self))
        if self.adapts(selection):
            names += ["max_recompute_ratio", "max_recompute_tokens"]
        if self.propagate > 0:  # off, the other propagate settings change nothing a calibration measured
            names += ["propagate", "propagate_temperature", "propagate_scope", "propagate_from_depth"]
        values = {f"blend.{name}": getattr(self, name) for name in names}
        values["blend.check_layer"] = self.check_layer_for(selection)
        return values

    def adapts(self, selection: str | None = None) -> bool:
        """The recompute budget follows each request's question (``budget = "adaptive"``) for this
        selection (default ``selection``): only selections scored by the question's attention have
        the attention the adaptive budget reads."""
        return self.budget == "adaptive" and strategies.get(selection or self.selection).needs_question(self)

    @property
    def static_ratio(self) -> float:
        """The ratio when no calibration is consulted: ``recompute_ratio``, or ``fallback_ratio`` for "auto"."""
        return self.fallback_ratio if self.recompute_ratio == "auto" else float(self.recompute_ratio)


class BlendKnobs(BlendSettings):
    """One request's blend parameters: the ``[blend]`` settings with the request's own choices applied
    and every ``"auto"`` resolved, built once where the request is made
    (:func:`ragcache.options.blend_knobs`), carried to the worker as is
    (:class:`ragcache.engine.messages.BlendParams`) and read by the blend's plan
    (:func:`ragcache.blend.plan.plan_blend`). Every ``[blend]`` setting is a field, with its default
    declared once, in :class:`BlendSettings`: a new setting reaches the worker with no other change.

    Attributes:
        recompute_ratio: the ratio in force, in [0, 1] (the request's, the index's calibration, or
            ``blend.recompute_ratio``; ``blend.fallback_ratio`` where that is ``"auto"``).
        check_layer: :meth:`BlendSettings.check_layer_for` the request's strategy, >= 0.
        selection, granule: the request's strategy and granule where it sets them, else the settings'.
        budget, mass_left: as :func:`ragcache.options.choose_budget` decided them: ``budget`` is
            ``"fixed"`` for a selection that does not read the question's attention.
        (every other field): the ``[blend]`` setting of the same name.

    Raises (on :meth:`model_validate`):
        pydantic.ValidationError: a value of another type (strict: ``"yes"`` is no boolean, ``"1"`` no
            number) or out of its setting's range.
    """

    model_config = ConfigDict(frozen=True, strict=True)  # as it travels: each value of its own type, none parsed

    recompute_ratio: Ratio
    check_layer: int = Field(ge=0)

    @property
    def token_selection(self) -> "strategies.Selection":
        """The knobs the token selection reads (:meth:`ragcache.strategies.Selection.from_settings`)."""
        return strategies.Selection.from_settings(self)


class StoreSettings(_Section):
    """Tiered KV store: device -> cpu -> disk -> remote."""

    gpu_kv_pool_gb: float = Field(2.0, ge=0.0, description="accelerator-memory tier size (GB); 0 = off")
    cpu_kv_pool_gb: float = Field(4.0, ge=0.0, description="host-RAM tier size (GB); 0 = off")
    ssd_cache_dir: Path = Field(DEFAULT_CACHE_HOME / "kv", description="disk tier folder")
    ssd_cache_max_gb: float = Field(20.0, ge=0.0, description="disk tier size (GB); 0 = off")
    remote_url: str = Field("", description="Redis URL for the shared tier (redis://host:port/db); empty = off; "
                            "with remote_cluster, one or more comma-separated seed nodes")
    remote_cluster: bool = Field(
        False, description="remote_url names node(s) of a Redis Cluster: entries spread "
        "over its hash slots")
    remote_timeout_s: float = Field(
        2.0, gt=0.0, le=60.0, description="seconds the remote tier waits to connect and for each reply; a Redis "
        "that does not answer in time is marked down (the local tiers answer; retried after a back-off)")
    namespace: str = Field(
        "default", description="KV namespace: part of every chunk key and Redis key; stores in different "
        "namespaces never share or see each other's KV")
    eviction_policy: Literal["lru", "lfu"] = Field("lru", description="lru or lfu")
    kv_compression: Literal["none", "int8", "int4"] = Field(
        "int8", description="stored form of chunk KV in every tier: int8 (K per channel, V per token, ~1/4 of "
        "float32's bytes), int4 (~1/8, a little less quality) or none (kv_dtype floats); part of every chunk key")
    kv_dtype: Literal["model", "float16", "bfloat16"] = Field(
        "model", description="dtype KV is stored in when kv_compression = none")
    enable_hit_rate_log: bool = Field(False, description="log per-tier hit rates periodically")
    log_interval_sec: float = Field(10.0, gt=0.0, description="seconds between hit-rate log lines")

    @field_validator("remote_url")
    @classmethod
    def _check_remote_url(cls, v: str) -> str:
        for one in v.split(",") if "," in v else [v]:
            cls._check_one_remote_url(one.strip())
        return v

    @classmethod
    def _check_one_remote_url(cls, v: str) -> str:
        if v and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix:// (or be empty to turn the tier off)")
        if v.startswith(("redis://", "rediss://")):
            url = urlsplit(v)
            try:
                url.port  # noqa: B018 - raises on a port that is not a number in 0-65535
            except ValueError:
                raise ValueError("has a port that is not a number in 0-65535 (e.g. redis://127.0.0.1:6379/0)") from None
            db = url.path.strip("/")
            if db and not db.isdigit():
                raise ValueError(f"has database {db!r}; use a number, e.g. redis://127.0.0.1:6379/0")
        return v

    @field_validator("namespace")
    @classmethod
    def _check_namespace(cls, v: str) -> str:
        if not NAMESPACE_PATTERN.fullmatch(v):
            raise ValueError("must be 1-32 letters, digits, '_' or '-', starting with a letter or digit")
        return v


class IngestSettings(_Section):
    """Loading and chunking documents."""

    index_dir: Path = Field(Path("indexes"), description="home of named indexes")
    chunk_size: int = Field(512, ge=16, le=8192, description="chunk size in LLM tokens")
    chunk_overlap: int = Field(0, ge=0, description="tokens shared by neighbouring chunks")
    max_file_mb: float = Field(50.0, gt=0.0, description="files larger than this are skipped (MB)")
    kv: Literal["eager", "lazy"] = Field(
        "eager", description="chunk KV: eager = computed and stored at ingest; lazy = computed at a chunk's first "
        "retrieval and stored then (corpora whose KV does not fit the tiers)")
    vector_store: Literal["faiss", "pgvector"] = Field(
        "faiss", description="where indexes live: faiss (folders under index_dir) or pgvector (PostgreSQL at pg_url, "
        "shared by every replica)")
    pg_url: str = Field("", description="PostgreSQL with pgvector for vector_store = pgvector "
                        "(postgresql://user[:password]@host:port/db)")

    executor: Literal["local", "ray"] = Field(
        "local", description="run read/split/embed/KV precompute in this process (local) or as Ray Data stages (ray)")
    ray_address: str = Field("", description="Ray cluster for executor = ray (ray://host:10001 or host:6379); "
                             "empty = a local Ray started for the ingest")
    ray_actors: int = Field(0, ge=0, le=4096, description="executor = ray: actors per pool (split-and-embed, KV "
                            "precompute); 0 = sized from the cluster: one KV actor per GPU, else per node")

    @model_validator(mode="before")
    @classmethod
    def _older_precompute_kv(cls, data: Any) -> Any:
        """``precompute_kv = true|false`` (the older name, in settings files and RAGCACHE_INGEST__PRECOMPUTE_KV)
        is read as ``kv = "eager"|"lazy"``; both set and disagreeing is refused."""
        if not isinstance(data, dict) or "precompute_kv" not in data:
            return data
        data = dict(data)
        raw = data.pop("precompute_kv")
        try:
            eager = TypeAdapter(bool).validate_python(raw)
        except ValidationError:
            raise ValueError(f"precompute_kv {raw!r} must be true or false (it is the older name of kv: "
                             "true = \"eager\", false = \"lazy\")") from None
        older = "eager" if eager else "lazy"
        if data.setdefault("kv", older) != older:
            raise ValueError(f"precompute_kv = {str(eager).lower()} (the older name of kv) and kv = {data['kv']!r} "
                             f"disagree: set kv = {older!r} (RAGCACHE_INGEST__KV={older}) and drop precompute_kv")
        return data

    @field_validator("pg_url")
    @classmethod
    def _check_pg_url(cls, v: str) -> str:
        if v and not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("must start with postgresql:// (e.g. postgresql://ragcache@127.0.0.1:5432/ragcache), "
                             "or be empty")
        return v


class RetrievalSettings(_Section):
    """Search."""

    top_k: TopK = Field(5, description="chunks retrieved per question")


class PromptSettings(_Section):
    """How the prompt is framed around the chunks."""

    system_prompt: str = Field(
        "Answer the question using the documents. Be brief.", description="system message"
    )
    chunk_separator: str = Field("\n\n", description="text placed after every chunk")
    kv_context_tokens: int = Field(
        256, ge=0, le=400, description="chunk KV is computed after the head and this many tokens of a neutral text shipped "
        "with ragcache (never part of a prompt), so the reused KV has seen a context like a prompt's; 0 = after "
        "the head alone (the first chunk of a prompt is then exact). Changing it changes every chunk's KV key")


class ServeSettings(_Section):
    """`ragcache serve`: the OpenAI-compatible HTTP server on the async engine."""

    host: str = Field("127.0.0.1", description="address to bind; a non-loopback address needs api_key")
    port: int = Field(8000, ge=1, le=65535, description="TCP port")
    api_key: str = Field("", description="bearer key clients must send (Authorization: Bearer KEY); empty = none")
    max_in_flight: int = Field(64, ge=1, description="requests answered at once; more get HTTP 429")
    index: str = Field("default", description="index served when a request's model names no index")
    keys_file: str = Field(
        "", description="TOML file of scoped keys (sha256 of each key -> tenant and the indexes it may read), read "
        "again on every request; empty = none (api_key alone). A file without keys refuses every scoped key; a "
        "deleted one refuses every key (HTTP 503) until it is back")
    keys_invalid: Literal["refuse", "keep"] = Field(
        "refuse", description="when keys_file turns invalid while serving (not TOML, a wrong entry): refuse every "
        "key, api_key too, with HTTP 503 naming the file until it is fixed; or keep the keys read before (a key "
        "removed in the same write stays valid). /health and /metrics show the file's state either way")
    blend_fallback: Literal["refuse", "full", "prefix"] = Field(
        "refuse", description="when reuse/blend is unavailable at start (no adapter, failed self-check) and "
        "engine.mode needs it: refuse to start, or serve in full or prefix mode")
    max_header_bytes: int = Field(
        65536, ge=1024, le=16 * 1024 * 1024,
        description="largest request line plus headers a client may send (bytes), however they arrive; more "
        "gets HTTP 431 and the connection is closed")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024,
        description="largest request body a client may send (bytes); more gets HTTP 413 before the body is "
        "parsed")


class RouteSettings(_Section):
    """``engine.mode = "auto"``: which requests blend and which take full prefill."""

    min_speedup: float = Field(
        1.5, gt=0.0, description="blend a request only when its TTFT is predicted at least this many times lower "
        "than full prefill's")
    min_passage_tokens: int = Field(
        400, ge=0, description="on an index `ragcache calibrate` has not measured for a request's prompt and "
        "passage lengths, blend only over retrieved chunks of at least this many tokens on average")
    window: int = Field(
        64, ge=4, le=4096, description="recent requests of each path the cost model is fitted on")
    min_blend_samples: int = Field(
        3, ge=1, description="blends measured before the cost model prices blend from them (before: a "
        "conservative prior)")
    measure_at_start: bool = Field(
        True, description="time two full prefills of synthetic prompts at engine start, so the first requests are "
        "routed by this host's speed")


class UISettings(_Section):
    """The Streamlit UI."""

    server_url: str = Field(
        "", description="a running `ragcache serve` (e.g. http://127.0.0.1:8000) to answer through; empty = embedded engine")

    @field_validator("server_url")
    @classmethod
    def _check_server_url(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https:// (or be empty for the embedded engine)")
        return v.rstrip("/")


_settings_file: ContextVar[Path | None] = ContextVar("ragcache_settings_file", default=None)


def resolve_settings_file() -> Path | None:
    """The TOML file that will be read: explicit > $RAGCACHE_SETTINGS_FILE > ./settings.toml."""
    explicit = _settings_file.get()
    if explicit is not None:
        return explicit
    env = os.environ.get(SETTINGS_FILE_ENV)
    if env:
        return Path(env)
    local = Path("settings.toml")
    return local if local.is_file() else None


class Settings(BaseSettings):
    """All ragcache settings. Prefer :meth:`Settings.load`, which turns errors into :class:`ConfigError`."""

    model_config = SettingsConfigDict(
        env_prefix="RAGCACHE_", env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    models: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    blend: BlendSettings = BlendSettings()
    store: StoreSettings = StoreSettings()
    ingest: IngestSettings = IngestSettings()
    retrieval: RetrievalSettings = RetrievalSettings()
    prompt: PromptSettings = PromptSettings()
    serve: ServeSettings = ServeSettings()
    route: RouteSettings = RouteSettings()
    ui: UISettings = UISettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = resolve_settings_file()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    @classmethod
    def load(cls, settings_file: str | Path | None = None, **overrides: Any) -> "Settings":
        """Read settings from TOML, environment and ``overrides`` (highest precedence).

        Args:
            settings_file: TOML file to read instead of $RAGCACHE_SETTINGS_FILE / ./settings.toml.
            overrides: section dicts, e.g. ``store={"cpu_kv_pool_gb": 2}``; merged key by key.

        Raises:
            ConfigError: unreadable TOML, unknown key, a value out of range, or an environment
                variable that cannot be parsed (e.g. ``RAGCACHE_STORE='{bad'``).
        """
        token = _settings_file.set(Path(settings_file) if settings_file is not None else None)
        toml_path = None
        try:
            toml_path = resolve_settings_file()
            if toml_path is not None:
                _check_toml(toml_path)
            return cls(**overrides)
        except ValidationError as exc:
            raise ConfigError(_describe(exc, toml_path)) from None
        except SettingsError as exc:
            raise ConfigError(_describe_source_error(exc)) from None
        finally:
            _settings_file.reset(token)


def check_value(section: str, key: str, value: Any, flag: str) -> Any:
    """Validate one value for the setting ``section.key`` as :class:`Settings` would: for command-line
    flags that override a setting, so they keep to the same bounds.

    Returns:
        the value as the setting holds it (e.g. coerced to int).

    Raises:
        ConfigError: out of the setting's range, naming ``flag``, the value, the allowed range and
            the setting.
    """
    cls = Settings.model_fields[section].annotation
    try:
        return getattr(cls(**{key: value}), key)
    except ValidationError as exc:
        text = range_text(cls.model_fields[key])
        if text == _NO_RANGE:  # a validator's own rule (e.g. a number or "auto"): its message says it
            text = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{flag} {value}: {text} (the range of the setting {section}.{key})") from None


_NO_RANGE = "is not a valid value"


def range_text(info: Any) -> str:
    """``must be in [0, 1]`` / ``must be >= 1`` / ``must be in (0, 1]`` from the bounds of a field
    (pydantic ``FieldInfo``) or of an ``Annotated`` range type such as :data:`Ratio`."""
    lo = hi = None
    metadata = list(getattr(info, "metadata", ()))
    for extra in get_args(info)[1:]:  # Annotated[float, Field(ge=..)]: the FieldInfo's own metadata
        metadata += list(getattr(extra, "metadata", ()))
    for m in metadata:
        for name, bracket in (("ge", "["), ("gt", "(")):
            if getattr(m, name, None) is not None:
                lo = (bracket, getattr(m, name))
        for name, bracket in (("le", "]"), ("lt", ")")):
            if getattr(m, name, None) is not None:
                hi = (bracket, getattr(m, name))
    if lo and hi:
        return f"must be in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    if lo:
        return f"must be {'>=' if lo[0] == '[' else '>'} {lo[1]:g}"
    if hi:
        return f"must be {'<=' if hi[0] == ']' else '<'} {hi[1]:g}"
    return _NO_RANGE


def _check_toml(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"settings file {path} does not exist; create it or unset {SETTINGS_FILE_ENV}")
    try:
        tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"cannot read settings file {path}: {exc}. Fix the TOML syntax.") from None


def _describe_source_error(exc: SettingsError) -> str:
    """One line for a value pydantic-settings could not parse (a section variable that is not JSON)."""
    m = re.search(r'field "(\w+)" from source "(\w+)"', str(exc))
    field, source = (m.group(1), m.group(2)) if m else ("", "")
    if source.startswith("Env") and field:
        var = f"RAGCACHE_{field.upper()}"
        return (f"cannot parse environment variable {var}={os.environ.get(var, '')!r}: a section variable must "
                f"hold a JSON object, e.g. {var}='{{\"key\": value}}'; or set one key with {var}__<KEY>, "
                f"or unset {var}")
    return f"cannot read the settings ({exc}); check the RAGCACHE_* environment variables and the settings file"


def _describe(exc: ValidationError, toml_path: Path | None) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        env = "RAGCACHE_" + "__".join(str(p).upper() for p in err["loc"])
        value = err.get("input")
        where = f"{toml_path} or {env}" if toml_path else env
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown setting {key!r} (from {where}); see settings.toml for the valid keys")
        elif isinstance(value, dict):  # a check across keys of a section: the message names them
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"invalid settings in [{key}]: {msg} (set in {where})")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] in _BOUND_ERRORS:  # say the whole range, not only the bound that was crossed
                rule = _setting_range(err["loc"])
                msg = rule if rule != _NO_RANGE else msg
            lines.append(f"invalid setting {key} = {value!r}: {msg} (set in {where})")
    return "; ".join(lines)


#: pydantic error types of a value outside a field's bounds
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _setting_range(loc: tuple) -> str:
    """:func:`range_text` of the setting at ``loc`` (``("blend", "recompute_depth")``), or :data:`_NO_RANGE`."""
    try:
        section, key = loc[0], loc[1]
        return range_text(Settings.model_fields[section].annotation.model_fields[key])
    except (IndexError, KeyError, AttributeError):
        return _NO_RANGE
