"""``ragcache bench diverge`` on a constructed case: one context token's reused KV is made stale on
purpose (scaled in the deep layers, where the blend's KV-deviation check at layer 1 cannot see it),
the answer flips, and the report must name that token as the top-attended reused token with a large
KV error, and the counterfactual that forces it into the recompute set must restore the answer.
Tiny random Llama (tests/hf_ops.py), no vLLM, a few seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ragcache.bench.diverge import CAUSES, Diagnosis, aggregate, classify
from ragcache.bench.reference import HFDecoderOps, greedy_decode, token_relative_error
from ragcache.bench.report import render
from ragcache.config import Settings
from tests.hf_ops import hf_layer_kv, tiny_llama


class _Tokens:
    """The tokenizer the report needs: decode only."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(f"t{i}" for i in ids)


def _prompt(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 256, (6,), generator=g).tolist()
    chunks = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (24, 20, 22)]
    tail = torch.randint(0, 256, (5,), generator=g).tolist()
    ids, segments = list(head), [SimpleNamespace(key="head", start=0, length=len(head))]
    for j, c in enumerate(chunks):
        segments.append(SimpleNamespace(key=f"c{j}", start=len(ids), length=len(c)))
        ids.extend(c)
    return SimpleNamespace(token_ids=ids + tail, ctx_len=len(ids), lead_in_len=len(head), segments=segments)


@pytest.fixture(scope="module")
def diagnosis() -> Diagnosis:
    ops = HFDecoderOps(tiny_llama(seed=3))
    settings = Settings.load(None, blend={"selection": "deviation", "budget": "fixed", "recompute_ratio": 0.5,
                                          "min_recompute_tokens": 0, "granule": 1},
                             store={"kv_compression": "none"})
    return Diagnosis(settings, ops, _Tokens(), passages=3, max_tokens=6, top_k=4, head_tokens=2)


def test_greedy_decode_matches_transformers(diagnosis: Diagnosis) -> None:
    """The reference decode over full prefill's KV picks transformers' own next token."""
    ops = diagnosis.ops
    prompt = _prompt()
    ctx = diagnosis.context_of(prompt)
    ids = torch.tensor(prompt.token_ids)
    with torch.inference_mode():
        want = int(ops.model(input_ids=ids[None]).logits[0, -1].argmax())
        layers = hf_layer_kv(ops.model, ids[:ctx["n"]], torch.arange(ctx["n"]))
    trace = greedy_decode(ops, list(ctx["full_k"]), list(ctx["full_v"]), ctx["tail"], 1)
    assert trace.tokens == [want]
    torch.testing.assert_close(ctx["full_k"][2], layers[2][0], rtol=1e-4, atol=1e-4)
    assert trace.attention[0].shape == (ops.num_layers, ctx["n"])
    mass = trace.attention[0].sum(dim=1)  # [L]: the context's share; the rest is on the tail
    assert bool(torch.isfinite(trace.attention[0]).all()) and float(mass.min()) > 0.0
    assert float(mass.max()) <= 1.0 + 1e-5


