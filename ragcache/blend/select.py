"""Selecting the tokens to recompute: the HKVD tokens of CacheBlend, or the question's tokens.

Owns: the recompute budget (:func:`hkvd_budget`), the per-token scores (KV deviation, attention
from the question), the score function of each selection strategy (:data:`SCORES`; the strategy's
record, what it needs and which settings it reads, is in :mod:`ragcache.strategies`) and
:func:`select_tokens`, which turns a strategy's scores into an exact budget of token indices
(:class:`~ragcache.strategies.Selection`). The three strategies ragcache ships:

``deviation``
    CacheBlend (Yao et al., EuroSys'25, §4.3 "Selecting which tokens to recompute"): at the check
    layer the blend has, for every context token, both the reused KV (computed per chunk, without
    the other chunks in view) and the fresh KV (with full cross-chunk attention); the tokens whose
    reused KV deviates most (squared L2, on V by default) are recomputed.
``question``
    Question-aware selection in the spirit of ProphetKV (ICML'26, "crowding-out" of
    question-relevant tokens by globally salient ones) and A3: the question tail goes through the
    layers up to the check layer together with the context, and each context token is scored by
    the attention it receives from the tail's queries (softmax weights averaged over the tail
    tokens, pooled over heads by mean or max (``question_heads``), and averaged over the layers).
    With ``candidates`` > 1 (check layer 0) the question's choice is refined once, at layer
    ``refine_layer`` (R), in the way of CacheBlend's gradual filtering: the question picks
    ``candidates`` times the budget, those tokens go through layers 0 .. R-1 (layer 0 exactly: its
    reused KV is its fresh KV), and the budget is kept among them by their *impact*, the question's
    attention times the L2 error of their reused V summed over layers 1 .. R (the error a stale
    token adds to a layer's attention output is its weight times its value error): a token the
    question reads but whose reused KV is already right gives way to one that is read and stale. The
    error of a stale token grows with depth as its neighbours' errors feed into it, so a deeper R
    sees it better, at the cost of the extra candidates' work in R layers
    (:mod:`ragcache.blend.forward`; docs/benchmarks.md for R).
``hybrid``
    Both signals mixed by rank (``question_weight``), plus the first ``chunk_head_tokens`` tokens
    of every chunk whose KV moved (EPIC, Hu et al. 2024: a chunk's first tokens carry the attention
    sink its reused KV was computed with), with a cap on any one chunk's share of the budget.

Any strategy may choose in runs (``granule`` > 1): each chunk is cut into aligned runs of
``granule`` tokens (the last run of a chunk may be shorter), a run scores the mean of its tokens'
scores, and the best runs are taken whole until the budget is spent (the last one trimmed to its
best tokens). Recomputed tokens in runs cost less attention than scattered ones on a paged-attention
kernel (each run is one causal query segment), and a run recomputes a token's neighbourhood, not
only the token.

Invariants of every strategy: the budget is exact (``min(ceil(ratio * N), N - forced)`` tokens
plus the forced ones); tokens with no cached KV (``forced``) are always selected; tokens whose
cached KV is already exact (``exact``: the prompt head and a chunk at its canonical place) are
taken only when nothing else is left, so ratio 1.0 still selects every token.
Must not import vLLM, transformers, or anything above blend/ in ragcache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ragcache.strategies import QUESTION_HEADS, Selection

#: name -> the score function of each selection strategy (:func:`score_function`); the strategy's
#: record (what it needs, its check layer, the settings it reads) is in :mod:`ragcache.strategies`
SCORES: dict[str, "ScoreFunction"] = {}


@dataclass(frozen=True)
class TokenScores:
    """What a strategy's score function reads: the signals of ``S`` context tokens of ``G`` requests,
    one request after another (one request: ``G = 1``).

    Attributes:
        deviation: ``[S]`` KV deviation per token (:func:`deviation_scores`), or None when the
            strategy does not need it.
        question: ``[S]`` attention from the question (:func:`question_attention`), or None.
        group: ``[S]`` int64, ascending: the request each token belongs to.
        starts: ``[G + 1]`` int64: request g owns tokens ``starts[g] .. starts[g + 1]``.
    """

    deviation: torch.Tensor | None
    question: torch.Tensor | None
    group: torch.Tensor
    starts: torch.Tensor

    @property
    def offsets(self) -> torch.Tensor:
        """``[S]`` int64: each token's index within its request's context."""
        return torch.arange(self.group.shape[0], device=self.group.device) - self.starts[self.group]

    def ranks(self, scores: torch.Tensor) -> torch.Tensor:
        """``[S]`` float32: ``scores`` mapped to their rank within their request, in [0, 1] (the
        smallest 0, the largest 1); ties keep the tokens' order."""
        group, n = self.group, scores.shape[0]
        order = torch.argsort(scores, stable=True)
        order = order[torch.argsort(group[order], stable=True)]  # by request, ascending score within it
        ranks = torch.empty(n, dtype=torch.float32, device=scores.device)
        ranks[order] = (torch.arange(n, device=scores.device) - self.starts[group[order]]).float()
        sizes = self.starts[1:] - self.starts[:-1]  # [G]
        return ranks / (sizes[group] - 1).clamp(min=1).float()


