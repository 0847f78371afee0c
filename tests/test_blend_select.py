"""ragcache.blend.select: HKVD tokens are the largest KV deviations plus the forced tokens."""

import pytest
import torch

from ragcache.blend import hkvd_budget, select_hkvd


def kv_with_deviations(deviations: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """reused/fresh [N, 2, 4] whose squared L2 deviation of token t is deviations[t]."""
    g = torch.Generator().manual_seed(0)
    reused = torch.randn(len(deviations), 2, 4, generator=g)
    fresh = reused.clone()
    fresh[:, 0, 0] += torch.tensor(deviations).sqrt()
    return reused, fresh


def test_picks_the_largest_squared_l2_deviations_sorted():
    reused, fresh = kv_with_deviations([0.1, 5.0, 0.2, 9.0, 0.0, 3.0, 0.3, 0.4, 0.5, 0.6])
    selected = select_hkvd(reused, fresh, 0.3)
    assert selected.tolist() == [1, 3, 5]
    assert selected.dtype == torch.long


def test_deviation_is_summed_over_heads_and_dims():
    reused = torch.zeros(3, 2, 4)
    fresh = torch.zeros(3, 2, 4)
    fresh[0, 0, 0] = 2.0  # 4
    fresh[1] = 0.8  # 8 * 0.64 = 5.12
    fresh[2, 1, 3] = -2.1  # 4.41
    assert select_hkvd(reused, fresh, 1 / 3).tolist() == [1]


def test_budget_is_ceil_of_ratio_times_tokens_without_float_noise():
    assert hkvd_budget(0.15, 100) == 15  # 0.15 * 100 == 15.000000000000002
    assert hkvd_budget(0.15, 101) == 16
    assert hkvd_budget(0.0, 50) == 0
    assert hkvd_budget(1.0, 50) == 50
    reused, fresh = kv_with_deviations([float(i) for i in range(100)])
    assert select_hkvd(reused, fresh, 0.15).tolist() == list(range(85, 100))


def test_ratio_zero_selects_only_forced_tokens():
    reused, fresh = kv_with_deviations([1.0, 2.0, 3.0, 4.0])
    assert select_hkvd(reused, fresh, 0.0).tolist() == []
    forced = torch.tensor([False, True, False, False])
    assert select_hkvd(reused, fresh, 0.0, forced).tolist() == [1]


def test_ratio_one_selects_all_tokens():
    reused, fresh = kv_with_deviations([0.0, 0.0, 1.0, 0.0])
    assert select_hkvd(reused, fresh, 1.0).tolist() == [0, 1, 2, 3]
    assert select_hkvd(reused, fresh, 1.0, torch.tensor([True, False, False, True])).tolist() == [0, 1, 2, 3]


def test_forced_tokens_are_added_and_do_not_use_up_the_budget():
    # Forced tokens have no cached KV; their placeholder rows deviate hugely but must not crowd out
    # the real HKVD tokens.
    reused, fresh = kv_with_deviations([0.1, 0.2, 7.0, 0.3, 6.0, 0.4, 100.0, 100.0])
    forced = torch.tensor([False] * 6 + [True, True])
    assert select_hkvd(reused, fresh, 0.25, forced).tolist() == [2, 4, 6, 7]


def test_rejects_ratio_outside_unit_interval_and_mismatched_shapes():
    reused, fresh = kv_with_deviations([1.0, 2.0])
    for ratio in (-0.1, 1.5):
        with pytest.raises(ValueError, match="ratio"):
            select_hkvd(reused, fresh, ratio)
    with pytest.raises(ValueError):
        select_hkvd(reused, fresh[:1], 0.5)
    with pytest.raises(ValueError):
        select_hkvd(reused, fresh, 0.5, torch.tensor([1, 0]))
    with pytest.raises(ValueError):
        select_hkvd(reused, fresh, 0.5, torch.tensor([True, False, True]))
