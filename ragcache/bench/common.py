"""What several benchmark runners share: variants, their order, warm-ups, records and targets.

Owns: :class:`Variant` (a way of answering, as data: a mode and, for ``blend``, its recompute
ratio), :func:`make_variants` and :func:`main_blend`; the untimed warm-ups (engine start-up
costs, vLLM's prefix cache for ``prefix``); gold-answer token ids; the per-request record
(:class:`~ragcache.engine.messages.RequestMetrics` as plain data, plus the answer); the targets
the results are judged by; the error for invalid benchmark parameters. Runners call the engine's
public methods only. Imports ragcache.chunks/config; the engine only for type checking; never
app/ or ui/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ragcache import strategies
from ragcache.bench.metrics import rounded
from ragcache.chunks import Chunk
from ragcache.config import MODES
from ragcache.quality.table import PROMPT_CLASS_EDGES, prompt_class
from ragcache.options import QueryOptions, QueryOptionsError, SelectionSpec

if TYPE_CHECKING:
    from ragcache.engine import BlendEngine, Generation

#: progress lines of a runner (the CLI prints them to stderr)
Progress = Callable[[str], None]
#: receives the result so far (``"partial": True``) after every example
Checkpoint = Callable[[dict[str, Any]], None]

#: question of the untimed warm-up requests that fill vLLM's prefix cache for ``prefix`` mode
WARMUP_QUESTION = "What are these documents about?"

#: the targets results are judged by (KL(full || mode) of ``reuse`` is the yardstick of blend's KL).
#: Speed and answer agreement depend on the prompt's length: a blend's fixed costs (the question probe,
#: ``blend.min_recompute_tokens``) weigh more on short prompts, and there quality comes before speed.
TARGETS = {
    "blend_ttft_speedup_min": {"short": 2.2, "mid": 3.0, "long": 4.0},  # TTFT(best full) / TTFT(blend)
    "blend_kl_vs_reuse_max": {"mid": 0.15, "long": 0.15},  # first-token KL <= 0.15 of reuse's
    "blend_agree_em_min": {"short": 0.5, "mid": 0.8},   # share of answers equal to full prefill's
    "blend_agree_rouge_l_min": {"short": 0.75, "mid": 0.7, "long": 0.7},  # Rouge-L against full's answer
    "blend_f1_vs_full_min": {"short": 0.9},              # gold F1 of blend / gold F1 of full
    "full_vs_plain_max": 1.05,          # the connector costs full prefill at most 5%
    "ratio_one_vs_plain_max": 1.1,      # the own layer-wise path at ratio 1 costs <= 1.1x plain vLLM's prefill
    "blend_nll_rel_max": 0.05,          # blend gold NLL at most 5% above full's (below is better)
    "hotset_last_vs_first_min": 0.9,    # speedup of the last 10 questions >= 90% of the first 10
    "disk_vs_cpu_ttft_max": 1.2,        # disk-tier blend TTFT <= 1.2x cpu-tier, pipeline_overlap on
    "blend_ops_max": 1000,              # operators one blend dispatches in the worker (any length, any device)
}
#: prompt-length classes by mean prompt tokens: short below ``mid``, long from ``long`` on (the router's
#: classes, :data:`ragcache.quality.table.PROMPT_CLASS_EDGES`)
PROMPT_LENGTHS = dict(zip(("mid", "long"), PROMPT_CLASS_EDGES))


def prompt_length(prompt_tokens: float | None) -> str:
    """``"short"``, ``"mid"`` or ``"long"`` for a mean prompt length in tokens
    (:func:`ragcache.quality.table.prompt_class`; None: long, the strictest speed target)."""
    return "long" if prompt_tokens is None else prompt_class(prompt_tokens)


class BenchConfigError(ValueError):
    """A benchmark parameter is invalid (unknown mode, ratio outside [0, 1], too few examples...)."""


def target(value: float | None, limit: float, kind: str, note: str) -> dict[str, Any]:
    """A target record: ``kind`` is ``min`` (value >= limit) or ``max`` (value <= limit); ``met`` is
    None when the value could not be measured."""
    checks = {"min": lambda v: v >= limit, "max": lambda v: v <= limit}
    return {"value": rounded(value, 4), kind: limit, "met": None if value is None else checks[kind](value),
            "note": note}


#: the plain-vLLM baseline (no ragcache connector), run in a child process by ``bench ttft``
PLAIN = "plain"
#: full prefill by a plain vLLM engine in the other compute dtype (:func:`other_dtype`), in a child
#: process: how often it agrees with ragcache's full prefill is the noise floor of every agreement
#: figure (the answers two correct prefills give when only their rounding differs)
FLOOR = "floor"
#: what ``--modes`` accepts: ragcache's modes plus the plain baseline and the noise floor
BENCH_MODES: tuple[str, ...] = (*MODES, PLAIN, FLOOR)


def other_dtype(dtype: str) -> str:
    """The dtype the noise floor (:data:`FLOOR`) runs in: float32 beside a 16-bit engine, bfloat16
    beside a float32 one."""
    return "bfloat16" if dtype == "float32" else "float32"


@dataclass(frozen=True)
class Variant:
    """A way of answering: a mode, and for ``blend`` its recompute ratio, token selection and budget.

    ``name`` keys the results: ``full``, ``plain``, ``reuse``, ``blend@0.15`` (the default
    selection and budget), ``blend:question@0.15`` or ``blend@0.15/fixed``.

    ``budget`` is a budget spec (:func:`budget_options`): ``"fixed"``, ``"adaptive"`` or the
    adaptive budget's ``mass_left`` as a number (``"0.02"``); None for the settings' own.
    """

    name: str
    mode: str
    ratio: float | None = None
    selection: str | None = None
    budget: str | None = None

    @property
    def spec(self) -> SelectionSpec | None:
        """The selection as strategy and granule (:meth:`SelectionSpec.parse`); None for the settings' own."""
        return SelectionSpec.parse(self.selection) if self.selection else None

    def options(self, max_tokens: int | None = None) -> QueryOptions:
        """This variant's requests (``max_tokens`` decoded; the engine's default when None).

        Raises:
            QueryOptionsError: a ratio, selection or ``max_tokens`` out of range.
        """
        return QueryOptions.parse({"mode": None if self.mode in (PLAIN, FLOOR) else self.mode,
                                   "recompute_ratio": self.ratio,
                                   "selection": self.selection, "max_tokens": max_tokens,
                                   **budget_options(self.budget)})


