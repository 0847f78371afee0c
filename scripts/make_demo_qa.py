"""Write ragcache/bench/data/demo_pydoc_qa.json: questions over the demo corpus as a bench dataset.

Each example is one question about a function of the demo corpus (the pydoc pages `make demo`
ingests), the chunks the demo index retrieves for it (top-k, in the prompt's stable order: what
`ragcache ask --index demo` reads) and, as the gold answer, the first sentence of that function's
docstring. `ragcache bench ttft --dataset demo` then measures blend on prompts like the demo's
(~2k tokens of pydoc text), with longer answers than the QA sets' (`--max-tokens 64`) for the
repetition-loop share.

Run after `make demo` (it needs indexes/demo), from the repository root:
    .venv/bin/python scripts/make_demo_qa.py
The file is committed: pydoc pages change with the Python version, the benchmark should not.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.demo_cmd import DEMO_QUESTIONS  # noqa: E402
from ragcache.bench.datasets import PACKAGED  # noqa: E402

#: more questions of the same form over the same pages (the demo asks the first six)
MORE = [
    "What does json.loads return?", "What does json.dump do?", "What is json.JSONDecodeError?",
    "What does itertools.groupby do?", "What does itertools.product return?", "What does itertools.islice do?",
    "What does itertools.accumulate return?", "What does functools.partial do?", "What does functools.lru_cache do?",
    "What does functools.reduce do?", "What does functools.wraps do?", "What does shutil.copytree do?",
    "What does shutil.move do?", "What does shutil.which return?", "What does csv.reader return?",
    "What does csv.DictWriter do?", "What does heapq.heappop return?", "What does heapq.nlargest return?",
    "What does heapq.merge do?", "What does bisect.bisect_left return?", "What does textwrap.dedent do?",
    "What does textwrap.wrap return?", "What does statistics.stdev compute?", "What does statistics.mode return?",
]


def target_of(question: str) -> str:
    """``"What does json.dumps return?"`` -> ``"json.dumps"``."""
    return re.search(r"\b([a-z]+\.[A-Za-z_]+)", question).group(1)


#: where a docstring's first sentence is a signature or usage line, not an answer
GOLD = {
    "functools.partial": "A new function with partial application of the given arguments and keywords.",
    "csv.reader": "A reader object which will iterate over lines in the given csvfile.",
    "csv.DictWriter": "It writes dictionaries to a CSV file as rows, mapping keys to the fieldnames columns.",
}


def first_sentence(name: str) -> str:
    """The first sentence of the docstring of ``module.attr`` (signature lines skipped), or ``GOLD``'s."""
    if name in GOLD:
        return GOLD[name]
    module, attr = name.split(".")
    doc = inspect.getdoc(getattr(importlib.import_module(module), attr)) or ""
    paragraphs = [p for p in doc.split("\n\n") if p.strip() and not re.match(r"^\w+\(.*\)", p.strip())]
    text = " ".join(paragraphs[0].split()) if paragraphs else ""
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def main() -> None:
    from ragcache.config import Settings
    from ragcache.index.folder import resolve_index_path
    from ragcache.index.retrieval import Retriever, stable_order

    settings = Settings.load(None)
    retriever = Retriever.from_settings(settings, resolve_index_path("demo", settings.ingest.index_dir))
    questions = [q for q, _ in DEMO_QUESTIONS] + MORE
    out = []
    for q in questions:
        found = stable_order(retriever.retrieve(q, settings.retrieval.top_k))
        out.append({"question": q, "answers": [first_sentence(target_of(q))],
                    "ctxs": [{"title": "", "text": r.chunk.text, "source": Path(r.chunk.doc_id).stem} for r in found]})
    path = PACKAGED["demo"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(REPO)}: {len(out)} questions, python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
