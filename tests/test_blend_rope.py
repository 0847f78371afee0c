"""ragcache.blend.rope: pre-RoPE K moved to any positions equals the K a plain forward computes there."""

import pytest
import torch
from hf_ops import HFLlamaOps, hf_layer_kv, smollm2, tiny_llama

from ragcache.blend import compute_kv, move_keys


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama()
    return model, HFLlamaOps(model)


@pytest.fixture(scope="module")
def smol():
    model, tokenizer = smollm2()
    return model, HFLlamaOps(model), tokenizer


def random_ids(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def assert_moved_keys_match(model, ops, ids, from_start, to_start, atol, rtol):
    """K computed at from_start.., stored pre-RoPE, moved to to_start.., vs transformers' K at to_start.."""
    n = ids.shape[0]
    k_pre, v = compute_kv(ops, ids, torch.arange(from_start, from_start + n))
    target = torch.arange(to_start, to_start + n)
    expected = hf_layer_kv(model, ids, target)
    for layer in range(ops.num_layers):
        moved = move_keys(ops, layer, k_pre[layer], target)
        torch.testing.assert_close(moved, expected[layer][0], atol=atol, rtol=rtol, msg=f"K of layer {layer}")
        torch.testing.assert_close(v[layer], expected[layer][1], atol=atol, rtol=rtol, msg=f"V of layer {layer}")


def test_pre_rope_k_rerotated_at_its_positions_equals_transformers_k_tiny(tiny):
    model, ops = tiny
    ids = random_ids(50, 256)
    positions = torch.arange(50)
    k_pre, _ = compute_kv(ops, ids, positions)
    expected = hf_layer_kv(model, ids, positions)
    for layer in range(ops.num_layers):
        k = move_keys(ops, layer, k_pre[layer], positions)
        torch.testing.assert_close(k, expected[layer][0], atol=1e-6, rtol=0)


@pytest.mark.parametrize(("from_start", "to_start"), [(0, 37), (20, 2500), (3000, 5)])
def test_k_moved_from_p_to_q_equals_k_computed_at_q_tiny(tiny, from_start, to_start):
    model, ops = tiny
    assert_moved_keys_match(model, ops, random_ids(60, 256, seed=1), from_start, to_start, atol=1e-5, rtol=1e-5)


def test_move_keys_leaves_its_input_untouched_and_checks_lengths(tiny):
    _, ops = tiny
    k_pre = torch.randn(8, ops.num_kv_heads, ops.head_dim)
    before = k_pre.clone()
    moved = move_keys(ops, 0, k_pre, torch.arange(100, 108))
    assert torch.equal(k_pre, before)
    assert not torch.allclose(moved, k_pre)
    at_zero = move_keys(ops, 0, k_pre, torch.zeros(8, dtype=torch.long))
    torch.testing.assert_close(at_zero, k_pre)  # position 0 is the identity rotation
    with pytest.raises(ValueError):
        move_keys(ops, 0, k_pre, torch.arange(7))


def test_pre_rope_k_rerotated_at_its_positions_equals_transformers_k_smollm2(smol):
    # DESIGN.md's cheap RoPE check: rotate_half with theta 1e5, via the model's own rotary module.
    model, ops, tokenizer = smol
    ids = torch.tensor(tokenizer("The Eiffel Tower is a wrought-iron lattice tower in Paris, France.")["input_ids"])
    positions = torch.arange(ids.shape[0])
    k_pre, _ = compute_kv(ops, ids, positions)
    expected = hf_layer_kv(model, ids, positions)
    for layer in range(ops.num_layers):
        k = move_keys(ops, layer, k_pre[layer], positions)
        torch.testing.assert_close(k, expected[layer][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("from_start", "to_start"), [(0, 37), (3000, 5)])
def test_k_moved_from_p_to_q_equals_k_computed_at_q_smollm2(smol, from_start, to_start):
    # Attention is relative, so only float rounding (larger at large positions) separates the two.
    model, ops, _ = smol
    assert_moved_keys_match(model, ops, random_ids(120, 49152, seed=2), from_start, to_start, atol=2e-3, rtol=1e-3)