#: a strategy's scores: ``(selection, scores) -> [S]`` float32, every value >= 0, the highest chosen first
ScoreFunction = Callable[[Selection, TokenScores], torch.Tensor]


def score_function(name: str) -> Callable[[ScoreFunction], ScoreFunction]:
    """Decorator: register the score function of strategy ``name`` in :data:`SCORES` (its record goes
    in :mod:`ragcache.strategies` with :func:`ragcache.strategies.register`).

    Raises:
        ValueError: ``name`` has a score function already.
    """
    def add(fn: ScoreFunction) -> ScoreFunction:
        if name in SCORES:
            raise ValueError(f"selection strategy {name!r} has a score function already")
        SCORES[name] = fn
        return fn
    return add


@score_function("deviation")
def _deviation(selection: Selection, scores: TokenScores) -> torch.Tensor:
    return scores.deviation.float()


@score_function("question")
def _question(selection: Selection, scores: TokenScores) -> torch.Tensor:
    return scores.question.float()


@score_function("hybrid")
def _hybrid(selection: Selection, scores: TokenScores) -> torch.Tensor:
    w = selection.question_weight
    score = torch.zeros(scores.group.shape[0], dtype=torch.float32, device=scores.group.device)
    if w < 1:
        score += (1 - w) * scores.ranks(scores.deviation.float())
    if w > 0:
        score += w * scores.ranks(scores.question.float())
    return score


def _score(selection: Selection, scores: TokenScores) -> torch.Tensor:
    """``[S]`` float32 scores of ``selection``'s strategy (its function in :data:`SCORES`).

    Raises:
        ValueError: the strategy has a record but no score function.
    """
    fn = SCORES.get(selection.strategy)
    if fn is None:
        raise ValueError(f"selection {selection.strategy!r} has no score function: register one with "
                         f"@ragcache.blend.select.score_function({selection.strategy!r})")
    return fn(selection, scores)


