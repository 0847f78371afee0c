"""Answer-quality metrics and the small statistics of benchmark summaries.

Owns: the agreement of two token sequences (:func:`agreed_prefix`) and median / percentile / mean /
rounding as every summary uses them. The measures calibration shares (KL divergence of first-token
distributions, mean NLL, the repetition-loop detector, SQuAD answer normalisation, exact match,
token F1, Rouge-L) live in :mod:`ragcache.quality.measures` and are re-exported here. Pure Python on strings and numbers: imports only
ragcache.quality.measures, and never app/ or ui/.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from ragcache.quality.measures import (  # noqa: F401  (re-exported)
    exact_match, kl_divergence, lcs_length, mean_nll, normalize_answer, repetition_loop, rouge_l, token_f1,
)
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
