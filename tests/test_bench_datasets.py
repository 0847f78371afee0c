"""ragcache.bench.datasets without a model: reading QA files and the error for a missing one."""

from __future__ import annotations

import json

import pytest

from ragcache.bench.datasets import DatasetNotFoundError, load_qa, passage_text


def test_load_qa_and_dataset_errors(tmp_path):
    f = tmp_path / "qa.json"
    f.write_text(json.dumps([{"question": f"q{i}", "answers": ["a"], "ctxs": [{"title": "T", "text": "x"}]}
                             for i in range(3)]))
    exs = load_qa(f, n=2, offset=1)
    assert [e.question for e in exs] == ["q1", "q2"] and exs[0].index == 1
    assert exs[0].passages == [("T", "x")] and passage_text("T", "x") == "T\nx" and passage_text("", "x") == "x"
    with pytest.raises(DatasetNotFoundError, match="musique"):
        load_qa(tmp_path / "missing.json")