def hkvd_budget(ratio: float, num_tokens: int, min_tokens: int = 0) -> int:
    """``ceil(ratio * num_tokens)``, robust to float noise (0.15 * 100 gives 15, not 16), and at
    least ``min(min_tokens, num_tokens)`` when ``ratio > 0``.

    The floor is for short contexts: the tokens an answer needs from its passage (a name, the
    sentence that holds the fact) do not shrink with the prompt, while ``ratio * N`` does; at 15%
    of ~1.3k tokens the answer's later tokens can loop on stale KV (docs/benchmarks.md).

    Raises:
        ValueError: if ``ratio`` is outside ``[0, 1]`` or ``min_tokens`` is negative.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute ratio must be in [0, 1], got {ratio}")
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    budget = min(num_tokens, math.ceil(round(ratio * num_tokens, 9)))
    return max(budget, min(min_tokens, num_tokens)) if ratio > 0 else budget


@dataclass(frozen=True)
class BudgetRule:
    """The adaptive recompute budget (:func:`adaptive_budget`): how much of the question's attention
    a blend may leave on reused KV, and the bounds around the ratio's budget.

    Attributes:
        mass_left: the question tail's attention (softmax weight averaged over its tokens, heads and
            the layers probed, :func:`question_attention`) that may stay on context tokens whose KV is
            reused, in (0, 1): the budget grows until the rest is recomputed.
        max_ratio: the budget is at most this share of the context's tokens, in (0, 1] (never below
            the ratio's own budget): the cost a request may take.
        max_tokens: and at most this many tokens (never below the ratio's own budget), >= 1: on a
            long context the ratio's budget already holds what the question reads, and more would
            cost what reuse saves; a short one may take up to ``max_ratio``.
        min_share: the budget is at least this share of the ratio's budget, in (0, 1] (and never
            below ``min_recompute_tokens``): what a request whose question reads little of the
            context still recomputes.
    """

    mass_left: float
    max_ratio: float = 1.0
    min_share: float = 0.5
    max_tokens: int = 1 << 30

    def __post_init__(self) -> None:
        if not 0.0 < self.mass_left < 1.0:
            raise ValueError(f"mass_left must be in (0, 1), got {self.mass_left}")
        if not 0.0 < self.max_ratio <= 1.0:
            raise ValueError(f"max_ratio must be in (0, 1], got {self.max_ratio}")
        if not 0.0 < self.min_share <= 1.0:
            raise ValueError(f"min_share must be in (0, 1], got {self.min_share}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Budget:
    """The recompute budget one blend chose, and why (reported per request).

    Attributes:
        tokens: context tokens chosen for recompute (forced tokens, which have no cached KV, come on top).
        centre: the ratio's budget (``hkvd_budget(ratio, N, min_recompute_tokens)``): what a fixed
            budget recomputes.
        need: tokens the question's attention asked for (:func:`tokens_for_mass`), or None for a
            fixed budget.
        low, high: the bounds ``tokens`` was kept within.
        mass: the question's attention on context tokens whose KV moved (0 for a fixed budget).
        mass_left: the part of ``mass`` left on reused tokens by the ``tokens`` most attended ones.
        reason: one line for people: what set the budget, starting with the budget's kind and a colon
            (``adaptive: ...``, ``fixed: ...``), the word the engine's request metrics report it by.
    """

    tokens: int
    centre: int
    need: int | None = None
    low: int = 0
    high: int = 0
    mass: float = 0.0
    mass_left: float = 0.0
    reason: str = ""


def tokens_for_mass(scores: torch.Tensor, mass_left: float) -> int:
    """How many of the highest ``scores`` must be taken so that the rest sum to at most ``mass_left``.

    Args:
        scores: ``[M]`` float, >= 0 (attention weights of the candidate tokens).
        mass_left: in [0, 1).

    Returns:
        k in ``[0, M]`` (0 when all of ``scores`` sum to at most ``mass_left``).
    """
    if scores.numel() == 0:
        return 0
    ordered = torch.sort(scores.float(), descending=True).values
    total = float(ordered.sum())
    if total <= mass_left:
        return 0
    # tokens whose running sum still leaves more than mass_left outside, plus the one that crosses it
    return min(int((ordered.cumsum(0) < total - mass_left).sum()) + 1, ordered.numel())


def adaptive_budget(question: torch.Tensor, movable: torch.Tensor, *, ratio: float, min_tokens: int,
                    rule: BudgetRule) -> Budget:
    """A per-request recompute budget from the attention the question gives the context's reused KV.

    The question tail's attention over the context is measured by the question probe before any
    token is chosen (:func:`question_attention`, fused over layers as ProphetKV, ICML'26, does). The
    error a stale token adds to the answer's attention is its weight times its KV error, so the
    budget is set by the weight left on reused tokens: the fewest tokens whose recompute leaves at
    most ``rule.mass_left`` of it (:func:`tokens_for_mass`). A question that reads a few tokens of one
    passage gets a small budget; one whose attention is spread over many passages (multi-hop, or a
    short context where every passage counts) gets more. The ratio's budget is the centre: the
    result stays within ``[rule.min_share x centre, max(centre, min(rule.max_ratio x N, rule.max_tokens))]`` (and at least
    ``min_tokens``). Per chunk, the budget follows the attention: a chunk the question reads more
    holds more of the tokens that leave mass, so it receives more of the budget.

    Args:
        question: ``[N]`` float32 attention each context token receives from the question (>= 0).
        movable: ``[N]`` bool, tokens that may be chosen and whose KV moved (not forced, not exact).
        ratio: the recompute ratio in [0, 1] (the centre).
        min_tokens: ``blend.min_recompute_tokens``.
        rule: the budget's knobs.

    Returns:
        the :class:`Budget` (``tokens`` <= the movable tokens).

    Raises:
        ValueError: shapes disagree, or the ratio or floor is out of range (:func:`hkvd_budget`).
    """
    n = question.shape[0]
    check_mask(movable, n, "movable")
    centre = hkvd_budget(ratio, n, min_tokens)
    available = int(movable.sum())
    low = min(max(min(min_tokens, n), math.ceil(rule.min_share * centre)), centre)
    high = max(centre, min(math.floor(rule.max_ratio * n), rule.max_tokens))
    scores = question[movable]
    mass = float(scores.sum())
    need = tokens_for_mass(scores, rule.mass_left)
    tokens = min(max(need, low), high, available)
    ordered = torch.sort(scores.float(), descending=True).values
    left = float(ordered[tokens:].sum()) if tokens < available else 0.0
    share = 100.0 * tokens / max(n, 1)
    if need > high:
        why = ("capped at the ratio's budget" if high == centre else
               f"capped at {high} tokens (max_recompute_ratio {rule.max_ratio:g}, max_recompute_tokens {rule.max_tokens})")
    elif need < low:
        why = "raised to its floor"
    else:
        why = "as the question's attention asks"
    reason = (f"adaptive: {tokens} tokens ({share:.0f}%), {why}; the question gives {mass:.2f} of its attention to "
              f"moved tokens, {left:.3f} left on reused KV (target {rule.mass_left:g}); ratio {ratio:g} gives {centre}")
    return Budget(tokens=tokens, centre=centre, need=need, low=low, high=high, mass=mass, mass_left=left,
                  reason=reason)


def check_mask(mask: torch.Tensor | None, num_tokens: int, name: str = "forced") -> None:
    """Raise ValueError unless ``mask`` is None or a bool tensor of shape ``[num_tokens]``."""
    if mask is not None and (mask.shape != (num_tokens,) or mask.dtype != torch.bool):
        raise ValueError(
            f"{name} must be a bool tensor of shape ({num_tokens},), got {mask.dtype} {tuple(mask.shape)}"
        )


def deviation_scores(reused: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Squared L2 deviation per token, ``sum((fresh - reused) ** 2)`` over heads and dims.

    Args:
        reused: ``[N, Hkv, D]`` K or V as loaded from the cache (K rotated to ``fresh``'s positions).
        fresh: ``[N, Hkv, D]`` the same layer's K or V computed with the whole context in view.

    Returns:
        ``[N]`` float32 on ``fresh``'s device.

    Raises:
        ValueError: the shapes differ.
    """
    if reused.shape != fresh.shape or fresh.dim() < 1:
        raise ValueError(f"reused {tuple(reused.shape)} and fresh {tuple(fresh.shape)} differ in shape")
    return (fresh.float() - reused.to(fresh.device).float()).pow(2).flatten(1).sum(dim=1)


def question_attention(q_tail: torch.Tensor, k_ctx: torch.Tensor, k_tail: torch.Tensor, scaling: float, *,
                       v_ctx: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
                       heads: str = "mean") -> tuple[torch.Tensor | None, torch.Tensor]:
    """The question tail's attention over the context and itself, and what each context token receives.

    The tail follows the context: tail token i sees every context token and tail tokens ``<= i``.
    Query heads share their KV head in groups (GQA) without expanding K or V. One request's form of
    :func:`tail_attention`.

    Args:
        q_tail: ``[T, Hq, D]`` post-RoPE queries of the tail tokens.
        k_ctx: ``[N, Hkv, D]`` post-RoPE keys of the context.
        k_tail: ``[T, Hkv, D]`` post-RoPE keys of the tail.
        scaling: softmax scale.
        v_ctx, v_tail: ``[N, Hkv, D]`` and ``[T, Hkv, D]`` values; give both to get the output.
        heads: how the per-head scores (softmax weight averaged over the tail tokens) are pooled
            over the query heads: ``"mean"``, or ``"max"`` (a token scores what its most attentive
            head gives it: a head that reads the passage the question asks about is not averaged
            away by the heads that attend to the prompt's sink and format tokens).

    Returns:
        ``(out, scores)``: ``out`` ``[T, Hq, D]`` the tail's attention output (None without values);
        ``scores`` ``[N]`` float32, the softmax weight each context token receives, averaged over
        tail tokens and pooled over query heads (in [0, 1]).

    Raises:
        ValueError: ``heads`` is not one of :data:`QUESTION_HEADS`.
    """
    t, num_heads, _ = q_tail.shape
    n = k_ctx.shape[0]
    masks = TailMasks.of(torch.tensor([n]), torch.tensor([t]), n, t, num_heads, num_heads // k_ctx.shape[1], heads,
                         q_tail.dtype, q_tail.device)
    values = None if v_ctx is None or v_tail is None else torch.cat([v_ctx, v_tail])
    out, scores = tail_attention(q_tail, torch.cat([k_ctx, k_tail]), values, scaling, masks)
    return out, scores[0]


@dataclass(frozen=True)
class TailMasks:
    """What :func:`tail_attention` needs to know of a padded batch of question tails, made once per batch.

    R requests, each with ``N_r`` context tokens (padded to ``N``) followed by ``T_r`` tail tokens
    (padded to ``T``); the keys of request r are its context then its tail, ``P = N + T`` columns.

    Attributes:
        bias: ``[R, 1, G * T, P]`` in the model's dtype: 0 where tail query (g, t) may see the key,
            ``-inf`` at padded context keys, padded tail keys and later tail tokens (causal).
        pool: how the weights become per-token scores: ``"mean"``: ``[R, 1, Hq * T]`` with
            ``1 / (Hq * T_r)`` for real queries, 0 for padded ones; ``"max"``: ``[R, 1, 1, T]`` with
            ``1 / T_r`` and 0.
        num_ctx: N, the padded context length (the first N key columns).
        num_tail: T, the padded tail length.
    """

    bias: torch.Tensor
    pool: torch.Tensor
    num_ctx: int
    num_tail: int

    @classmethod
    def of(cls, ctx_lengths: torch.Tensor, tail_lengths: torch.Tensor, num_ctx: int, num_tail: int, num_heads: int,
           group: int, heads: str, dtype: torch.dtype, device: torch.device) -> "TailMasks":
        """Masks for tails of ``tail_lengths`` ``[R]`` (int64, >= 1) after contexts of ``ctx_lengths`` ``[R]``,
        padded to ``num_tail`` and ``num_ctx``; ``group`` query heads per KV head.

        Raises:
            ValueError: ``heads`` is not one of :data:`QUESTION_HEADS`.
        """
        if heads not in QUESTION_HEADS:
            raise ValueError(f"heads must be one of {QUESTION_HEADS}, got {heads!r}")
        ctx_lengths, tail_lengths = ctx_lengths.to(device), tail_lengths.to(device)
        t = torch.arange(num_tail, device=device)
        ctx_hidden = torch.arange(num_ctx, device=device) >= ctx_lengths[:, None]  # [R, N]
        tail_hidden = (t[None, :] > t[:, None]) | (t[None, None, :] >= tail_lengths[:, None, None])  # [R, T, T]
        hidden = torch.cat([ctx_hidden[:, None, :].expand(-1, num_tail, -1), tail_hidden], dim=2)  # [R, T, P]
        bias = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        bias = bias.repeat(1, group, 1).unsqueeze(1)  # [R, 1, G * T, P]: rows (g, t)
        per_tail = (t[None, :] < tail_lengths[:, None]).to(dtype) / tail_lengths[:, None].to(dtype)  # [R, T]
        if heads == "mean":
            pool = (per_tail / num_heads).repeat(1, num_heads).unsqueeze(1)  # [R, 1, Hq * T]: rows (h, t)
        else:
            pool = per_tail[:, None, None, :]  # [R, 1, 1, T]
        return cls(bias=bias, pool=pool, num_ctx=num_ctx, num_tail=num_tail)


def tail_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scaling: float, masks: TailMasks
                   ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Question tails' attention over their contexts and themselves, for a padded batch of R requests.

    The question probe's attention (ProphetKV-style scores, ICML'26): what each context token receives
    from the tail's queries is the per-token score; the output is the tail's attention output. A
    constant number of operators whatever R, N and T: one matmul for the logits, one masked softmax,
    one matmul for the scores and one for the output.

    Args:
        q: ``[R, T, Hq, D]`` post-RoPE tail queries (padded rows are ignored); ``[T, Hq, D]`` for R = 1.
        k: ``[R, P, Hkv, D]`` post-RoPE keys: the context (padded to N) then the tail (to T);
            ``[P, Hkv, D]`` for R = 1.
        v: values in the same layout as ``k``, or None for the scores alone.
        scaling: softmax scale.
        masks: :class:`TailMasks` of this padding.

    Returns:
        ``(out [R * T, Hq, D] or None, scores [R, N] float32)``; ``scores`` pooled over the heads as
        ``masks`` says and averaged over each request's real tail tokens (0 at padded tokens).
    """
    num_heads, head_dim = q.shape[-2:]
    r, t, p, num_kv_heads = masks.bias.shape[0], masks.num_tail, k.shape[-3], k.shape[-2]
    g = num_heads // num_kv_heads
    # rows ordered (group member, tail token): [R, Hkv, G * T, D]; matmuls batched over R and the KV heads
    query = (q * scaling).view(r, t, num_kv_heads, g, head_dim).permute(0, 2, 3, 1, 4).reshape(
        r, num_kv_heads, g * t, head_dim)
    # In the model's dtype: softmax accumulates in float32 inside. No float32 copy of these
    # [R, Hkv, G*T, P] tensors (a conversion per layer cost more than the matmuls around them).
    logits = torch.matmul(query, k.movedim(-3, -1)).add_(masks.bias)  # [R, Hkv, G*T, P]
    weights = torch.softmax(logits, dim=-1)
    # the pooled sum over queries (and heads) accumulates in float32 inside the matmul, rounded once
    n = masks.num_ctx
    if masks.pool.dim() == 3:  # mean over heads and tail tokens
        scores = torch.matmul(masks.pool, weights.view(r, num_heads * t, p)[..., :n]).view(r, n).float()  # [R, N]
    else:  # per query head: the mean over the tail tokens, then the most attentive head
        scores = torch.matmul(masks.pool, weights.view(r, num_heads, t, p)[..., :n]).amax(dim=1).view(r, n).float()
    if v is None:
        return None, scores
    out = torch.matmul(weights, v.transpose(-3, -2))  # [R, Hkv, G*T, D]
    return out.view(r, num_kv_heads, g, t, head_dim).permute(0, 3, 1, 2, 4).reshape(r * t, num_heads, head_dim), scores


def value_error(fresh_v: torch.Tensor, reused_v: torch.Tensor) -> torch.Tensor:
    """``[m]`` float32: the L2 norm of ``fresh_v - reused_v`` per token, over heads and dims.

    Args:
        fresh_v: ``[m, Hkv, D]`` fresh V of m tokens.
        reused_v: ``[m, Hkv, D]`` their reused V at the same layer.
    """
    return (fresh_v.float() - reused_v.float()).pow(2).sum(dim=(1, 2)).sqrt()


def impact_scores(question: torch.Tensor, candidates: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """Each candidate's impact on the attention output: the question's attention times the L2 error
    of its reused V (see the module docstring, ``candidates``).

    Args:
        question: ``[N]`` attention from the question (:func:`question_attention`, >= 0).
        candidates: ``[m]`` int64 indices of the candidates.
        error: ``[m]`` float32, >= 0: the candidates' V error (:func:`value_error`), summed over the
            layers it was measured at.

    Returns:
        ``[N]`` float32: ``question * error`` at the candidates, plus the smallest positive float so
        a candidate always ranks above a non-candidate; 0 elsewhere.

    Raises:
        ValueError: ``error`` does not have one value per candidate.
    """
    if error.shape != candidates.shape:
        raise ValueError(f"error {tuple(error.shape)} does not match {candidates.shape[0]} candidates")
    impact = torch.zeros(question.shape[0], dtype=torch.float32, device=question.device)
    impact[candidates] = question[candidates].float() * error.float() + torch.finfo(torch.float32).tiny
    return impact


def _chunk_ids(num_tokens: int, segment_starts: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[N]`` int64: the index of the segment each token belongs to."""
    starts = torch.tensor(sorted(segment_starts), dtype=torch.long, device=device)
    return torch.searchsorted(starts, torch.arange(num_tokens, device=device), right=True) - 1


