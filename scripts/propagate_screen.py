"""Screen delta propagation on the plain-torch reference: the reused tokens' KV corrected by the
recomputed tokens' corrections.

In every selective layer of the default blend, the recomputed tokens' fresh K (pre-RoPE) and V
minus their reused K/V are the corrections the blend measured; each reused moved token gets the
mean of them weighted by ``softmax(cos(its reused pre-RoPE key, theirs) / tau)`` per KV head, times
``alpha`` (K and V apart: ``--variants alpha_k:alpha_v:tau``; ``0:0:1`` is the blend as it runs), before
the selected rows attend over the layer (``--from-layer``: only from that layer on; ``--top``: only each
token's most similar recomputed tokens weighed). The rationale: a reused token's KV is off because its
attention missed the chunks before it, and tokens whose keys look alike in the same layer are moved
alike by that context. A scratch measurement for choosing what to build, on the reference of
``ragcache bench diverge`` (vLLM's kernels round differently); it wraps
``ragcache.blend.forward._selective_layer`` for the run. The form chosen ships as the
``blend.propagate`` settings (:mod:`ragcache.blend.propagate`): ``RAGCACHE_BLEND__PROPAGATE=0.5`` with
``--variants 0:0:1`` runs the blend as the engine would, propagation included.

Prints, per variant, the answers equal to full prefill's, the median first-token KL(full || variant)
and the mean relative K/V error of the tokens left reused against full prefill's; writes every row
to ``--out``.

Usage::

    python scripts/propagate_screen.py --dataset musique --offset 10 --n 10 --passages 5 \\
        --variants 0:0:1,0.5:0.5:0.05,0.5:0:0.05,0:0.5:0.05 --out propagate.json
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

    ap = screen_parser(__doc__, n=10, out="propagate_screen.json")
    ap.add_argument("--variants", default="0:0:1,0.5:0.5:0.05", help="alpha_k:alpha_v:tau, comma-separated")
    ap.add_argument("--from-layer", type=int, default=0, help="propagate in selective layers from this one on")
    ap.add_argument("--top", type=int, default=0, help="weigh only each token's TOP most similar recomputed tokens (0: all)")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    import ragcache.blend.forward as forward
    from ragcache.bench.reference import greedy_decode, token_relative_error

    examples, diag = open_screen(args)
    ops = diag.ops
    variants = [tuple(float(x) for x in v.split(":")) for v in args.variants.split(",")]
    now = {"ak": 0.0, "av": 0.0, "tau": 1.0, "moved": None}
    selective_layer = forward._selective_layer

    def propagated(p, layer, sel, reused, last, observe, reused_k_pre=None):
        if reused is not None and (now["ak"] or now["av"]) and sel.rows.numel() > 0 and layer >= args.from_layer:
            k_all, v_all = reused  # [N, Hkv, D] each, K post-RoPE at the new positions
            _, k, v = forward._qkv_rope(p.ops, layer, sel.hidden, sel.positions)
            positions = torch.arange(k_all.shape[0])
            left = now["moved"].clone()
            left[sel.rows] = False
            left = left.nonzero().flatten()
            k_pre = ops.rope(layer, -positions, None, k_all)[1]  # RoPE undone: [N, Hkv, D]
            dk = ops.rope(layer, -sel.positions, None, k)[1] - k_pre[sel.rows]
            dv = v - v_all[sel.rows]
            a = F.normalize(k_pre[left], dim=-1).transpose(0, 1)  # [Hkv, u, D]
            b = F.normalize(k_pre[sel.rows], dim=-1).transpose(0, 1)  # [Hkv, s, D]
            sim = a @ b.transpose(1, 2) / now["tau"]  # [Hkv, u, s]
            if 0 < args.top < sim.shape[-1]:
                sim = sim.masked_fill(sim < sim.topk(args.top, dim=-1).values[..., -1:], float("-inf"))
            w = torch.softmax(sim, dim=-1)
            if now["av"]:
                v_all[left] += now["av"] * (w @ dv.transpose(0, 1)).transpose(0, 1)
            if now["ak"]:
                k_new = k_pre[left] + now["ak"] * (w @ dk.transpose(0, 1)).transpose(0, 1)
                k_all[left] = ops.rope(layer, positions[left], None, k_new)[1]
        return selective_layer(p, layer, sel, reused, last, observe, reused_k_pre)

    forward._selective_layer = propagated

    def error(a, b, mask) -> float:
        return float(token_relative_error(a, b)[mask].mean())

    rows = []
    with torch.inference_mode():
        for ex in examples:
            t0 = time.time()
            ctx = diag.context(ex)
            full = greedy_decode(ops, list(ctx["full_k"]), list(ctx["full_v"]), ctx["tail"], args.max_tokens,
                                 diag.stop_ids, keep_logprobs=True)
            now["moved"] = ~ctx["exact"]
            for ak, av, tau in variants:
                now.update(ak=ak, av=av, tau=tau)
                k, v, selected = diag._blend(ctx)
                trace = greedy_decode(ops, list(k), list(v), ctx["tail"], args.max_tokens, diag.stop_ids,
                                      keep_logprobs=True)
                kl = float((full.logprobs[0].exp() * (full.logprobs[0] - trace.logprobs[0])).sum())
                left = now["moved"].clone()
                left[sorted(selected)] = False
                rows.append({"index": ex.index, "variant": f"{ak:g}:{av:g}:{tau:g}", "equal": trace.tokens == full.tokens,
                             "kl": kl, "recomputed": len(selected) / ctx["n"], "from_layer": args.from_layer, "top": args.top,
                             "k_error": error(k, ctx["full_k"], left), "v_error": error(v, ctx["full_v"], left)})
            print(f"example {ex.index}: {time.time() - t0:.0f} s", flush=True)
            args.out.write_text(json.dumps(rows, indent=1), encoding="utf-8")

    print("variant equal KL(median) recomputed K-error V-error (tokens left reused)")
    for name in dict.fromkeys(x["variant"] for x in rows):
        r = [x for x in rows if x["variant"] == name]
        print(name, f"{sum(x['equal'] for x in r)}/{len(r)}", f"{statistics.median(x['kl'] for x in r):.4f}",
              f"{statistics.mean(x['recomputed'] for x in r):.3f}", f"{statistics.mean(x['k_error'] for x in r):.4f}",
              f"{statistics.mean(x['v_error'] for x in r):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
