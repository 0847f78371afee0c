"""ragcache.blend.attention: exact causal attention by absolute position for any set of queries."""

import math

import pytest
import torch
import torch.nn.functional as F

from ragcache.blend import causal_attention, causal_plan, expand_kv_heads, torch_attention

HQ, HKV, D = 4, 2, 16


def reference_attention(q, q_positions, k, v, k_positions):
    """Dense float64 softmax attention with an explicit position mask: [n, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(rep, dim=1)  # [N, Hq, D]
    v = v.double().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])  # [Hq, n, N]
    visible = k_positions[None, :] <= q_positions[:, None]  # [n, N]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).float()


def random_qkv(n, num_keys, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HQ, D, generator=g)
    k = torch.randn(num_keys, HKV, D, generator=g)
    v = torch.randn(num_keys, HKV, D, generator=g)
    return q, k, v


def test_full_prefill_matches_reference():
    q, k, v = random_qkv(64, 64)
    positions = torch.arange(64)
    out = causal_attention(q, positions, k, v)
    torch.testing.assert_close(out, reference_attention(q, positions, k, v, positions), atol=1e-5, rtol=1e-5)


def test_full_prefill_at_an_offset_matches_reference():
    q, k, v = random_qkv(40, 40)
    positions = torch.arange(1000, 1040)
    out = causal_attention(q, positions, k, v, positions)
    torch.testing.assert_close(out, reference_attention(q, positions, k, v, positions), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 7, 256])
def test_sparse_sorted_queries_equal_rows_of_full_causal_attention(block_size):
    num_keys = 300
    q_all, k, v = random_qkv(num_keys, num_keys, seed=1)
    positions = torch.arange(num_keys)
    full = causal_attention(q_all, positions, k, v, positions)
    selected = torch.sort(torch.randperm(num_keys, generator=torch.Generator().manual_seed(2))[:45]).values
    out = causal_attention(q_all[selected], selected, k, v, positions, block_size=block_size)
    torch.testing.assert_close(out, full[selected], atol=1e-5, rtol=1e-5)


def test_unsorted_queries_come_back_in_input_order():
    num_keys = 120
    q_all, k, v = random_qkv(num_keys, num_keys, seed=3)
    positions = torch.arange(num_keys)
    full = causal_attention(q_all, positions, k, v, positions)
    picked = torch.tensor([90, 3, 57, 0, 119, 58])
    out = causal_attention(q_all[picked], picked, k, v, positions, block_size=4)
    torch.testing.assert_close(out, full[picked], atol=1e-5, rtol=1e-5)


def test_question_queries_after_the_context_see_all_earlier_keys():
    # The question's prefill: queries at N..N+Q-1 over the context keys plus their own.
    q_all, k, v = random_qkv(100, 100, seed=4)
    positions = torch.arange(100)
    out = causal_attention(q_all[80:], positions[80:], k, v, positions)
    expected = reference_attention(q_all[80:], positions[80:], k, v, positions)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_unsorted_key_positions_are_masked_by_position_not_index():
    q, k, v = random_qkv(30, 50, seed=5)
    k_positions = torch.randperm(50, generator=torch.Generator().manual_seed(6))
    q_positions = torch.sort(torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(7))).values
    out = causal_attention(q, q_positions, k, v, k_positions, block_size=8)
    torch.testing.assert_close(out, reference_attention(q, q_positions, k, v, k_positions), atol=1e-5, rtol=1e-5)


def test_sdpa_is_causal_would_be_wrong_for_fewer_queries_than_keys():
    # The pitfall this module exists for: is_causal aligns top-left when n < N.
    q_all, k, v = random_qkv(64, 64, seed=8)
    positions = torch.arange(64)
    rows = torch.arange(32, 64)
    top_left = F.scaled_dot_product_attention(
        q_all[rows].transpose(0, 1)[None], expand_kv_heads(k, HQ), expand_kv_heads(v, HQ), is_causal=True
    )[0].transpose(0, 1)
    exact = causal_attention(q_all[rows], rows, k, v, positions)
    assert not torch.allclose(top_left, exact, atol=1e-3)
    torch.testing.assert_close(exact, reference_attention(q_all[rows], rows, k, v, positions), atol=1e-5, rtol=1e-5)


def test_expand_kv_heads_repeats_each_kv_head_for_its_query_group():
    k = torch.randn(5, HKV, D)
    out = expand_kv_heads(k, HQ)  # [1, Hq, N, D]
    assert out.shape == (1, HQ, 5, D)
    for head in range(HQ):
        torch.testing.assert_close(out[0, head], k[:, head // (HQ // HKV)])


def test_rejects_mismatched_lengths_and_queries_that_see_no_key():
    q, k, v = random_qkv(4, 10)
    with pytest.raises(ValueError):
        causal_attention(q, torch.arange(3), k, v)
    with pytest.raises(ValueError):
        causal_attention(q, torch.arange(4), k, v, torch.arange(9))
    with pytest.raises(ValueError):
        causal_attention(q, torch.arange(4), k, v[:9])
    with pytest.raises(ValueError, match="precedes every key"):
        causal_attention(q, torch.arange(4), k, v, torch.arange(2, 12))


def test_no_queries_give_an_empty_result():
    _, k, v = random_qkv(1, 10)
    out = causal_attention(torch.empty(0, HQ, D), torch.empty(0, dtype=torch.long), k, v)
    assert out.shape == (0, HQ, D)


def test_a_plan_made_once_serves_every_call_with_the_same_positions():
    num_keys = 300
    positions = torch.arange(500, 500 + num_keys)
    selected = torch.sort(torch.randperm(num_keys, generator=torch.Generator().manual_seed(5))[:70]).values
    plan = causal_plan(positions[selected], positions, block_size=16)
    assert not plan.prefill and plan.order is None and len(plan.blocks) == math.ceil(70 / 16)
    assert causal_plan(positions, positions).prefill
    for seed in range(3):  # three "layers": other q/k/v, the same positions
        q_all, k, v = random_qkv(num_keys, num_keys, seed=seed)
        out = causal_attention(q_all[selected], positions[selected], k, v, positions, plan=plan)
        expected = reference_attention(q_all[selected], positions[selected], k, v, positions)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="plan is for 70 queries over 300 keys"):
        causal_attention(q_all[:60], positions[:60], k, v, positions, plan=plan)


def test_torch_attention_plans_once_per_query_set(monkeypatch):
    import ragcache.blend.attention as attention

    made = []
    monkeypatch.setattr(attention, "causal_plan", lambda *a, **kw: made.append(a) or causal_plan(*a, **kw))
    num_keys = 200
    positions = torch.arange(num_keys)
    attend = torch_attention(positions, D**-0.5)
    first = torch.tensor([3, 4, 5, 90, 150, 199])
    second = torch.tensor([10, 11, 120])
    q_all, k, v = random_qkv(num_keys, num_keys, seed=7)
    for index in (first, first, first, second, second):  # layers: the query set changes once (a refine layer)
        out = attend(0, q_all[index], index, k, v)
        torch.testing.assert_close(out, reference_attention(q_all[index], positions[index], k, v, positions),
                                   atol=1e-5, rtol=1e-5)
    assert len(made) == 2


def test_masked_attention_is_the_reference_in_one_call_for_every_request():
    from ragcache.blend import masked_attention

    g = torch.Generator().manual_seed(21)
    sizes = [40, 25, 33]
    starts = [0, 40, 65, 98]
    positions = torch.cat([torch.arange(n) + 3 for n in sizes])  # each request's context from position 3
    k, v = torch.randn(98, 2, 16, generator=g), torch.randn(98, 2, 16, generator=g)
    index = torch.tensor([0, 1, 2, 17, 39, 40, 41, 64, 65, 80, 81, 97])
    q = torch.randn(index.numel(), 4, 16, generator=g)
    expected = torch_attention(positions, 0.25, starts)(0, q, index, k, v)
    torch.testing.assert_close(masked_attention(positions, 0.25, starts)(0, q, index, k, v), expected, atol=1e-5,
                               rtol=1e-5)
    one = masked_attention(positions[:40], 0.25)(0, q[:5], index[:5], k[:40], v[:40])
    torch.testing.assert_close(one, torch_attention(positions[:40], 0.25)(0, q[:5], index[:5], k[:40], v[:40]),
                               atol=1e-5, rtol=1e-5)