def select_tokens(
    budget: int,
    selection: Selection,
    *,
    deviation: torch.Tensor | None = None,
    question: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    exact: torch.Tensor | None = None,
    segment_starts: Sequence[int] = (0,),
) -> torch.LongTensor:
    """Indices of the tokens to recompute: ``budget`` chosen ones plus every forced token.

    Args:
        budget: tokens to choose (``hkvd_budget(ratio, N)``); capped at the non-forced tokens.
        selection: the strategy and its knobs.
        deviation: ``[N]`` KV deviation per token (:func:`deviation_scores`); needed unless the
            strategy is ``question``.
        question: ``[N]`` attention from the question (:func:`question_attention`); needed for
            ``question`` and for ``hybrid`` with ``question_weight > 0``.
        forced: ``[N]`` bool, tokens with no cached KV: always selected, outside the budget.
        exact: ``[N]`` bool, tokens whose cached KV already equals the fresh KV: chosen last.
        segment_starts: first index of every segment (chunk) of the context, ascending, starting
            at 0; used for the chunk heads, the per-chunk cap and the runs.

    Returns:
        ``[n]`` int64 indices, ascending; ``n = min(budget, N - num_forced) + num_forced``.

    Raises:
        ValueError: a score the strategy needs is missing, shapes disagree, or neither scores nor a
            mask is given (the number of tokens is unknown).
    """
    given = [t for t in (deviation, question, forced, exact) if t is not None]
    if not given:
        raise ValueError("select_tokens needs scores or a mask (deviation, question, forced or exact)")
    return select_grouped([budget], selection, deviation=deviation, question=question, forced=forced, exact=exact,
                          segment_starts=[segment_starts], starts=[0, given[0].shape[0]])


