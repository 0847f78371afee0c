"""ragcache.quality.measures: the repetition-loop detector on constructed token sequences (KL and NLL are
checked where the benchmarks use them, tests/test_bench_metrics.py)."""

import pytest

from ragcache.quality.measures import repetition_loop


def test_a_phrase_repeated_three_times_in_a_row_is_a_loop():
    heap, q, dot = 17, 5, 9
    assert repetition_loop([1, 2, heap, q, dot, heap, q, dot, heap, q, dot, 4])  # "heapq.heapq.heapq."
    assert repetition_loop([7] * 6)  # one token six times is the 2-gram (7, 7) three times
    assert repetition_loop([3, 1, 2, 1, 2, 1, 2])


def test_repeats_that_are_not_three_in_a_row_are_not_a_loop():
    assert not repetition_loop([])
    assert not repetition_loop([1, 2, 1, 2, 3])  # twice only
    assert not repetition_loop([1, 2, 5, 1, 2, 5, 6, 1, 2])  # (1, 2) three times, but not in a row
    assert not repetition_loop([7] * 5)  # a single token five times: no 2-gram thrice
    assert not repetition_loop([4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23, 42])  # a long unit twice


def test_the_unit_and_the_repeats_are_parameters():
    assert repetition_loop([1, 2, 1, 2], min_repeats=2)
    assert repetition_loop([5, 5, 5], min_ngram=1)
    assert not repetition_loop([1, 2, 3, 1, 2, 3, 1, 2, 3], min_ngram=4)
    with pytest.raises(ValueError):
        repetition_loop([1, 1], min_ngram=0)
    with pytest.raises(ValueError):
        repetition_loop([1, 1], min_repeats=1)
