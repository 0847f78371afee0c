"""ragcache.blend.forward.blend_batch: several blends in one pass equal each blend alone, and the
operators a pass dispatches do not grow with its requests, chunks or runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from blend_calls import blend_request, knobs
from hf_ops import HFLlamaOps, LayerCollector, cached_context, tiny_llama

from ragcache.blend import (
    BlendRequest, BudgetRule, CachedKV, Selection, blend_batch, blend_kv, plan_blend, torch_attention,
)
from ragcache.blend.opcount import count_ops


@pytest.fixture(scope="module")
def ops():
    return HFLlamaOps(tiny_llama())


def make_context(ops, seed: int, chunk_sizes: list[int]):
    g = torch.Generator().manual_seed(seed)
    lead_in = torch.randint(0, 256, (6,), generator=g).tolist()
    chunks = [torch.randint(0, 256, (n,), generator=g).tolist() for n in chunk_sizes]
    return cached_context(ops, lead_in, chunks), torch.randint(0, 256, (3 + seed % 4,), generator=g)


@pytest.fixture(scope="module")
def contexts(ops):
    """Four contexts of different lengths and chunkings, each with its own question tail."""
    return [make_context(ops, seed, sizes) for seed, sizes in
            ((1, [40, 25, 33]), (2, [17, 60]), (3, [30, 30, 30, 12]), (4, [50]))]


def request(context, tail, **given) -> BlendRequest:
    starts = [0, *context.chunk_starts]
    exact = torch.zeros(context.token_ids.shape[0], dtype=torch.bool)
    exact[:context.chunk_starts[0]] = True
    return blend_request(context.token_ids, context.positions, tail_ids=tail, segment_starts=starts, exact=exact,
                         **{"check_layer": 0, "deviation": "value", **given})


#: one pass's requests: different lengths, budgets (one adaptive), depths and tails, one selection
KNOBS = [dict(recompute_ratio=0.2), dict(recompute_ratio=0.35, recompute_depth=0.5),
         dict(recompute_ratio=0.1, budget_rule=BudgetRule(mass_left=0.2)), dict(recompute_ratio=0.5)]


def requests_for(contexts, selection, n=4):
    return [request(c, t, selection=selection, **k) for (c, t), k in zip(contexts[:n], KNOBS[:n])]


class PagedDouble:
    """An engine double: ``on_layer`` keeps whole layers (its "cache", every request's rows), ``write_rows``
    overwrites rows of them, and the attention reads the cache (request by request), never its k/v."""

    def __init__(self, ops, positions, starts):
        self.cache = LayerCollector(ops.num_layers)
        self.reference = torch_attention(positions, ops.scaling, starts)

    def write_rows(self, layer, index, k, v):
        self.cache.k[layer][index] = k
        self.cache.v[layer][index] = v

    def attention(self, layer, q, index, k, v):
        return self.reference(layer, q, index, self.cache.k[layer], self.cache.v[layer])


def staged(contexts) -> CachedKV:
    """Every layer of the contexts one after another (copies: the blend writes into them)."""
    return CachedKV(k_pre=torch.cat([c.k_pre for c, _ in contexts], dim=1).contiguous(),
                    v=torch.cat([c.v for c, _ in contexts], dim=1).contiguous())


def streamed(contexts):
    def load_layer(layer):
        return (torch.cat([c.k_pre[layer] for c, _ in contexts]), torch.cat([c.v[layer] for c, _ in contexts]))
    return load_layer


def run_batch(ops, reqs, contexts, source, engine_like):
    positions = torch.cat([r.positions for r in reqs])
    starts = [0]
    for r in reqs:
        starts.append(starts[-1] + r.num_tokens)
    load = staged(contexts[:len(reqs)]) if source == "staged" else streamed(contexts[:len(reqs)])
    if engine_like:
        double = PagedDouble(ops, positions, starts)
        results = blend_batch(ops, reqs, load, on_layer=double.cache, attention=double.attention,
                              write_rows=double.write_rows, prefetch=False)
        kv = double.cache
    else:
        kv = LayerCollector(ops.num_layers)
        results = blend_batch(ops, reqs, load, on_layer=kv, prefetch=False)
    return results, kv, starts


@pytest.mark.parametrize("selection", [Selection("question", granule=4), Selection("question", candidates=2.0),
                                       Selection("deviation", granule=4)])
@pytest.mark.parametrize("source", ["staged", "streamed"])
@pytest.mark.parametrize("engine_like", [False, True])
def test_a_batched_pass_equals_each_blend_alone(ops, contexts, selection, source, engine_like):
    check_layer = 1 if selection.needs_deviation else 0
    for size in (1, 2, 3, 4):
        reqs = [replace(r, knobs=r.knobs.model_copy(update={"check_layer": check_layer}))
                for r in requests_for(contexts, selection, size)]
        results, kv, starts = run_batch(ops, reqs, contexts, source, engine_like)
        assert len(results) == size
        for r, (req, result) in enumerate(zip(reqs, results)):
            alone_kv = LayerCollector(ops.num_layers)
            assert req.selection == selection and req.knobs.check_layer == check_layer
            alone = blend_kv(ops, req, streamed([contexts[r]]), on_layer=alone_kv, prefetch=False)
            assert torch.equal(result.selected, alone.selected), (size, r)
            assert result.budget == alone.budget and result.recomputed_layers == alone.recomputed_layers
            assert 0 < result.num_recomputed < req.num_tokens and result.batch == size
            rows = slice(starts[r], starts[r + 1])
            for layer in range(ops.num_layers):
                torch.testing.assert_close(kv.k[layer][rows], alone_kv.k[layer], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(kv.v[layer][rows], alone_kv.v[layer], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("source", ["staged", "streamed"])
@pytest.mark.parametrize("engine_like", [False, True])
def test_a_batched_pass_with_correction_propagation_equals_each_blend_alone(ops, contexts, source, engine_like):
    """Requests that propagate and one that does not share a pass; an engine's pass then writes
    whole layers (every reused row may change) and still equals each blend alone."""
    selection = Selection("question", candidates=2.0)
    reqs = [replace(r, knobs=r.knobs.model_copy(update={"propagate": alpha}))
            for r, alpha in zip(requests_for(contexts, selection), (0.5, 0.0, 0.5, 0.3))]
    results, kv, starts = run_batch(ops, reqs, contexts, source, engine_like)
    for r, (req, result) in enumerate(zip(reqs, results)):
        alone_kv = LayerCollector(ops.num_layers)
        alone = blend_kv(ops, req, streamed([contexts[r]]), on_layer=alone_kv, prefetch=False)
        assert torch.equal(result.selected, alone.selected), r
        rows = slice(starts[r], starts[r + 1])
        for layer in range(ops.num_layers):
            torch.testing.assert_close(kv.k[layer][rows], alone_kv.k[layer], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kv.v[layer][rows], alone_kv.v[layer], atol=1e-5, rtol=1e-5)
    unpropagated = LayerCollector(ops.num_layers)
    blend_kv(ops, replace(reqs[0], knobs=reqs[0].knobs.model_copy(update={"propagate": 0.0})), streamed(contexts[:1]),
             on_layer=unpropagated, prefetch=False)
    assert not torch.allclose(unpropagated.v[-1], kv.v[-1][starts[0]:starts[1]])  # it did propagate


def test_blends_of_one_pass_must_share_the_schedule(ops, contexts):
    (c, t), (d, u) = contexts[:2]
    question = request(c, t, recompute_ratio=0.2, selection=Selection("question"))
    deviation = request(d, u, recompute_ratio=0.2, selection=Selection("deviation"), check_layer=1)
    assert question.pass_key(ops.num_layers) != deviation.pass_key(ops.num_layers)
    with pytest.raises(ValueError, match="pass_key"):
        blend_batch(ops, [question, deviation], streamed(contexts[:2]), on_layer=LayerCollector(ops.num_layers))


def test_the_plan_is_made_without_a_model():
    plan = plan_blend(num_tokens=1000, num_layers=30, has_tail=True,
                      knobs=knobs(recompute_ratio=0.15, min_recompute_tokens=0, recompute_depth=1.0, check_layer=0,
                                  deviation="value", selection=Selection("question", candidates=2.0, refine_layer=1)))
    assert plan.fixed.tokens == 150 and plan.scores_matter and plan.probe and plan.fast_path
    assert plan.probe_layers == range(0, 30) and plan.selective_layers == range(0, 30)
    assert plan.refine_at == 1 and plan.refines(150) and plan.candidate_budget(150) == 300
    assert plan.load_order(writes_rows=True) == list(range(30))  # the probe writes every layer once
    assert plan.load_order(writes_rows=False) == list(range(30)) * 2
    whole = plan_blend(num_tokens=100, num_layers=30, has_tail=True,
                       knobs=knobs(recompute_ratio=1.0, check_layer=0, deviation="value",
                                   selection=Selection("question")))
    assert not whole.scores_matter and not whole.probe and whole.depth_end == 30 and whole.refine_at is None
    deviation = plan_blend(num_tokens=100, num_layers=30, has_tail=False,
                           knobs=knobs(recompute_ratio=0.2, check_layer=1, deviation="key",
                                       selection=Selection("deviation"), recompute_depth=0.5))
    assert not deviation.fast_path and deviation.selective_layers == range(2, 30) and deviation.depth_end == 15
    assert deviation.load_order(writes_rows=True) == [1, *range(2, 30)]
    with pytest.raises(ValueError, match="tail"):
        plan_blend(num_tokens=100, num_layers=30, has_tail=False,
                   knobs=knobs(recompute_ratio=0.2, check_layer=0, deviation="value", selection=Selection("question")))


class ZeroAttention:
    """A constant-size stand-in for an engine's varlen kernel (the count is of the blend, not of it)."""

    def __call__(self, layer, q, index, k, v):
        return torch.zeros_like(q)


def operators(ops, reqs, contexts) -> int:
    with count_ops() as counted:
        blend_batch(ops, reqs, staged(contexts[:len(reqs)]), on_layer=lambda *a: None, attention=ZeroAttention(),
                    write_rows=lambda *a: None, prefetch=False)
    return counted.total


def test_a_pass_dispatches_as_many_operators_whatever_its_chunks_runs_and_requests(ops):
    selection = Selection("question", granule=4)
    few = [make_context(ops, 7, [40, 25])]
    many = [make_context(ops, 7, [9, 8, 12, 11, 10, 15, 5, 10])]  # as many tokens, four times the chunks
    base = operators(ops, [request(*few[0], recompute_ratio=0.3, selection=selection)], few)
    assert operators(ops, [request(*many[0], recompute_ratio=0.3, selection=selection)], many) == base
    runs = Selection("question", granule=1)  # every token its own run
    assert operators(ops, [request(*few[0], recompute_ratio=0.3, selection=runs)], few) == base
    # more requests: projections, MLP, probe and selection run once for all of them; only the
    # per-request results are sliced apart (two operators each)
    contexts = [make_context(ops, seed, [20 + seed, 31, 17]) for seed in range(4)]
    counts = {n: operators(ops, [request(c, t, recompute_ratio=0.3, selection=selection) for c, t in contexts[:n]],
                           contexts) for n in (1, 2, 4)}
    assert counts[4] - counts[2] <= 2 * 2
    assert counts[4] <= 1.3 * counts[1]


def test_a_pass_s_operators_are_put_down_to_the_blend_and_to_the_model_it_runs(ops):
    """The count splits the blend's own operators (selection, staging, its attention plan) from those
    the model adapter's modules dispatch (here the test adapter's transformers layers: not ragcache's)."""
    context = [make_context(ops, 3, [30, 22])]
    with count_ops() as counted:
        blend_batch(ops, [request(*context[0], recompute_ratio=0.3)], staged(context), on_layer=lambda *a: None,
                    attention=ZeroAttention(), write_rows=lambda *a: None, prefetch=False)
    linear = counted.by_name.get("aten::linear", 0)
    assert linear >= 4 * ops.num_layers  # q/k/v/o (and the MLP's) projections of every selective layer
    assert 0 < counted.own <= counted.total - linear


@pytest.mark.parametrize("size", [1, 3])
def test_the_attention_pairs_are_the_selective_queries_causal_keys(ops, contexts, size):
    """``attention_pairs`` counts, over the selective layers' attention calls, each recomputed query with
    the keys at or before it in its own context (not the pass's other requests' rows, not the keys after
    it): recounted here from the calls the attention actually received."""
    reqs = [replace(r, knobs=r.knobs.model_copy(update={"check_layer": 1}))
            for r in requests_for(contexts, Selection("deviation", granule=4), size)]
    positions = torch.cat([r.positions for r in reqs])
    starts = torch.tensor([0, *torch.tensor([r.num_tokens for r in reqs]).cumsum(0).tolist()])
    reference = torch_attention(positions, ops.scaling, starts.tolist())
    calls = []

    def attention(layer, q, index, k, v):
        calls.append(index.clone())
        return reference(layer, q, index, k, v)

    results = blend_batch(ops, reqs, streamed(contexts[:size]), on_layer=LayerCollector(ops.num_layers),
                          attention=attention, prefetch=False)
    selective = [i for i in calls if i.numel() < int(starts[-1])]  # the check layer's call is every row
    assert len(selective) >= ops.num_layers - 2  # the check layer's selected rows, then every later layer but the last
    local = [i - starts[torch.searchsorted(starts[1:], i, right=True)] for i in selective]
    expected = sum(int((j + 1).sum()) for j in local)
    assert all(r.attention_pairs == expected for r in results)
    assert 0 < expected < len(selective) * sum(n * (n + 1) // 2 for n in (r.num_tokens for r in reqs))
