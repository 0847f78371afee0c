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
    "json.loads", "json.dump", "json.JSONDecodeError", "itertools.groupby", "itertools.product", "itertools.islice",
    "itertools.accumulate", "functools.partial", "functools.lru_cache", "functools.reduce", "functools.wraps",
    "shutil.copytree", "shutil.move", "shutil.which", "csv.reader", "csv.DictWriter", "heapq.heappop",
    "heapq.nlargest", "heapq.merge", "bisect.bisect_left", "textwrap.dedent", "textwrap.wrap", "statistics.stdev",
    "statistics.mode",
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
    from ragcache.index import resolve_index_path
    from ragcache.retrieval import Retriever, stable_order

    settings = Settings.load(None)
    retriever = Retriever.from_settings(settings, resolve_index_path("demo", settings.ingest.index_dir))
    verbs = {name: "return" for name in MORE}
    verbs.update({"json.dump": "do", "itertools.groupby": "do", "itertools.islice": "do", "functools.partial": "do",
                  "functools.lru_cache": "do", "functools.reduce": "do", "functools.wraps": "do",
                  "shutil.copytree": "do", "shutil.move": "do", "csv.DictWriter": "do", "heapq.merge": "do",
                  "textwrap.dedent": "do", "statistics.stdev": "compute"})
    questions = [q for q, _ in DEMO_QUESTIONS] + [
        f"What is {n}?" if n.endswith("Error") else f"What does {n} {verbs[n]}?" for n in MORE]
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
