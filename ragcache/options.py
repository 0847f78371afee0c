"""Per-request options: one typed object from where a request enters down to the engine.

Owns :class:`RequestOptions` (the options a request names one by one: mode, top_k, recompute_ratio,
selection, budget, mass_left), :class:`QueryOptions` (those, plus max_tokens, sampling and
history), :class:`SamplingOptions`, :class:`SelectionSpec`, the ranges they share with the settings
(:data:`~ragcache.config.Ratio`, :data:`~ragcache.config.TopK`, :data:`~ragcache.config.MaxTokens`,
:data:`~ragcache.config.Granule`, defined once in :mod:`ragcache.config`) and
:class:`QueryOptionsError`.

A request's options are validated once, where the request enters:

- the SDK: ``RAGPipeline.query(question, top_k=3, ...)`` builds them with :meth:`QueryOptions.parse`
  (or takes a ``QueryOptions`` its caller built, which pydantic validated then);
- the CLI: ``ragcache ask --top-k 3`` builds them with :meth:`QueryOptions.parse`, naming the flags
  in its one-line errors, before the engine starts;
- HTTP: the request's ``ragcache`` object (:mod:`ragcache.server.schemas`) is a
  :class:`RequestOptions`, so FastAPI validates it while it parses the body; ``query_options()``
  then assembles the object without checking anything again.

Each option is declared once, as a field of :class:`RequestOptions` (its range type, its
description, :data:`BLEND_ONLY` where only a blend reads it): the HTTP ``ragcache`` object, the
body :class:`~ragcache.server.client.RemotePipeline` sends (:meth:`RequestOptions.given`) and the
CLI's query flags (app/ask_cmd.py) are derived from these fields, so a new option is one field
here, plus the engine code that reads it.

From there the object travels unchanged: the pipeline reads ``top_k`` and ``history``, the engine
``mode``, ``max_tokens``, ``recompute_ratio``, ``selection`` and ``sampling`` (into the connector's
``BlendParams`` and vLLM's ``SamplingParams``). Nothing below checks these values again; the one
change on the way is the pipeline filling in the recompute ratio of the index's calibration when
the caller gave none (:meth:`QueryOptions.with_ratio`). Imports ragcache.config, ragcache.conversation and
pydantic only: every layer may use it.
"""

from __future__ import annotations

from typing import Annotated, Any, Mapping

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from ragcache.config import BudgetMode, Granule, MassLeft, MaxTokens, Mode, Ratio, SelectionName, TopK, range_text
from ragcache.conversation import Turn

#: the seeds vLLM accepts: a signed 64-bit integer (its own OpenAI server checks the same range;
#: a larger one fails inside the engine, after the request was registered)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX, description="a signed 64-bit integer")]
MinTokens = Annotated[int, Field(ge=0)]
#: at most this many stop strings per request (OpenAI's limit)
MAX_STOP = 4


def check_stop(stop: Any) -> tuple[str, ...]:
    """Stop strings as a tuple: ``None``, one string or a list of at most :data:`MAX_STOP`
    non-empty strings.

    Raises:
        ValueError: more than four, or an empty one.
    """
    items = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(items) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop sequences")
    if any(not s for s in items):
        raise ValueError("stop sequences must not be empty")
    return items


