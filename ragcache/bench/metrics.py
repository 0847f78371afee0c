"""Answer-quality metrics and the small statistics of benchmark summaries.

Owns: SQuAD answer normalisation, exact match, token F1, Rouge-L (with its LCS), and median /
percentile / mean / rounding as every summary uses them. The measures the engine and calibration
share (KL divergence of first-token distributions, mean NLL, the repetition-loop detector) live in
:mod:`ragcache.quality.measures` and are re-exported here. Pure Python on strings and numbers: imports only
ragcache.quality.measures, and never app/ or ui/.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Sequence

from ragcache.quality.measures import kl_divergence, mean_nll, repetition_loop  # noqa: F401  (re-exported)

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


def agreed_prefix(tokens: Sequence[int], reference: Sequence[int]) -> float | None:
    """The share of ``reference``'s tokens that ``tokens`` repeats before their first divergence
    (greedy answers of two modes: 1.0 when equal, 0.0 when the first token differs); None for an
    empty reference."""
    if not reference:
        return None
    same = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        same += 1
    return same / len(reference)


def median(values: Sequence[float]) -> float | None:
    """Median (mean of the two middle values for an even count); None for no values."""
    return percentile(values, 50.0)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def mean(values: Iterable[float | None]) -> float | None:
    """Mean of the values that are not None; None for no values."""
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def rounded(x: float | None, nd: int = 4) -> float | None:
    """``x`` as a float rounded to ``nd`` decimals, for results; None stays None."""
    return None if x is None else round(float(x), nd)
