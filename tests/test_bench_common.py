"""ragcache.bench.common without a model: variants, rotated order, the per-request record."""

from __future__ import annotations

import dataclasses
import os

import pytest

from ragcache.bench.common import BenchConfigError, make_variants, request_record, speedup
from ragcache.engine import Generation, RequestMetrics
from ragcache.quality.measures import rotated


def test_variants_put_full_first_and_expand_blend_per_ratio():
    vs = make_variants(["blend", "reuse"], [0.3, 0.05], 0.15)
    assert [v.name for v in vs] == ["full", "blend@0.05", "blend@0.15", "blend@0.3", "reuse"]
    assert vs[2].ratio == 0.15 and vs[0].ratio is None
    with pytest.raises(BenchConfigError):
        make_variants(["fast"], [], 0.15)
    with pytest.raises(BenchConfigError):
        make_variants(["blend"], [1.5], 0.15)


def test_rotated_order_changes_per_example():
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert rotated([], 3) == []


def test_request_record_holds_every_request_metric_rounded_and_the_answer():
    m = RequestMetrics(mode="blend", ttft_s=0.123456789, total_s=1.5, load_s=0.01, worker_s=0.05, prompt_tokens=100,
                       ctx_tokens=80, reused_tokens=70, recomputed_tokens=10, chunk_tiers=["cpu", "disk", "cpu"],
                       stages={"rope_s": 0.0012345}, recompute_ratio=0.15, output_tokens=4)
    rec = request_record(Generation("Paris", [1, 2], m))
    assert {f.name for f in dataclasses.fields(RequestMetrics)} | {"tier_hits", "answer"} == set(rec)
    assert rec["ttft_s"] == 0.1235 and rec["stages"] == {"rope_s": 0.0012} and rec["answer"] == "Paris"
    assert rec["tier_hits"] == {"cpu": 2, "disk": 1} and rec["chunk_tiers"] == ["cpu", "disk", "cpu"]
    assert rec["prompt_tokens"] == 100 and rec["recompute_ratio"] == 0.15


def test_speedup_is_full_ttft_over_the_request_ttft():
    def gen(ttft: float) -> Generation:
        return Generation("", [], RequestMetrics(mode="full", ttft_s=ttft))

    assert speedup(gen(2.0), gen(0.5)) == pytest.approx(4.0)
    assert speedup(gen(2.0), gen(0.0)) is None


def test_the_compute_floor_counts_the_tokens_the_blend_recomputed_not_the_nominal_ratio():
    from ragcache.bench.ttft import with_floor

    stages = {"ttft_s_plain": 3.0, "ratio": 0.15, "recomputed_frac": 0.3, "ttft_s_ratio_one": None,
              "worker_s_reuse": 0.1, "worker_s": 1.0}
    got = with_floor(stages, check_layer=0, num_layers=30)
    assert got["floor_s"] == pytest.approx(1 / 30 * 3.0 + 0.3 * 29 / 30 * 3.0 + 0.1, abs=1e-3)
    nominal = with_floor({**stages, "recomputed_frac": None}, check_layer=0, num_layers=30)
    assert nominal["floor_s"] == pytest.approx(1 / 30 * 3.0 + 0.15 * 29 / 30 * 3.0 + 0.1, abs=1e-3)
    assert got["worker_vs_floor"] < nominal["worker_vs_floor"]
    shallow = with_floor(stages, check_layer=0, num_layers=30, depth_layers=27)  # blend.recompute_depth 0.9
    assert shallow["floor_s"] == pytest.approx(1 / 30 * 3.0 + 0.3 * 26 / 30 * 3.0 + 0.1, abs=1e-3)
    assert shallow["depth_layers"] == 27 and got["depth_layers"] == 30
    # the plan's fast path (question selection at check layer 0) runs no layer for every token
    from ragcache.blend.plan import layers_for_every_token
    assert [layers_for_every_token(0, False), layers_for_every_token(0, True), layers_for_every_token(2, False)] == [0, 1, 3]
    fast = with_floor(stages, check_layer=0, num_layers=30, full_layers=0)
    assert fast["floor_s"] == pytest.approx(0.3 * 3.0 + 0.1, abs=1e-3) and fast["full_layers"] == 0
    assert fast["worker_vs_floor"] > got["worker_vs_floor"]


