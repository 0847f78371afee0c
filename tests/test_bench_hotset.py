"""ragcache.bench.hotset without a model: building the question sequence over a hot pool."""

from __future__ import annotations

import pytest

from ragcache.bench.common import BenchConfigError
from ragcache.bench.datasets import QAExample
from ragcache.bench.hotset import build_hotset


def test_build_hotset_draws_the_overlap_from_the_most_recurring_passages():
    pool = [("", f"hot{i}") for i in range(4)]
    exs = [QAExample(i, f"q{i}", ["a"], [pool[i % 4], pool[(i + 1) % 4]] + [("", f"own{i}-{j}") for j in range(5)])
           for i in range(8)]
    qs = build_hotset(exs, questions=6, passages=5, overlap=0.6, hot_pool=4, seed=1)
    assert len(qs) == 6 and all(q.hot == 3 for q in qs)
    for q in qs:
        texts = [t for _, t in q.passages]
        assert len(texts) == 5 == len(set(texts))
        assert sum(t.startswith("hot") for t in texts) == 3
        assert texts[:2] == [f"own{q.index}-0", f"own{q.index}-1"]
    with pytest.raises(BenchConfigError):
        build_hotset(exs, questions=20, passages=5, overlap=0.6, hot_pool=4)