def select_grouped(
    budgets: Sequence[int],
    selection: Selection,
    *,
    deviation: torch.Tensor | None = None,
    question: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    exact: torch.Tensor | None = None,
    segment_starts: Sequence[Sequence[int]],
    starts: Sequence[int],
    device: torch.device | None = None,
) -> torch.LongTensor:
    """:func:`select_tokens` for several requests at once, over their tokens concatenated.

    Request g owns tokens ``starts[g] .. starts[g + 1]`` of the scores and masks, chooses
    ``budgets[g]`` of them (plus its forced ones) exactly as :func:`select_tokens` would alone, and its
    chunks start at ``segment_starts[g]`` (indices within the request). Without chunk heads or a chunk
    cap the choice dispatches a constant number of operators whatever the number of requests, chunks
    and runs; with either, the requests are chosen one after the other. The tokens are scored by the
    strategy's function in :data:`SCORES`; ``device`` is where they are chosen (default: that of the
    first scores or mask given).

    Returns:
        ``[n]`` int64 indices into the concatenation, ascending.

    Raises:
        ValueError: a score the strategy needs is missing, shapes disagree, the strategy has no score
            function, or no device is given or implied.
    """
    num_tokens = starts[-1]
    given = [t for t in (deviation, question, forced, exact) if t is not None]
    if device is None and not given:
        raise ValueError("select_grouped needs scores, a mask or a device")
    device = given[0].device if device is None else device
    for name, s in (("deviation", deviation), ("question", question)):
        if s is not None and s.shape != (num_tokens,):
            raise ValueError(f"{name} scores {tuple(s.shape)} do not match {num_tokens} tokens")
    if selection.needs_deviation and deviation is None:
        raise ValueError(f"selection {selection.strategy!r} needs deviation scores")
    if selection.needs_question and question is None:
        raise ValueError(f"selection {selection.strategy!r} needs the question's attention scores")
    check_mask(forced, num_tokens, "forced")
    check_mask(exact, num_tokens, "exact")
    if len(starts) != len(budgets) + 1 or starts[0] != 0:
        raise ValueError(f"group starts {list(starts)} do not cover {num_tokens} tokens in {len(budgets)} groups")
    if selection.chunk_head_tokens > 0 or selection.max_chunk_share < 1.0:
        parts = []
        for g, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
            part = (lambda t: None if t is None else t[lo:hi])
            parts.append(lo + _select_structured(budgets[g], selection, part(deviation), part(question), part(forced),
                                                 part(exact), segment_starts[g], hi - lo, device))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # every chunk of every request, as global token indices; runs never cross a chunk
    chunk_starts = sorted({lo + c for g, lo in enumerate(starts[:-1]) for c in segment_starts[g]})
    group_starts = torch.tensor(starts, dtype=torch.long, device=device)  # [G + 1]
    tokens = torch.arange(num_tokens, device=device)
    group = torch.searchsorted(group_starts[1:], tokens, right=True)  # [S]
    sizes = group_starts[1:] - group_starts[:-1]
    score = _score(selection, TokenScores(deviation, question, group, group_starts))
    # priority: forced tokens are added apart; exact tokens come after every other candidate
    # (every score is >= 0: exact tokens rank below all others, forced never)
    priority = score if exact is None else score.masked_fill(exact.to(device), -1.0)
    limit = torch.tensor(budgets, dtype=torch.float32, device=device)
    if forced is not None:
        forced = forced.to(device)
        priority = priority.masked_fill(forced, float("-inf"))
        limit = limit.minimum(sizes.float() - torch.zeros_like(limit).index_add_(0, group, forced.float()))
    picked = _best_runs(priority, tokens, group, torch.tensor(chunk_starts, dtype=torch.long, device=device),
                        selection.granule, limit)
    return (picked if forced is None else picked | forced).nonzero().squeeze(1)


