"""Write a mixed QA set in the bench's schema from the public MuSiQue and HotpotQA files: short prompts
(HotpotQA, 10 passages of ~130 tokens), mid (MuSiQue, 6 passages of ~600 tokens) and long (MuSiQue,
10 passages), ``--n`` of each, for ``ragcache bench ttft --modes full,blend,auto``.

    python scripts/mixed_set.py --out mixed.json   # reads $RAGCACHE_DATA_DIR (see README)
    ragcache bench ttft --dataset mixed.json --n 24 --modes full,blend,auto --ratios 0.15 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ragcache.bench.datasets import resolve_dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--n", type=int, default=8, help="examples per length class")
    p.add_argument("--hotpotqa-offset", type=int, default=20, help="first HotpotQA row (short prompts)")
    p.add_argument("--mid-offset", type=int, default=40, help="first MuSiQue row of the mid prompts")
    p.add_argument("--long-offset", type=int, default=60, help="first MuSiQue row of the long prompts")
    args = p.parse_args()
    hotpot = json.loads(resolve_dataset("hotpotqa").read_text(encoding="utf-8"))
    musique = json.loads(resolve_dataset("musique").read_text(encoding="utf-8"))

    def rows(data: list, start: int, passages: int) -> list[dict]:
        return [{"question": e["question"], "answers": e["answers"],
                 "ctxs": [{"title": c.get("title", ""), "text": c["text"]} for c in e["ctxs"][:passages]]}
                for e in data[start:start + args.n]]

    mixed = (rows(hotpot, args.hotpotqa_offset, 10) + rows(musique, args.mid_offset, 6)
             + rows(musique, args.long_offset, 10))
    args.out.write_text(json.dumps(mixed), encoding="utf-8")
    print(f"wrote {len(mixed)} examples to {args.out}")


if __name__ == "__main__":
    main()
