"""ragcache.bench.metrics: answer-quality metrics and statistics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from ragcache.bench.metrics import (
    exact_match, kl_divergence, lcs_length, mean, mean_nll, median, normalize_answer, percentile, rouge_l, token_f1,
)

# ---- normalisation, EM, F1 ---------------------------------------------------------------------


def test_normalize_answer_drops_case_punctuation_articles_and_extra_spaces():
    assert normalize_answer("  The  Eiffel-Tower, in PARIS!  ") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_exact_match_is_max_over_gold_answers_after_normalisation():
    assert exact_match("the Exeter College.", ["Oxford", "exeter college"]) == 1.0
    assert exact_match("Exeter", ["Exeter College"]) == 0.0
    assert exact_match("anything", []) == 0.0


def test_token_f1_hand_computed():
    # pred tokens [eiffel, tower], gold [eiffel, tower, in, paris]: P = 1, R = 1/2, F1 = 2/3
    assert token_f1("The Eiffel Tower!", ["eiffel tower in paris"]) == pytest.approx(2 / 3)
    # repeated tokens count as a multiset: pred [paris, paris], gold [paris]: P = 1/2, R = 1, F1 = 2/3
    assert token_f1("Paris Paris", "Paris") == pytest.approx(2 / 3)
    assert token_f1("London", ["Paris"]) == 0.0


def test_token_f1_takes_the_best_gold_answer():
    assert token_f1("Exeter College", ["University of Oxford", "Exeter College"]) == 1.0
    # against "college of exeter": shared {exeter, college}, P = 1, R = 2/3 -> 0.8
    assert token_f1("Exeter College", ["London", "College of Exeter"]) == pytest.approx(0.8)


def test_token_f1_empty_answers():
    assert token_f1("", [""]) == 1.0
    assert token_f1("the", ["Paris"]) == 0.0  # normalises to nothing
    assert token_f1("Paris", []) == 0.0


# ---- Rouge-L ---------------------------------------------------------------------------------


def test_lcs_length_hand_computed():
    assert lcs_length("wxyz", "wyzqr") == 3
    assert lcs_length([1, 2, 3], [3, 2, 1]) == 1
    assert lcs_length([], [1]) == 0


def test_rouge_l_hand_computed():
    # LCS(w x y z, w y z q r) = 3: P = 3/4, R = 3/5, F = 2PR/(P+R) = 2/3
    assert rouge_l("w x y z", ["w y z q r"]) == pytest.approx(2 / 3)
    # order matters: [police, killed, gunman] vs [gunman, killed, police] share a subsequence of 1
    assert rouge_l("police killed the gunman", "the gunman killed police") == pytest.approx(1 / 3)
    assert rouge_l("Exeter College", ["x", "exeter college"]) == 1.0
    assert rouge_l("", [""]) == 1.0 and rouge_l("a", ["b"]) == 0.0


# ---- KL, NLL, statistics ---------------------------------------------------------------------


def test_kl_divergence_hand_computed():
    p = {0: math.log(0.5), 1: math.log(0.5)}
    q = {0: math.log(0.25), 1: math.log(0.75)}
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # 0.1438 nats
    assert kl_divergence(p, q) == pytest.approx(expected)
    assert kl_divergence(p, p) == 0.0


def test_kl_divergence_is_asymmetric_and_ignores_zero_probability_tokens():
    p = {0: 0.0, 1: -math.inf}  # all mass on token 0
    q = {0: math.log(0.8), 1: math.log(0.2)}
    assert kl_divergence(p, q) == pytest.approx(-math.log(0.8))
    assert kl_divergence(q, {0: math.log(0.5), 1: math.log(0.5)}) == pytest.approx(
        0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5))


def test_kl_divergence_treats_missing_tokens_as_least_likely():
    p = {0: math.log(0.5), 1: math.log(0.5)}
    q = {0: math.log(0.9), 2: math.log(0.1)}  # token 1 missing -> log 0.1
    assert kl_divergence(p, q) == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))
    with pytest.raises(ValueError):
        kl_divergence({}, q)


def test_mean_nll_is_the_negative_mean_logprob():
    assert mean_nll([-1.0, -2.0, -3.0]) == pytest.approx(2.0)
    assert mean_nll([math.log(0.5)]) == pytest.approx(math.log(2))
    with pytest.raises(ValueError):
        mean_nll([])


def test_median_and_percentile_interpolate_like_numpy():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([], 90) is None and mean([]) is None