def _best_runs(priority: torch.Tensor, tokens: torch.Tensor, group: torch.Tensor, chunk_starts: torch.Tensor,
               granule: int, limit: torch.Tensor, cap: int | None = None,
               taken: torch.Tensor | None = None) -> torch.Tensor:
    """``[S]`` bool: per group, ``limit[g]`` open tokens chosen run by run, best run first (the module
    docstring), with a constant number of operators whatever the number of groups, chunks and runs.

    A run scores the mean priority of its open tokens; runs are taken whole, best first (ties: the
    earlier run), while the tokens taken before leave room; the last run taken is trimmed to its best
    open tokens (ties: the later token kept). With ``cap``, a chunk's runs are taken only while its
    chosen tokens (``taken`` plus its runs taken before) are below ``cap``; the runs so skipped are
    taken after every other run, best first, when the budget is still not spent.

    Args:
        priority: ``[S]`` float32; ``-inf`` marks tokens that may not be chosen, exact tokens are
            ``-1`` (below every other score, which is >= 0).
        tokens: ``arange(S)``.
        group: ``[S]`` int64, ascending: the group (request) of each token.
        chunk_starts: ``[C]`` int64 ascending, from 0: the first token of every chunk of every group.
        granule: run length (1: every token is its own run).
        limit: ``[G]`` float32, tokens to choose per group, at most its open tokens.
        cap: at most this many chosen tokens per chunk before the skipped runs fill the rest, or None.
        taken: ``[S]`` bool, tokens chosen already (they count against ``cap``; they should be closed
            in ``priority``), or None.
    """
    num_tokens, device = priority.shape[0], priority.device
    chunk = torch.searchsorted(chunk_starts, tokens, right=True) - 1  # [S]
    run_key = chunk * (num_tokens + 1) + (tokens - chunk_starts[chunk]) // granule  # ascending along the tokens
    new_run = torch.ones(num_tokens, dtype=torch.bool, device=device)
    new_run[1:] = run_key[1:] != run_key[:-1]
    run_of = torch.cumsum(new_run, 0) - 1  # [S] run index of each token
    bounds = torch.cat([new_run.nonzero().squeeze(1), tokens[-1:] + 1])  # [R + 1]
    num_runs = bounds.shape[0] - 1
    open_ = priority > float("-inf")
    count = torch.zeros(num_runs, device=device).index_add_(0, run_of, open_.float())  # open tokens per run
    total = torch.zeros(num_runs, device=device).index_add_(0, run_of, priority.masked_fill(~open_, 0.0))
    run_score = (total / count.clamp(min=1)).masked_fill(count == 0, float("-inf"))  # [R] mean of open tokens
    run_group = group[bounds[:-1]]
    order = torch.argsort(run_score, descending=True, stable=True)  # best first
    if cap is not None:  # a chunk's runs past its cap go after every other run, best first
        run_chunk = chunk[bounds[:-1]]
        used = torch.zeros(chunk_starts.shape[0], device=device)
        if taken is not None:
            used.index_add_(0, chunk, taken.float())
        by_chunk = order[torch.argsort(run_chunk[order], stable=True)]  # by chunk, best first within it
        in_chunk, run_count = run_chunk[by_chunk], count[by_chunk]
        per_chunk = torch.zeros(chunk_starts.shape[0], device=device).index_add_(0, run_chunk, count)
        before = run_count.cumsum(0) - run_count - (per_chunk.cumsum(0) - per_chunk)[in_chunk]
        skipped = torch.zeros(num_runs, dtype=torch.bool, device=device).index_put_(
            (by_chunk,), used[in_chunk] + before >= cap)
        order = order[torch.argsort(skipped[order], stable=True)]
    # runs by group, in the order above within a group; take a run while the tokens before it leave room
    order = order[torch.argsort(run_group[order], stable=True)]
    ordered_group, ordered_count = run_group[order], count[order]
    per_group = torch.zeros(limit.shape[0], device=device).index_add_(0, run_group, count)
    before = ordered_count.cumsum(0) - ordered_count - (per_group.cumsum(0) - per_group)[ordered_group]
    room = limit[ordered_group]
    take = (before < room) & (ordered_count > 0)
    # only the last run a group takes can overshoot: drop its worst open tokens
    over = (before + ordered_count - room).clamp(min=0) * take
    taken_runs = torch.zeros(num_runs, dtype=torch.bool, device=device).index_put_((order,), take)
    drop = torch.zeros(num_runs, device=device).index_put_((order,), over)
    by_run = torch.argsort(priority, stable=True)
    by_run = by_run[torch.argsort(run_of[by_run], stable=True)]  # by run, ascending priority (closed first)
    closed = (bounds[1:] - bounds[:-1]) - count  # [R]
    rank = torch.empty(num_tokens, dtype=torch.float32, device=device)
    rank[by_run] = (tokens - bounds[run_of[by_run]]).float()
    return taken_runs[run_of] & open_ & (rank - closed[run_of] >= drop[run_of])


