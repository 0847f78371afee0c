"""QA data for the benchmarks: the MuSiQue / HotpotQA files and their passages as chunks.

Owns: where the public QA sets are read from, the short dataset names, reading ``{question, answers, ctxs}``
JSON files into :class:`QAExample`, and turning passages into :class:`~ragcache.chunks.Chunk`
objects with fixed token ids. Imports ragcache.chunks only; never the engine, app/ or ui/.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from ragcache.chunks import Chunk, chunk_id_for

#: MuSiQue / HotpotQA files under the data folder (:func:`data_dir`), by short name
DATASETS = {
    "musique": "musique/musique_s.json",
    "hotpotqa": "hotpotqa/hotpotqa_distractor_100.json",
}

#: datasets that ship with ragcache, by short name: ``demo``, 30 questions over the demo corpus (the
#: pydoc pages ``make demo`` ingests) with the chunks the demo index retrieves for each and the first
#: sentence of the function's docstring as the gold answer (written by scripts/make_demo_qa.py)
PACKAGED = {
    "demo": Path(__file__).resolve().parent / "data" / "demo_pydoc_qa.json",
}

#: the repository root (this file is ragcache/bench/datasets.py)
_REPO = Path(__file__).resolve().parents[2]


class DatasetNotFoundError(FileNotFoundError):
    """The QA file does not exist; the message says how to name one that does."""


@dataclass
class QAExample:
    """One multi-passage QA example.

    Attributes:
        index: position in the file.
        question: the question.
        answers: gold answers (the first is the canonical one; the rest are aliases).
        passages: ``(title, text)`` in the file's (retrieval) order.
    """

    index: int
    question: str
    answers: list[str]
    passages: list[tuple[str, str]]


def data_dir() -> Path | None:
    """The folder of the public QA sets: ``$RAGCACHE_DATA_DIR``, or None when it is not set."""
    env = os.environ.get("RAGCACHE_DATA_DIR")
    return Path(env) if env else None


def resolve_dataset(name_or_path: str | os.PathLike[str]) -> Path:
    """A dataset short name (``musique``, ``hotpotqa``, ``demo``) or a path, as an existing file.

    Raises:
        DatasetNotFoundError: no such file.
    """
    key = str(name_or_path)
    if key in PACKAGED:
        path = PACKAGED[key]
    elif key in DATASETS:
        folder = data_dir()
        if folder is None:
            raise DatasetNotFoundError(
                f"dataset {key}: RAGCACHE_DATA_DIR is not set; set it to the folder holding {DATASETS[key]} (the "
                f"README says where MuSiQue and HotpotQA come from), or use --dataset demo (ships with ragcache) "
                f"or a JSON file: a list of {{question, answers: [str], ctxs: [{{title, text}}]}}")
        path = folder / DATASETS[key]
    else:
        path = Path(key).expanduser()
    if not path.is_file():
        where = (f"set RAGCACHE_DATA_DIR to the folder holding {DATASETS[key]} (the README says where MuSiQue and "
                 f"HotpotQA come from); " if key in DATASETS else "")
        raise DatasetNotFoundError(
            f"dataset {key}: {path} not found; {where}--dataset takes musique, hotpotqa, demo (ships with ragcache) "
            f"or a JSON file: a list of {{question, answers: [str], ctxs: [{{title, text}}]}}")
    return path


def load_qa(path: str | os.PathLike[str], n: int | None = None, offset: int = 0) -> list[QAExample]:
    """Read ``n`` examples from ``offset`` of a QA file: a JSON list of ``{question, answers, ctxs}``."""
    data = json.loads(resolve_dataset(path).read_text(encoding="utf-8"))
    stop = len(data) if n is None else min(len(data), offset + n)
    out = []
    for i in range(offset, stop):
        ex = data[i]
        out.append(QAExample(
            index=i, question=ex["question"], answers=list(ex.get("answers") or []),
            passages=[(c.get("title") or "", c["text"]) for c in ex["ctxs"]],
        ))
    return out


def passage_text(title: str, text: str) -> str:
    """A passage as chunk text: ``title\\ntext`` (just ``text`` when untitled, as in MuSiQue)."""
    return f"{title}\n{text}" if title else text


def make_chunks(tokenizer: Any, passages: Sequence[tuple[str, str]], source: str = "qa") -> list[Chunk]:
    """One :class:`Chunk` per ``(title, text)`` passage, token ids fixed with ``tokenizer`` (no BOS)."""
    chunks = []
    for title, body in passages:
        text = passage_text(title, body)
        cid = chunk_id_for(text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        chunks.append(Chunk(cid, f"{source}:{cid}", title, 0, text, tuple(ids)))
    return chunks


def distinct_chunks(chunks: Iterable[Chunk]) -> list[Chunk]:
    """Each chunk once (the first with its chunk id), in order: what one ingest of many prompts computes."""
    seen: dict[str, Chunk] = {}
    for c in chunks:
        seen.setdefault(c.chunk_id, c)
    return list(seen.values())
