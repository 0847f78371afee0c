"""Routing (``engine.mode = "auto"``): each request takes blend or full prefill, whichever is predicted
sooner at full prefill's answer quality.

Owns: :class:`CostModel` (TTFT of full prefill and of blend, fitted on this host from measured
requests), :class:`RouteInputs` (what is known of a request before it is scheduled),
:class:`Router` (the decision, :meth:`Router.decide`, and the model kept fresh from the engine's own
finished requests, :meth:`Router.observe`) and :class:`Route` (the decision and why, carried into
``RequestMetrics.route`` / ``route_reason`` / ``route_rule``). The quality side is the index's
:class:`~ragcache.quality.table.QualityTable` (``ragcache calibrate``), looked up per prompt-length
class and passage-length class (a class it did not measure takes the verdict of its passage class at the
nearest prompt length, :meth:`~ragcache.quality.table.QualityTable.nearest`); without either, the
conservative prior :meth:`~ragcache.quality.table.QualityTable.prior` decides.

The cost model (x = tokens / 1000; every coefficient >= 0, fitted by non-negative least squares):

- full prefill of ``n`` uncached tokens at prompt length ``N``:
  ``f0 + f1 * x_n + f2 * x_n * x_N`` (projections and MLP linear in the tokens, attention linear in
  tokens times context);
- blend of a context of ``C`` tokens with ``R`` recomputed tokens and a tail of ``q`` tokens:
  ``b0 + b1 * x_C + g * (f1 * x_Rq + f2 * x_Rq * x_N) + load``: fixed costs, per-context-token costs
  (moving the KV, the check layers, writing the paged cache), and the recomputed tokens and the tail
  priced as prefill's tokens times ``g`` (selective compute is less efficient per token than a
  dense prefill); ``load`` is seconds per token of the tiers expected to serve the chunks.

Until :attr:`RouteSettings.min_blend_samples <ragcache.config.RouteSettings>` blends were measured,
``b0``, ``b1`` and ``g`` are conservative priors (blend looks slower than it usually is); while the
blends measured have contexts within a factor of two of each other, the prior's shape is scaled to
their times (one length cannot tell fixed from per-token costs); until full
prefills of three lengths reaching 2,048 tokens were measured, full prefill's attention term is tied
to its linear term. Imports no vLLM and no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ragcache.config import RouteSettings
from ragcache.quality.table import QualityTable, passage_class, prompt_class

log = logging.getLogger(__name__)

#: the tier assumed for a chunk the router has not seen served yet
UNSEEN_TIER = "disk"
#: chunks whose serving tier the router remembers (the least recently served are forgotten)
TIERS_REMEMBERED = 65536
#: prior seconds per 1,000 context tokens loaded from each tier (replaced by measured medians)
LOAD_PRIOR_S = {"device": 0.0, "cpu": 0.004, "disk": 0.02, "remote": 0.05, "computed": 0.0}
#: prior blend costs: fixed seconds, per-context-token share of full prefill's linear cost, and the
#: recomputed tokens' cost relative to prefill's per token; conservative (blend priced high)
PRIOR_B0_S = 0.05
PRIOR_B1_SHARE = 0.25
PRIOR_G = 2.5
#: full prefill's attention term relative to its linear term until prompts of several lengths up to
#: :data:`SPREAD_TOKENS` were measured (attention costs as much as the projections and MLP at ~3k tokens)
PRIOR_ATTENTION_SHARE = 0.3
SPREAD_TOKENS = 2048


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares: ``argmin ||a @ w - y||`` with ``w >= 0`` (scipy's Lawson-Hanson).

    Args:
        a: ``[samples, features]`` float64. y: ``[samples]`` float64.
    """
    from scipy.optimize import nnls as scipy_nnls

    return scipy_nnls(a, y)[0]


