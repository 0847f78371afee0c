"""Screen what chunk KV is computed after, on the plain-torch reference of the engine.

For each question of a QA file: full prefill and blend, greedy, on the reference of
``ragcache bench diverge`` (transformers + ragcache.blend), with chunk KV computed after

- ``textN``: the head and the first N tokens of the shipped KV context (``prompt.kv_context_tokens = N``;
  ``text0`` is the head alone);
- ``nbrN``: the head and the chunk's N most similar passages of the file's slice (MiniLM embeddings,
  the most similar closest to the chunk): FusionRAG's offline stage (arXiv 2601.12904). Not a
  ragcache setting: it needs a neighbour list fixed at ingest.
- ``poolN``: the head and the N passages of the slice nearest its mean embedding, the same for every
  chunk (the next one for a chunk that is one of them): an index's own text as a shared context.

and the blend at each ``--ratios`` (fixed budget; ``default`` = the settings' own), its answer decoded
with each ``--temper T:S``: APE's attention temperature and scale (Yang et al., ICLR'25) on the
moved context's keys, i.e. the question's and answer's attention logits to every context token after
the head divided by T and raised by log S (``1:1``, the default, leaves them as the engine runs them).
Prints, per variant, ratio and temper, the answers equal to full prefill's, the median first-token KL
and the mean relative K/V error of the non-exact context tokens against full prefill's; writes every row to
``--out``. A scratch measurement for choosing what to build, not a benchmark of the engine (vLLM's
kernels round differently): measure a choice with ``ragcache bench ttft`` before shipping it.

Usage::

    python scripts/kv_context_screen.py --dataset OUT_DIR/unrelated.json --n 12 \\
        --variants text0,text256,nbr2 --ratios 0.15,0.3,default --out screen.json
    python scripts/kv_context_screen.py --dataset OUT_DIR/unrelated.json --n 12 --variants text256 \\
        --ratios default --temper 1:1,0.95:1,0.9:1,1:0.9,1:1.1,1.05:1 --out ape.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from ragcache.bench.screen import open_screen, screen_parser

    ap = screen_parser(__doc__, n=12, out="kv_context_screen.json")
    ap.add_argument("--variants", default="text0,text256,nbr2")
    ap.add_argument("--ratios", default="0.15,0.3,default")
    ap.add_argument("--temper", default="1:1", help="APE settings T:S, comma-separated")
    args = ap.parse_args()

    import torch

    from ragcache.bench.datasets import make_chunks
    import ragcache.bench.reference as reference
    from ragcache.bench.reference import greedy_decode, token_relative_error
    from ragcache.blend import BlendRequest, CachedKV, blend_kv
    from ragcache.models import load_embed_model
    from ragcache.prompt import PromptBuilder, lead_in_for

    examples, diag = open_screen(args)
    settings, tok, ops = diag.settings, diag.tokenizer, diag.ops
    variants, ratios = args.variants.split(","), args.ratios.split(",")
    tempers = [tuple(float(x) for x in t.split(":")) for t in args.temper.split(",")]

    # APE on the reference's attention: logits to keys lo..hi-1 (the moved context) divided by T, plus log S
    ape = {"lo": 0, "hi": 0, "T": 1.0, "S": 1.0}
    plain_attend = reference._attend

    def temper(scores):
        lo, hi = ape["lo"], ape["hi"]
        scores[..., lo:hi] = scores[..., lo:hi] / ape["T"] + math.log(ape["S"])
        return scores

    def tempered_attend(q, k, v, q_pos, k_pos, scaling):
        untempered = (ape["T"], ape["S"]) == (1.0, 1.0)
        return plain_attend(q, k, v, q_pos, k_pos, scaling, adjust=None if untempered else temper)

    reference._attend = tempered_attend

    # the slice's passages, embedded: each chunk's neighbours for the nbrN variants
    corpus = {tuple(c.token_ids): c.text for ex in examples for c in make_chunks(tok, ex.passages[:args.passages])}
    keys = list(corpus)
    vecs = torch.tensor(load_embed_model(settings).get_text_embedding_batch([corpus[k] for k in keys]))
    sims = vecs @ vecs.T
    sims.fill_diagonal_(-1)
    central = torch.argsort(vecs @ vecs.mean(0), descending=True).tolist()  # the poolN variants' order

    def builder(tokens: int) -> PromptBuilder:
        prompt = settings.prompt.model_copy(update={"kv_context_tokens": tokens})
        return PromptBuilder(tok, prompt, "reference", compute_dtype=str(ops.dtype))

    builders = {v: builder(int(v[4:]) if v.startswith("text") else 0) for v in variants}

    def context(ex, variant: str) -> dict:
        b = builders[variant]
        prompt = b.build(ex.question, make_chunks(tok, ex.passages[:args.passages]))
        ctx = diag.context_of(prompt)
        if not variant.startswith(("nbr", "pool")):
            return ctx
        m, ids, head = int(variant.removeprefix("nbr").removeprefix("pool")), list(prompt.token_ids), list(b.head_ids)
        ks, vs = [], []
        for seg in prompt.segments:
            unit = ids[seg.start:seg.start + seg.length]
            lead = lead_in_for(seg.start, head)
            if seg.start:
                own = next(i for i, k in enumerate(keys) if tuple(unit[:len(k)]) == k)
                separator = unit[len(keys[own]):]
                ranked = torch.argsort(sims[own], descending=True).tolist() if variant.startswith("nbr") \
                    else [j for j in central if j != own]
                for j in reversed(ranked[:m]):
                    lead += list(keys[j]) + separator
            k, v = diag._stored(lead, unit)
            ks.append(k)
            vs.append(v)
        exact = torch.zeros(ctx["n"], dtype=torch.bool)
        exact[:prompt.segments[1].start] = True  # only the head sits where it was computed
        return {**ctx, "k_pre": torch.cat(ks, 1).contiguous(), "v": torch.cat(vs, 1).contiguous(), "exact": exact}

    def blend(ctx, ratio: str):
        knobs = ctx["params"].blend
        if ratio != "default":
            knobs = knobs.model_copy(update={"recompute_ratio": float(ratio), "budget": "fixed",
                                             "min_recompute_tokens": 0})
        n = ctx["n"]
        request = BlendRequest(token_ids=ctx["ids"], positions=torch.arange(n), knobs=knobs, tail_ids=ctx["tail_sel"],
                               segment_starts=ctx["starts"], exact=ctx["exact"])
        out_k, out_v = [None] * ops.num_layers, [None] * ops.num_layers

        def keep(layer, k, v):
            out_k[layer], out_v[layer] = k.clone(), v.clone()

        res = blend_kv(ops, request, CachedKV(ctx["k_pre"].clone(), ctx["v"].clone()), on_layer=keep, prefetch=False)
        return torch.stack(out_k), torch.stack(out_v), int(res.selected.numel())

    def error(a, b, mask) -> float:
        return float(token_relative_error(a, b)[mask].mean())

    rows = []
    for ex in examples:
        t0 = time.time()
        full = None
        for variant in variants:
            ctx = context(ex, variant)
            if full is None:
                full = greedy_decode(ops, list(ctx["full_k"]), list(ctx["full_v"]), ctx["tail"], args.max_tokens,
                                     diag.stop_ids, keep_logprobs=True)
            for ratio in ratios:
                k, v, selected = blend(ctx, ratio)
                k_error, v_error = error(k, ctx["full_k"], ~ctx["exact"]), error(v, ctx["full_v"], ~ctx["exact"])
                for t, s in tempers:
                    ape.update(lo=int(ctx["starts"][1]) if len(ctx["starts"]) > 1 else ctx["n"], hi=ctx["n"], T=t, S=s)
                    trace = greedy_decode(ops, list(k), list(v), ctx["tail"], args.max_tokens, diag.stop_ids,
                                          keep_logprobs=True)
                    ape.update(T=1.0, S=1.0)
                    kl = float((full.logprobs[0].exp() * (full.logprobs[0] - trace.logprobs[0])).sum())
                    rows.append({"index": ex.index, "variant": variant, "ratio": ratio, "temper": f"{t:g}:{s:g}",
                                 "equal": trace.tokens == full.tokens, "kl": kl, "recomputed": selected / ctx["n"],
                                 "k_error": k_error, "v_error": v_error})
        print(f"example {ex.index}: {time.time() - t0:.0f} s", flush=True)
        args.out.write_text(json.dumps(rows, indent=1), encoding="utf-8")

    print("variant ratio temper equal KL(median) recomputed K-error V-error")
    for variant in variants:
        for ratio in ratios:
            for setting in dict.fromkeys(x["temper"] for x in rows):
                r = [x for x in rows if x["variant"] == variant and x["ratio"] == ratio and x["temper"] == setting]
                print(variant, ratio, setting, f"{sum(x['equal'] for x in r)}/{len(r)}",
                      f"{statistics.median(x['kl'] for x in r):.4f}", f"{statistics.mean(x['recomputed'] for x in r):.3f}",
                      f"{statistics.mean(x['k_error'] for x in r):.4f}", f"{statistics.mean(x['v_error'] for x in r):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