class SamplingOptions(BaseModel):
    """Per-request sampling (vLLM ``SamplingParams`` fields of the same names).

    The default is greedy decoding (``temperature=0``): answers are reproducible and the modes
    can be compared token for token. ``stop`` strings end the answer (not included in it);
    ``seed`` makes sampling at ``temperature > 0`` reproducible; ``ignore_eos`` and ``min_tokens``
    fix the answer length (load tests).

    Raises (on construction):
        pydantic.ValidationError: a value out of range (temperature in [0, 2], top_p in (0, 1],
            seed a signed 64-bit integer, min_tokens >= 0, at most 4 non-empty stop strings).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    stop: tuple[str, ...] = ()
    seed: Seed | None = None
    ignore_eos: bool = False
    min_tokens: MinTokens = 0

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, v: Any) -> tuple[str, ...]:
        return check_stop(v)


GREEDY = SamplingOptions()


class SelectionSpec(BaseModel):
    """A token-selection strategy for blend, with an optional granule (tokens per recomputed run;
    ``blend.granule`` when None). Written ``"question"`` or ``"question/16"`` wherever a string is
    taken (CLI flags, settings-like input); :meth:`parse` reads that form.

    Raises (on construction):
        pydantic.ValidationError: an unknown strategy or a granule outside ``blend.granule``'s range.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: SelectionName
    granule: Granule | None = None

    @classmethod
    def parse(cls, spec: "str | SelectionSpec") -> "SelectionSpec":
        """``"question"`` -> ``SelectionSpec(strategy="question")``; ``"question/16"`` -> with granule 16.

        Raises:
            ValueError: a granule that is not an integer; pydantic.ValidationError (a ValueError):
                an unknown strategy or a granule out of range.
        """
        if isinstance(spec, SelectionSpec):
            return spec
        strategy, sep, granule = str(spec).partition("/")
        if not sep:
            return cls(strategy=strategy)
        try:
            number = int(granule)
        except ValueError:
            raise ValueError(f"selection {spec!r}: the granule after '/' must be an integer (e.g. question/16)"
                             ) from None
        return cls(strategy=strategy, granule=number)

    def __str__(self) -> str:
        return self.strategy if self.granule is None else f"{self.strategy}/{self.granule}"


def _selection(v: Any) -> Any:
    return SelectionSpec.parse(v) if isinstance(v, str) else v


#: a selection field: a :class:`SelectionSpec`, or its string form ("question/16"), which is also
#: what it is written as in JSON
_Selection = Annotated[SelectionSpec, BeforeValidator(_selection), PlainSerializer(str, when_used="json")]


def check_min_tokens(min_tokens: int, max_tokens: int | None) -> None:
    """Refuse a minimum answer length above the maximum (``max_tokens`` None: the engine's default,
    not known here).

    Raises:
        ValueError: ``min_tokens > max_tokens``.
    """
    if max_tokens is not None and min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) is larger than max_tokens ({max_tokens})")


def check_blend_only(value: Any, info: ValidationInfo) -> Any:
    """Refuse a blend-only option on a request whose mode is set to another mode, where it would be
    ignored without a word (the validator of :data:`BLEND_ONLY`; the request's ``mode``, declared
    before these fields, is in ``info.data``).

    Raises:
        ValueError: the option is set and the request's mode is full, prefix or reuse.
    """
    mode = info.data.get("mode")
    if value is not None and mode is not None and mode != "blend":
        raise ValueError(f"applies in blend mode only, and the request's mode is {mode!r}: drop it, or ask in blend "
                         f"mode")
    return value


#: marks an option that only a blend reads (``Annotated[X | None, BLEND_ONLY]``): refused with another mode
BLEND_ONLY = AfterValidator(check_blend_only)


class QueryOptionsError(ValueError):
    """A request option out of its range: one line naming the option (as the caller called it),
    the value and the rule.

    Attributes:
        field: the option's path in :class:`QueryOptions` (``"recompute_ratio"``, ``"sampling.temperature"``).
        name: the name the caller used (``"--recompute-ratio"``, ``"ragcache.recompute_ratio"``).
        value: the value given.
    """

    def __init__(self, message: str, *, field: str, name: str, value: Any):
        super().__init__(message)
        self.field, self.name, self.value = field, name, value


#: the setting whose range each option shares (named in error messages)
SETTING_OF = {"top_k": "retrieval.top_k", "max_tokens": "engine.max_tokens",
              "recompute_ratio": "blend.recompute_ratio", "mass_left": "blend.mass_left"}