def test_the_pair_floor_prices_the_prefill_s_attention_by_the_query_key_pairs_the_selection_implies():
    from ragcache.bench.ttft import with_floor

    # ratio 1: attention 6 s of 6 + 3 s selective stages (a = 2/3); the blend attends 0.25 of its pairs at r = 0.15
    stages = {"ttft_s_plain": 9.0, "ratio": 0.15, "recomputed_frac": 0.15, "ttft_s_ratio_one": 9.0,
              "worker_s_reuse": 0.1, "worker_s": 2.5, "attention_pairs": 2.5e8, "attention_pairs_ratio_one": 1e9,
              "stages_s_ratio_one": {"selective_attention_s": 6.0, "selective_layers_s": 3.0}}
    st = with_floor(stages, check_layer=0, num_layers=30, full_layers=0)
    assert st["attention_share_ratio_one"] == pytest.approx(0.667, abs=1e-3)
    assert st["floor_s"] == pytest.approx(0.15 * 9.0 + 0.1, abs=1e-3)
    assert st["pair_floor_s"] == pytest.approx(9.0 * (0.15 / 3 + 0.25 * 2 / 3) + 0.1, abs=2e-3)
    assert st["worker_vs_pair_floor"] == pytest.approx(2.5 / st["pair_floor_s"], abs=1e-3)
    assert st["worker_vs_pair_floor"] < st["worker_vs_floor"]  # late tokens' extra keys are the selection's, not waste
    # without a ratio-1 run there is no attention share, so no pair floor
    alone = with_floor({**stages, "stages_s_ratio_one": {}, "attention_pairs_ratio_one": None}, 0, 30, full_layers=0)
    assert alone["pair_floor_s"] is None and alone["worker_vs_pair_floor"] is None and alone["floor_s"] is not None


def test_the_selective_attention_is_judged_per_query_key_pair_against_the_ratio_one_path():
    from ragcache.bench.report import tables
    from ragcache.bench.ttft import stage_table, summarize_variant, with_floor

    def record(attention_s, pairs):
        return {"ttft_s": 1.0, "load_s": 0.0, "worker_s": 1.0, "stages": {"selective_attention_s": attention_s},
                "attention_pairs": pairs, "speedup": 1.0, "speedup_vs_best": 1.0, "kl_from_full": 0.0,
                "gold_nll": None, "answer_nll": None, "f1": 0.0, "rouge_l": 0.0, "em": 0.0, "agree_em": 1.0,
                "agree_rouge_l": 1.0, "agree_tokens": 1.0, "agree_prefix": 1.0, "recomputed_tokens": 1,
                "ctx_tokens": 10, "prompt_tokens": 12}

    variants = {v.name: v for v in make_variants(["full", "reuse", "blend"], [0.15, 1.0], 0.15, ["question"], "question")}
    # example 1: 0.3 s over 2e8 pairs (1.5 ns) at 0.15, 2.0 s over 1e9 (2 ns) at ratio 1; example 2 likewise x2
    per_example = {"blend@0.15": [(0.3, 2e8), (0.6, 4e8)], "blend@1": [(2.0, 1e9), (4.0, 2e9)]}
    records = [{"results": {name: record(*per_example.get(name, [(0.0, 0), (0.0, 0)])[i]) for name in variants}}
               for i in range(2)]
    summaries = {name: summarize_variant(v, records) for name, v in variants.items()}
    assert summaries["blend@0.15"]["attention_ns_per_pair_median"] == pytest.approx(1.5)
    assert summaries["full"]["attention_ns_per_pair_median"] is None  # no selective attention, no figure
    st = with_floor(stage_table(summaries, "blend@0.15"), check_layer=0, num_layers=30)
    assert st["attention_per_pair_vs_ratio_one"] == pytest.approx(0.75)
    assert st["attention_pairs_vs_ratio_one"] == pytest.approx(0.2)
    rows = tables({"benchmark": "ttft", "n": 2, "passages": 3, "modes": summaries, "sweep": [], "stages": st})[-1][2]
    assert ["attention per pair / ratio 1's", 0.75, None, None] in rows


def test_the_main_blend_is_the_settings_selection_else_the_first_at_the_default_ratio():
    from ragcache.bench.common import main_blend

    def name(selections, ratios=(0.3,)):
        v = main_blend(make_variants(["blend"], list(ratios), 0.15, selections, "question"), 0.15, "question", 8)
        return v.name if v is not None else None

    assert name([]) == "blend@0.15"
    assert name(["question/1", "question/8", "question/16"]) == "blend:question/8@0.15"  # the settings' granule
    assert name(["deviation", "question"]) == "blend:question@0.15"
    assert name(["question/1", "question/16"]) == "blend:question/1@0.15"  # none is the settings': the first
    assert name(["deviation/8"]) == "blend:deviation/8@0.15"
    assert main_blend(make_variants(["reuse"], [], 0.15), 0.15, "question", 8) is None


