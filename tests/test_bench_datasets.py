"""ragcache.bench.datasets without a model: reading QA files and the error for a missing one."""

from __future__ import annotations

import json
import re

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


def test_the_demo_dataset_ships_with_ragcache(tmp_path, monkeypatch):
    from app.demo_cmd import DEMO_QUESTIONS
    from ragcache.bench.datasets import PACKAGED, resolve_dataset

    monkeypatch.setenv("RAGCACHE_DATA_DIR", str(tmp_path))  # no shared data: the file comes with the package
    assert resolve_dataset("demo") == PACKAGED["demo"]
    exs = load_qa("demo")
    assert len(exs) == 30
    assert [e.question for e in exs[:len(DEMO_QUESTIONS)]] == [q for q, _ in DEMO_QUESTIONS]  # what `make demo` asks
    assert len({e.question for e in exs}) == 30
    for e in exs:
        # a gold answer from the docstring, and the demo index's top-k chunks as untitled passages
        assert e.answers and e.answers[0].strip(), e.question
        assert len(e.passages) == 5 and all(title == "" and text.strip() for title, text in e.passages), e.question
    # the passages are about the function asked: its module's page is among their sources
    for e in json.loads(PACKAGED["demo"].read_text(encoding="utf-8")):
        module = re.search(r"\b([a-z]+)\.[A-Za-z_]+", e["question"]).group(1)
        assert module in {c["source"] for c in e["ctxs"]}, e["question"]


def test_the_public_sets_are_read_from_ragcache_data_dir_alone(tmp_path, monkeypatch):
    from ragcache.bench.datasets import resolve_dataset

    monkeypatch.delenv("RAGCACHE_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetNotFoundError, match="RAGCACHE_DATA_DIR is not set.*musique/musique_s.json"):
        resolve_dataset("musique")
    (tmp_path / "musique").mkdir()
    (tmp_path / "musique" / "musique_s.json").write_text("[]")
    monkeypatch.setenv("RAGCACHE_DATA_DIR", str(tmp_path))
    assert resolve_dataset("musique") == tmp_path / "musique" / "musique_s.json"
