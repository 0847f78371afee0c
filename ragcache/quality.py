"""Answer-quality measures the engine, the pipeline, calibration and the benchmarks share.

Owns: :func:`kl_divergence` (first-token distributions), :func:`mean_nll` (teacher-forced
likelihood) and :func:`repetition_loop` (a degenerate answer: a phrase repeated over and over).
Imports nothing from ragcache, so every layer may use it (bench/ re-exports the first two).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

#: a loop is an n-gram of at least LOOP_MIN_NGRAM tokens repeated LOOP_MIN_REPEATS times in a row
LOOP_MIN_NGRAM = 2
LOOP_MIN_REPEATS = 3


def kl_divergence(p: Mapping[int, float], q: Mapping[int, float]) -> float:
    """KL(p || q) in nats from two ``{token_id: logprob}`` distributions over the whole vocabulary.

    ``sum_t exp(p_t) * (p_t - q_t)``. Use p = full prefill, q = the mode under test. A token missing
    from ``q`` (only possible with a truncated distribution) counts as q's least likely token;
    tokens with p = 0 contribute nothing. Rounding noise below zero is clipped to 0.

    Raises:
        ValueError: ``p`` is empty.
    """
    if not p:
        raise ValueError("p is empty: request the first token's logprobs with logprobs=-1")
    floor = min(q.values()) if q else -math.inf
    total = 0.0
    for tok, lp in p.items():
        if lp == -math.inf:
            continue
        total += math.exp(lp) * (lp - q.get(tok, floor))
    return max(total, 0.0)


def mean_nll(logprobs: Sequence[float]) -> float:
    """Mean negative log-likelihood per token, in nats, of teacher-forced token log-probabilities.

    Raises:
        ValueError: no log-probabilities.
    """
    if not logprobs:
        raise ValueError("no token log-probabilities to average")
    return -sum(logprobs) / len(logprobs)


def repetition_loop(token_ids: Sequence[int], min_ngram: int = LOOP_MIN_NGRAM,
                    min_repeats: int = LOOP_MIN_REPEATS) -> bool:
    """Whether ``token_ids`` contain an n-gram of >= ``min_ngram`` tokens repeated >= ``min_repeats``
    times in a row (``heapq.heapq.heapq.`` is ``[heap, q, .]`` three times): the degenerate answer of
    a decoder that attends to the wrong tokens. A single token repeated ``min_ngram *
    min_repeats`` times counts too (it is such an n-gram).

    Args:
        token_ids: the answer's token ids (any hashable items).
        min_ngram: shortest repeated unit, in tokens (>= 1).
        min_repeats: consecutive copies that make a loop (>= 2).

    Raises:
        ValueError: ``min_ngram < 1`` or ``min_repeats < 2``.
    """
    if min_ngram < 1 or min_repeats < 2:
        raise ValueError(f"need min_ngram >= 1 and min_repeats >= 2, got {min_ngram}, {min_repeats}")
    ids = list(token_ids)
    length = len(ids)
    for n in range(min_ngram, length // min_repeats + 1):
        span = n * min_repeats
        for start in range(length - span + 1):
            unit = ids[start:start + n]
            if all(ids[start + r * n:start + (r + 1) * n] == unit for r in range(1, min_repeats)):
                return True
    return False
