"""Settings for ragcache: one tree, read from settings.toml < RAGCACHE_* environment < explicit args.

This module owns every tunable and its validation. It imports nothing else from ragcache.

Sources, lowest precedence first (pydantic-settings, ``settings_customise_sources``):

1. ``settings.toml``: the file named by ``RAGCACHE_SETTINGS_FILE``, else ``./settings.toml``
   when it exists (the repository's top-level file documents every default);
2. environment variables ``RAGCACHE_<SECTION>__<KEY>``, e.g. ``RAGCACHE_STORE__CPU_KV_POOL_GB=2``;
3. keyword arguments, e.g. ``Settings.load(store={"cpu_kv_pool_gb": 2})``.

Invalid values raise :class:`ConfigError` at start, naming the key, the value and what is allowed.
"""

from __future__ import annotations

import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

SETTINGS_FILE_ENV = "RAGCACHE_SETTINGS_FILE"
DEFAULT_CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ragcache"

Mode = Literal["full", "prefix", "reuse", "blend"]
MODES: tuple[str, ...] = ("full", "prefix", "reuse", "blend")


class ConfigError(ValueError):
    """A setting has an invalid value or the settings file cannot be read."""


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
        "auto", description="model dtype; auto = bfloat16 on CUDA and on CPUs with AMX-BF16/AVX512-BF16, "
        "float32 on other CPUs"
    )
    enforce_eager: bool = Field(True, description="skip torch.compile/CUDA graphs (start-up minutes on CPU)")
    in_process: bool = Field(
        True, description="run vLLM's engine core in this process (start-up ~6 s vs ~30 s multi-process on CPU)"
    )
    mode: Mode = Field("blend", description="default query mode: full, prefix, reuse or blend")
    max_tokens: int = Field(64, ge=1, description="tokens to decode per answer")


class BlendSettings(_Section):
    """CacheBlend selective recompute (Yao et al., EuroSys'25) and how its tokens are selected."""

    recompute_ratio: float = Field(0.15, ge=0.0, le=1.0, description="share of context tokens recomputed")
    check_layer: int = Field(1, ge=0, description="layer where the recomputed tokens are selected")
    deviation: Literal["value", "key"] = Field("value", description="KV deviation measured on V or K")
    selection: Literal["deviation", "question", "hybrid"] = Field(
        "deviation", description="how tokens are selected: KV deviation, question attention, or a hybrid")
    chunk_head_tokens: int = Field(
        0, ge=0, le=64, description="hybrid: the first k tokens of every moved chunk are always recomputed")
    question_weight: float = Field(
        0.5, ge=0.0, le=1.0, description="hybrid: weight of question attention against KV deviation")
    max_chunk_share: float = Field(
        1.0, gt=0.0, le=1.0, description="hybrid: largest share of the budget one chunk may take")
    pipeline_overlap: bool = Field(True, description="load layer i+1 while computing layer i")


class StoreSettings(_Section):
    """Tiered KV store: device -> cpu -> disk -> remote."""

    gpu_kv_pool_gb: float = Field(2.0, ge=0.0, description="accelerator-memory tier size (GB); 0 = off")
    cpu_kv_pool_gb: float = Field(4.0, ge=0.0, description="host-RAM tier size (GB); 0 = off")
    ssd_cache_dir: Path = Field(DEFAULT_CACHE_HOME / "kv", description="disk tier folder")
    ssd_cache_max_gb: float = Field(20.0, ge=0.0, description="disk tier size (GB); 0 = off")
    remote_url: str = Field("", description="Redis URL for the shared tier (redis://host:port/db); empty = off")
    eviction_policy: Literal["lru", "lfu"] = Field("lru", description="lru or lfu")
    kv_dtype: Literal["model", "float16", "bfloat16"] = Field("model", description="dtype KV is stored in")
    enable_hit_rate_log: bool = Field(False, description="log per-tier hit rates periodically")
    log_interval_sec: float = Field(10.0, gt=0.0, description="seconds between hit-rate log lines")

    @field_validator("remote_url")
    @classmethod
    def _check_remote_url(cls, v: str) -> str:
        if v and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix:// (or be empty to turn the tier off)")
        return v


class IngestSettings(_Section):
    """Loading and chunking documents."""

    index_dir: Path = Field(Path("indexes"), description="home of named indexes")
    chunk_size: int = Field(512, ge=16, le=8192, description="chunk size in LLM tokens")
    chunk_overlap: int = Field(0, ge=0, description="tokens shared by neighbouring chunks")
    max_file_mb: float = Field(50.0, gt=0.0, description="files larger than this are skipped (MB)")
    precompute_kv: bool = Field(True, description="compute chunk KV at ingest")


class RetrievalSettings(_Section):
    """Search."""

    top_k: int = Field(5, ge=1, le=100, description="chunks retrieved per question")


class PromptSettings(_Section):
    """How the prompt is framed around the chunks."""

    system_prompt: str = Field(
        "Answer the question using the documents. Be brief.", description="system message"
    )
    chunk_separator: str = Field("\n\n", description="text placed after every chunk")


class ServeSettings(_Section):
    """`ragcache serve`: the OpenAI-compatible HTTP server on the async engine."""

    host: str = Field("127.0.0.1", description="address to bind; a non-loopback address needs api_key")
    port: int = Field(8000, ge=1, le=65535, description="TCP port")
    api_key: str = Field("", description="bearer key clients must send (Authorization: Bearer KEY); empty = none")
    max_in_flight: int = Field(64, ge=1, description="requests answered at once; more get HTTP 429")
    index: str = Field("default", description="index served when a request's model names no index")


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
            ConfigError: unreadable TOML, unknown key, or a value out of range.
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
        finally:
            _settings_file.reset(token)


def _check_toml(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"settings file {path} does not exist; create it or unset {SETTINGS_FILE_ENV}")
    try:
        tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"cannot read settings file {path}: {exc}. Fix the TOML syntax.") from None


def _describe(exc: ValidationError, toml_path: Path | None) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        env = "RAGCACHE_" + "__".join(str(p).upper() for p in err["loc"])
        value = err.get("input")
        where = f"{toml_path} or {env}" if toml_path else env
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown setting {key!r} (from {where}); see settings.toml for the valid keys")
        else:
            lines.append(f"invalid setting {key} = {value!r}: {err['msg']} (set in {where})")
    return "; ".join(lines)
