"""ragcache.blend.forward: compute_kv is an exact prefill; blend_kv spans reuse (ratio 0) to full prefill (ratio 1)."""

import threading

import pytest
import torch
from hf_ops import TINY_TAIL, HFLlamaOps, LayerCollector, cached_context, context_layout, hf_layer_kv, smollm2, tiny_llama
from hf_ops import tiny_context as hf_tiny_context

from blend_calls import blend_of

from ragcache.blend import (
    DecoderOps, LoadOnCaller, Selection, compute_kv, hkvd_budget, lead_in_kv, move_keys, reuse_kv, torch_attention,
)
from ragcache.config import BlendSettings


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama()
    return model, HFLlamaOps(model)


@pytest.fixture(scope="module")
def tiny_context(tiny):
    """A lead-in and three chunks of the tiny model, each chunk's KV computed alone after the lead-in."""
    return hf_tiny_context(tiny[1])


@pytest.fixture(scope="module")
def smol():
    model, tokenizer = smollm2()
    return model, HFLlamaOps(model), tokenizer


def full_kv(ops, context):
    """compute_kv of the whole context, K rotated to its positions: per layer [N, Hkv, D]."""
    k_pre, v = compute_kv(ops, context.token_ids, context.positions)
    return [move_keys(ops, layer, k_pre[layer], context.positions) for layer in range(ops.num_layers)], list(v)


def assert_full_prefill(ops, context, got, tol=1e-5, layers=None):
    """``got`` (a LayerCollector) holds full prefill's K/V of ``context`` in ``layers`` (default all)."""
    expected_k, expected_v = full_kv(ops, context)
    for layer in range(ops.num_layers) if layers is None else layers:
        torch.testing.assert_close(got.k[layer], expected_k[layer], atol=tol, rtol=tol)
        torch.testing.assert_close(got.v[layer], expected_v[layer], atol=tol, rtol=tol)


#: the [blend] settings' defaults, for calls that do not set a knob themselves; blend_kv's own default
#: selection is CacheBlend's deviation, whose check layer "auto" resolves to
DEFAULTS = {**BlendSettings().model_dump(include={"recompute_ratio", "deviation"}),
            "check_layer": BlendSettings(selection="deviation").resolved_check_layer}


def blend(ops, ids, positions, load_layer, **kwargs):
    """``blend_kv`` with the settings' defaults for the knobs not given."""
    return blend_of(ops, ids, positions, load_layer, **{**DEFAULTS, **kwargs})


def run_blend(ops, context, **kwargs):
    collected = LayerCollector(ops.num_layers)
    result = blend(ops, context.token_ids, context.positions, context.load_layer, on_layer=collected, **kwargs)
    return result, collected


def test_transformers_adapter_satisfies_the_decoder_ops_protocol(tiny):
    _, ops = tiny
    assert isinstance(ops, DecoderOps)
    assert (ops.num_layers, ops.num_heads, ops.num_kv_heads, ops.head_dim) == (4, 4, 2, 16)
    assert ops.scaling == 16**-0.5


