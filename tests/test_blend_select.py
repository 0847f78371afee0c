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


def test_budget_floor_applies_to_short_contexts_only_and_never_to_ratio_zero():
    assert hkvd_budget(0.15, 1000, min_tokens=384) == 384  # 150 by the ratio alone
    assert hkvd_budget(0.15, 6000, min_tokens=384) == 900  # the ratio gives more: the floor does nothing
    assert hkvd_budget(0.15, 200, min_tokens=384) == 200  # a context shorter than the floor: all of it
    assert hkvd_budget(0.0, 1000, min_tokens=384) == 0  # ratio 0 stays plain reuse
    assert hkvd_budget(0.15, 1000, min_tokens=0) == 150
    with pytest.raises(ValueError, match="min_tokens"):
        hkvd_budget(0.15, 1000, min_tokens=-1)


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


# --- select_tokens: strategies, exact budgets, forced and exact tokens ---------------------------

from ragcache.blend import Selection, question_attention, select_tokens  # noqa: E402


def scores(values):
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("strategy", ["deviation", "question", "hybrid"])
def test_every_strategy_spends_exactly_the_budget_plus_the_forced_tokens(strategy):
    g = torch.Generator().manual_seed(1)
    dev, q = torch.rand(40, generator=g), torch.rand(40, generator=g)
    forced = torch.zeros(40, dtype=torch.bool)
    forced[[3, 17]] = True
    exact = torch.zeros(40, dtype=torch.bool)
    exact[:5] = True
    sel = Selection(strategy, chunk_head_tokens=2, max_chunk_share=0.5)
    for budget in (0, 1, 6, 20, 38, 40):
        got = select_tokens(budget, sel, deviation=dev, question=q, forced=forced, exact=exact,
                            segment_starts=[0, 5, 15, 30])
        assert got.tolist() == sorted(set(got.tolist()))
        assert len(got) == min(budget, 38) + 2 and {3, 17} <= set(got.tolist())


def test_exact_tokens_are_taken_only_when_nothing_else_is_left():
    q = scores([9.0, 8.0, 0.1, 0.2, 0.3, 0.4])  # the two exact tokens get the most attention
    exact = torch.tensor([True, True, False, False, False, False])
    assert select_tokens(2, Selection("question"), question=q, exact=exact).tolist() == [4, 5]
    assert select_tokens(5, Selection("question"), question=q, exact=exact).tolist() == [0, 2, 3, 4, 5]
    assert select_tokens(6, Selection("question"), question=q, exact=exact).tolist() == list(range(6))


def test_question_strategy_follows_the_question_scores_and_deviation_the_deviation():
    dev = scores([5.0, 0.0, 4.0, 0.0, 0.0, 0.0])
    q = scores([0.0, 0.9, 0.0, 0.8, 0.0, 0.0])
    assert select_tokens(2, Selection("deviation"), deviation=dev, question=q).tolist() == [0, 2]
    assert select_tokens(2, Selection("question"), deviation=dev, question=q).tolist() == [1, 3]
    with pytest.raises(ValueError, match="question"):
        select_tokens(2, Selection("question"), deviation=dev)
    with pytest.raises(ValueError, match="deviation"):
        select_tokens(2, Selection("hybrid", question_weight=0.5), question=q)


def test_hybrid_mixes_ranks_adds_chunk_heads_and_caps_a_chunk():
    # two chunks of 6 tokens after a 2-token exact head
    starts = [0, 2, 8]
    exact = torch.zeros(14, dtype=torch.bool)
    exact[:2] = True
    dev = torch.zeros(14)
    dev[10:14] = torch.tensor([4.0, 5.0, 6.0, 7.0])  # chunk 2's tail deviates most
    q = torch.zeros(14)
    q[4:8] = torch.tensor([0.4, 0.5, 0.6, 0.7])  # chunk 1's tail is what the question reads
    heads = Selection("hybrid", chunk_head_tokens=1, question_weight=0.5)
    got = select_tokens(4, heads, deviation=dev, question=q, exact=exact, segment_starts=starts).tolist()
    assert {2, 8} <= set(got)  # the first token of each moved chunk
    capped = Selection("hybrid", question_weight=0.0, max_chunk_share=0.5)
    got = select_tokens(4, capped, deviation=dev, question=q, exact=exact, segment_starts=starts).tolist()
    assert sum(1 for i in got if i >= 8) == 2  # chunk 2 alone would take all four
    uncapped = select_tokens(4, Selection("deviation"), deviation=dev, exact=exact, segment_starts=starts)
    assert uncapped.tolist() == [10, 11, 12, 13]