class RequestOptions(BaseModel):
    """The options a request names one by one; every field unset means "the settings' default".

    The one declaration of each option: the fields of HTTP's ``ragcache`` object
    (:class:`ragcache.server.schemas.RagcacheOptions` adds ``index`` and what to return), of the
    body a :class:`~ragcache.server.client.RemotePipeline` sends (:meth:`given`) and, with
    :class:`QueryOptions`' ``max_tokens``, of the CLI's query flags (``top_k`` -> ``--top-k``, the
    description as its help).

    Attributes:
        mode: full, prefix, reuse or blend (default ``engine.mode``).
        top_k: chunks retrieved (default ``retrieval.top_k``), in [1, 100].
        recompute_ratio: blend's share of context tokens recomputed, in [0, 1] (default: the
            pipeline's, see ``RAGPipeline.recompute_ratio``).
        selection: blend's token selection (default ``blend.selection`` / ``blend.granule``); a
            string such as ``"question/16"`` is read by :meth:`SelectionSpec.parse` (and written so
            in JSON).
        budget: blend's recompute budget, ``"adaptive"`` (from the question's attention) or
            ``"fixed"`` (the ratio alone) (default ``blend.budget``).
        mass_left: the adaptive budget's share of the question's attention that may stay on reused
            KV, in (0, 1) (default ``blend.mass_left``, or the index's calibration with
            ``recompute_ratio = "auto"``); setting it asks for the adaptive budget (unless ``budget``
            says otherwise).

    The options marked :data:`BLEND_ONLY` (recompute_ratio, selection, budget, mass_left) are
    refused on a request whose ``mode`` is another.

    Raises (on construction):
        pydantic.ValidationError: a value out of range, or a blend-only option with another mode.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode | None = Field(None, description="full, prefix, reuse or blend (default engine.mode)")
    top_k: TopK | None = Field(None, description="chunks retrieved (default retrieval.top_k)")
    recompute_ratio: Annotated[Ratio | None, BLEND_ONLY] = Field(
        None, description="share of context tokens recomputed in blend mode (default blend.recompute_ratio)")
    selection: Annotated[_Selection | None, BLEND_ONLY] = Field(
        None, description="blend's token selection, e.g. question or question/16 (default blend.selection)")
    budget: Annotated[BudgetMode | None, BLEND_ONLY] = Field(
        None, description="blend's recompute budget: adaptive (from the question's attention) or fixed (the ratio) "
        "(default blend.budget)")
    mass_left: Annotated[MassLeft | None, BLEND_ONLY] = Field(
        None, description="adaptive budget: share of the question's attention that may stay on reused KV, in (0, 1) "
        "(default blend.mass_left)")

    def given(self) -> dict[str, Any]:
        """The :class:`RequestOptions` fields set (not None) as JSON data, a selection in its string
        form: the ``ragcache`` object of a request body."""
        return self.model_dump(mode="json", include=set(RequestOptions.model_fields), exclude_none=True)


class QueryOptions(RequestOptions):
    """How to answer one question: the :class:`RequestOptions`, the answer's length, its sampling
    and the conversation so far; every field unset means "the settings' default".

    Attributes:
        mode, top_k, recompute_ratio, selection, budget, mass_left: see :class:`RequestOptions`.
        max_tokens: tokens decoded (default ``engine.max_tokens``), >= 1.
        sampling: temperature, top_p, stop strings, seed (default greedy).
        history: earlier turns of the conversation, oldest first.

    Raises (on construction):
        pydantic.ValidationError: a value out of range, or a blend-only option with another mode
            (use :meth:`parse` for one-line errors).
    """

    max_tokens: MaxTokens | None = Field(None, description="tokens to decode (default engine.max_tokens)")
    sampling: SamplingOptions = GREEDY
    history: tuple[Turn, ...] = ()

    @model_validator(mode="after")
    def _check_min_tokens(self) -> "QueryOptions":
        check_min_tokens(self.sampling.min_tokens, self.max_tokens)
        return self

    @classmethod
    def parse(cls, fields: Mapping[str, Any], names: Mapping[str, str] | None = None) -> "QueryOptions":
        """Build and validate options from plain values (the SDK's keyword arguments, CLI flags);
        ``None`` values mean "not given".

        Args:
            fields: :class:`QueryOptions` field names (``sampling`` may be a
                :class:`SamplingOptions` or a dict of its fields).
            names: what the caller calls each field in messages (``{"top_k": "--top-k"}``);
                unnamed fields are called by their own names.

        Raises:
            QueryOptionsError: the first invalid value, e.g. ``--top-k 0: must be in [1, 100] (the
                range of the setting retrieval.top_k)``.
            TypeError: an unknown field name.
        """
        unknown = set(fields) - set(cls.model_fields)
        if unknown:
            raise TypeError(f"unknown query option(s) {', '.join(sorted(unknown))}; use some of "
                            f"{', '.join(cls.model_fields)}")
        given = {k: v for k, v in fields.items() if v is not None}
        try:
            return cls(**given)
        except ValidationError as exc:
            raise options_error(exc, names or {}) from None

    def with_ratio(self, ratio: float) -> "QueryOptions":
        """These options with the recompute ratio the pipeline resolved for the request (from the
        settings or the index's calibration, both validated where they were read)."""
        return self.model_copy(update={"recompute_ratio": ratio})


def options_error(exc: ValidationError, names: Mapping[str, str]) -> QueryOptionsError:
    """The first error of a :class:`QueryOptions` validation as a :class:`QueryOptionsError`
    (the field named as ``names`` says, its range stated as the settings state theirs)."""
    err = exc.errors()[0]
    path = ".".join(str(p) for p in err.get("loc", ()) if not isinstance(p, int))
    head, _, rest = path.partition(".")
    if path not in names and head in names:  # a part of a named option: "--selection granule"
        name = f"{names[head]} {rest}".strip()
    else:
        name = names.get(path) or path or "options"
    value = err.get("input")
    rule = None
    if path in RANGES and err.get("type", "").startswith(("greater_than", "less_than")):
        rule = range_text(RANGES[path])
    if rule is None:
        rule = str(err.get("msg", "is invalid")).removeprefix("Value error, ")
    shown = "" if isinstance(value, (dict, list, tuple, BaseModel)) or value is None else f" {value}"
    same = path in SETTING_OF and rule.startswith("must")
    setting = f" (the range of the setting {SETTING_OF[path]})" if same else ""
    return QueryOptionsError(f"{name}{shown}: {rule}{setting}", field=path, name=name, value=value)


#: the range type of each bounded option (for messages)
RANGES = {"top_k": TopK, "max_tokens": MaxTokens, "recompute_ratio": Ratio, "mass_left": MassLeft,
          "selection.granule": Granule,
          "sampling.temperature": Temperature, "sampling.top_p": TopP, "sampling.seed": Seed,
          "sampling.min_tokens": MinTokens}


#: the options of a request that sets nothing: the settings decide everything
DEFAULTS = QueryOptions()


def options_from(options: QueryOptions | None, fields: Mapping[str, Any]) -> QueryOptions:
    """A request's options where it enters the SDK (``RAGPipeline.query(q, options)`` or
    ``RAGPipeline.query(q, top_k=3)``): ``options`` as given (pydantic validated it when it was
    built), or built and validated from keyword ``fields`` (:meth:`QueryOptions.parse`); the
    settings' defaults when neither.

    Raises:
        QueryOptionsError: a field out of range. TypeError: both given, or an unknown field.
    """
    if options is not None:
        if fields:
            raise TypeError(f"pass options or keyword fields, not both (got options and {', '.join(fields)})")
        if not isinstance(options, QueryOptions):
            raise TypeError(f"options must be a QueryOptions, not {type(options).__name__} (e.g. mode={options!r} "
                            "as a keyword)")
        return options
    return QueryOptions.parse(fields) if fields else DEFAULTS