def test_compute_kv_equals_transformers_past_key_values_every_layer_tiny(tiny):
    model, ops = tiny
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(70)
    k_pre, v = compute_kv(ops, ids, positions)
    assert k_pre.shape == v.shape == (ops.num_layers, 70, ops.num_kv_heads, ops.head_dim)
    expected = hf_layer_kv(model, ids, positions)
    for layer in range(ops.num_layers):
        k = move_keys(ops, layer, k_pre[layer], positions)
        torch.testing.assert_close(k, expected[layer][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(v[layer], expected[layer][1], atol=1e-6, rtol=0)


def test_compute_kv_keep_from_returns_the_tail_of_the_full_prefill(tiny):
    _, ops = tiny
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(100, 130)
    k_all, v_all = compute_kv(ops, ids, positions)
    k_tail, v_tail = compute_kv(ops, ids, positions, keep_from=12)
    assert torch.equal(k_tail, k_all[:, 12:]) and torch.equal(v_tail, v_all[:, 12:])
    with pytest.raises(ValueError):
        compute_kv(ops, ids, positions, keep_from=30)
    with pytest.raises(ValueError):
        compute_kv(ops, ids, positions[:-1])


def test_compute_kv_after_a_cached_lead_in_equals_the_prefill_of_both(tiny):
    _, ops = tiny
    gen = torch.Generator().manual_seed(5)
    lead, chunk = torch.randint(0, 256, (40,), generator=gen), torch.randint(0, 256, (25,), generator=gen)
    k_all, v_all = compute_kv(ops, torch.cat([lead, chunk]), torch.arange(65), keep_from=40)
    cached = lead_in_kv(ops, lead.tolist())
    assert cached.length == 40 and cached.k.shape == (ops.num_layers - 1, 40, ops.num_kv_heads, ops.head_dim)
    k, v = compute_kv(ops, chunk, torch.arange(40, 65), lead_in=cached)
    torch.testing.assert_close(k, k_all, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, v_all, atol=1e-5, rtol=1e-5)
    # the lead-in is attended to: the same chunk after another lead-in gets other KV
    other = lead_in_kv(ops, torch.randint(0, 256, (40,), generator=gen).tolist())
    k_other, _ = compute_kv(ops, chunk, torch.arange(40, 65), lead_in=other)
    assert (k_other[1:] - k_all[1:]).abs().max() > 1e-3  # layer 0's K depends on the token alone
    with pytest.raises(ValueError, match="inside the lead-in"):
        compute_kv(ops, chunk, torch.arange(30, 55), lead_in=cached)


def test_compute_kv_equals_transformers_past_key_values_every_layer_smollm2(smol):
    model, ops, tokenizer = smol
    text = "Paris is the capital of France. It hosts the Louvre, the most visited museum in the world."
    ids = torch.tensor(tokenizer(text)["input_ids"])
    positions = torch.arange(ids.shape[0])
    k_pre, v = compute_kv(ops, ids, positions)
    expected = hf_layer_kv(model, ids, positions)
    for layer in range(ops.num_layers):
        k = move_keys(ops, layer, k_pre[layer], positions)
        torch.testing.assert_close(k, expected[layer][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[layer], expected[layer][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("check_layer", "deviation", "prefetch"),
    [(0, "value", True), (1, "value", True), (1, "key", False), (3, "key", True), (3, "value", False)],
)
def test_blend_at_ratio_one_reproduces_full_prefill_multi_chunk_tiny(
    tiny, tiny_context, check_layer, deviation, prefetch
):
    _, ops = tiny
    result, got = run_blend(
        ops, tiny_context, recompute_ratio=1.0, check_layer=check_layer, deviation=deviation, prefetch=prefetch
    )
    n = tiny_context.token_ids.shape[0]
    assert result.num_recomputed == n and result.selected.tolist() == list(range(n))
    assert_full_prefill(ops, tiny_context, got)


def test_blend_at_ratio_one_reproduces_full_prefill_multi_chunk_smollm2(smol):
    _, ops, tokenizer = smol
    lead_in = tokenizer("<|im_start|>system\nAnswer from the passages.<|im_end|>\n")["input_ids"]
    passages = [
        "The Amazon is the largest rainforest on Earth, spanning nine countries in South America.",
        "Mount Kilimanjaro, a dormant volcano in Tanzania, is the highest mountain in Africa.",
        "The Danube flows through ten countries, more than any other river in the world.",
    ]
    context = cached_context(ops, lead_in, [tokenizer(p + "\n")["input_ids"] for p in passages])
    _, got = run_blend(ops, context, recompute_ratio=1.0, check_layer=1)
    assert_full_prefill(ops, context, got, tol=1e-4)


TAIL = TINY_TAIL  # a question tail after the tiny context


@pytest.mark.parametrize("strategy", ["question", "hybrid"])
def test_every_selection_at_ratio_one_reproduces_full_prefill(tiny, tiny_context, strategy):
    _, ops = tiny
    starts, exact = context_layout(tiny_context)
    sel = Selection(strategy, chunk_head_tokens=3, max_chunk_share=0.5)
    result, got = run_blend(ops, tiny_context, recompute_ratio=1.0, selection=sel, tail_ids=TAIL,
                            segment_starts=starts, exact=exact)
    n = tiny_context.token_ids.shape[0]
    assert result.selected.tolist() == list(range(n))
    assert "question_probe_s" not in result.stages  # every token is recomputed: no scores needed
    assert_full_prefill(ops, tiny_context, got)


@pytest.mark.parametrize("strategy", ["deviation", "question", "hybrid"])
def test_selections_spend_the_exact_budget_outside_the_exact_tokens(tiny, tiny_context, strategy):
    _, ops = tiny
    starts, exact = context_layout(tiny_context)
    n = tiny_context.token_ids.shape[0]
    result, _ = run_blend(ops, tiny_context, recompute_ratio=0.2, selection=Selection(strategy, chunk_head_tokens=2),
                          tail_ids=TAIL, segment_starts=starts, exact=exact)
    assert result.num_recomputed == hkvd_budget(0.2, n)
    assert not exact[result.selected].any()
    if strategy != "deviation":
        assert result.stages["question_probe_s"] > 0


def test_the_recompute_floor_raises_a_short_contexts_budget(tiny, tiny_context):
    _, ops = tiny
    starts, exact = context_layout(tiny_context)
    n = tiny_context.token_ids.shape[0]
    floor = hkvd_budget(0.2, n) + 5
    result, _ = run_blend(ops, tiny_context, recompute_ratio=0.2, min_recompute_tokens=floor,
                          selection=Selection("question"), tail_ids=TAIL, segment_starts=starts, exact=exact)
    assert result.num_recomputed == floor
    zero, _ = run_blend(ops, tiny_context, recompute_ratio=0.0, min_recompute_tokens=floor,
                        selection=Selection("question"), tail_ids=TAIL, segment_starts=starts, exact=exact)
    assert zero.num_recomputed == 0


class _CountingOps:
    """The tiny model's ops, counting the rows each layer's QKV projection is given."""

    def __init__(self, ops):
        self._ops = ops
        self.qkv_rows: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def qkv(self, layer, hidden):
        self.qkv_rows[layer] = self.qkv_rows.get(layer, 0) + hidden.shape[0]
        return self._ops.qkv(layer, hidden)


def test_question_selection_at_check_layer_zero_computes_only_the_tail_and_the_selected_tokens(tiny, tiny_context):
    # A token's layer-0 K/V depend on that token alone: the cached KV moved to the new positions is
    # layer 0's fresh KV, so no context token is projected in full; layer 0 still equals full prefill.
    _, ops = tiny
    counting = _CountingOps(ops)
    starts, exact = context_layout(tiny_context)
    n = tiny_context.token_ids.shape[0]
    collected = LayerCollector(ops.num_layers)
    result = blend_of(counting, tiny_context.token_ids, tiny_context.positions, tiny_context.load_layer,
                      recompute_ratio=0.2, check_layer=0, deviation="value", selection=Selection("question"),
                      tail_ids=TAIL, segment_starts=starts, exact=exact, on_layer=collected)
    assert result.num_recomputed == hkvd_budget(0.2, n) < n
    assert counting.qkv_rows[0] == TAIL.shape[0] + result.num_recomputed
    assert all(rows == TAIL.shape[0] + result.num_recomputed for rows in counting.qkv_rows.values())
    assert_full_prefill(ops, tiny_context, collected, layers=[0])
    kept = torch.ones(n, dtype=torch.bool)
    kept[result.selected] = False
    for layer in range(1, ops.num_layers):  # unselected rows keep the cached KV, selected ones are fresh
        assert torch.equal(collected.v[layer][kept], tiny_context.v[layer][kept])
        assert not torch.allclose(collected.v[layer][~kept], tiny_context.v[layer][~kept])
    assert result.stages["question_probe_s"] > 0 and "full_layers_s" not in result.stages


def test_question_selection_needs_the_tail(tiny, tiny_context):
    _, ops = tiny
    with pytest.raises(ValueError, match="tail_ids"):
        run_blend(ops, tiny_context, recompute_ratio=0.2, selection=Selection("question"))


@pytest.mark.parametrize("check_layer", [0, 1, 2])
def test_blend_at_ratio_zero_equals_reuse_after_the_check_layer(tiny, tiny_context, check_layer):
    _, ops = tiny
    result, blended = run_blend(ops, tiny_context, recompute_ratio=0.0, check_layer=check_layer)
    reused = LayerCollector(ops.num_layers)
    reuse_result = reuse_kv(ops, tiny_context.positions, tiny_context.load_layer, reused)
    assert result.num_recomputed == 0 and reuse_result.num_recomputed == 0
    assert_full_prefill(ops, tiny_context, blended, layers=range(check_layer + 1))  # every token in full
    for layer in range(check_layer + 1, ops.num_layers):
        assert torch.equal(blended.k[layer], reused.k[layer])
        assert torch.equal(blended.v[layer], reused.v[layer])


def test_reuse_moves_cached_k_and_keeps_v(tiny, tiny_context):
    _, ops = tiny
    got = LayerCollector(ops.num_layers)
    shifted = tiny_context.positions + 500
    reuse_kv(ops, shifted, tiny_context.load_layer, got, prefetch=False)
    for layer in range(ops.num_layers):
        assert torch.equal(got.k[layer], move_keys(ops, layer, tiny_context.k_pre[layer], shifted))
        assert torch.equal(got.v[layer], tiny_context.v[layer])


def test_reuse_of_a_single_chunk_at_its_canonical_position_is_exact(tiny, tiny_context):
    # Lead-in + first chunk sit exactly where they were precomputed: reuse equals full prefill.
    _, ops = tiny
    n = tiny_context.chunk_starts[1]
    k_pre, v = tiny_context.k_pre[:, :n], tiny_context.v[:, :n]
    got = LayerCollector(ops.num_layers)
    reuse_kv(ops, torch.arange(n), lambda layer: (k_pre[layer], v[layer]), got)
    expected_k, expected_v = compute_kv(ops, tiny_context.token_ids[:n], torch.arange(n))
    for layer in range(ops.num_layers):
        k = move_keys(ops, layer, expected_k[layer], torch.arange(n))
        torch.testing.assert_close(got.k[layer], k, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.v[layer], expected_v[layer], atol=1e-6, rtol=0)


def test_blend_recomputes_the_budget_and_keeps_unselected_rows_cached(tiny, tiny_context):
    _, ops = tiny
    check_layer = 1
    result, got = run_blend(ops, tiny_context, recompute_ratio=0.2, check_layer=check_layer)
    n = tiny_context.token_ids.shape[0]
    assert result.num_recomputed == hkvd_budget(0.2, n) == result.selected.shape[0]
    assert torch.all(result.selected[1:] > result.selected[:-1])
    kept = torch.ones(n, dtype=torch.bool)
    kept[result.selected] = False
    for layer in range(check_layer + 1, ops.num_layers):
        cached_k = move_keys(ops, layer, tiny_context.k_pre[layer], tiny_context.positions)
        assert torch.equal(got.k[layer][kept], cached_k[kept])
        assert torch.equal(got.v[layer][kept], tiny_context.v[layer][kept])
        assert not torch.allclose(got.v[layer][~kept], tiny_context.v[layer][~kept])


def test_blend_selects_by_value_deviation_at_the_check_layer(tiny, tiny_context):
    _, ops = tiny
    result, got = run_blend(ops, tiny_context, recompute_ratio=0.1, check_layer=2)
    deviation = (got.v[2] - tiny_context.v[2]).pow(2).sum(dim=(1, 2))
    expected = torch.sort(torch.topk(deviation, result.num_recomputed).indices).values
    assert torch.equal(result.selected, expected)


def test_forced_tokens_without_cached_kv_are_recomputed(tiny, tiny_context):
    # The second chunk's KV is missing: load_layer hands zeros for it and it is forced.
    _, ops = tiny
    start, stop = tiny_context.chunk_starts[1], tiny_context.chunk_starts[2]
    forced = torch.zeros(tiny_context.token_ids.shape[0], dtype=torch.bool)
    forced[start:stop] = True
    k_pre, v = tiny_context.k_pre.clone(), tiny_context.v.clone()
    k_pre[:, start:stop] = 0
    v[:, start:stop] = 0
    collected = LayerCollector(ops.num_layers)
    result = blend(
        ops, tiny_context.token_ids, tiny_context.positions, lambda layer: (k_pre[layer], v[layer]),
        recompute_ratio=0.1, forced=forced, on_layer=collected,
    )
    n = tiny_context.token_ids.shape[0]
    assert set(range(start, stop)) <= set(result.selected.tolist())
    assert result.num_recomputed == (stop - start) + hkvd_budget(0.1, n)
    for layer in range(ops.num_layers):
        assert collected.v[layer][start:stop].abs().sum(dim=(1, 2)).min() > 0

    # Every token forced, nothing cached: the blend is a full prefill.
    everything = LayerCollector(ops.num_layers)
    blend(
        ops, tiny_context.token_ids, tiny_context.positions, lambda layer: (torch.zeros_like(k_pre[layer]),) * 2,
        recompute_ratio=0.0, forced=torch.ones(n, dtype=torch.bool), on_layer=everything,
    )
    assert_full_prefill(ops, tiny_context, everything)


def test_prefetch_loads_layers_in_order_on_a_background_thread(tiny, tiny_context):
    _, ops = tiny
    calls = []

    def load_layer(layer):
        calls.append((layer, threading.current_thread() is threading.main_thread()))
        return tiny_context.load_layer(layer)

    ids, positions = tiny_context.token_ids, tiny_context.positions
    collected = LayerCollector(ops.num_layers)
    result = blend(ops, ids, positions, load_layer, check_layer=1, on_layer=collected)
    assert [layer for layer, _ in calls] == [1, 2, 3]  # layers before the check layer need no cached KV
    assert not any(on_main for _, on_main in calls)
    assert result.load_s >= 0 and result.compute_s > 0 and result.on_layer_s > 0

    calls.clear()
    blend(ops, ids, positions, load_layer, check_layer=1, on_layer=collected, prefetch=False)
    assert calls == [(1, True), (2, True), (3, True)]


def test_a_load_the_prefetch_thread_hands_back_is_done_again_on_the_callers_thread(tiny, tiny_context):
    """A loader that raises LoadOnCaller in the background (the worker's, when a chunk must be
    recomputed: a model forward must not run beside the blend's) is called again for that layer on
    the caller's thread, before the next layer starts loading; the blend is unchanged."""
    _, ops = tiny
    calls = []

    def load_layer(layer):
        on_main = threading.current_thread() is threading.main_thread()
        calls.append((layer, on_main))
        if layer == 2 and not on_main:
            raise LoadOnCaller("layer 2 needs the caller's thread")
        return tiny_context.load_layer(layer)

    ids, positions = tiny_context.token_ids, tiny_context.positions
    handed_back, plain = LayerCollector(ops.num_layers), LayerCollector(ops.num_layers)
    blend(ops, ids, positions, load_layer, check_layer=1, on_layer=handed_back)
    assert calls == [(1, False), (2, False), (2, True), (3, False)]
    blend(ops, ids, positions, tiny_context.load_layer, check_layer=1, on_layer=plain, prefetch=False)
    for layer in range(ops.num_layers):
        assert torch.equal(handed_back.k[layer], plain.k[layer]) and torch.equal(handed_back.v[layer], plain.v[layer])


def test_question_selection_loads_the_probed_layers_again_instead_of_keeping_them(tiny, tiny_context):
    # The probe loads each layer once for the question's scores; the selective pass loads it again
    # (holding every layer's moved KV made each request fault in that much fresh memory).
    _, ops = tiny
    starts, exact = context_layout(tiny_context)
    layers = list(range(ops.num_layers))
    for check_layer, expected in ((0, layers + layers), (1, [1] + layers[2:] + layers[2:])):
        for prefetch in (True, False):
            calls = []

            def load_layer(layer):
                calls.append(layer)
                return tiny_context.load_layer(layer)

            kept = LayerCollector(ops.num_layers)
            result = blend(ops, tiny_context.token_ids, tiny_context.positions, load_layer, recompute_ratio=0.2,
                           check_layer=check_layer, selection=Selection("question"), tail_ids=TAIL,
                           segment_starts=starts, exact=exact, on_layer=kept, prefetch=prefetch)
            assert calls == expected, (check_layer, prefetch)
            assert 0 < result.num_recomputed < tiny_context.token_ids.shape[0]
    # with a probe limited to one layer after the check layer, only that one is loaded twice
    calls = []

    def load_counted(layer):
        calls.append(layer)
        return tiny_context.load_layer(layer)

    blend(ops, tiny_context.token_ids, tiny_context.positions, load_counted, recompute_ratio=0.2, check_layer=1,
          selection=Selection("question", probe_layers=1), tail_ids=TAIL, segment_starts=starts, exact=exact,
          on_layer=LayerCollector(ops.num_layers), prefetch=False)
    assert calls == [1, 2] + layers[2:]


class CacheRowsAttention:
    """An engine double for ``write_rows``: ``on_layer`` keeps whole layers (its "cache"),
    ``write_rows`` overwrites rows of them, and the attention reads the cache, never its k/v."""

    def __init__(self, ops, positions):
        self.cache = LayerCollector(ops.num_layers)
        self.reference = torch_attention(positions, ops.scaling)
        self.rows_written = []

    def write_rows(self, layer, index, k, v):
        assert self.cache.k[layer] is not None, "rows written before the layer"
        self.rows_written.append(layer)
        self.cache.k[layer][index] = k
        self.cache.v[layer][index] = v

    def attention(self, layer, q, index, k, v):
        return self.reference(layer, q, index, self.cache.k[layer], self.cache.v[layer])


def cached_engine_blend(ops, context, prefetch=False, **kwargs):
    """``blend`` of ``context`` through :class:`CacheRowsAttention` (an engine whose attention reads
    its own cache): ``(result, engine, calls)``, ``calls`` the layers loaded, in order."""
    calls = []

    def load_layer(layer):
        calls.append(layer)
        return context.load_layer(layer)

    engine = CacheRowsAttention(ops, context.positions)
    result = blend(ops, context.token_ids, context.positions, load_layer, on_layer=engine.cache,
                   attention=engine.attention, write_rows=engine.write_rows, prefetch=prefetch, **kwargs)
    return result, engine, calls


@pytest.mark.parametrize("check_layer", [0, 1])
def test_question_probe_writes_its_layers_once_with_write_rows(tiny, tiny_context, check_layer):
    # With write_rows (an engine whose attention reads its own cache), each probed layer is loaded
    # and moved once, written whole by the probe, then only its recomputed rows are written again:
    # the same KV and the same selection as the path that loads every layer twice.
    _, ops = tiny
    starts, exact = context_layout(tiny_context)
    ids, positions = tiny_context.token_ids, tiny_context.positions
    kwargs = dict(recompute_ratio=0.2, check_layer=check_layer, selection=Selection("question", granule=4),
                  tail_ids=TAIL, segment_starts=starts, exact=exact)
    twice = LayerCollector(ops.num_layers)
    reference = blend(ops, ids, positions, tiny_context.load_layer, on_layer=twice, **kwargs)
    for prefetch in (True, False):
        result, engine, calls = cached_engine_blend(ops, tiny_context, prefetch=prefetch, **kwargs)
        first = 0 if check_layer == 0 else check_layer + 1
        assert calls == ([] if check_layer == 0 else [check_layer]) + list(range(first, ops.num_layers))
        assert engine.rows_written == list(range(first, ops.num_layers))
        assert torch.equal(result.selected, reference.selected)
        for layer in range(ops.num_layers):
            torch.testing.assert_close(engine.cache.k[layer], twice.k[layer], rtol=0, atol=1e-6)
            torch.testing.assert_close(engine.cache.v[layer], twice.v[layer], rtol=0, atol=1e-6)
        assert result.on_layer_s > 0 and result.stages["cache_write_s"] == pytest.approx(result.on_layer_s)
    # without an attention of its own, write_rows is not used (torch's attention reads the tensors)
    engine = CacheRowsAttention(ops, positions)
    blend(ops, ids, positions, tiny_context.load_layer, on_layer=engine.cache, write_rows=engine.write_rows, **kwargs)
    assert engine.rows_written == []


@pytest.mark.parametrize("kernel_like", [False, True])
def test_recompute_depth_stops_the_selected_tokens_and_keeps_the_reused_kv_after_it(tiny, tiny_context, kernel_like):
    _, ops = tiny
    starts, exact = context_layout(tiny_context)
    ids, positions = tiny_context.token_ids, tiny_context.positions
    kwargs = dict(recompute_ratio=0.2, check_layer=0, selection=Selection("question", granule=4), tail_ids=TAIL,
                  segment_starts=starts, exact=exact)
    every, every_kv = run_blend(ops, tiny_context, **kwargs)
    reused = LayerCollector(ops.num_layers)
    reuse_kv(ops, positions, tiny_context.load_layer, reused)
    if kernel_like:  # the engine path: the probe writes whole layers, then only recomputed rows
        engine = CacheRowsAttention(ops, positions)
        half = blend(ops, ids, positions, tiny_context.load_layer, on_layer=engine.cache, attention=engine.attention,
                     write_rows=engine.write_rows, recompute_depth=0.5, **kwargs)
        half_kv = engine.cache
    else:
        half, half_kv = run_blend(ops, tiny_context, recompute_depth=0.5, **kwargs)
    assert torch.equal(half.selected, every.selected) and half.num_recomputed == every.num_recomputed > 0
    assert (half.recomputed_layers, every.recomputed_layers) == (2, ops.num_layers)  # reported per blend
    for layer in range(ops.num_layers):  # 4 layers: the selected tokens are recomputed in layers 0 and 1
        want_k, want_v = (every_kv.k[layer], every_kv.v[layer]) if layer < 2 else (reused.k[layer], reused.v[layer])
        torch.testing.assert_close(half_kv.k[layer], want_k, rtol=0, atol=1e-6)
        torch.testing.assert_close(half_kv.v[layer], want_v, rtol=0, atol=1e-6)
    assert not torch.allclose(every_kv.v[3], reused.v[3])  # the full depth does change the late layers
    # ratio 1.0 is full prefill whatever the depth
    whole, one = run_blend(ops, tiny_context, recompute_ratio=1.0, recompute_depth=0.25, check_layer=1)
    assert_full_prefill(ops, tiny_context, one)
    assert whole.recomputed_layers == ops.num_layers
    none, _ = run_blend(ops, tiny_context, recompute_ratio=0.0)
    assert none.num_recomputed == 0 and none.recomputed_layers == 0


def second_chunk_forced(context):
    """``(start, stop, forced)``: the context's second chunk as tokens with no cached KV."""
    start, stop = context.chunk_starts[1], context.chunk_starts[2]
    forced = torch.zeros(context.token_ids.shape[0], dtype=torch.bool)
    forced[start:stop] = True
    return start, stop, forced


def test_forced_tokens_go_through_every_layer_whatever_the_recompute_depth(tiny, tiny_context):
    _, ops = tiny
    start, stop, forced = second_chunk_forced(tiny_context)
    n = tiny_context.token_ids.shape[0]
    k_pre, v = tiny_context.k_pre.clone(), tiny_context.v.clone()
    k_pre[:, start:stop] = 0
    v[:, start:stop] = 0
    got = LayerCollector(ops.num_layers)
    result = blend(ops, tiny_context.token_ids, tiny_context.positions, lambda layer: (k_pre[layer], v[layer]),
                   recompute_ratio=0.2, forced=forced, on_layer=got, recompute_depth=0.5)
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[result.selected] = True
    assert chosen[forced].all() and (chosen & ~forced).any()
    for layer in range(ops.num_layers):
        assert got.v[layer][start:stop].abs().sum(dim=(1, 2)).min() > 0  # computed, never the zeros loaded
    for layer in (2, 3):  # after the depth: the other chosen tokens keep their cached KV
        others = chosen & ~forced
        assert torch.equal(got.v[layer][others], tiny_context.v[layer][others])


def test_recompute_layers_rounds_up_and_keeps_the_check_layer():
    from ragcache.blend.forward import recompute_layers

    assert recompute_layers(1.0, 30, 0) == 30 and recompute_layers(0.9, 30, 0) == 27
    assert recompute_layers(0.8, 30, 0) == 24 and recompute_layers(0.81, 30, 0) == 25
    assert recompute_layers(0.01, 30, 1) == 2  # at least through the check layer and one more


def test_blend_rejects_bad_arguments(tiny, tiny_context):
    _, ops = tiny
    ids, positions, load = tiny_context.token_ids, tiny_context.positions, tiny_context.load_layer
    sink = LayerCollector(ops.num_layers)
    for kwargs in (
        {"recompute_ratio": 1.5},
        {"recompute_ratio": -0.1},
        {"check_layer": ops.num_layers},
        {"check_layer": -1},
        {"deviation": "attention"},
        {"forced": torch.zeros(3, dtype=torch.bool)},
        {"recompute_depth": 0.0},
        {"recompute_depth": 1.5},
    ):
        with pytest.raises(ValueError):
            blend(ops, ids, positions, load, on_layer=sink, **kwargs)
    with pytest.raises(ValueError):
        blend(ops, ids, positions[:-1], load, on_layer=sink)
    with pytest.raises(ValueError, match="load_layer"):
        blend(ops, ids, positions, lambda layer: (load(layer)[0][:-1], load(layer)[1]), on_layer=sink)
    with pytest.raises(ValueError, match="load_layer"):
        reuse_kv(ops, positions, lambda layer: (load(layer)[0][:-1], load(layer)[1]), sink)


@pytest.mark.parametrize("kernel_like,refine_layer", [(False, 1), (True, 1), (False, 2), (True, 2)])
def test_candidates_are_refined_at_the_refine_layer_to_the_budget(tiny, tiny_context, kernel_like, refine_layer):
    # candidates = 3: the question picks 3x the budget, they go through layers 0 .. R-1, and layer R keeps
    # the budget among them (by attention x reused-V error over layers 1 .. R); the rest keep their reused
    # KV from layer R on
    _, ops = tiny
    starts, exact = context_layout(tiny_context)
    ids, positions = tiny_context.token_ids, tiny_context.positions
    n = ids.shape[0]
    kwargs = dict(check_layer=0, tail_ids=TAIL, segment_starts=starts, exact=exact, recompute_ratio=0.1)
    budget = hkvd_budget(0.1, n)
    alone, _ = run_blend(ops, tiny_context, selection=Selection("question", granule=4), **kwargs)
    wide, _ = run_blend(ops, tiny_context, selection=Selection("question", granule=4),
                        **{**kwargs, "min_recompute_tokens": 3 * budget})  # the question's 3x budget choice
    refined_sel = Selection("question", granule=4, candidates=3.0, refine_layer=refine_layer)
    refined, got = run_blend(ops, tiny_context, selection=refined_sel, **kwargs)
    assert refined.num_recomputed == alone.num_recomputed == budget and wide.num_recomputed == 3 * budget
    chosen = set(refined.selected.tolist())
    assert chosen <= set(wide.selected.tolist()) and chosen != set(alone.selected.tolist())
    assert refined.stages["select_s"] > 0
    reused = LayerCollector(ops.num_layers)
    reuse_kv(ops, positions, tiny_context.load_layer, reused)
    dropped = sorted(set(wide.selected.tolist()) - chosen)
    for layer in range(1, refine_layer):  # before R the dropped candidates were recomputed too
        assert not torch.equal(got.v[layer][dropped], reused.v[layer][dropped])
    for layer in range(refine_layer, ops.num_layers):  # from R on they keep their reused KV
        assert torch.equal(got.v[layer][dropped], reused.v[layer][dropped])
    expected_k, expected_v = full_kv(ops, tiny_context)
    torch.testing.assert_close(got.v[1][refined.selected], expected_v[1][refined.selected], atol=1e-5, rtol=1e-5)
    if kernel_like:  # the engine path (the probe writes whole layers, then only recomputed rows): the same
        engine = CacheRowsAttention(ops, positions)
        same = blend(ops, ids, positions, tiny_context.load_layer, on_layer=engine.cache, attention=engine.attention,
                     write_rows=engine.write_rows, selection=refined_sel, **kwargs)
        assert torch.equal(same.selected, refined.selected)
        for layer in range(ops.num_layers):
            torch.testing.assert_close(engine.cache.k[layer], got.k[layer], rtol=0, atol=1e-6)
            torch.testing.assert_close(engine.cache.v[layer], got.v[layer], rtol=0, atol=1e-6)
    # no refinement where it cannot apply: the selected tokens stop at or before layer R (depth R of 4
    # layers), or the budget is every token
    shallow, _ = run_blend(ops, tiny_context, selection=refined_sel, recompute_depth=refine_layer / 4, **kwargs)
    assert torch.equal(shallow.selected, alone.selected)
    whole, whole_kv = run_blend(ops, tiny_context, selection=refined_sel, **{**kwargs, "recompute_ratio": 1.0})
    assert_full_prefill(ops, tiny_context, whole_kv)


@pytest.mark.parametrize("refine_layer", [1, 3])
def test_forced_tokens_survive_the_refinement(tiny, tiny_context, refine_layer):
    _, ops = tiny
    _, _, forced = second_chunk_forced(tiny_context)
    n = tiny_context.token_ids.shape[0]
    result, got = run_blend(ops, tiny_context, recompute_ratio=0.1, check_layer=0, forced=forced, tail_ids=TAIL,
                            selection=Selection("question", granule=4, candidates=3.0, refine_layer=refine_layer))
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[result.selected] = True
    assert chosen[forced].all() and int((chosen & ~forced).sum()) == hkvd_budget(0.1, n)
