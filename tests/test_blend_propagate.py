"""ragcache.blend.propagate: the recomputed tokens' KV corrections spread to the tokens left reused.

The math against a plain reference; which rows give and take (never exact, forced or recomputed
rows, never across requests); inside a blend: ratio 1 stays full prefill, the layers up to the check
layer and the selection are untouched, and on the real SmolLM2 the tokens left reused move closer
to full prefill's KV.
"""

from __future__ import annotations

import pytest
import torch
from hf_ops import TINY_TAIL, HFLlamaOps, LayerCollector, cached_context, context_layout, hotpotqa_examples, smollm2
from test_blend_forward import tiny, tiny_context  # noqa: F401 (fixtures)
from test_blend_forward import assert_full_prefill, cached_engine_blend, full_kv, run_blend
from test_blend_quality import hotpot_prompt

from blend_calls import blend_of
from ragcache.blend import Selection
from ragcache.blend.propagate import Propagation, spread_corrections
from ragcache.config import BlendSettings


def reference_spread(keys_to, keys_from, dk, dv, alpha, tau):
    """Target by target, head by head, in float64."""
    u, h, _ = keys_to.shape
    ck, cv = torch.zeros(u, h, dk.shape[-1], dtype=torch.float64), torch.zeros(u, h, dv.shape[-1], dtype=torch.float64)
    for i in range(u):
        for head in range(h):
            a = keys_to[i, head].double()
            sims = torch.stack([torch.dot(a, b) / (a.norm() * b.norm()) for b in keys_from[:, head].double()])
            w = torch.softmax(sims / tau, dim=0)
            ck[i, head] = alpha * (w[:, None] * dk[:, head].double()).sum(0)
            cv[i, head] = alpha * (w[:, None] * dv[:, head].double()).sum(0)
    return ck, cv


