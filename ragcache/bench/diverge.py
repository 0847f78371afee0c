"""``ragcache bench diverge``: where and why blend's greedy answers part from full prefill's.

Owns: :func:`run_diverge` (per question: full prefill and blend, greedy, same prompt, same model and
dtype; for an answer that parts, the first differing step, the context tokens that step attends to,
whether they were recomputed or reused, their KV error against full prefill's, and counterfactual
reruns that force tokens into the recompute set), :func:`classify` (one cause per divergence) and
:func:`aggregate` (the share of divergences each cause explains). Imports torch only inside the
runner.

Where it runs: on the plain-torch reference of the engine (:mod:`ragcache.bench.reference`: the
configured model through transformers, the same :func:`ragcache.blend.blend_kv` over its
``DecoderOps``), because vLLM exposes neither per-token K/V nor attention weights. The blend is
built as the engine's worker builds it (:meth:`ragcache.engine.messages.BlendParams.from_options`
from the ``[blend]`` settings, the same exact/segment layout, the same budget rule), the chunk KV
is computed where the placement rule puts it (after the prompt head and the KV context) and
stored in ``store.kv_compression``'s form (int8 by default: quantised and dequantised with
:mod:`ragcache.kvstore.codec`), and the attention is torch's. What
the reference cannot show: vLLM's own kernels' rounding (full prefill fp32 vs bf16 already changes
1 answer in 12 on short prompts).

Counterfactuals (each a new blend whose recomputed set is exactly the original selection plus the
extra tokens: those go in as ``forced`` with the ratio's budget at 0; ``replay`` forces the original
selection alone and must reproduce the divergence):

- ``top_k``: the ``top_k`` context tokens the diverging step attends to most (the query of step s,
  the token blend and full both chose at s - 1; attention averaged over every layer and query head);
- ``heads``: the first ``head_tokens`` tokens of every moved chunk (the chunks' attention sinks,
  what ``blend.chunk_head_tokens`` recomputes);
- ``passage``: every token of the moved chunk that step attends to most (Cache-Craft-style);
- ``all``: every moved token (the blend at ratio 1: what is left is the rounding of the blend's own
  layer-wise path against full prefill's, not staleness);
- ``patch_top_k`` (no blend): the blended KV with the top-k tokens' rows replaced by full prefill's
  (their KV exact, everything else as blended): whether those tokens' KV error is the cause at all;
- ``patch_layers_0-H`` and ``patch_layers_H-L`` (no blend; ``H`` = half the ``L`` layers): the
  blended KV with every context token's K/V in the first (second) half of the layers replaced by full
  prefill's: in which layers the staleness that parts the answer sits.

A token is restored when the rerun's greedy tokens up to and including step s equal full prefill's;
the answer when all its tokens do. A divergence's cause is the smallest forced set that restores the
token (top-k < heads < passage < all), else "not restored".

Run: ``ragcache bench diverge --dataset hotpotqa --n 6`` (``--dtype auto``: the engine's dtype on this
host). ``scripts/unseen_sets.py OUT_DIR`` writes two sets from rows no setting was tuned on (HotpotQA
questions among unrelated passages; MuSiQue with ~500-token passages) for ``--dataset OUT_DIR/...``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from ragcache.bench.datasets import QAExample
    from ragcache.config import Settings

#: causes in the order :func:`classify` tries them, with their table labels
CAUSES = {
    "top_k": "attended tokens reused: forcing the step's top-k restores",
    "heads": "chunk heads (attention sinks): forcing every chunk's first tokens restores",
    "passage": "passage: forcing the attended chunk whole restores",
    "all": "only recomputing every token restores (staleness spread over the context)",
    "not_restored": "not restored even by recomputing every token (the blend path's rounding)",
    "replay_differs": "the replay of the blend's own selection does not diverge (reference noise)",
}

#: a full-prefill top-1/top-2 log-probability gap below this (nats) counts as a near tie
NEAR_TIE = 0.5


def classify(record: Mapping[str, Any]) -> str:
    """The cause of one divergence (a key of :data:`CAUSES`) from its counterfactuals:
    ``record["counterfactuals"][name]["token_restored"]`` for ``replay`` (must *not* restore),
    ``top_k``, ``heads``, ``passage``, ``all``."""
    cf = record["counterfactuals"]
    if cf["replay"]["token_restored"]:
        return "replay_differs"
    for name in ("top_k", "heads", "passage", "all"):
        if cf.get(name, {}).get("token_restored"):
            return name
    return "not_restored"


def aggregate(records: Sequence[Mapping[str, Any]], head_tokens: int = 4) -> dict[str, Any]:
    """Summary over the questions: how many answers equal full prefill's, and for the divergences the
    share of each cause, each counterfactual's restore rates, and the KV error and attention of the
    tokens the diverging steps attend to (``top_chunk_heads``: those among a chunk's first
    ``head_tokens``)."""
    div = [r["divergence"] for r in records if r.get("divergence")]
    n = len(div)
    out: dict[str, Any] = {
        "questions": len(records), "answers_equal": sum(1 for r in records if r["answer_equal"]),
        "divergences": n,
        "mean_recompute_share": _mean([r["recomputed"] / r["ctx_tokens"] for r in records]),
    }
    if not n:
        return out
    counts = {c: sum(1 for d in div if d["cause"] == c) for c in CAUSES}
    out["causes"] = {c: {"count": k, "share": round(k / n, 3), "label": CAUSES[c]} for c, k in counts.items() if k}
    names = sorted({name for d in div for name in d["counterfactuals"]})
    out["counterfactuals"] = {name: {
        "token_restored": sum(1 for d in div if d["counterfactuals"].get(name, {}).get("token_restored")),
        "answer_restored": sum(1 for d in div if d["counterfactuals"].get(name, {}).get("answer_restored")),
        "extra_tokens_mean": _mean([d["counterfactuals"][name].get("extra_tokens", 0) for d in div
                                    if name in d["counterfactuals"]]),
    } for name in names}
    top = [t for d in div for t in d["top"]]
    out["step_fraction_mean"] = _mean([d["step"] / max(1, d["full_len"]) for d in div])
    out["near_tie"] = sum(1 for d in div if d["full_margin"] < NEAR_TIE)
    out["full_margin_median"] = _median([d["full_margin"] for d in div])
    out["top_tokens"] = {
        kind: {"count": sum(1 for t in top if t["kind"] == kind),
               "k_error_mean": _mean([t["k_error"] for t in top if t["kind"] == kind]),
               "v_error_mean": _mean([t["v_error"] for t in top if t["kind"] == kind]),
               "mass_mean": _mean([t["mass"] for t in top if t["kind"] == kind])}
        for kind in ("exact", "recomputed", "reused")}
    out["top_chunk_heads"] = sum(1 for t in top if t["chunk"] > 0 and t["pos_in_chunk"] < head_tokens)
    out["top_listed"] = len(top)
    out["reused_mass_mean"] = _mean([d["reused_mass"] for d in div])
    out["context_error"] = {key: _mean([d["context_error"][key] for d in div]) for key in div[0]["context_error"]}
    return out


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def _median(xs: Sequence[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    m = len(xs) // 2
    return round(xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2, 4)


def run_diverge(settings: "Settings", examples: Sequence["QAExample"], *, dtype: str, passages: int = 10,
                max_tokens: int = 32, top_k: int = 8, head_tokens: int = 4,
                progress: Callable[[str], None] | None = None,
                checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The divergence report over ``examples`` (see the module docstring).

    Args:
        settings: ragcache settings: ``models.model`` (the reference model), ``[blend]`` (the blend
            built as the engine's worker builds it), ``[prompt]``, ``store.kv_compression``.
        examples: the questions; the first ``passages`` passages of each, in the file's order.
        dtype: the reference's compute dtype (``float32``, ``bfloat16``, ``float16``): the engine's
            (``engine.dtype`` resolved on this host) for the engine's numbers.
        max_tokens: answer tokens decoded greedily.
        top_k: context tokens listed (and forced by the ``top_k`` counterfactual) per divergence.
        head_tokens: chunk head tokens forced by the ``heads`` counterfactual.
        progress: called with one line per question.
        checkpoint: called with the partial result after every question.

    Returns:
        ``{"benchmark": "diverge", "settings": ..., "records": [...], "summary": aggregate(...)}``;
        each record has the question, both answers, ``answer_equal``, the blend's recompute share
        and, when the answers part, ``divergence`` (step, tokens, margins, top-attended tokens with
        chunk, position, kind, attention mass and KV error, the context's KV error by kind, the
        counterfactuals and the cause).

    Raises:
        ragcache.models.ModelNotFoundError: the model cannot be provided.
    """
    from ragcache.bench.reference import load_reference

    say = progress or (lambda _msg: None)
    model, tokenizer, ops = load_reference(settings.models.model, settings.models.cache_dir, dtype)
    diag = Diagnosis(settings, ops, tokenizer, passages=passages, max_tokens=max_tokens, top_k=top_k,
                      head_tokens=head_tokens)
    records: list[dict[str, Any]] = []

    def result() -> dict[str, Any]:
        summary = aggregate(records, head_tokens)
        return {"benchmark": "diverge", "reference": "transformers + ragcache.blend (plain torch)",
                "dtype": dtype, "kv_compression": settings.store.kv_compression, "passages": passages,
                "max_tokens": max_tokens, "top_k": top_k, "head_tokens": head_tokens,
                "attention": "step query's attention, mean over all layers and query heads",
                "blend": settings.blend.model_dump(mode="json"), "summary": summary, "records": records}

    for ex in examples:
        t0 = time.perf_counter()
        rec = diag.example(ex)
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        records.append(rec)
        d = rec.get("divergence")
        say(f"[{len(records)}/{len(examples)}] example {ex.index}: "
            + ("equal" if d is None else f"parts at step {d['step']}/{d['full_len']} -> {d['cause']}")
            + f" ({rec['wall_s']} s)")
        if checkpoint is not None:
            checkpoint({**result(), "partial": True})
    return result()