@dataclass(frozen=True)
class RouteInputs:
    """What is known of a request before it is scheduled. Tokens.

    Attributes:
        prompt_tokens: the whole prompt. ctx_tokens: the context a blend serves from cached KV.
        tail_tokens: the question tail vLLM prefills either way. chunks: retrieved chunks.
        passage_tokens: mean tokens per retrieved chunk (0 without chunks).
        recompute_tokens: the context tokens a blend is predicted to recompute.
        tier_tokens: context tokens per tier expected to serve them (:data:`UNSEEN_TIER` for chunks
            not seen served yet).
        cached_prefix_tokens: prompt tokens full prefill finds in vLLM's prefix cache (0 when its
            requests do not share exact-prefix blocks).
    """

    prompt_tokens: int
    ctx_tokens: int
    tail_tokens: int
    chunks: int
    passage_tokens: float
    recompute_tokens: int
    tier_tokens: Mapping[str, int] = field(default_factory=dict)
    cached_prefix_tokens: int = 0


@dataclass(frozen=True)
class Route:
    """A routing decision.

    Attributes:
        mode: the mode that runs (``"full"`` or ``"blend"``; an explicit mode as asked).
        rule: a short code for metrics labels: ``explicit``, ``faster``, ``slower``, ``quality``,
            ``no_context``, ``unavailable``.
        reason: one sentence for people.
        full_s, blend_s: predicted TTFT of each path, seconds (None for an explicit mode).
        decide_s: seconds the decision took.
    """

    mode: str
    rule: str
    reason: str
    full_s: float | None = None
    blend_s: float | None = None
    decide_s: float = 0.0

    @property
    def predicted_speedup(self) -> float | None:
        """Predicted full-prefill TTFT / blend TTFT, or None."""
        if self.full_s is None or not self.blend_s:
            return None
        return self.full_s / self.blend_s


