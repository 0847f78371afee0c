"""Answer-quality measures the engine, the pipeline, calibration and the benchmarks share.

Owns: :func:`kl_divergence` (first-token distributions), :func:`mean_nll` (teacher-forced
likelihood), :func:`repetition_loop` (a degenerate answer: a phrase repeated over and over), the
SQuAD-style text measures (:func:`normalize_answer`, :func:`exact_match`, :func:`token_f1`,
:func:`rouge_l`) and :func:`rotated`, the order a measurement asks its variants in. Imports nothing
from ragcache, so every layer may use it (bench/metrics re-exports the measures).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

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


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` rotated left by ``k`` (mod length): prompt k asks the variants in this order.

    Timing every variant in the same order biases the comparison: the first request of a prompt
    that reads its chunks' KV pays the slower tier they sit in (the disk tier, in a process that has
    not read them yet) and promotes them, the next ones read RAM (demo index, 8 probes, a fresh
    process: the first blend of each prompt 0.506 s median, the same blend again 0.442 s; with the
    chunks already in RAM, 0.443 vs 0.431 s). Rotating gives each variant each place equally often.
    """
    if not items:
        return []
    k %= len(items)
    return list(items[k:]) + list(items[:k])

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD answer normalisation: lower case, drop punctuation and the articles a/an/the, squeeze spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _tokens(text: str) -> list[str]:
    return normalize_answer(text).split()


def _golds(golds: str | Iterable[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(prediction: str, golds: str | Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return max((float(pred == normalize_answer(g)) for g in _golds(golds)), default=0.0)


def _best_f_measure(prediction: str, golds: str | Iterable[str],
                    overlap: Callable[[list[str], list[str]], int]) -> float:
    """The maximum over the gold answers of ``2 * overlap / (len(pred) + len(gold))`` (= 2PR / (P + R)
    with P = overlap / len(pred), R = overlap / len(gold)) on normalised tokens; an empty prediction
    or gold scores 1.0 only against an empty counterpart."""
    pred = _tokens(prediction)
    best = 0.0
    for gold in _golds(golds):
        ref = _tokens(gold)
        if not pred or not ref:
            score = float(pred == ref)
        else:
            shared = overlap(pred, ref)
            score = 0.0 if shared == 0 else 2 * shared / (len(pred) + len(ref))
        best = max(best, score)
    return best


def _shared_tokens(pred: list[str], ref: list[str]) -> int:
    return sum((Counter(pred) & Counter(ref)).values())


def token_f1(prediction: str, golds: str | Iterable[str]) -> float:
    """SQuAD token F1 in [0, 1] on normalised tokens, the maximum over the gold answers.

    F1 = 2PR / (P + R) over the multiset of shared tokens; an empty prediction or gold scores 1.0
    only against an empty counterpart.
    """
    return _best_f_measure(prediction, golds, _shared_tokens)


def lcs_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a) * len(b)))."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, golds: str | Iterable[str]) -> float:
    """Rouge-L F-measure (beta = 1) in [0, 1] on normalised tokens, the maximum over the gold answers.

    P = LCS / len(prediction), R = LCS / len(gold), F = 2PR / (P + R).
    """
    return _best_f_measure(prediction, golds, lcs_length)
