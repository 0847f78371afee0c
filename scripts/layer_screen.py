"""Screen in which layers the reused KV's staleness parts blend's answers, on the plain-torch reference.

For each question of a QA file: full prefill and the default blend, greedy, on the reference of
``ragcache bench diverge`` (transformers + ragcache.blend, chunk KV stored as the engine stores it), then
the blended KV decoded again with

- ``--bands A-B,...``: every context token's K and V in layers A..B-1 replaced by full prefill's
  (``kA-B`` / ``vA-B``: K only / V only): an oracle, not something an engine can do;
- ``--restart L,...``: layers L.. prefilled again over every context token (causal attention over the
  whole context) from each chunk's own hidden states at layer L's input, computed with its KV at
  ingest (after the chunk's lead-in): what a store that also kept one residual stream per token could
  do, at (layers - L) / layers of full prefill's compute.

Prints, per variant, the answers equal to full prefill's, the median first-token KL(full || variant)
and the mean number of leading answer tokens equal to full's; writes every row to ``--out``. A scratch
measurement for choosing what to build, not a benchmark of the engine (vLLM's kernels round
differently).

Usage::

    python scripts/layer_screen.py --dataset musique --offset 10 --n 10 --passages 5 \\
        --bands 0-30,k0-30,v0-30,0-15,15-30 --restart 15,20 --out layers.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from ragcache.bench.screen import open_screen, screen_parser

    ap = screen_parser(__doc__, n=10, out="layer_screen.json")
    ap.add_argument("--bands", default="0-15,15-30", help="layer bands A-B (kA-B: K only, vA-B: V only)")
    ap.add_argument("--restart", default="", help="layers to prefill again from, comma-separated")
    args = ap.parse_args()

    import torch

    from ragcache.bench.datasets import make_chunks
    from ragcache.bench.reference import _attend, greedy_decode
    from ragcache.prompt import PromptBuilder, lead_in_for

    examples, diag = open_screen(args)
    settings, tok, ops = diag.settings, diag.tokenizer, diag.ops
    builder = PromptBuilder(tok, settings.prompt, "reference", compute_dtype=str(ops.dtype))
    L = ops.num_layers
    bands = {}
    for b in filter(None, args.bands.split(",")):
        which = b[0] if b[0] in "kv" else "kv"
        lo, hi = (int(x) for x in b.lstrip("kv").split("-"))
        if not 0 <= lo < hi <= L:
            ap.error(f"band {b!r} is outside the model's {L} layers")
        bands[b] = (lo, hi, which)
    restarts = [int(x) for x in filter(None, args.restart.split(","))]

    def forward(h, positions, layers):
        """Causal prefill of the residual stream ``h`` through ``layers``: (h after, [K], [V] per layer)."""
        ks, vs = [], []
        for layer in layers:
            q, k, v = ops.qkv(layer, h)
            q, k = ops.rope(layer, positions, q, k)
            ks.append(k)
            vs.append(v)
            out, _ = _attend(q, k, v, positions, positions, ops.scaling)
            h = ops.finish_layer(layer, h, out)
        return h, ks, vs

    def stale_hidden(prompt, layer):
        """[N, ...] every context token's residual stream at ``layer``'s input, each chunk computed after
        its own lead-in (the head alone for the head)."""
        ids, head = list(prompt.token_ids), list(prompt.token_ids[:prompt.lead_in_len])
        parts = []
        for seg in prompt.segments:
            lead = list(lead_in_for(seg.start, head, tuple(getattr(prompt, "kv_context", ()))))
            unit = ids[seg.start:seg.start + seg.length]
            h, _, _ = forward(ops.embed(torch.tensor(lead + unit)), torch.arange(len(lead) + len(unit)), range(layer))
            parts.append(h[len(lead):])
        return torch.cat(parts)

    rows = []
    with torch.inference_mode():
        for ex in examples:
            t0 = time.time()
            prompt = builder.build(ex.question, make_chunks(tok, ex.passages[:args.passages]))
            ctx = diag.context_of(prompt)
            full = greedy_decode(ops, list(ctx["full_k"]), list(ctx["full_v"]), ctx["tail"], args.max_tokens,
                                 diag.stop_ids, keep_logprobs=True)
            bk, bv, selected = diag._blend(ctx)
            variants = {"blend": (bk, bv)}
            for name, (lo, hi, which) in bands.items():
                k, v = bk.clone(), bv.clone()
                if "k" in which:
                    k[lo:hi] = ctx["full_k"][lo:hi]
                if "v" in which:
                    v[lo:hi] = ctx["full_v"][lo:hi]
                variants[name] = (k, v)
            for layer in restarts:
                _, ks, vs = forward(stale_hidden(prompt, layer), torch.arange(ctx["n"]), range(layer, L))
                variants[f"restart{layer}"] = (torch.cat([bk[:layer], torch.stack(ks)]),
                                               torch.cat([bv[:layer], torch.stack(vs)]))
            for name, (k, v) in variants.items():
                trace = greedy_decode(ops, list(k), list(v), ctx["tail"], args.max_tokens, diag.stop_ids,
                                      keep_logprobs=True)
                kl = float((full.logprobs[0].exp() * (full.logprobs[0] - trace.logprobs[0])).sum())
                prefix = next((i for i, (a, b) in enumerate(zip(trace.tokens, full.tokens)) if a != b),
                              min(len(trace.tokens), len(full.tokens)))
                rows.append({"index": ex.index, "variant": name, "equal": trace.tokens == full.tokens, "kl": kl,
                             "prefix": prefix, "recomputed": len(selected) / ctx["n"]})
            print(f"example {ex.index}: {ctx['n']} context tokens, {time.time() - t0:.0f} s", flush=True)
            args.out.write_text(json.dumps(rows, indent=1), encoding="utf-8")

    print("variant equal KL(median) equal-prefix(mean)")
    for name in dict.fromkeys(x["variant"] for x in rows):
        r = [x for x in rows if x["variant"] == name]
        print(name, f"{sum(x['equal'] for x in r)}/{len(r)}", f"{statistics.median(x['kl'] for x in r):.4f}",
              f"{statistics.mean(x['prefix'] for x in r):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