def test_stale_token_is_named_and_forcing_it_restores(diagnosis: Diagnosis) -> None:
    ctx = diagnosis.context_of(_prompt())
    clean = diagnosis.compare(ctx)
    assert clean["answer_equal"], "precondition: the blend of the clean cache answers as full prefill does"
    _, _, selected = diagnosis._blend(ctx)
    # the reused token of a moved chunk (the first chunk sits where its KV was computed: exact) that
    # full prefill's first step attends to most in the deep layers; its K there made larger (it draws
    # more attention) and its V much larger: a stale token the selection at layer 1 cannot see
    full = greedy_decode(diagnosis.ops, list(ctx["full_k"]), list(ctx["full_v"]), ctx["tail"], 1)
    deep = full.attention[0][2:].mean(dim=0)  # [N]
    moved = torch.zeros(ctx["n"], dtype=torch.bool)
    moved[ctx["starts"][2]:] = True
    moved[sorted(selected)] = False
    stale = int(deep.masked_fill(~moved, -1.0).argmax())
    ctx["k_pre"][2:, stale] *= 4.0
    ctx["v"][2:, stale] *= 12.0

    rec = diagnosis.compare(ctx)

    assert not rec["answer_equal"]
    d = rec["divergence"]
    top = d["top"][0]
    assert top["index"] == stale and top["kind"] == "reused"
    assert top["k_error"] > 1.0 and top["v_error"] > 1.0  # relative L2 against full prefill's KV
    others = [t["k_error"] for t in d["top"][1:] if t["kind"] == "reused"]
    assert all(e < top["k_error"] for e in others)
    cf = d["counterfactuals"]
    assert not cf["replay"]["token_restored"]  # the replay of the blend's own selection diverges the same way
    assert cf["top_k"]["token_restored"] and cf["top_k"]["answer_restored"]
    assert cf["patch_top_k"]["answer_restored"]
    # the staleness sits in layers 2.. only: full prefill's KV in the second half of the layers restores
    # the answer, in the first half it does not
    half = diagnosis.ops.num_layers // 2
    assert half == 2, "precondition: the stale layers are the second half"
    assert cf[f"patch_layers_{half}-{2 * half}"]["answer_restored"]
    assert not cf[f"patch_layers_0-{half}"]["token_restored"]
    assert cf["all"]["answer_restored"] and cf["all"]["recomputed"] == ctx["n"] - ctx["lengths"][0] - ctx["lengths"][1]
    assert d["cause"] == "top_k" == classify(d)

    summary = aggregate([clean, rec])
    assert summary["answers_equal"] == 1 and summary["divergences"] == 1
    assert summary["causes"]["top_k"]["count"] == 1
    assert summary["counterfactuals"]["top_k"]["answer_restored"] == 1
    text = render({"benchmark": "diverge", "dtype": "float32", "kv_compression": "none", "top_k": 4,
                   "attention": "mean over layers and heads", "summary": summary, "records": [clean, rec]})
    assert CAUSES["top_k"] in text and "1/2 answers equal" in text


def test_classify_order() -> None:
    def rec(**restored):
        return {"counterfactuals": {name: {"token_restored": restored.get(name, False)}
                                    for name in ("replay", "top_k", "heads", "passage", "all")}}
    assert classify(rec(replay=True, top_k=True)) == "replay_differs"
    assert classify(rec(top_k=True, passage=True)) == "top_k"
    assert classify(rec(heads=True, passage=True)) == "heads"
    assert classify(rec(passage=True, all=True)) == "passage"
    assert classify(rec(all=True)) == "all"
    assert classify(rec()) == "not_restored"


def test_cli_parses_diverge() -> None:
    from app.bench_cmd import run_diverge
    from app.cli import build_parser

    args = build_parser().parse_args(["bench", "diverge", "--dataset", "x.json", "--n", "2", "--dtype", "float32"])
    assert (args.func, args.n, args.offset, args.passages, args.max_tokens, args.top_k, args.head_tokens, args.dtype) == (
        run_diverge, 2, 0, 10, 32, 8, 4, "float32")
    assert str(args.out) == "results/bench_diverge.json"


def test_token_relative_error_is_per_token_and_layer_averaged() -> None:
    want = torch.randn(3, 5, 2, 4)  # [L, N, Hkv, D]
    got = want.clone()
    got[:, 1] *= 1.1  # token 1: 10% off in every layer
    got[2, 3] = 0  # token 3: 100% off in one layer of three
    err = token_relative_error(got.to(torch.bfloat16), want)
    assert err.shape == (5,) and err.dtype == torch.float32
    torch.testing.assert_close(err, torch.tensor([0.0, 0.1, 0.0, 1 / 3, 0.0]), atol=5e-3, rtol=0)