@dataclass
class CostModel:
    """TTFT of full prefill and of blend on this host (see the module docstring for the formulas).

    Attributes:
        f: ``(f0, f1, f2)`` full prefill, seconds. b: ``(b0, b1, g)`` blend. load_s: seconds per
        1,000 tokens by tier. full_samples, blend_samples: requests the fit used.
    """

    f: tuple[float, float, float] = (0.05, 0.3, 0.09)
    b: tuple[float, float, float] = (PRIOR_B0_S, PRIOR_B1_SHARE * 0.3, PRIOR_G)
    load_s: dict[str, float] = field(default_factory=lambda: dict(LOAD_PRIOR_S))
    full_samples: int = 0
    blend_samples: int = 0

    def full(self, uncached: int, prompt_tokens: int) -> float:
        """Predicted TTFT (seconds) of full prefill of ``uncached`` tokens in a ``prompt_tokens`` prompt."""
        f0, f1, f2 = self.f
        xn, xN = uncached / 1000, prompt_tokens / 1000
        return f0 + f1 * xn + f2 * xn * xN

    def compute(self, tokens: int, prompt_tokens: int) -> float:
        """Full prefill's compute (no fixed cost) for ``tokens`` queries over a ``prompt_tokens`` context."""
        _, f1, f2 = self.f
        x, xN = tokens / 1000, prompt_tokens / 1000
        return f1 * x + f2 * x * xN

    def blend(self, inp: RouteInputs) -> float:
        """Predicted TTFT (seconds) of a blend of ``inp``."""
        b0, b1, g = self.b
        load = sum(self.load_s.get(tier, self.load_s[UNSEEN_TIER]) * n / 1000 for tier, n in inp.tier_tokens.items())
        return (b0 + b1 * inp.ctx_tokens / 1000 + g * self.compute(inp.recompute_tokens + inp.tail_tokens,
                                                                   inp.prompt_tokens) + load)

    @classmethod
    def fit(cls, full: Sequence[tuple[int, int, float]], blend: Sequence[tuple[RouteInputs, float, float]],
            loads: Mapping[str, float] | None = None, min_blend_samples: int = 3) -> "CostModel":
        """Fit on measured requests.

        Args:
            full: ``(uncached tokens, prompt tokens, TTFT seconds)`` of full prefills.
            blend: ``(inputs as served, TTFT seconds, load seconds)`` of blends (``recompute_tokens``
                the budget actually used, ``tier_tokens`` the tiers that served).
            loads: measured seconds per 1,000 tokens by tier (the others keep :data:`LOAD_PRIOR_S`).
            min_blend_samples: blends needed before ``b`` is fitted rather than the priors.

        Raises:
            ValueError: no full-prefill sample (the blend's prices are relative to it).
        """
        if not full:
            raise ValueError("the cost model needs at least one measured full prefill")
        xn = np.array([u / 1000 for u, _, _ in full])
        xN = np.array([n / 1000 for _, n, _ in full])
        y = np.array([t for _, _, t in full])
        if len({round(n, 1) for n in xN}) >= 3 and xN.max() >= max(2 * xN.min(), SPREAD_TOKENS / 1000):
            f0, f1, f2 = nnls(np.stack([np.ones_like(xn), xn, xn * xN], axis=1), y)
        else:  # too few lengths to separate attention from the linear work: tie them
            w0, w1 = nnls(np.stack([np.ones_like(xn), xn + PRIOR_ATTENTION_SHARE * xn * xN], axis=1), y)
            f0, f1, f2 = w0, w1, w1 * PRIOR_ATTENTION_SHARE
        model = cls(f=(float(f0), float(f1), float(f2)), full_samples=len(full))
        model.load_s.update(loads or {})
        prior = (PRIOR_B0_S, PRIOR_B1_SHARE * (model.full(1000, 1000) - model.f[0]), PRIOR_G)
        model.b = prior  # per context token, a share of what a 1k-token prefill costs per token here
        if len(blend) >= min_blend_samples:
            rows = np.array([[1.0, inp.ctx_tokens / 1000,
                              model.compute(inp.recompute_tokens + inp.tail_tokens, inp.prompt_tokens)]
                             for inp, _, _ in blend])
            ys = np.array([max(0.0, ttft - load) for _, ttft, load in blend])
            ctx = rows[:, 1]
            if ctx.max() >= 2 * ctx.min():  # lengths far enough apart to tell fixed, per-token and compute costs
                b0, b1, g = nnls(rows, ys)
                model.b = (float(b0), float(b1), float(g))
            else:  # one length: the prior's shape, scaled to what the blends took
                scale = float(np.median(ys / np.maximum(rows @ np.array(prior), 1e-9)))
                model.b = tuple(scale * c for c in prior)
            model.blend_samples = len(blend)
        return model

    def describe(self) -> str:
        """One line: the fitted coefficients and what they rest on."""
        f0, f1, f2 = self.f
        b0, b1, g = self.b
        blend = (f"fitted on {self.blend_samples} blends" if self.blend_samples
                 else "priced by the conservative prior until blends are measured")
        return (f"full prefill {f0:.3f} s + {f1:.3f} s/1k tokens + {f2:.4f} s/1k tokens^2 ({self.full_samples} "
                f"requests); blend {b0:.3f} s + {b1:.3f} s/1k context tokens + {g:.2f}x prefill's cost of its "
                f"recomputed tokens ({blend})")


