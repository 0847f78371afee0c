"""ragcache.evaluation without a model: metrics against hand-computed values, helpers, tables."""

from __future__ import annotations

import json
import math

import pytest

from ragcache import evaluation as ev

# ---- normalisation, EM, F1 ---------------------------------------------------------------------


def test_normalize_answer_drops_case_punctuation_articles_and_extra_spaces():
    assert ev.normalize_answer("  The  Eiffel-Tower, in PARIS!  ") == "eiffeltower in paris"
    assert ev.normalize_answer("An apple a day") == "apple day"
    assert ev.normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_exact_match_is_max_over_gold_answers_after_normalisation():
    assert ev.exact_match("the Exeter College.", ["Oxford", "exeter college"]) == 1.0
    assert ev.exact_match("Exeter", ["Exeter College"]) == 0.0
    assert ev.exact_match("anything", []) == 0.0


def test_token_f1_hand_computed():
    # pred tokens [eiffel, tower], gold [eiffel, tower, in, paris]: P = 1, R = 1/2, F1 = 2/3
    assert ev.token_f1("The Eiffel Tower!", ["eiffel tower in paris"]) == pytest.approx(2 / 3)
    # repeated tokens count as a multiset: pred [paris, paris], gold [paris]: P = 1/2, R = 1, F1 = 2/3
    assert ev.token_f1("Paris Paris", "Paris") == pytest.approx(2 / 3)
    assert ev.token_f1("London", ["Paris"]) == 0.0


def test_token_f1_takes_the_best_gold_answer():
    assert ev.token_f1("Exeter College", ["University of Oxford", "Exeter College"]) == 1.0
    # against "college of exeter": shared {exeter, college}, P = 1, R = 2/3 -> 0.8
    assert ev.token_f1("Exeter College", ["London", "College of Exeter"]) == pytest.approx(0.8)


def test_token_f1_empty_answers():
    assert ev.token_f1("", [""]) == 1.0
    assert ev.token_f1("the", ["Paris"]) == 0.0  # normalises to nothing
    assert ev.token_f1("Paris", []) == 0.0


# ---- Rouge-L ---------------------------------------------------------------------------------


def test_lcs_length_hand_computed():
    assert ev.lcs_length("wxyz", "wyzqr") == 3
    assert ev.lcs_length([1, 2, 3], [3, 2, 1]) == 1
    assert ev.lcs_length([], [1]) == 0


def test_rouge_l_hand_computed():
    # LCS(w x y z, w y z q r) = 3: P = 3/4, R = 3/5, F = 2PR/(P+R) = 2/3
    assert ev.rouge_l("w x y z", ["w y z q r"]) == pytest.approx(2 / 3)
    # order matters: [police, killed, gunman] vs [gunman, killed, police] share a subsequence of 1
    assert ev.rouge_l("police killed the gunman", "the gunman killed police") == pytest.approx(1 / 3)
    assert ev.rouge_l("Exeter College", ["x", "exeter college"]) == 1.0
    assert ev.rouge_l("", [""]) == 1.0 and ev.rouge_l("a", ["b"]) == 0.0


# ---- KL, NLL, statistics ---------------------------------------------------------------------


def test_kl_divergence_hand_computed():
    p = {0: math.log(0.5), 1: math.log(0.5)}
    q = {0: math.log(0.25), 1: math.log(0.75)}
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # 0.1438 nats
    assert ev.kl_divergence(p, q) == pytest.approx(expected)
    assert ev.kl_divergence(p, p) == 0.0


def test_kl_divergence_is_asymmetric_and_ignores_zero_probability_tokens():
    p = {0: 0.0, 1: -math.inf}  # all mass on token 0
    q = {0: math.log(0.8), 1: math.log(0.2)}
    assert ev.kl_divergence(p, q) == pytest.approx(-math.log(0.8))
    assert ev.kl_divergence(q, {0: math.log(0.5), 1: math.log(0.5)}) == pytest.approx(
        0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5))


def test_kl_divergence_treats_missing_tokens_as_least_likely():
    p = {0: math.log(0.5), 1: math.log(0.5)}
    q = {0: math.log(0.9), 2: math.log(0.1)}  # token 1 missing -> log 0.1
    assert ev.kl_divergence(p, q) == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))
    with pytest.raises(ValueError):
        ev.kl_divergence({}, q)


def test_mean_nll_is_the_negative_mean_logprob():
    assert ev.mean_nll([-1.0, -2.0, -3.0]) == pytest.approx(2.0)
    assert ev.mean_nll([math.log(0.5)]) == pytest.approx(math.log(2))
    with pytest.raises(ValueError):
        ev.mean_nll([])


def test_median_and_percentile_interpolate_like_numpy():
    assert ev.median([3.0, 1.0, 2.0]) == 2.0
    assert ev.median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert ev.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert ev.percentile([], 90) is None and ev.mean([]) is None


# ---- variants, rotation, data ----------------------------------------------------------------


def test_variants_put_full_first_and_expand_blend_per_ratio():
    vs = ev.make_variants(["blend", "reuse"], [0.3, 0.05], 0.15)
    assert [v.name for v in vs] == ["full", "blend@0.05", "blend@0.15", "blend@0.3", "reuse"]
    assert vs[2].ratio == 0.15 and vs[0].ratio is None
    with pytest.raises(ev.BenchConfigError):
        ev.make_variants(["fast"], [], 0.15)
    with pytest.raises(ev.BenchConfigError):
        ev.make_variants(["blend"], [1.5], 0.15)


def test_rotated_order_changes_per_example():
    assert ev.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert ev.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert ev.rotated([], 3) == []