def budget_options(spec: str | None) -> dict[str, Any]:
    """The query options of a budget spec: ``"fixed"`` or ``"adaptive"`` (``budget``), or a number
    (the adaptive budget at that ``mass_left``); none for None.

    Raises:
        BenchConfigError: another word, or a number outside (0, 1).
    """
    if spec is None:
        return {}
    if spec in ("fixed", "adaptive"):
        return {"budget": spec}
    try:
        mass = float(spec)
    except ValueError:
        raise BenchConfigError(f"unknown budget {spec!r}; use fixed, adaptive or the adaptive budget's mass_left "
                               "(e.g. 0.02)") from None
    try:
        QueryOptions.parse({"budget": "adaptive", "mass_left": mass}, {"mass_left": "budget"})
    except QueryOptionsError as exc:
        raise BenchConfigError(str(exc)) from None
    return {"budget": "adaptive", "mass_left": mass}


def ratio_name(ratio: float, selection: str | None = None, budget: str | None = None) -> str:
    """The variant name of blend at ``ratio`` (and a non-default ``selection`` and ``budget``):
    ``blend@0.15``, ``blend:question@0.15``, ``blend@0.15/fixed``, ``blend@0.15/0.02``."""
    name = f"blend:{selection}@{ratio:g}" if selection else f"blend@{ratio:g}"
    return f"{name}/{budget}" if budget else name


def make_variants(modes: Sequence[str], ratios: Sequence[float], default_ratio: float,
                  selections: Sequence[str] = (), default_selection: str | None = None,
                  budgets: Sequence[str] = ()) -> list[Variant]:
    """``full`` first (the reference of every comparison), then the modes; ``blend`` expands to one
    variant per ratio in ``ratios`` plus ``default_ratio``, for each of ``selections`` (default:
    just ``default_selection``, named without it) and each of ``budgets`` (budget specs,
    :func:`budget_options`; default: the settings' budget, named without it).

    Raises:
        BenchConfigError: an unknown mode, selection or budget, or a ratio outside [0, 1].
    """
    for b in budgets:
        budget_options(b)
    for m in modes:
        if m not in BENCH_MODES:
            raise BenchConfigError(f"unknown mode {m!r}; use some of {', '.join(BENCH_MODES)}")
    for r in [*ratios, default_ratio]:
        try:
            QueryOptions.parse({"recompute_ratio": r}, {"recompute_ratio": "recompute ratio"})
        except QueryOptionsError as exc:
            raise BenchConfigError(str(exc)) from None
    for sel in selections:
        try:
            QueryOptions.parse({"selection": sel})
        except (QueryOptionsError, ValueError) as exc:
            raise BenchConfigError(f"unknown selection {sel!r} ({exc}); use some of "
                                   f"{', '.join(strategies.names())}, each optionally with /GRANULE (e.g. question/16)"
                                   ) from None
    named = len(set(selections)) > 1 or (bool(selections) and selections[0] != default_selection)
    out = [Variant("full", "full")]
    for m in dict.fromkeys(modes):
        if m == "full":
            continue
        if m == "blend":
            for sel in (dict.fromkeys(selections) or [default_selection]):
                for b in (dict.fromkeys(budgets) or [None]):
                    out += [Variant(ratio_name(r, sel if named else None, b), "blend", r, sel, b)
                            for r in sorted(set(ratios) | {default_ratio})]
        else:
            out.append(Variant(m, m))
    return out


