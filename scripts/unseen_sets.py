"""Build two QA sets from rows of the public sets that no blend setting was tuned on.

Tuning used HotpotQA rows 20-27, 50-61, 70-81 and MuSiQue rows 40-47, 60-67, 100-105, 120-123,
130-135; this script reads only HotpotQA rows 85-99 and MuSiQue rows 140-149 (by default) and
writes, in the schema of the public sets (a JSON list of ``{question, answers: [str], ctxs: [{title,
text}]}``, plus ``source`` naming the row it came from):

- ``unrelated.json`` (HotpotQA): each question's own gold passages (the titles of its
  ``supporting_facts``) and, to make ``--passages`` in all, gold passages of OTHER questions of the
  slice (unrelated topics), the question's own placed at seeded random positions. HotpotQA
  questions need both gold passages (bridge and comparison), so there are 2 of its own and 8 others.
- ``long_passages.json`` (MuSiQue): each question's passages in the file's order, each cut at a
  sentence end to at most ``--words`` words (~500 LLM tokens at the default 380 words).

Usage::

    python scripts/unseen_sets.py OUT_DIR [--data DIR] [--hotpotqa-rows 85-99] [--musique-rows 140-149]

``--data`` is the folder holding ``hotpotqa/hotpotqa_distractor_100.json`` and
``musique/musique_s.json`` (default: ``$RAGCACHE_DATA_DIR``). The
outputs are read by ``ragcache bench ... --dataset OUT_DIR/unrelated.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

#: rows the blend settings were tuned on (never used here)
TUNED = {
    "hotpotqa": [(20, 27), (50, 61), (70, 81)],
    "musique": [(40, 47), (60, 67), (100, 105), (120, 123), (130, 135)],
}


def rows(spec: str) -> list[int]:
    """``"85-99"`` -> ``[85, ..., 99]`` (inclusive); ``"85,90-92"`` also works."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def check_unseen(name: str, picked: list[int], size: int) -> None:
    """Refuse rows that tuning used or that the file does not have (ValueError)."""
    bad = [i for i in picked if any(lo <= i <= hi for lo, hi in TUNED[name])]
    if bad:
        raise ValueError(f"{name} rows {bad} were used for tuning")
    if max(picked) >= size:
        raise ValueError(f"{name} has {size} rows; asked for row {max(picked)}")


def gold_titles(example: dict) -> list[str]:
    """The titles of a HotpotQA example's supporting passages, in the order they first appear."""
    facts = example["supporting_facts"]
    titles = facts["title"] if isinstance(facts, dict) else [f[0] for f in facts]
    return list(dict.fromkeys(titles))


def unrelated(hotpot: list[dict], picked: list[int], passages: int, seed: int) -> list[dict]:
    """Each picked question with its own gold passages and other questions' gold passages."""
    rng = random.Random(seed)
    golds = {}
    for i in picked:
        by_title = {c["title"]: c for c in hotpot[i]["ctxs"]}
        golds[i] = [{"title": t, "text": by_title[t]["text"]} for t in gold_titles(hotpot[i]) if t in by_title]
    out = []
    for i in picked:
        own = golds[i]
        pool = [c for j in picked if j != i for c in golds[j] if c["title"] not in {o["title"] for o in own}]
        others = rng.sample(pool, passages - len(own))
        ctxs = list(others)
        for c in own:
            ctxs.insert(rng.randrange(len(ctxs) + 1), c)
        out.append({"question": hotpot[i]["question"], "answers": list(hotpot[i]["answers"]), "ctxs": ctxs,
                    "source": f"hotpotqa_distractor_100.json row {i}"})
    return out


def cut(text: str, words: int) -> str:
    """``text`` cut after the last sentence end within its first ``words`` words (at ``words`` words
    when no sentence ends there)."""
    tokens = text.split()
    if len(tokens) <= words:
        return text
    head = " ".join(tokens[:words])
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", head)]
    return head[:ends[-1]] if ends and ends[-1] > len(head) // 2 else head


def long_passages(musique: list[dict], picked: list[int], words: int) -> list[dict]:
    """Each picked question with its passages cut to at most ``words`` words."""
    return [{"question": musique[i]["question"], "answers": list(musique[i]["answers"]),
             "ctxs": [{"title": c.get("title") or "", "text": cut(c["text"], words)} for c in musique[i]["ctxs"]],
             "source": f"musique_s.json row {i}"} for i in picked]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder to write unrelated.json and long_passages.json into")
    p.add_argument("--data", type=Path, default=None, help="folder of the public QA sets")
    p.add_argument("--hotpotqa-rows", default="85-99")
    p.add_argument("--musique-rows", default="140-149")
    p.add_argument("--passages", type=int, default=10, help="passages per question of unrelated.json")
    p.add_argument("--words", type=int, default=380, help="most words per passage of long_passages.json")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.data is None:
        from ragcache.bench.datasets import data_dir

        args.data = data_dir()
    if args.data is None:
        print("unseen_sets: give --data or set RAGCACHE_DATA_DIR to the folder of the public QA sets", file=sys.stderr)
        return 2
    hotpot = json.loads((args.data / "hotpotqa" / "hotpotqa_distractor_100.json").read_text())
    musique = json.loads((args.data / "musique" / "musique_s.json").read_text())
    h_rows, m_rows = rows(args.hotpotqa_rows), rows(args.musique_rows)
    try:
        check_unseen("hotpotqa", h_rows, len(hotpot))
        check_unseen("musique", m_rows, len(musique))
    except ValueError as exc:
        print(f"unseen_sets: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in (("unrelated.json", unrelated(hotpot, h_rows, args.passages, args.seed)),
                       ("long_passages.json", long_passages(musique, m_rows, args.words))):
        path = args.out / name
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {path}: {len(data)} questions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