def test_load_qa_and_dataset_errors(tmp_path):
    f = tmp_path / "qa.json"
    f.write_text(json.dumps([{"question": f"q{i}", "answers": ["a"], "ctxs": [{"title": "T", "text": "x"}]}
                             for i in range(3)]))
    exs = ev.load_qa(f, n=2, offset=1)
    assert [e.question for e in exs] == ["q1", "q2"] and exs[0].index == 1
    assert exs[0].passages == [("T", "x")] and ev.passage_text("T", "x") == "T\nx" and ev.passage_text("", "x") == "x"
    with pytest.raises(ev.DatasetNotFoundError, match="musique"):
        ev.load_qa(tmp_path / "missing.json")


def test_build_hotset_draws_the_overlap_from_the_most_recurring_passages():
    pool = [("", f"hot{i}") for i in range(4)]
    exs = [ev.QAExample(i, f"q{i}", ["a"], [pool[i % 4], pool[(i + 1) % 4]] + [("", f"own{i}-{j}") for j in range(5)])
           for i in range(8)]
    qs = ev.build_hotset(exs, questions=6, passages=5, overlap=0.6, hot_pool=4, seed=1)
    assert len(qs) == 6 and all(q.hot == 3 for q in qs)
    for q in qs:
        texts = [t for _, t in q.passages]
        assert len(texts) == 5 == len(set(texts))
        assert sum(t.startswith("hot") for t in texts) == 3
        assert texts[:2] == [f"own{q.index}-0", f"own{q.index}-1"]
    with pytest.raises(ev.BenchConfigError):
        ev.build_hotset(exs, questions=20, passages=5, overlap=0.6, hot_pool=4)


# ---- presentation ----------------------------------------------------------------------------


def _summary(name, mode, ratio, ttft, speedup, kl, nll, rel):
    return {"variant": name, "mode": mode, "recompute_ratio": ratio, "n": 2, "ttft_median_s": ttft, "ttft_p90_s": ttft,
            "ttft_mean_s": ttft, "speedup_median": speedup, "load_s_median": 0.0, "worker_s_median": 0.0,
            "kl_mean": kl, "kl_median": kl, "gold_nll_mean": nll, "gold_nll_rel_full": rel, "f1_mean": 0.1,
            "rouge_l_mean": 0.1, "em_mean": 0.0, "agree_em_mean": 1.0, "agree_rouge_l_mean": 1.0,
            "agree_tokens_mean": 1.0, "recomputed_frac_mean": 0.15, "prompt_tokens_mean": 100.0}


def test_ttft_targets_tables_and_plot(tmp_path):
    modes = {"full": _summary("full", "full", None, 10.0, 1.0, 0.0, 2.0, 0.0),
             "reuse": _summary("reuse", "reuse", None, 1.0, 10.0, 0.4, 2.2, 0.1),
             "blend": _summary("blend@0.15", "blend", 0.15, 2.0, 5.0, 0.1, 2.02, 0.01)}
    result = {"benchmark": "ttft", "n": 2, "passages": 3, "modes": modes,
              "sweep": [_summary("blend@0.05", "blend", 0.05, 1.5, 6.6, 0.3, 2.1, 0.05), modes["blend"]],
              "targets": ev.ttft_targets(modes), "machine": {"cpu_count": 2}}
    t = result["targets"]
    assert t["blend_ttft_speedup"]["met"] and t["blend_kl_vs_reuse"]["value"] == pytest.approx(0.25)
    assert t["blend_nll_within"]["met"] is True
    text = ev.render(result)
    assert "blend (r=0.15)" in text and "recompute-ratio sweep" in text and "targets" in text
    paths = ev.write_result(result, tmp_path / "r.json")
    assert json.loads(paths["json"].read_text())["plot"] == "r.png"
    assert paths["png"].stat().st_size > 1000 and "| mode |" in paths["md"].read_text()


# ---- CLI errors (no engine is started) -------------------------------------------------------


def test_cli_missing_dataset_and_bad_flags_fail_with_one_line(tmp_path, capsys):
    from app.cli import main

    assert main(["bench", "ttft", "--dataset", str(tmp_path / "nope.json"), "--out", str(tmp_path / "r.json")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["eval", "--dataset", str(tmp_path / "nope.json")]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "ttft", "--modes", "full,fast"])
    for bad in (["bench", "ttft", "--n", "0"], ["bench", "hotset", "--passages", "0"],
                ["eval", "--max-tokens", "-1"], ["bench", "ttft", "--offset", "-1"],
                ["bench", "tiers", "--repeats", "x"]):
        with pytest.raises(SystemExit):  # rejected by the parser, before any engine starts
            main(bad + ["--out", str(tmp_path / "r.json")])
        assert "expected" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_bench_help_shows_list_defaults_as_typed_and_no_empty_defaults(capsys):
    from app.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "ttft", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 0,0.05,0.1,0.15,0.3,1)" in text and "[0.0" not in text
    assert "(default: None)" not in text and ".png" in text
    args = parser.parse_args(["bench", "ttft"])
    assert args.ratios == [0.0, 0.05, 0.1, 0.15, 0.3, 1.0] and args.modes == ["full", "prefix", "reuse", "blend"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "tiers", "--help"])
    assert ".png" not in capsys.readouterr().out


def test_markdown_table_escapes_pipes_inside_cells():
    md = ev.markdown_table(["target", "limit"], [["KL(full||blend)", "|x| ≤ 0.02"]])
    rows = md.splitlines()
    assert rows[2] == "| KL(full\\|\\|blend) | \\|x\\| ≤ 0.02 |"
    assert all(row.replace("\\|", "").count("|") == 3 for row in rows)