def main_blend(variants: Sequence[Variant], default_ratio: float, selection: str, granule: int) -> Variant | None:
    """The blend variant a run reports as "blend" (the main table, the stage table, the targets): at
    ``default_ratio``, the one that selects as the settings do (``selection`` with runs of
    ``granule``: ``question``, ``question/8``), else the first at that ratio (a run of other
    selections only, e.g. ``--selections deviation`` or ``question/1,question/16``); None without
    blend variants at that ratio."""
    at_ratio = [v for v in variants if v.mode == "blend" and v.ratio == default_ratio]
    at_ratio = [v for v in at_ratio if v.budget in (None, "adaptive")] or at_ratio  # the settings' budget first
    for v in at_ratio:
        spec = v.spec
        if spec is None or (spec.strategy == selection and (spec.granule or granule) == granule):
            return v
    return at_ratio[0] if at_ratio else None


def warm_up(engine: "BlendEngine", chunks: Sequence[Chunk], modes: Sequence[str] = ("full", "blend")) -> None:
    """One untimed short request per mode: the first request after start-up pays one-time costs
    (kernel set-up, allocations; seconds on CPU) that would otherwise land in one timed TTFT."""
    prompt = engine.prompts.build(WARMUP_QUESTION, list(chunks)[:2])
    for mode in dict.fromkeys(modes):
        engine.generate(prompt, QueryOptions(mode=mode, max_tokens=2))
    engine.reset_prefix_cache()


def warm_prefix_cache(engine: "BlendEngine", chunks: Sequence[Chunk], how: str) -> None:
    """Fill vLLM's prefix cache before a timed ``prefix`` request (the warm-up itself is not timed).

    ``chunks``: each chunk once on its own right after the prompt head (what ingest gives blend),
        so only the head and the prompt's first chunk can be exact-prefix hits;
    ``context``: the same chunks in the same order with another question (the best case for
        prefix caching: a repeated chunk set);
    ``none``: nothing (``prefix`` then costs a full prefill).
    """
    if how == "none":
        return
    if how == "chunks":
        prompts = [engine.prompts.build(WARMUP_QUESTION, [c]) for c in chunks]
    elif how == "context":
        prompts = [engine.prompts.build(WARMUP_QUESTION, list(chunks))]
    else:
        raise ValueError(f"unknown prefix warm-up {how!r}; use chunks, context or none")
    engine.generate_many(prompts, QueryOptions(mode="prefix", max_tokens=1))


def answer_ids(engine: "BlendEngine", answer: str) -> list[int]:
    """Token ids of a gold answer as the assistant would write it (no BOS, no end-of-turn)."""
    return list(engine.tokenizer(answer.strip(), add_special_tokens=False)["input_ids"])


def _rounded_floats(value: Any) -> Any:
    if isinstance(value, float):
        return rounded(value)
    if isinstance(value, dict):
        return {k: _rounded_floats(v) for k, v in value.items()}
    return value


def request_record(g: "Generation") -> dict[str, Any]:
    """One request as result data: every field of its ``RequestMetrics.to_dict()`` (seconds rounded
    to 4 decimals) and the ``answer`` text."""
    rec = {k: _rounded_floats(v) for k, v in g.metrics.to_dict().items()}
    rec["answer"] = g.text
    return rec


def speedup(full: "Generation", g: "Generation") -> float | None:
    """TTFT(full) / TTFT(g) of two requests for the same prompt (None when g's TTFT is 0)."""
    return rounded(full.metrics.ttft_s / g.metrics.ttft_s) if g.metrics.ttft_s > 0 else None