def test_selection_rejects_unknown_strategies_and_bad_knobs():
    for kwargs in ({"strategy": "attention"}, {"strategy": "hybrid", "chunk_head_tokens": -1},
                   {"strategy": "hybrid", "question_weight": 1.5}, {"strategy": "hybrid", "max_chunk_share": 0.0}):
        with pytest.raises(ValueError):
            Selection(**kwargs)


def test_question_attention_is_the_tail_queries_causal_attention_with_its_weights_on_the_context():
    from ragcache.blend import causal_attention

    torch.manual_seed(0)
    n, t, hq, hkv, d = 5, 3, 4, 2, 8
    q = torch.randn(t, hq, d)
    k, v = torch.randn(n + t, hkv, d), torch.randn(n + t, hkv, d)
    pos = torch.arange(n + t)
    out, got = question_attention(q, k[:n], k[n:], d ** -0.5, v_ctx=v[:n], v_tail=v[n:])
    torch.testing.assert_close(out, causal_attention(q, pos[n:], k, v, pos, d ** -0.5), atol=1e-5, rtol=1e-5)
    keys = k.repeat_interleave(hq // hkv, dim=1)  # [n+t, hq, d]
    expected = torch.zeros(n)
    for ti in range(t):
        visible = n + ti + 1
        for h in range(hq):
            w = torch.softmax(keys[:visible, h] @ q[ti, h] * d ** -0.5, dim=0)
            expected += w[:n]
    torch.testing.assert_close(got, expected / (t * hq))
    assert float(got.sum()) < 1.0  # part of the attention stays on the tail itself
    none, same = question_attention(q, k[:n], k[n:], d ** -0.5)
    assert none is None and torch.equal(same, got)


def test_question_attention_pooled_by_max_scores_each_token_by_its_most_attentive_head():
    torch.manual_seed(1)
    n, t, hq, hkv, d = 6, 3, 6, 2, 8
    q = torch.randn(t, hq, d)
    k = torch.randn(n + t, hkv, d)
    keys = k.repeat_interleave(hq // hkv, dim=1)  # [n+t, hq, d]: query head h reads KV head h // 3
    per_head = torch.zeros(hq, n)
    for h in range(hq):
        for ti in range(t):
            per_head[h] += torch.softmax(keys[:n + ti + 1, h] @ q[ti, h] * d ** -0.5, dim=0)[:n]
    per_head /= t
    _, got = question_attention(q, k[:n], k[n:], d ** -0.5, heads="max")
    torch.testing.assert_close(got, per_head.amax(dim=0))
    _, mean = question_attention(q, k[:n], k[n:], d ** -0.5)
    torch.testing.assert_close(mean, per_head.mean(dim=0))
    assert bool((got >= mean - 1e-6).all()) and not torch.allclose(got, mean)
    with pytest.raises(ValueError, match="heads"):
        question_attention(q, k[:n], k[n:], d ** -0.5, heads="median")


def test_the_settings_offer_exactly_the_question_head_poolings():
    import typing

    from ragcache.blend.select import QUESTION_HEADS
    from ragcache.config import BlendSettings

    assert typing.get_args(BlendSettings.model_fields["question_heads"].annotation) == QUESTION_HEADS
    with pytest.raises(ValueError, match="question_heads"):
        Selection("question", question_heads="median")


def test_every_registered_strategy_has_a_score_function_and_every_score_function_a_record():
    from ragcache import strategies
    from ragcache.blend import SCORES

    assert strategies.names() == ("deviation", "question", "hybrid")
    assert set(SCORES) == set(strategies.names())


# --- run-granular selection ----------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["deviation", "question", "hybrid"])
@pytest.mark.parametrize("granule", [4, 8, 16])
def test_runs_keep_the_exact_budget_and_the_forced_tokens(strategy, granule):
    g = torch.Generator().manual_seed(granule)
    n = 100
    dev, q = torch.rand(n, generator=g), torch.rand(n, generator=g)
    forced = torch.zeros(n, dtype=torch.bool)
    forced[[50, 51]] = True
    exact = torch.zeros(n, dtype=torch.bool)
    exact[:7] = True
    starts = [0, 7, 40, 77]
    for cap in (1.0, 0.4):
        sel = Selection(strategy, chunk_head_tokens=2, max_chunk_share=cap, granule=granule)
        for budget in (0, 1, 5, 15, 40, 98):
            got = select_tokens(budget, sel, deviation=dev, question=q, forced=forced, exact=exact,
                                segment_starts=starts).tolist()
            assert got == sorted(set(got)) and {50, 51} <= set(got)
            assert len(got) == min(budget, n - 2) + 2


def test_runs_are_aligned_within_each_chunk_and_chosen_whole():
    # chunk starts 0 (the exact head), 5, 29; runs of 8 inside each chunk: 5-12, 13-20, 21-28, 29-36, ...
    n, starts = 45, [0, 5, 29]
    q = torch.zeros(n)
    q[14] = 1.0  # one hot token in the run 13-20
    q[30] = 0.6  # and one in the run 29-36
    exact = torch.zeros(n, dtype=torch.bool)
    exact[:5] = True
    sel = Selection("question", granule=8)
    assert select_tokens(8, sel, question=q, exact=exact, segment_starts=starts).tolist() == list(range(13, 21))
    assert select_tokens(16, sel, question=q, exact=exact, segment_starts=starts).tolist() == \
        list(range(13, 21)) + list(range(29, 37))
    # a budget that ends inside a run keeps that run's best tokens
    got = select_tokens(10, sel, question=q, exact=exact, segment_starts=starts).tolist()
    assert got[:8] == list(range(13, 21)) and 30 in got[8:] and all(29 <= i < 37 for i in got[8:])
    assert len(got) == 10


def test_granule_one_equals_token_by_token():
    g = torch.Generator().manual_seed(5)
    q = torch.rand(60, generator=g)
    for budget in (3, 17):
        by_runs = select_tokens(budget, Selection("question", granule=1, max_chunk_share=0.99), question=q,
                                segment_starts=[0, 30])
        plain = select_tokens(budget, Selection("question"), question=q, segment_starts=[0, 30])
        assert by_runs.tolist() == plain.tolist()


def test_granule_and_probe_layers_are_checked():
    with pytest.raises(ValueError, match="granule"):
        Selection("question", granule=0)
    with pytest.raises(ValueError, match="probe_layers"):
        Selection("question", probe_layers=-1)


def test_impact_is_attention_times_the_reused_value_error_at_the_candidates_only():
    from ragcache.blend import impact_scores, value_error

    question = torch.tensor([0.5, 0.2, 0.1, 0.2])
    reused = torch.zeros(4, 1, 2)
    fresh = torch.tensor([[[3.0, 4.0]], [[0.0, 0.0]]])  # candidates 1 and 3: errors 5 and 0
    candidates = torch.tensor([1, 3])
    error = value_error(fresh, reused[candidates])
    assert error.tolist() == [5.0, 0.0]
    impact = impact_scores(question, candidates, error)
    assert impact[1] == pytest.approx(1.0) and 0 < impact[3] < 1e-30  # a candidate ranks above the rest
    assert impact[0] == impact[2] == 0  # not a candidate, however much attention
    # the error summed over layers: an earlier layer's error lifts candidate 3 above candidate 1
    summed = impact_scores(question, candidates, error + torch.tensor([0.0, 6.0]))
    assert summed[3] == pytest.approx(1.2) and summed[3] > summed[1]
    with pytest.raises(ValueError, match="does not match"):
        impact_scores(question, candidates, error[:1])
    with pytest.raises(ValueError, match="candidates must be >= 1"):
        Selection("question", candidates=0.5)
    with pytest.raises(ValueError, match="refine_layer must be >= 1"):
        Selection("question", candidates=2.0, refine_layer=0)


def best_runs(priority, chunk_starts, granule, limit, group=None, cap=None, taken=None) -> list[int]:
    """The shared run-taking routine over plain lists, the chosen token indices ascending."""
    from ragcache.blend.select import _best_runs

    p = torch.tensor(priority, dtype=torch.float32)
    n = p.shape[0]
    group = torch.zeros(n, dtype=torch.long) if group is None else torch.tensor(group)
    taken = None if taken is None else torch.tensor(taken)
    picked = _best_runs(p, torch.arange(n), group, torch.tensor(chunk_starts), granule,
                        torch.tensor(limit, dtype=torch.float32), cap=cap, taken=taken)
    return picked.nonzero().squeeze(1).tolist()


def test_runs_end_at_chunk_and_context_edges_and_ties_go_to_the_earlier_run_and_the_later_token():
    # chunks 0-6 and 7-9, granule 3: runs 0-2, 3-5, 6 (cut by the chunk's end) and 7-9 (the context's end)
    priority = [1, 1, 1, 1, 1, 1, 9, 5, 5, 5]
    assert best_runs(priority, [0, 7], 3, [1]) == [6]
    assert best_runs(priority, [0, 7], 3, [4]) == [6, 7, 8, 9]
    # a budget of 5 is no multiple of 3: runs 0-2 and 3-5 tie, the earlier is taken and trimmed to its
    # best tokens, which tie too: the later ones stay
    assert best_runs(priority, [0, 7], 3, [5]) == [2, 6, 7, 8, 9]
    assert best_runs(priority, [0, 7], 3, [10]) == list(range(10))


def test_a_run_scores_the_mean_of_its_open_tokens_and_closed_tokens_are_never_taken():
    inf = float("inf")
    priority = [-inf, 4, -inf, 1, 1, -1]  # closed, open, closed | open, open, exact
    assert best_runs(priority, [0], 3, [1]) == [1]
    assert best_runs(priority, [0], 3, [2]) == [1, 4]  # the second run trimmed: the exact token goes first
    assert best_runs(priority, [0], 3, [4]) == [1, 3, 4, 5]


def test_a_chunk_at_its_cap_gives_way_and_its_skipped_runs_fill_what_is_left_best_first():
    # chunks 0-3 and 4-7, runs of 2: 0-1 (9), 2-3 (8), 6-7 (2), 4-5 (1)
    priority = [9, 9, 8, 8, 1, 1, 2, 2]
    assert best_runs(priority, [0, 4], 2, [4]) == [0, 1, 2, 3]  # without a cap
    assert best_runs(priority, [0, 4], 2, [4], cap=2) == [0, 1, 6, 7]
    assert best_runs(priority, [0, 4], 2, [5], cap=2) == [0, 1, 3, 6, 7]  # every chunk at its cap: 2-3 fills
    # a token chosen already counts against its chunk's cap
    taken = [False] * 8
    taken[4] = True
    priority[4] = -float("inf")
    assert best_runs(priority, [0, 4], 2, [4], cap=1, taken=taken) == [0, 1, 2, 3]


def test_each_group_spends_its_own_limit():
    priority = [1, 2, 3, 4, 4, 3, 2, 1]
    assert best_runs(priority, [0, 4], 2, [1, 3], group=[0, 0, 0, 0, 1, 1, 1, 1]) == [3, 4, 5, 6]
    assert best_runs(priority, [0, 4], 2, [0, 0], group=[0, 0, 0, 0, 1, 1, 1, 1]) == []


# ---- the adaptive recompute budget ------------------------------------------------------------


def test_tokens_for_mass_takes_the_fewest_tokens_that_leave_at_most_the_mass():
    from ragcache.blend.select import tokens_for_mass

    scores = torch.tensor([0.05, 0.4, 0.1, 0.0, 0.2])
    assert tokens_for_mass(scores, 0.5) == 1  # 0.75 total: taking 0.4 leaves 0.35
    assert tokens_for_mass(scores, 0.2) == 2  # 0.4 + 0.2 leave 0.15
    assert tokens_for_mass(scores, 0.06) == 3  # ... + 0.1 leave 0.05
    assert tokens_for_mass(scores, 0.01) == 4  # ... + 0.05 leave 0 (the zero is never needed)
    assert tokens_for_mass(scores, 0.8) == 0 and tokens_for_mass(torch.zeros(0), 0.1) == 0


def test_adaptive_budget_grows_where_the_questions_attention_is_spread():
    from ragcache.blend import BudgetRule, adaptive_budget

    n = 1000
    movable = torch.ones(n, dtype=torch.bool)
    rule = BudgetRule(mass_left=0.05, max_ratio=0.5)
    focused = torch.full((n,), 0.01 / n)
    focused[:20] = 0.5 / 20  # half of the attention on 20 tokens, a trace elsewhere
    spread = torch.full((n,), 0.5 / n)  # the same mass over every token
    a = adaptive_budget(focused, movable, ratio=0.15, min_tokens=0, rule=rule)
    b = adaptive_budget(spread, movable, ratio=0.15, min_tokens=0, rule=rule)
    assert a.need is not None and b.need is not None and a.need < 150 < b.need
    assert a.tokens == a.low == 75  # below the centre, down to its floor: half of the ratio's 150
    assert b.need in (900, 901) and b.tokens == b.high == 500  # capped at max_ratio x N (901: float32 sums)
    assert "capped" in b.reason and b.mass_left == pytest.approx(0.25, abs=1e-3)
    assert a.centre == b.centre == 150 and "question gives 0.51 of its attention" in a.reason


def test_adaptive_budget_keeps_the_floor_and_the_cap_and_counts_only_movable_tokens():
    from ragcache.blend import BudgetRule, adaptive_budget, hkvd_budget

    gen = torch.Generator().manual_seed(3)
    for trial in range(50):
        n = int(torch.randint(50, 3000, (1,), generator=gen))
        scores = torch.rand(n, generator=gen) ** 4
        scores = scores / scores.sum() * float(torch.rand(1, generator=gen))
        movable = torch.rand(n, generator=gen) > 0.2
        ratio, floor = float(torch.rand(1, generator=gen)) * 0.4, int(torch.randint(0, 400, (1,), generator=gen))
        rule = BudgetRule(mass_left=float(torch.rand(1, generator=gen)) * 0.2 + 0.001,
                          max_ratio=float(torch.rand(1, generator=gen)) * 0.9 + 0.1,
                          max_tokens=int(torch.randint(1, 2000, (1,), generator=gen)))
        got = adaptive_budget(scores, movable, ratio=ratio, min_tokens=floor, rule=rule)
        centre = hkvd_budget(ratio, n, floor)
        assert got.centre == centre
        assert got.tokens <= int(movable.sum())
        # the cap: max_ratio and max_tokens, never below the ratio's own budget
        assert got.tokens <= max(centre, min(int(rule.max_ratio * n), rule.max_tokens))
        assert got.tokens >= min(min(floor, n), centre, int(movable.sum()))  # the floor
        if got.low <= got.need <= got.high and got.need <= int(movable.sum()):
            assert got.tokens == got.need and got.mass_left <= rule.mass_left + 1e-6
        # the tokens outside the budget hold the mass it reports, counted over movable tokens only
        rest = torch.sort(scores[movable], descending=True).values[got.tokens:].sum()
        assert got.mass_left == pytest.approx(float(rest), abs=1e-5)


def test_a_long_context_keeps_the_ratios_budget_where_max_tokens_is_below_it():
    from ragcache.blend import BudgetRule, adaptive_budget

    rule = BudgetRule(mass_left=0.01, max_ratio=0.5, max_tokens=768)
    spread = torch.full((6000,), 0.5 / 6000)  # asks for most of the context
    long_ = adaptive_budget(spread, torch.ones(6000, dtype=torch.bool), ratio=0.15, min_tokens=384, rule=rule)
    assert long_.tokens == long_.centre == 900 and "capped at the ratio's budget" in long_.reason
    short = adaptive_budget(spread[:1500] * 4, torch.ones(1500, dtype=torch.bool), ratio=0.15, min_tokens=384,
                            rule=rule)
    assert short.centre == 384 and short.tokens == 750  # max_ratio: half of 1,500, below 768
    mid = adaptive_budget(spread[:3000] * 2, torch.ones(3000, dtype=torch.bool), ratio=0.15, min_tokens=384,
                          rule=rule)
    assert mid.tokens == 768 and "max_recompute_tokens 768" in mid.reason


def test_budget_rule_refuses_values_outside_its_ranges():
    from ragcache.blend import BudgetRule

    for kwargs in ({"mass_left": 0.0}, {"mass_left": 1.0}, {"mass_left": 0.1, "max_ratio": 0.0},
                   {"mass_left": 0.1, "min_share": 1.5}, {"mass_left": 0.1, "max_tokens": 0}):
        with pytest.raises(ValueError):
            BudgetRule(**kwargs)