def test_spread_corrections_is_the_similarity_weighted_mean_per_kv_head():
    g = torch.Generator().manual_seed(0)
    keys_to, keys_from = torch.randn(9, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    dk, dv = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    expected = reference_spread(keys_to, keys_from, dk, dv, 0.5, 0.1)
    for block in (2048, 4):  # blocks of targets give the same rows
        ck, cv = spread_corrections(keys_to, keys_from, dk, dv, 0.5, 0.1, block=block)
        torch.testing.assert_close(ck.double(), expected[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(cv.double(), expected[1], atol=1e-6, rtol=1e-5)
    # a target whose key is a source's takes mostly that source's correction at a low temperature
    ck, _ = spread_corrections(keys_from[:1], keys_from, dk, dv, 1.0, 1e-3)
    torch.testing.assert_close(ck[0], dk[0], atol=1e-4, rtol=1e-4)


def test_spread_corrections_refuses_mismatched_shapes():
    x = torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match="expected"):
        spread_corrections(x, x[:0], x[:0], x[:0], 0.5, 0.05)
    with pytest.raises(ValueError, match="expected"):
        spread_corrections(x, x, x, torch.zeros(3, 2, 5), 0.5, 0.05)


def test_propagation_corrects_only_rows_left_reused_and_only_from_their_own_request():
    g = torch.Generator().manual_seed(1)
    s, h, d = 30, 2, 8
    starts = [0, 12, 22, 30]  # three requests: the second does not propagate
    knobs = [BlendSettings(propagate=0.5, propagate_from_depth=0.0), BlendSettings(propagate=0.0),
             BlendSettings(propagate=0.8, propagate_temperature=0.2, propagate_from_depth=0.0)]
    exact, forced = torch.zeros(s, dtype=torch.bool), torch.zeros(s, dtype=torch.bool)
    exact[:3] = True  # the first request's head sits where it was computed
    forced[25] = True  # no cached KV: recomputed, and its "reused" rows hold anything
    rows = torch.tensor([3, 4, 8, 14, 15, 23, 25, 27])
    prop = Propagation.of(starts, knobs, exact, forced, num_layers=30)
    assert Propagation.of(starts, [BlendSettings(propagate=0.0)] * 3, exact, forced, num_layers=30) is None
    with pytest.raises(ValueError, match="num_layers"):  # 0 layers would start every depth at layer 0
        Propagation.of(starts, knobs, exact, forced, num_layers=0)
    k_pre, k, v = (torch.randn(s, h, d, generator=g) for _ in range(3))
    v[25] = 1e6  # a forced row's garbage must not spread
    fresh_k, fresh_v = torch.randn(len(rows), h, d, generator=g), torch.randn(len(rows), h, d, generator=g)
    positions = torch.arange(s) + 100

    def rotate(x, pos):  # stands for RoPE: a map that depends on the position
        return x * (1.0 + pos[:, None, None].float() / 1000)

    k2, v2 = k.clone(), v.clone()
    prop.apply_(rows, fresh_k, fresh_v, k_pre, k2, v2, positions, rotate)
    changed = ((k2 != k).flatten(1).any(1) | (v2 != v).flatten(1).any(1))
    expected_changed = torch.zeros(s, dtype=torch.bool)
    expected_changed[[*range(5, 8), *range(9, 12), 22, 24, 26, 28, 29]] = True
    assert torch.equal(changed, expected_changed)
    for (lo, hi), alpha, tau, src_at in (((0, 12), 0.5, 0.05, [0, 1, 2]), ((22, 30), 0.8, 0.2, [5, 7])):
        to = expected_changed[lo:hi].nonzero().flatten() + lo
        src = rows[src_at]
        ck, cv = spread_corrections(k_pre[to], k_pre[src], fresh_k[src_at] - k_pre[src], fresh_v[src_at] - v[src],
                                    alpha, tau)
        torch.testing.assert_close(k2[to], k[to] + rotate(ck, positions[to]))
        torch.testing.assert_close(v2[to], v[to] + cv)
    assert prop.corrected == int(expected_changed.sum())


def test_chunk_scope_takes_corrections_only_from_the_tokens_own_chunk():
    g = torch.Generator().manual_seed(2)
    s, h, d = 20, 2, 8
    knobs = [BlendSettings(propagate=0.5, propagate_scope="chunk", propagate_from_depth=0.0)]
    exact = torch.zeros(s, dtype=torch.bool)
    exact[:4] = True  # the head segment
    prop = Propagation.of([0, s], knobs, exact, None, [[0, 4, 11]], num_layers=30)
    rows = torch.tensor([5, 6, 12])  # two in the chunk at 4, one in the chunk at 11
    k_pre, k, v = (torch.randn(s, h, d, generator=g) for _ in range(3))
    fresh_k, fresh_v = torch.randn(3, h, d, generator=g), torch.randn(3, h, d, generator=g)
    k2, v2 = k.clone(), v.clone()
    prop.apply_(rows, fresh_k, fresh_v, k_pre, k2, v2, torch.arange(s), lambda x, pos: x)
    for (lo, hi), src_at in (((4, 11), [0, 1]), ((11, 20), [2])):
        to = torch.tensor([i for i in range(lo, hi) if i not in rows.tolist()])
        src = rows[src_at]
        ck, cv = spread_corrections(k_pre[to], k_pre[src], fresh_k[src_at] - k_pre[src], fresh_v[src_at] - v[src],
                                    0.5, 0.05)
        torch.testing.assert_close(k2[to], k[to] + ck)
        torch.testing.assert_close(v2[to], v[to] + cv)
    assert torch.equal(k2[:4], k[:4]) and prop.corrected == 5 + 8


def test_requests_of_one_pass_propagate_from_their_own_depth():
    g = torch.Generator().manual_seed(3)
    s, h, d = 20, 2, 8
    starts = [0, 10, 20]
    knobs = [BlendSettings(propagate=0.5, propagate_from_depth=0.0), BlendSettings(propagate=0.5)]  # layer 0, 15 of 30
    prop = Propagation.of(starts, knobs, None, None, num_layers=30)
    assert prop.start_layer == 0 and prop.active(0)
    rows = torch.tensor([2, 5, 12, 16])
    k_pre, k, v = (torch.randn(s, h, d, generator=g) for _ in range(3))
    fresh_k, fresh_v = torch.randn(4, h, d, generator=g), torch.randn(4, h, d, generator=g)
    for layer, moved in ((14, [0]), (15, [0, 1])):
        k2, v2 = k.clone(), v.clone()
        prop.apply_(rows, fresh_k, fresh_v, k_pre, k2, v2, torch.arange(s), lambda x, pos: x, layer)
        changed = (v2 != v).flatten(1).any(1)
        for r in (0, 1):
            assert bool(changed[starts[r]:starts[r + 1]].any()) == (r in moved), (layer, r)
    deep = Propagation.of(starts, [BlendSettings(propagate=0.5)] * 2, None, None, num_layers=30)
    assert deep.start_layer == 15 and not deep.active(14) and deep.active(15)


@pytest.mark.parametrize("selection,check_layer", [("deviation", 1), ("question", 0)])
def test_ratio_one_with_propagation_is_full_prefill(tiny, tiny_context, selection, check_layer):
    _, ops = tiny
    starts, exact = context_layout(tiny_context)
    result, got = run_blend(ops, tiny_context, recompute_ratio=1.0, check_layer=check_layer,
                            selection=Selection(selection), tail_ids=TINY_TAIL, segment_starts=starts, exact=exact,
                            propagate=0.5)
    assert result.num_recomputed == tiny_context.token_ids.shape[0]
    assert_full_prefill(ops, tiny_context, got)


def test_propagation_leaves_the_selection_and_the_layers_before_it_and_moves_the_reused_rows(tiny, tiny_context):
    _, ops = tiny
    starts, exact = context_layout(tiny_context)
    common = dict(recompute_ratio=0.25, check_layer=1, deviation="value", segment_starts=starts, exact=exact)
    plain, plain_kv = run_blend(ops, tiny_context, **common)
    spread, spread_kv = run_blend(ops, tiny_context, propagate=0.5, **common)
    assert torch.equal(plain.selected, spread.selected) and spread.stages["propagate_s"] > 0
    selected = torch.zeros(tiny_context.token_ids.shape[0], dtype=torch.bool)
    selected[plain.selected] = True
    left = ~selected & ~exact
    for layer in range(ops.num_layers):
        if layer <= 1:  # computed in full up to the check layer
            assert torch.equal(plain_kv.k[layer], spread_kv.k[layer]) and torch.equal(plain_kv.v[layer], spread_kv.v[layer])
            continue
        assert torch.equal(plain_kv.k[layer][exact], spread_kv.k[layer][exact])  # exact rows keep their KV
        assert not torch.allclose(plain_kv.v[layer][left], spread_kv.v[layer][left])
        assert not torch.allclose(plain_kv.k[layer][left], spread_kv.k[layer][left])
    # the first selective layer's recomputed rows come from the same hidden states
    torch.testing.assert_close(plain_kv.v[2][selected], spread_kv.v[2][selected], atol=1e-6, rtol=1e-6)


def test_propagation_from_a_depth_leaves_the_layers_before_it_as_the_blend_makes_them(tiny, tiny_context):
    _, ops = tiny  # 4 layers: from depth 0.75 on, only layer 3 propagates
    starts, exact = context_layout(tiny_context)
    common = dict(recompute_ratio=0.25, check_layer=1, deviation="value", segment_starts=starts, exact=exact)
    plain, plain_kv = run_blend(ops, tiny_context, **common)
    every, every_kv = run_blend(ops, tiny_context, propagate=0.5, **common)
    deep, deep_kv = run_blend(ops, tiny_context, propagate=0.5, propagate_from_depth=0.75, **common)
    assert torch.equal(plain.selected, deep.selected)
    for layer in range(3):
        assert torch.equal(plain_kv.k[layer], deep_kv.k[layer]) and torch.equal(plain_kv.v[layer], deep_kv.v[layer])
    left = torch.ones(tiny_context.token_ids.shape[0], dtype=torch.bool)
    left[plain.selected] = False
    left &= ~exact
    assert not torch.allclose(plain_kv.k[3][left], deep_kv.k[3][left])  # layer 3 corrects its reused rows ...
    assert not torch.allclose(every_kv.k[3][left], deep_kv.k[3][left])  # ... from layer 2's uncorrected stream
    beyond, beyond_kv = run_blend(ops, tiny_context, propagate=0.5, propagate_from_depth=1.0, **common)
    for layer in range(ops.num_layers):  # from the full depth on: no layer propagates
        assert torch.equal(plain_kv.k[layer], beyond_kv.k[layer]) and torch.equal(plain_kv.v[layer], beyond_kv.v[layer])
    assert beyond.stages.get("propagate_s", 0.0) == 0.0 < deep.stages["propagate_s"]


@pytest.mark.parametrize("depth,ahead", [(0.0, []), (0.5, [0, 1]), (1.0, [0, 1, 2, 3])])
def test_with_an_engine_cache_the_probe_writes_ahead_only_the_layers_before_the_propagation(tiny, tiny_context, depth,
                                                                                             ahead):
    # the engine path (its attention reads its own cache): a probed layer before the first propagating
    # one is written whole by the probe and then only its recomputed rows; from that layer on the
    # selective pass loads the layer again, corrects it and writes it whole. Same KV as without a cache.
    _, ops = tiny
    starts, exact = context_layout(tiny_context)
    kwargs = dict(recompute_ratio=0.2, check_layer=0, deviation="value", selection=Selection("question", granule=4),
                  tail_ids=TINY_TAIL, segment_starts=starts, exact=exact, propagate=0.5, propagate_from_depth=depth)
    reference, reference_kv = run_blend(ops, tiny_context, **kwargs)
    result, engine, calls = cached_engine_blend(ops, tiny_context, **kwargs)
    assert engine.rows_written == ahead
    assert calls == [*range(ops.num_layers), *(layer for layer in range(ops.num_layers) if layer not in ahead)]
    assert torch.equal(result.selected, reference.selected)
    for layer in range(ops.num_layers):
        torch.testing.assert_close(engine.cache.k[layer], reference_kv.k[layer], rtol=0, atol=1e-6)
        torch.testing.assert_close(engine.cache.v[layer], reference_kv.v[layer], rtol=0, atol=1e-6)


def relative_error(got, expected, rows):
    return float(((got[rows] - expected[rows]).norm(dim=-1) / expected[rows].norm(dim=-1).clamp_min(1e-9)).mean())


def test_propagation_brings_the_reused_tokens_kv_closer_to_full_prefill_on_smollm2():
    """The product's default blend (question selection, fast path) on HotpotQA passages with and
    without propagation: the tokens it leaves reused, in every layer after the first, against full
    prefill's KV of the same prompt (the screen in docs/fidelity.md saw this on five sets)."""
    model, tokenizer = smollm2()
    ops = HFLlamaOps(model)
    errors = {0.0: [], 0.5: []}
    for example in hotpotqa_examples()[:2]:
        lead_in, passages, question = hotpot_prompt(tokenizer, example)
        context = cached_context(ops, lead_in, passages)
        starts, exact = context_layout(context)
        full_k, full_v = full_kv(ops, context)
        for alpha in errors:
            got = LayerCollector(ops.num_layers)
            result = blend_of(ops, context.token_ids, context.positions, context.load_layer, on_layer=got,
                              recompute_ratio=0.15, check_layer=0, deviation="value", selection=Selection("question"),
                              tail_ids=torch.tensor(question), segment_starts=starts, exact=exact, propagate=alpha)
            left = torch.ones(context.token_ids.shape[0], dtype=torch.bool)
            left[result.selected] = False
            left &= ~exact
            errors[alpha].append(sum(relative_error(got.k[i], full_k[i], left) + relative_error(got.v[i], full_v[i], left)
                                     for i in range(1, ops.num_layers)))
    print(f"\nK+V relative error of the reused tokens, summed over layers: {errors}")
    assert all(with_ < without for with_, without in zip(errors[0.5], errors[0.0]))


def test_propagation_is_a_setting_a_calibration_records_only_when_on():
    assert (BlendSettings().propagate, BlendSettings().propagate_from_depth) == (0.0, 0.5)  # off; on: the deeper half
    assert "blend.propagate" not in BlendSettings().calibrated_settings()
    assert "blend.propagate_from_depth" not in BlendSettings(propagate=0.0, propagate_from_depth=0.2).calibrated_settings()
    on = BlendSettings(propagate=0.5, propagate_temperature=0.1).calibrated_settings()
    assert on["blend.propagate"] == 0.5 and on["blend.propagate_temperature"] == 0.1
    assert on["blend.propagate_scope"] == "chunk" and on["blend.propagate_from_depth"] == 0.5
    for bad in ({"propagate": 1.5}, {"propagate": -0.1}, {"propagate_temperature": 0.0}):
        with pytest.raises(ValueError):
            BlendSettings(**bad)
