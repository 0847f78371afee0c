"""scripts/unseen_sets.py on a synthetic pair of QA files: only untuned rows, the question's own gold
passages plus other questions' gold passages, passages cut to the word limit at a sentence end."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("unseen_sets", REPO / "scripts" / "unseen_sets.py")
unseen_sets = importlib.util.module_from_spec(spec)
spec.loader.exec_module(unseen_sets)


def _hotpot(n: int) -> list[dict]:
    out = []
    for i in range(n):
        ctxs = [{"title": f"q{i}-p{j}", "text": f"passage {j} of question {i}."} for j in range(10)]
        out.append({"id": str(i), "question": f"question {i}?", "answers": [f"a{i}"], "type": "bridge", "level": "hard",
                    "supporting_facts": {"title": [f"q{i}-p3", f"q{i}-p7", f"q{i}-p3"], "sent_id": [0, 0, 1]},
                    "ctxs": ctxs})
    return out


def _musique(n: int) -> list[dict]:
    text = " ".join(f"Sentence {k} has five words." for k in range(200))  # 1,000 words
    return [{"question": f"m{i}?", "answers": [f"b{i}"], "ctxs": [{"title": "", "text": text}] * 10} for i in range(n)]


def test_unseen_sets(tmp_path):
    data = tmp_path / "data"
    (data / "hotpotqa").mkdir(parents=True)
    (data / "musique").mkdir()
    (data / "hotpotqa" / "hotpotqa_distractor_100.json").write_text(json.dumps(_hotpot(100)))
    (data / "musique" / "musique_s.json").write_text(json.dumps(_musique(150)))
    assert unseen_sets.main([str(tmp_path / "out"), "--data", str(data)]) == 0

    unrelated = json.loads((tmp_path / "out" / "unrelated.json").read_text())
    assert [e["source"] for e in unrelated] == [f"hotpotqa_distractor_100.json row {i}" for i in range(85, 100)]
    for e in unrelated:
        i = int(e["source"].rsplit(" ", 1)[1])
        titles = [c["title"] for c in e["ctxs"]]
        assert len(titles) == 10 == len(set(titles))
        assert {f"q{i}-p3", f"q{i}-p7"} <= set(titles)  # its own gold passages
        others = [t for t in titles if not t.startswith(f"q{i}-")]
        assert len(others) == 8 and all(t.split("-")[1] in ("p3", "p7") for t in others)  # others' golds
        assert e["answers"] == [f"a{i}"]

    long = json.loads((tmp_path / "out" / "long_passages.json").read_text())
    assert len(long) == 10 and long[0]["source"] == "musique_s.json row 140"
    words = [len(c["text"].split()) for e in long for c in e["ctxs"]]
    assert max(words) <= 380 and min(words) >= 370 and all(c["text"].endswith(".") for c in long[0]["ctxs"])


def test_tuned_rows_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="used for tuning"):
        unseen_sets.check_unseen("hotpotqa", [84, 85, 86, 20], 100)
    with pytest.raises(ValueError, match="has 150 rows"):
        unseen_sets.check_unseen("musique", [140, 150], 150)