class Diagnosis:
    """The per-question work of :func:`run_diverge` on one reference model (torch imported here)."""

    def __init__(self, settings: "Settings", ops: Any, tokenizer: Any, *, passages: int, max_tokens: int,
                 top_k: int, head_tokens: int) -> None:
        self.settings = settings
        self.ops = ops
        self.tokenizer = tokenizer
        self.passages = passages
        self.max_tokens = max_tokens
        self.top_k = top_k
        self.head_tokens = head_tokens
        self._builder = None
        self.stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self._segment_kv: dict[tuple, tuple] = {}
        from ragcache.blend import LeadIns

        self._lead_ins = LeadIns(ops)  # the lead-ins' KV, computed once as the worker does (_stored)

    # ---- the KV each path sees -------------------------------------------------------------

    def _stored(self, lead_in: list[int], unit: list[int]):
        """One segment's KV as the store serves it: computed after ``lead_in`` as the engine's worker
        computes it (the lead-in's KV once, :func:`~ragcache.blend.lead_in_kv`), in the stored form."""
        import torch

        from ragcache.blend import compute_kv
        from ragcache.kvstore import codec

        key = (tuple(lead_in), tuple(unit))
        if key not in self._segment_kv:
            positions = torch.arange(len(lead_in), len(lead_in) + len(unit))
            k, v = compute_kv(self.ops, torch.tensor(unit), positions,
                              lead_in=self._lead_ins.get(lead_in) if lead_in else None)
            form = self.settings.store.kv_compression
            if form != "none":
                L, T, H, D = k.shape
                parts = codec.layer_parts(form, self.ops.dtype, T, H, D)
                k, v = codec.decode_all(form, parts, codec.encode(k, v, form, self.ops.dtype), self.ops.dtype,
                                        self.ops.device)
            self._segment_kv[key] = (k, v)
        return self._segment_kv[key]

    def _blend(self, ctx, forced_extra=None):
        """A blend of ``ctx``: the engine's (``forced_extra`` None) or one recomputing exactly the
        indices ``forced_extra`` (a set; nothing else selected). Returns (k, v, selected)."""
        import torch

        from ragcache.blend import BlendRequest, CachedKV, blend_kv

        p, n = ctx["params"], ctx["n"]
        knobs, forced = p.blend, None  # the request's blend record, as the worker hands it on
        if forced_extra is not None:
            forced = torch.zeros(n, dtype=torch.bool)
            forced[sorted(forced_extra)] = True
            knobs = knobs.model_copy(update={"recompute_ratio": 0.0, "min_recompute_tokens": 0, "budget": "fixed"})
        request = BlendRequest(token_ids=ctx["ids"], positions=torch.arange(n), knobs=knobs, tail_ids=ctx["tail_sel"],
                               segment_starts=ctx["starts"], exact=ctx["exact"], forced=forced)
        L = self.ops.num_layers
        ks: list = [None] * L
        vs: list = [None] * L

        def keep(layer, k, v):
            ks[layer], vs[layer] = k.clone(), v.clone()

        res = blend_kv(self.ops, request, CachedKV(ctx["k_pre"].clone(), ctx["v"].clone()), on_layer=keep,
                       prefetch=False)
        return torch.stack(ks), torch.stack(vs), set(res.selected.tolist())

    def _decode(self, ctx, k, v):
        from ragcache.bench.reference import greedy_decode

        return greedy_decode(self.ops, list(k), list(v), ctx["tail"], self.max_tokens, self.stop_ids)

    # ---- one question ----------------------------------------------------------------------

    def context(self, ex: "QAExample") -> dict[str, Any]:
        """The prompt and every KV the diagnosis compares: ``k_pre``/``v`` (stored, as the blend loads
        them), ``full_k``/``full_v`` (full prefill, K post-RoPE), and the blend's parameters."""
        from ragcache.bench.datasets import make_chunks
        from ragcache.prompt import PromptBuilder

        if self._builder is None:
            self._builder = PromptBuilder(self.tokenizer, self.settings.prompt, "reference",
                                          compute_dtype=str(self.ops.dtype))
        prompt = self._builder.build(ex.question, make_chunks(self.tokenizer, ex.passages[:self.passages]))
        return self.context_of(prompt)

    def context_of(self, prompt: Any) -> dict[str, Any]:
        """:meth:`context` of an :class:`~ragcache.prompt.AssembledPrompt` (or anything with its
        ``token_ids``, ``ctx_len``, ``lead_in_len``, ``segments`` of ``start``, ``length``, ``key``, and
        optionally ``kv_context``)."""
        import torch

        from ragcache.blend import compute_kv
        from ragcache.engine.messages import BlendParams, SegmentRef
        from ragcache.options import QueryOptions
        from ragcache.prompt import is_canonical, lead_in_for

        ids, n, lead = list(prompt.token_ids), prompt.ctx_len, prompt.lead_in_len
        head, context = ids[:lead], tuple(getattr(prompt, "kv_context", ()))
        k_parts, v_parts = [], []
        for seg in prompt.segments:
            k, v = self._stored(lead_in_for(seg.start, head, context), ids[seg.start:seg.start + seg.length])
            k_parts.append(k)
            v_parts.append(v)
        ctx_ids = torch.tensor(ids[:n])
        positions = torch.arange(n)
        with torch.inference_mode():
            fk_pre, fv = compute_kv(self.ops, ctx_ids, positions)
            full_k = torch.stack([self.ops.rope(i, positions, None, fk_pre[i])[1] for i in range(self.ops.num_layers)])
        params = BlendParams.from_options(
            self.settings.blend, QueryOptions(), mode="blend", ctx_len=n, lead_in_len=lead,
            segments=tuple(SegmentRef(s.key, s.start, s.length) for s in prompt.segments), kv_context=context)
        # as the worker builds its BlendRequest (ragcache.engine.worker, _open)
        canonical = [is_canonical(s.start, head, context) for s in prompt.segments]
        exact = torch.repeat_interleave(torch.tensor(canonical), torch.tensor([s.length for s in prompt.segments]))
        tail = ids[n:]
        return {"ids": ctx_ids, "n": n, "tail": tail, "params": params, "exact": exact,
                "starts": [s.start for s in prompt.segments], "lengths": [s.length for s in prompt.segments],
                "tail_sel": torch.tensor(tail) if params.blend.token_selection.needs_question else None,
                "k_pre": torch.cat(k_parts, dim=1).contiguous(), "v": torch.cat(v_parts, dim=1).contiguous(),
                "full_k": full_k, "full_v": fv}

    def example(self, ex: "QAExample") -> dict[str, Any]:
        """One question's record (see :func:`run_diverge`)."""
        return {"index": ex.index, "question": ex.question, "gold": ex.answers[:1], **self.compare(self.context(ex))}

    def compare(self, ctx: Mapping[str, Any]) -> dict[str, Any]:
        """Full prefill and blend of one :meth:`context`, greedy; the divergence when the answers part."""
        full = self._decode(ctx, ctx["full_k"], ctx["full_v"])
        bk, bv, selected = self._blend(ctx)
        blend = self._decode(ctx, bk, bv)
        rec: dict[str, Any] = {
            "ctx_tokens": ctx["n"], "tail_tokens": len(ctx["tail"]), "recomputed": len(selected),
            "full_answer": self.tokenizer.decode(full.tokens, skip_special_tokens=True),
            "blend_answer": self.tokenizer.decode(blend.tokens, skip_special_tokens=True),
            "answer_equal": full.tokens == blend.tokens,
        }
        if not rec["answer_equal"]:
            rec["divergence"] = self.divergence(ctx, full, blend, bk, bv, selected)
        return rec

    def divergence(self, ctx, full, blend, bk, bv, selected) -> dict[str, Any]:
        """Step, attended tokens, KV errors and counterfactuals of one answer that parts."""
        import torch

        from ragcache.bench.reference import token_relative_error

        s = next((i for i, (a, b) in enumerate(zip(full.tokens, blend.tokens)) if a != b),
                 min(len(full.tokens), len(blend.tokens)))
        s_att = min(s, len(blend.attention) - 1)
        n = ctx["n"]
        exact = ctx["exact"]
        kind = ["exact" if exact[i] else ("recomputed" if i in selected else "reused") for i in range(n)]
        # per token, layer-averaged relative L2 error of the blended K/V against full prefill's
        k_err, v_err = token_relative_error(bk, ctx["full_k"]), token_relative_error(bv, ctx["full_v"])  # [N] each
        att = blend.attention[s_att]  # [L, N]
        mass = att.mean(dim=0)  # [N]
        last = att[-1]
        full_mass = full.attention[min(s, len(full.attention) - 1)].mean(dim=0)
        starts = ctx["starts"]
        chunk_of = torch.searchsorted(torch.tensor(starts), torch.arange(n), right=True) - 1  # [N]
        top_idx = torch.topk(mass, min(self.top_k, n)).indices.tolist()
        top = []
        for i in top_idx:
            c = int(chunk_of[i])
            top.append({"index": i, "token": self.tokenizer.decode([int(ctx["ids"][i])]), "chunk": c,
                        "pos_in_chunk": i - starts[c], "kind": kind[i], "mass": round(float(mass[i]), 4),
                        "last_layer_mass": round(float(last[i]), 4), "full_mass": round(float(full_mass[i]), 4),
                        "k_error": round(float(k_err[i]), 4), "v_error": round(float(v_err[i]), 4)})
        reused = torch.tensor([k == "reused" for k in kind])
        recomputed = torch.tensor([k == "recomputed" for k in kind])
        context_error = {f"{w}_error_{name}": round(float(e[m].mean()), 4) if bool(m.any()) else None
                         for name, m in (("reused", reused), ("recomputed", recomputed)) for w, e in (("k", k_err), ("v", v_err))}
        # counterfactuals
        moved = [c for c in range(1, len(starts)) if not bool(exact[starts[c]])]
        chunk_mass = {c: float(mass[starts[c]:starts[c] + ctx["lengths"][c]].sum()) for c in moved}
        passage = max(chunk_mass, key=chunk_mass.get) if chunk_mass else None
        extras = {"replay": set(), "top_k": set(top_idx),
                  "heads": {starts[c] + j for c in moved for j in range(min(self.head_tokens, ctx["lengths"][c]))}}
        if passage is not None:
            extras["passage"] = set(range(starts[passage], starts[passage] + ctx["lengths"][passage]))
        extras["all"] = set(range(n))

        def rerun(k, v) -> dict[str, Any]:
            """The greedy decode over ``k``/``v``: whether it restores full prefill's token s and answer."""
            trace = self._decode(ctx, k, v)
            return {"token_restored": trace.tokens[:s + 1] == full.tokens[:s + 1],
                    "answer_restored": trace.tokens == full.tokens,
                    "answer": self.tokenizer.decode(trace.tokens, skip_special_tokens=True)}

        cfs = {}
        for name, extra in extras.items():
            extra = {i for i in extra if not bool(exact[i])}
            k, v, sel = self._blend(ctx, selected | extra)
            cfs[name] = {"extra_tokens": len(extra - selected), "recomputed": len(sel), **rerun(k, v)}
        # patches: full prefill's KV for some rows (the top-k tokens) or some layers (every context token)
        half = self.ops.num_layers // 2
        patches = {"patch_top_k": (len(top_idx), slice(None), torch.tensor(top_idx))}
        for lo, hi in ((0, half), (half, self.ops.num_layers)):
            patches[f"patch_layers_{lo}-{hi}"] = (int((~exact).sum()), slice(lo, hi), slice(None))
        for name, (count, layers, rows) in patches.items():
            pk, pv = bk.clone(), bv.clone()
            pk[layers, rows], pv[layers, rows] = ctx["full_k"][layers, rows], ctx["full_v"][layers, rows]
            cfs[name] = {"extra_tokens": count, **rerun(pk, pv)}
        d = {"step": s, "full_len": len(full.tokens),
             "full_token": self.tokenizer.decode(full.tokens[s:s + 1]),
             "blend_token": self.tokenizer.decode(blend.tokens[s:s + 1]),
             "full_margin": round(full.margins[min(s, len(full.margins) - 1)], 4),
             "blend_margin": round(blend.margins[s_att], 4),
             "reused_mass": round(float(mass[reused].sum()), 4),
             "recomputed_mass": round(float(mass[recomputed].sum()), 4),
             "attended_passage": passage, "top": top, "context_error": context_error, "counterfactuals": cfs}
        d["cause"] = classify(d)
        return d