def _select_structured(budget: int, selection: Selection, deviation: torch.Tensor | None,
                       question: torch.Tensor | None, forced: torch.Tensor | None, exact: torch.Tensor | None,
                       segment_starts: Sequence[int], num_tokens: int, device: torch.device) -> torch.LongTensor:
    """One request's :func:`select_tokens` with chunk heads or a per-chunk cap (``[n]`` ascending)."""
    forced = torch.zeros(num_tokens, dtype=torch.bool, device=device) if forced is None else forced.to(device)
    exact = torch.zeros(num_tokens, dtype=torch.bool, device=device) if exact is None else exact.to(device)
    one = torch.zeros(num_tokens, dtype=torch.long, device=device)  # [N] every token in request 0
    score = _score(selection, TokenScores(deviation, question, one, torch.tensor([0, num_tokens], device=device)))
    candidates = ~forced
    budget = min(budget, int(candidates.sum()))
    chosen = forced.clone()
    if budget <= 0:
        return chosen.nonzero().squeeze(1)
    priority = score.clone()
    priority[exact] = -1.0
    priority[forced] = float("-inf")

    k = selection.chunk_head_tokens
    if k > 0:  # a floor of structure: the first tokens of every chunk whose KV moved
        chunk = _chunk_ids(num_tokens, segment_starts, device)  # [N]
        starts = torch.tensor(sorted(segment_starts), dtype=torch.long, device=device)
        offset = torch.arange(num_tokens, device=device) - starts[chunk]
        heads = candidates & ~exact & (offset < k)
        if int(heads.sum()) > budget:  # more chunk heads than budget: the lowest offsets first
            order = torch.argsort(offset.float().masked_fill(~heads, float("inf")), stable=True)[:budget]
            heads = torch.zeros_like(heads)
            heads[order] = True
        chosen |= heads
        budget -= int(heads.sum())
        priority[heads] = float("-inf")
    if budget <= 0:
        return chosen.nonzero().squeeze(1)
    cap = None if selection.max_chunk_share >= 1.0 else \
        max(1, math.floor(selection.max_chunk_share * (budget + int((chosen & ~forced).sum()))))
    tokens = torch.arange(num_tokens, device=device)
    chunk_starts = torch.tensor(sorted(segment_starts), dtype=torch.long, device=device)
    chosen |= _best_runs(priority, tokens, one, chunk_starts, selection.granule,
                         torch.tensor([float(budget)], device=device), cap=cap, taken=chosen & ~forced)
    return chosen.nonzero().squeeze(1)