def test_the_route_table_compares_auto_with_full_and_blend_per_length_class_and_judges_its_targets():
    from ragcache.bench.ttft import auto_targets, route_table

    def record(tokens, auto_route, t_auto, t_full, t_blend, gold_auto, gold_full, agree):
        return {"prompt_tokens": tokens, "results": {
            "auto": {"ttft_s": t_auto, "route": auto_route, "route_rule": "faster" if auto_route == "blend" else "quality",
                     "gold_nll": gold_auto, "agree_tokens": agree, "route_s": 0.001},
            "full": {"ttft_s": t_full, "gold_nll": gold_full}, "blend@0.15": {"ttft_s": t_blend}}}

    records = [record(1300, "full", 1.0, 1.0, 0.8, 2.0, 2.0, 1.0), record(1400, "full", 1.1, 1.0, 0.8, 2.0, 2.0, 1.0),
               record(6000, "blend", 2.0, 6.0, 2.0, 1.9, 2.0, 0.0), record(6100, "blend", 2.2, 6.0, 2.0, 2.1, 2.0, 1.0)]
    table = route_table(records, "blend@0.15")
    assert set(table) == {"all", "short", "long"}
    short, long = table["short"], table["long"]
    assert short["routes"] == {"full:quality": 2} and short["blended"] == 0
    assert short["auto_over_full_median"] == pytest.approx(1.05)
    assert long["routes"] == {"blend:faster": 2} and long["auto_over_blend_median"] == pytest.approx(1.05)
    assert long["blended_gold_nll_rel_full"] == pytest.approx(0.0) and long["agree_tokens_n"] == 1
    targets = auto_targets(table)
    assert targets["auto_vs_full_median"]["met"] and targets["auto_vs_blend_long"]["met"]
    assert targets["auto_route_cost"]["met"]


def test_a_results_command_names_the_settings_the_environment_overrides(monkeypatch):
    """The stamp's ``command`` reruns the measurement: the ``RAGCACHE_<SECTION>__<NAME>`` settings set in
    the environment come before it (quoted), other variables do not, secrets are masked; the engine
    record names the budget."""
    from types import SimpleNamespace

    from ragcache.bench.environment import command_line, engine_info
    from ragcache.config import Settings

    for k in [k for k in os.environ if k.startswith("RAGCACHE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setattr("sys.argv", ["ragcache", "bench", "ttft", "--n", "3"])
    assert command_line() == "ragcache bench ttft --n 3"
    monkeypatch.setenv("RAGCACHE_BLEND__BUDGET", "fixed")
    monkeypatch.setenv("RAGCACHE_BLEND__PROPAGATE", "0.5")
    monkeypatch.setenv("RAGCACHE_PROMPT__SYSTEM_PROMPT", "be brief")
    monkeypatch.setenv("RAGCACHE_DATA_DIR", "/data")  # where data lives, not a setting
    assert command_line() == ("RAGCACHE_BLEND__BUDGET=fixed RAGCACHE_BLEND__PROPAGATE=0.5 "
                              "RAGCACHE_PROMPT__SYSTEM_PROMPT='be brief' ragcache bench ttft --n 3")
    monkeypatch.setenv("RAGCACHE_SERVER__API_KEY", "s3cret")
    monkeypatch.setenv("RAGCACHE_STORE__REMOTE_URL", "redis://:pw@10.0.0.1:7000,redis://:pw@10.0.0.2:7000")
    shown = command_line()
    assert "s3cret" not in shown and ":pw@" not in shown
    assert "RAGCACHE_SERVER__API_KEY='***'" in shown
    assert "RAGCACHE_STORE__REMOTE_URL='redis://:***@10.0.0.1:7000,redis://:***@10.0.0.2:7000'" in shown
    monkeypatch.delenv("RAGCACHE_SERVER__API_KEY")
    monkeypatch.delenv("RAGCACHE_STORE__REMOTE_URL")
    info = engine_info(SimpleNamespace(settings=Settings()))
    assert (info["budget"], info["propagate"]) == ("fixed", 0.5)
    assert {"mass_left", "max_recompute_ratio", "max_recompute_tokens"} <= info.keys()