def host_class(device: str, cpu_flags: Sequence[str] = ()) -> str:
    """The kind of host a measurement holds for: ``"cuda"`` (or another accelerator's type) or the CPU's
    fastest matrix unit: ``"cpu-amx"``, ``"cpu-avx512_bf16"``, ``"cpu-avx512"``, ``"cpu-avx2"``,
    ``"cpu"``."""
    kind = device.split(":")[0]
    if kind != "cpu":
        return kind
    flags = set(cpu_flags)
    for flag, name in (("amx_bf16", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if flag in flags:
            return f"cpu-{name}"
    return "cpu"


class Router:
    """Decides each ``auto`` request's path and keeps the cost model fresh (thread-safe).

    Args:
        settings: the ``[route]`` settings.
        host: :func:`host_class` of this engine (a quality table measured elsewhere is stale).
    """

    def __init__(self, settings: RouteSettings, host: str):
        self.settings = settings
        self.host = host
        self._lock = threading.Lock()
        self._full: deque[tuple[int, int, float]] = deque(maxlen=settings.window)
        self._blend: deque[tuple[RouteInputs, float, float]] = deque(maxlen=settings.window)
        self._shares: deque[tuple[str, float]] = deque(maxlen=settings.window)  # (prompt class, recomputed share)
        self._tier_of: OrderedDict[str, str] = OrderedDict()  # chunk key -> the tier that last served it
        self._loads: dict[str, deque[float]] = {}
        self._model: CostModel | None = None
        self.decisions: dict[tuple[str, str], int] = {}

    # ---- the model ---------------------------------------------------------------------------

    @property
    def model(self) -> CostModel | None:
        """The current cost model (None before any full prefill was measured)."""
        with self._lock:
            return self._current()

    def _current(self) -> CostModel | None:
        if self._model is None and self._full:
            loads = {t: statistics.median(v) for t, v in self._loads.items() if v}
            self._model = CostModel.fit(list(self._full), list(self._blend), loads, self.settings.min_blend_samples)
        return self._model

    def add_full(self, uncached: int, prompt_tokens: int, ttft_s: float) -> None:
        """Record one measured full prefill (start-up measurement or a finished request)."""
        if ttft_s <= 0 or uncached <= 0:
            return
        with self._lock:
            self._full.append((uncached, prompt_tokens, ttft_s))
            self._model = None

    def observe(self, metrics: Any, segment_keys: Sequence[str] = ()) -> None:
        """Feed a finished request's :class:`~ragcache.engine.messages.RequestMetrics` to the model.

        Full and prefix requests add a full-prefill sample; blends without missing chunks or a load
        error add a blend sample (TTFT, its measured load seconds and recomputed share) and record
        which tier served each chunk (``segment_keys``: the prompt's chunk keys, in order).
        """
        if metrics.ttft_s <= 0 or metrics.load_error:
            return
        if metrics.mode in ("full", "prefix"):
            self.add_full(metrics.prompt_tokens - metrics.num_cached_tokens, metrics.prompt_tokens, metrics.ttft_s)
            return
        if metrics.mode != "blend" or not metrics.ctx_tokens:
            return
        with self._lock:
            for key, tier in zip(segment_keys, metrics.chunk_tiers):
                self._tier_of[key] = "cpu" if tier == "computed" else tier  # a computed chunk is stored now
                self._tier_of.move_to_end(key)
            while len(self._tier_of) > TIERS_REMEMBERED:
                self._tier_of.popitem(last=False)
            if metrics.missing_computed_tokens:
                return
            tiers = set(metrics.chunk_tiers)
            if len(tiers) == 1:
                self._loads.setdefault(tiers.pop(), deque(maxlen=self.settings.window)).append(
                    metrics.load_s * 1000 / metrics.ctx_tokens)
            budget = metrics.recompute_budget or metrics.recomputed_tokens
            inp = RouteInputs(prompt_tokens=metrics.prompt_tokens, ctx_tokens=metrics.ctx_tokens,
                              tail_tokens=metrics.prompt_tokens - metrics.ctx_tokens, chunks=len(metrics.chunk_tiers),
                              passage_tokens=0.0, recompute_tokens=budget)
            self._blend.append((inp, metrics.ttft_s, metrics.load_s))
            if metrics.budget_mode == "adaptive":
                self._shares.append((prompt_class(metrics.prompt_tokens), budget / metrics.ctx_tokens))
            self._model = None

    # ---- the inputs --------------------------------------------------------------------------

    def recompute_tokens(self, ctx_tokens: int, prompt_tokens: int, *, ratio: float, adaptive: bool,
                         min_tokens: int, max_ratio: float, max_tokens: int) -> int:
        """The context tokens a blend is predicted to recompute: the ratio's budget (at least
        ``min_tokens``); for the adaptive budget, the median share recent adaptive blends of this
        prompt-length class recomputed, or its upper bound while fewer than three were measured."""
        fixed = min(ctx_tokens, max(math.ceil(ratio * ctx_tokens), min_tokens))
        if not adaptive:
            return fixed
        upper = min(ctx_tokens, max(fixed, min(math.ceil(max_ratio * ctx_tokens), max_tokens), min_tokens))
        with self._lock:
            shares = [s for c, s in self._shares if c == prompt_class(prompt_tokens)]
        if len(shares) < 3:
            return upper
        return min(upper, max(math.ceil(statistics.median(shares) * ctx_tokens), min_tokens))

    def tier_tokens(self, keys: Sequence[str], lengths: Sequence[int]) -> dict[str, int]:
        """Context tokens per tier expected to serve ``keys`` (the last tier seen serving each;
        :data:`UNSEEN_TIER` for the others)."""
        out: dict[str, int] = {}
        with self._lock:
            for key, n in zip(keys, lengths):
                tier = self._tier_of.get(key, UNSEEN_TIER)
                out[tier] = out.get(tier, 0) + n
        return out

    # ---- the decision ------------------------------------------------------------------------

    def decide(self, inp: RouteInputs, quality: QualityTable | None, *, stale: str = "") -> Route:
        """Blend or full prefill for ``inp``: blend when the index's quality table (or, without one,
        :meth:`QualityTable.prior`) passes blend for this prompt-length and passage-length class and
        the predicted speedup is at least ``route.min_speedup``.

        Args:
            quality: the index's table, or None (uncalibrated; ``stale``: why a recorded one is not
                used, said in the reason).
        """
        t0 = time.perf_counter()
        route = self._decide(inp, quality, stale)
        route = dataclasses.replace(route, decide_s=time.perf_counter() - t0)
        with self._lock:
            key = (route.mode, route.rule)
            self.decisions[key] = self.decisions.get(key, 0) + 1
        return route

    def _decide(self, inp: RouteInputs, quality: QualityTable | None, stale: str) -> Route:
        size = f"a {inp.prompt_tokens:,}-token prompt"
        if inp.chunks == 0 or inp.ctx_tokens <= 0:
            return Route("full", "no_context", f"full prefill: {size} with no retrieved chunks has nothing to reuse")
        pclass, qclass = prompt_class(inp.prompt_tokens), passage_class(inp.passage_tokens)
        cell = quality.nearest(pclass, qclass) if quality is not None else None
        passes, why = (cell.passes, cell.why) if cell is not None else QualityTable.prior(
            inp.passage_tokens, self.settings.min_passage_tokens)
        if cell is None:
            source = "prior, " + stale if stale else "prior: index not calibrated for these passages"
        elif cell.prompt_class == pclass:
            source = "calibrated"
        else:  # the index measured these passages in prompts of another length
            source = f"calibrated on {cell.prompt_class} prompts with these passages"
        model = self.model
        full_s = blend_s = None
        if model is not None:
            full_s = model.full(inp.prompt_tokens - inp.cached_prefix_tokens, inp.prompt_tokens)
            blend_s = model.blend(inp)
        if not passes:
            return Route("full", "quality", f"full prefill: blend's answers are not faithful on {size} with "
                         f"~{inp.passage_tokens:,.0f}-token passages ({why}; {source})", full_s, blend_s)
        if model is None:
            return Route("full", "slower", f"full prefill: no TTFT measured on this host yet for {size}",
                         full_s, blend_s)
        speedup = full_s / max(blend_s, 1e-9)
        if speedup < self.settings.min_speedup:
            return Route("full", "slower", f"full prefill: blend predicted {speedup:.1f}x for {size} on this host, "
                         f"below route.min_speedup {self.settings.min_speedup:g}", full_s, blend_s)
        return Route("blend", "faster", f"blend: predicted {speedup:.1f}x sooner than full prefill for {size} "
                     f"(~{inp.passage_tokens:,.0f}-token passages: {why}; {source})", full_s, blend_s)
