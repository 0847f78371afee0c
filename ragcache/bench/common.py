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

from ragcache.bench.metrics import rounded
from ragcache.chunks import Chunk
from ragcache.config import MODES, SELECTIONS
from ragcache.options import QueryOptions, QueryOptionsError, SelectionSpec

if TYPE_CHECKING:
    from ragcache.engine import BlendEngine, Generation

#: progress lines of a runner (the CLI prints them to stderr)
Progress = Callable[[str], None]
#: receives the result so far (``"partial": True``) after every example
Checkpoint = Callable[[dict[str, Any]], None]

#: question of the untimed warm-up requests that fill vLLM's prefix cache for ``prefix`` mode
WARMUP_QUESTION = "What are these documents about?"

#: the targets results are judged by, as issues 21 (speed) and 22 (quality) set them (KL(full || mode)
#: of ``reuse`` is the yardstick of blend's KL)
TARGETS = {
    "blend_ttft_speedup_min": 4.0,      # blend (default ratio) TTFT >= 4x lower than full and plain vLLM ...
    "blend_ttft_speedup_short_min": 2.5,  # ... on ~6k-token prompts; >= 2.5x on short ones (HotpotQA, ~1.5k)
    "long_prompt_tokens": 4000,         # mean prompt length from which the 4x target applies
    "full_vs_plain_max": 1.05,          # the connector costs full prefill at most 5%
    "blend_worker_vs_floor_max": 1.2,   # blend worker time <= 1.2x its compute floor (against plain vLLM)
    "ratio_one_vs_plain_max": 1.1,      # the own layer-wise path at ratio 1 costs <= 1.1x plain vLLM's prefill
    "question_probe_share_max": 0.05,   # the question probe takes <= 5% of blend's TTFT
    "blend_loop_share_max": 0.0,        # no blend answer with a repetition loop
    "blend_kl_vs_reuse_max": 0.15,      # blend first-token KL <= 0.15 of reuse's
    "blend_nll_rel_max": 0.05,          # blend gold NLL at most 5% above full's (below is better)
    "blend_agree_rouge_l_min": 0.7,     # blend's answer agrees with full's (Rouge-L)
    "hotset_last_vs_first_min": 0.9,    # speedup of the last 10 questions >= 90% of the first 10
    "disk_vs_cpu_ttft_max": 1.2,        # disk-tier blend TTFT <= 1.2x cpu-tier, pipeline_overlap on
}


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
#: what ``--modes`` accepts: ragcache's modes plus the plain baseline
BENCH_MODES: tuple[str, ...] = (*MODES, PLAIN)


@dataclass(frozen=True)
class Variant:
    """A way of answering: a mode, and for ``blend`` its recompute ratio and token selection.

    ``name`` keys the results: ``full``, ``plain``, ``reuse``, ``blend@0.15`` (the default
    selection) or ``blend:question@0.15``.
    """

    name: str
    mode: str
    ratio: float | None = None
    selection: str | None = None

    @property
    def spec(self) -> SelectionSpec | None:
        """The selection as strategy and granule (:meth:`SelectionSpec.parse`); None for the settings' own."""
        return SelectionSpec.parse(self.selection) if self.selection else None

    def options(self, max_tokens: int | None = None) -> QueryOptions:
        """This variant's requests (``max_tokens`` decoded; the engine's default when None).

        Raises:
            QueryOptionsError: a ratio, selection or ``max_tokens`` out of range.
        """
        return QueryOptions.parse({"mode": None if self.mode == PLAIN else self.mode, "recompute_ratio": self.ratio,
                                   "selection": self.selection, "max_tokens": max_tokens})


def ratio_name(ratio: float, selection: str | None = None) -> str:
    """The variant name of blend at ``ratio`` (and a non-default ``selection``): ``blend@0.15``,
    ``blend:question@0.15``."""
    return f"blend:{selection}@{ratio:g}" if selection else f"blend@{ratio:g}"


def make_variants(modes: Sequence[str], ratios: Sequence[float], default_ratio: float,
                  selections: Sequence[str] = (), default_selection: str | None = None) -> list[Variant]:
    """``full`` first (the reference of every comparison), then the modes; ``blend`` expands to one
    variant per ratio in ``ratios`` plus ``default_ratio``, for each of ``selections`` (default:
    just ``default_selection``, named without it).

    Raises:
        BenchConfigError: an unknown mode or selection, or a ratio outside [0, 1].
    """
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
            raise BenchConfigError(f"unknown selection {sel!r} ({exc}); use some of {', '.join(SELECTIONS)}, each "
                                   "optionally with /GRANULE (e.g. question/16)") from None
    named = len(set(selections)) > 1 or (bool(selections) and selections[0] != default_selection)
    out = [Variant("full", "full")]
    for m in dict.fromkeys(modes):
        if m == "full":
            continue
        if m == "blend":
            for sel in (dict.fromkeys(selections) or [default_selection]):
                out += [Variant(ratio_name(r, sel if named else None), "blend", r, sel)
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