def select_hkvd(
    reused: torch.Tensor,
    fresh: torch.Tensor,
    ratio: float,
    forced: torch.Tensor | None = None,
) -> torch.LongTensor:
    """CacheBlend's HKVD tokens: the ``ceil(ratio * N)`` largest KV deviations plus every forced token.

    The deviation of token t is ``sum((fresh[t] - reused[t]) ** 2)`` over heads and dims, in float32
    (:func:`deviation_scores`); the budget is taken among the tokens that are not forced (a forced
    token has no cached KV, so its "reused" row is a placeholder and must not use up the budget).

    Args:
        reused: ``[N, Hkv, D]`` K or V of the context tokens as loaded from the cache (K rotated to
            the same positions as ``fresh`` when comparing keys).
        fresh: ``[N, Hkv, D]`` the same layer's K or V computed with full attention.
        ratio: recompute ratio in ``[0, 1]``; 0 selects only the forced tokens, 1 selects all.
        forced: ``[N]`` bool, True for tokens that must be recomputed (no cached KV), or None.

    Returns:
        ``[n]`` int64 token indices, sorted ascending, on ``fresh``'s device;
        ``n = min(ceil(ratio * N), N - num_forced) + num_forced``.

    Raises:
        ValueError: if the shapes of ``reused``, ``fresh`` and ``forced`` disagree or ``ratio`` is
            outside ``[0, 1]``.
    """
    deviation = deviation_scores(reused, fresh)
    return select_tokens(hkvd_budget(ratio, deviation.shape[0]), Selection("deviation"),
                         deviation=deviation, forced=forced)
