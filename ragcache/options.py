"""Per-request options: one typed object from where a request enters down to the engine.

Owns :class:`RequestOptions` (the options a request names one by one: mode, top_k, recompute_ratio,
selection, budget, mass_left), :class:`QueryOptions` (those, plus max_tokens, sampling and
history), :class:`SamplingOptions`, :class:`SelectionSpec`, the ranges they share with the settings
(:data:`~ragcache.config.Ratio`, :data:`~ragcache.config.TopK`, :data:`~ragcache.config.MaxTokens`,
:data:`~ragcache.config.Granule`, defined once in :mod:`ragcache.config`) and
:class:`QueryOptionsError`.

A request's options are validated once, where the request enters (and held once against the
settings it will run under, :func:`check_request`, where its default mode is known: the
pipeline's ``prepare``, the server, the CLI; no option is dropped without a word):

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
``mode``, ``max_tokens`` and ``sampling`` (into vLLM's ``SamplingParams``) and turns the blend options
into the request's one record of blend parameters (:func:`blend_knobs`; the connector's
``BlendParams`` carries it to the worker). The budget is decided here, once: its ratio
(:func:`choose_ratio`), fixed or adaptive and its threshold, the default that gives way and the
refusals (:func:`choose_budget`, whose refusals :func:`check_request` raises). Nothing below checks
these values again; the one change on the way is the pipeline filling in the ratio
:func:`choose_ratio` gives (and the calibration's ``mass_left``) when the caller gave none
(:meth:`QueryOptions.with_budget`). Imports ragcache.config, ragcache.strategies,
ragcache.conversation and pydantic only: every layer may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Mapping

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, Strict,
                      ValidationError, ValidationInfo, field_validator, model_validator)

from ragcache import strategies
from ragcache.config import (BLENDING_MODES, BlendKnobs, BudgetMode, Granule, MassLeft, MaxTokens, Mode, Ratio,
                             SelectionName, TopK, range_text)
from ragcache.conversation import Turn

if TYPE_CHECKING:
    from ragcache.config import BlendSettings

#: the seeds vLLM accepts: a signed 64-bit integer (its own OpenAI server checks the same range;
#: a larger one fails inside the engine, after the request was registered)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

#: a request's numbers are strict (pydantic's Strict): a JSON number, an int where a float is taken, never a
#: boolean (``true`` is not 1) nor a string (``"0.1"``); the settings' own types (environment variables are
#: strings) stay lax, the CLI converts its flags before they get here
Temperature = Annotated[float, Field(ge=0.0, le=2.0), Strict()]
TopP = Annotated[float, Field(gt=0.0, le=1.0), Strict()]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX, description="a signed 64-bit integer"), Strict()]
MinTokens = Annotated[int, Field(ge=0), Strict()]
#: the settings' ranges, strict as a request's numbers are
RequestTopK = Annotated[TopK, Strict()]
RequestRatio = Annotated[Ratio, Strict()]
RequestMassLeft = Annotated[MassLeft, Strict()]
RequestMaxTokens = Annotated[MaxTokens, Strict()]
RequestGranule = Annotated[Granule, Strict()]
#: ``n``: the choices of one request, 1 (OpenAI's field; one choice is all ragcache answers)
Choices = Annotated[int, Field(ge=1, le=1, description="only one choice per request"), Strict()]
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
    granule: RequestGranule | None = None

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


def blend_only_rule(mode: str, source: str = "") -> str:
    """Why a blend-only option is refused on a request of ``mode`` (one not in
    :data:`~ragcache.config.BLENDING_MODES`), ``source`` saying where the mode came from when the
    request named none ("" = the request's own ``mode``), with the fix."""
    where = f" ({source})" if source else ""
    fix = "drop it" if "blend_fallback" in source else "drop it, or ask in blend mode"
    return f"applies in {' or '.join(BLENDING_MODES)} mode only, and the request's mode is {mode!r}{where}: {fix}"


def check_blend_only(value: Any, info: ValidationInfo) -> Any:
    """Refuse a blend-only option on a request whose mode is set to one that never blends, where it
    would be ignored without a word (the validator of :data:`BLEND_ONLY`; the request's ``mode``,
    declared before these fields, is in ``info.data``). A request without a mode is checked against
    its server's default by :func:`check_request`.

    Raises:
        ValueError: the option is set and the request's mode is full, prefix or reuse (not one of
            :data:`~ragcache.config.BLENDING_MODES`).
    """
    mode = info.data.get("mode")
    if value is not None and mode is not None and mode not in BLENDING_MODES:
        raise ValueError(blend_only_rule(mode))
    return value


#: marks an option that only a blend reads (``Annotated[X | None, BLEND_ONLY]``): refused with another mode
BLEND_ONLY = AfterValidator(check_blend_only)


def _question_readers() -> str:
    """The strategies whose scores may read the question's attention, for messages: ``question or hybrid``."""
    readers = [n for n in strategies.names() if strategies.get(n).may_read_question]
    return " or ".join(readers)


def adaptive_rule(option: str, selection: str, source: str = "the request's", note: str = "",
                  fix: str = "") -> str:
    """Why ``option`` (``budget`` adaptive, or ``mass_left``) is refused with ``selection``, whose
    scores do not read the question's attention that the adaptive budget follows; ``source`` says
    whose selection it is, ``note`` why it does not read it (a setting), ``fix`` the other way out
    (default: a selection that reads the question)."""
    what = ("the adaptive budget follows the question's attention" if option == "budget" else
            "sets the adaptive budget's threshold on the question's attention")
    return (f"{what}, and {source} selection {selection!r}{note} does not read it: drop {option}, or "
            f"{fix or 'select by ' + _question_readers()}")


class QueryOptionsError(ValueError):
    """A request option out of its range or of another type, contradicting another option, or one
    the settings it runs under would ignore: one line naming the option (as the caller called it),
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
        mode: auto, full, prefix, reuse or blend (default ``engine.mode``).
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

    No option is dropped without a word; these are refused, each naming the fields:

    - the options marked :data:`BLEND_ONLY` (recompute_ratio, selection, budget, mass_left) with a
      ``mode`` that never blends (full, prefix, reuse; blend and auto take them), and, for a
      request without a mode, with a server default that never blends (:func:`check_request`);
    - ``mass_left`` with ``budget = "fixed"`` (the threshold of a budget not used);
    - ``budget = "adaptive"`` or ``mass_left`` with a selection whose scores never read the
      question's attention, which the adaptive budget follows (``deviation``), and, checked against
      the settings by :func:`check_request`, with the settings' selection or a hybrid whose
      ``blend.question_weight`` is 0.

    A setting's default gives way instead: a request's own selection that does not read the
    question runs with the ratio's (fixed) budget whatever ``blend.budget`` says, and a request's
    ``mass_left`` asks for the adaptive budget whatever ``blend.budget`` says.

    Numbers are strict: a boolean or a string is refused where a number is taken.

    Raises (on construction):
        pydantic.ValidationError: a value out of range or of another type, or one of the
            contradictions above.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode | None = Field(None, description="auto, full, prefix, reuse or blend (default engine.mode)")
    top_k: RequestTopK | None = Field(None, description="chunks retrieved (default retrieval.top_k)")
    recompute_ratio: Annotated[RequestRatio | None, BLEND_ONLY] = Field(
        None, description="share of context tokens recomputed in blend mode (default blend.recompute_ratio)")
    selection: Annotated[_Selection | None, BLEND_ONLY] = Field(
        None, description="blend's token selection, e.g. question or question/16 (default blend.selection)")
    budget: Annotated[BudgetMode | None, BLEND_ONLY] = Field(
        None, description="blend's recompute budget: adaptive (from the question's attention) or fixed (the ratio) "
        "(default blend.budget)")
    mass_left: Annotated[RequestMassLeft | None, BLEND_ONLY] = Field(
        None, description="adaptive budget: share of the question's attention that may stay on reused KV, in (0, 1) "
        "(default blend.mass_left)")

    @field_validator("budget")
    @classmethod
    def _check_budget(cls, v: str | None, info: ValidationInfo) -> str | None:
        sel = info.data.get("selection")
        if v == "adaptive" and sel is not None and not strategies.get(sel.strategy).may_read_question:
            raise ValueError(adaptive_rule("budget", sel.strategy))
        return v

    @field_validator("mass_left")
    @classmethod
    def _check_mass_left(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is None:
            return v
        if info.data.get("budget") == "fixed":
            raise ValueError("sets the adaptive budget's threshold, and the request's budget is 'fixed' (the ratio "
                             "alone): drop mass_left, or ask for budget adaptive")
        sel = info.data.get("selection")
        if sel is not None and not strategies.get(sel.strategy).may_read_question:
            raise ValueError(adaptive_rule("mass_left", sel.strategy))
        return v

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

    max_tokens: RequestMaxTokens | None = Field(None, description="tokens to decode (default engine.max_tokens)")
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

    def with_budget(self, ratio: float, mass_left: float | None = None) -> "QueryOptions":
        """These options with the recompute ratio the pipeline resolved for the request (from the
        settings or the index's calibration, both validated where they were read) and the
        calibration's ``mass_left``, each where the request set none (the request's own gives no way).
        Returns ``self`` when nothing changes."""
        update = {k: v for k, v in (("recompute_ratio", ratio), ("mass_left", mass_left))
                  if v is not None and getattr(self, k) is None}
        return self.model_copy(update=update) if update else self


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
    if isinstance(value, (dict, list, tuple, BaseModel)) or value is None:
        shown = ""
    else:  # a value of the wrong type as written: '0.1' is a string, True a boolean
        shown = f" {value!r}" if err.get("type", "").endswith("_type") else f" {value}"
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

#: where a request's mode comes from when it names none (words for :func:`check_request`'s ``mode_from``)
MODE_FROM_SETTING = "no mode given: the setting engine.mode"


def check_request(options: RequestOptions, blend: "BlendSettings", *, default_mode: str,
                  mode_from: str = MODE_FROM_SETTING, names: Mapping[str, str] | None = None,
                  given: Mapping[str, Any] | None = None) -> None:
    """Refuse what a request asks that the settings it will run under would drop without a word;
    called where the default mode is known, before any work (the pipeline's :meth:`prepare
    <ragcache.pipeline.RAGPipeline.prepare>`, the server, the CLI). What the request contradicts
    by itself was refused when it was built (:class:`RequestOptions`).

    Args:
        options: the request's options, as validated.
        blend: the ``[blend]`` settings in force (``blend.selection``, ``blend.question_weight``).
        default_mode: the mode a request without one gets (``engine.mode``, or a server's fallback).
        mode_from: where ``default_mode`` comes from, in words for the message
            (:data:`MODE_FROM_SETTING`, or ``serve.blend_fallback``'s).
        names: what the caller calls each option in messages (``{"mass_left": "--mass-left"}``).
        given: options set, with the value given, that ``options`` does not carry (the CLI's
            ``--recompute-ratio auto``, a setting for the run).

    Raises:
        QueryOptionsError: a blend-only option when the request's mode (its own, else
            ``default_mode``) is not one of :data:`~ragcache.config.BLENDING_MODES`; ``budget =
            "adaptive"`` or ``mass_left`` when the selection in force (the request's, else
            ``blend.selection``) does not read the question's attention with these settings.
    """
    names, given = names or {}, given or {}
    set_ = [f for f in RequestOptions.model_fields if getattr(options, f) is not None or f in given]

    def error(field: str, rule: str) -> QueryOptionsError:
        name, value = names.get(field, field), given.get(field, getattr(options, field))
        shown = "" if value is None else f" {value}"
        return QueryOptionsError(f"{name}{shown}: {rule}", field=field, name=name, value=value)

    mode = options.mode or default_mode
    if mode not in BLENDING_MODES:
        for field in set_:
            if _is_blend_only(field):
                raise error(field, blend_only_rule(mode, "" if options.mode else mode_from))
        return
    refusal = choose_budget(options, blend).refusal
    if refusal is not None:
        raise error(*refusal)


@dataclass(frozen=True)
class BudgetChoice:
    """The recompute budget a blend runs with, as :func:`choose_budget` decided it.

    Attributes:
        budget: ``"adaptive"`` (from the question's attention, within the settings' bounds
            ``max_recompute_ratio`` and ``max_recompute_tokens``) or ``"fixed"`` (the ratio alone).
        mass_left: the adaptive budget's threshold, in (0, 1): the request's, else ``blend.mass_left``.
        refusal: ``(option, rule)`` when the request asks for the adaptive budget (its ``budget =
            "adaptive"`` or its ``mass_left``) and the selection in force does not read the question's
            attention, which that budget follows: :func:`check_request` raises it as a
            :class:`QueryOptionsError`; None otherwise.
    """

    budget: BudgetMode
    mass_left: float
    refusal: tuple[str, str] | None = None


def choose_budget(options: RequestOptions, blend: "BlendSettings") -> BudgetChoice:
    """The one decision of a blend's recompute budget, from the request's options and the ``[blend]``
    settings (``blend.budget``, ``blend.mass_left``, ``blend.selection``; the ratio is the request's
    or the pipeline's, :meth:`QueryOptions.with_budget`).

    A setting's default gives way to what the request sets: a request's ``mass_left`` asks for the
    adaptive budget whatever ``blend.budget`` says (unless it sets ``budget``), and a selection that
    does not read the question's attention (the request's, else ``blend.selection``; a hybrid whose
    ``blend.question_weight`` is 0) runs with the fixed budget whatever ``blend.budget`` says. What
    the request itself asks for and cannot have is returned as :attr:`BudgetChoice.refusal`.
    """
    strategy = options.selection.strategy if options.selection is not None else blend.selection
    record = strategies.get(strategy)
    granule = options.selection.granule if options.selection is not None else None
    reads_question = record.needs_question(strategies.Selection.from_settings(blend, strategy, granule))
    budget = options.budget or ("adaptive" if options.mass_left is not None else blend.budget)
    mass_left = blend.mass_left if options.mass_left is None else options.mass_left
    asks = "mass_left" if options.mass_left is not None else "budget" if options.budget == "adaptive" else None
    refusal = None
    if asks is not None and options.budget != "fixed" and not reads_question:
        if options.selection is None:
            rule = adaptive_rule(asks, strategy, "the", " (no selection given: the setting blend.selection)")
        else:
            knobs = ", ".join(f"blend.{k} = {getattr(blend, k)!r}" for k in record.settings)
            rule = adaptive_rule(asks, strategy, "the request's", f" with {knobs}" if knobs else "",
                                 f"change {knobs}" if knobs else "")
        refusal = (asks, rule)
    return BudgetChoice(budget if reads_question else "fixed", mass_left, refusal)


def choose_ratio(override: float | None, blend: "BlendSettings",
                 calibration: Callable[[], Any] = lambda: None) -> tuple[float, float | None, str]:
    """A blend's recompute ratio, the adaptive threshold that goes with it, and where the ratio came
    from: ``"request"`` (``override``), ``"settings"`` (a number in ``blend.recompute_ratio``),
    ``"calibration"`` (``blend.recompute_ratio = "auto"`` and ``calibration()``, the index's
    calibration, has a ratio) or ``"fallback"`` (``"auto"`` without one: ``blend.fallback_ratio``).

    Args:
        calibration: called only for ``"auto"``: None, or a record with ``ratio`` and ``mass_left``
            (float or None; :class:`ragcache.quality.records.Calibration`).

    Returns:
        ``(ratio, mass_left, source)``: ``mass_left`` is the calibration's where the ratio is
        (the threshold was fitted with it), else None; the request's own ``mass_left`` comes first
        (:meth:`QueryOptions.with_budget`).
    """
    if override is not None:
        return float(override), None, "request"
    if blend.recompute_ratio != "auto":
        return float(blend.recompute_ratio), None, "settings"
    cal = calibration()
    if cal is not None and cal.ratio is not None:
        return cal.ratio, cal.mass_left, "calibration"
    return blend.fallback_ratio, None, "fallback"


def blend_knobs(blend: "BlendSettings", options: RequestOptions) -> "BlendKnobs":
    """One request's blend parameters (:class:`~ragcache.config.BlendKnobs`): the ``[blend]``
    settings, with the request's own recompute ratio, selection and granule where its options set
    them, ``recompute_ratio = "auto"`` unresolved by the caller read as ``blend.fallback_ratio``, the
    check layer resolved for the strategy, and the budget :func:`choose_budget` decides.

    Nothing is range-checked here: the settings were validated when they were loaded, the options
    where the request entered.

    Raises:
        ValueError: the request's selection measures KV deviation while ``blend.check_layer`` is 0.
    """
    sel = options.selection
    strategy = sel.strategy if sel is not None else blend.selection
    choice = choose_budget(options, blend)
    return BlendKnobs.model_construct(**{
        **blend.model_dump(), "selection": strategy,
        "granule": blend.granule if sel is None or sel.granule is None else sel.granule,
        "recompute_ratio": blend.static_ratio if options.recompute_ratio is None else options.recompute_ratio,
        "check_layer": blend.check_layer_for(strategy), "budget": choice.budget, "mass_left": choice.mass_left})


def _is_blend_only(field: str) -> bool:
    """Whether the :class:`RequestOptions` field ``field`` is marked :data:`BLEND_ONLY`."""
    return any(m is BLEND_ONLY for m in RequestOptions.model_fields[field].metadata)


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
