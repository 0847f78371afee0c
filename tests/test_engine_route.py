"""The router of ``engine.mode = "auto"``: the cost model's fit on synthetic timings, the decision at
its speed and quality boundaries, the predicted budget and tiers, and the quality table. No engine."""

from __future__ import annotations

import time

import pytest

from ragcache.config import RouteSettings
from ragcache.engine.messages import RequestMetrics
from ragcache.engine.route import PRIOR_G, CostModel, Router, RouteInputs, host_class
from ragcache.quality.records import Calibration
from ragcache.quality.table import QualityCell, QualityTable, passage_class, prompt_class

F = (0.04, 0.25, 0.08)  # full prefill: s, s per 1k tokens, s per 1k tokens^2
B = (0.03, 0.06, 1.7)  # blend: s, s per 1k context tokens, x prefill's cost of its recomputed tokens


def _full_ttft(n: int) -> float:
    x = n / 1000
    return F[0] + F[1] * x + F[2] * x * x


def _blend_inputs(n: int, share: float = 0.2, tail: int = 30, passage: float = 500.0) -> RouteInputs:
    ctx = n - tail
    return RouteInputs(prompt_tokens=n, ctx_tokens=ctx, tail_tokens=tail, chunks=max(1, round(ctx / passage)),
                       passage_tokens=passage, recompute_tokens=int(share * ctx))


def _blend_ttft(inp: RouteInputs) -> float:
    model = CostModel(f=F, b=B, load_s={"disk": 0.0})
    return model.blend(inp)


def test_fit_recovers_full_prefill_and_blend_coefficients_from_synthetic_timings():
    full = [(n, n, _full_ttft(n)) for n in (256, 1024, 2048, 4096, 6000)]
    blends = [(_blend_inputs(n, share), _blend_ttft(_blend_inputs(n, share)) + 0.01, 0.01)
              for n, share in ((1200, 0.4), (3500, 0.2), (6000, 0.15), (5000, 0.3))]
    model = CostModel.fit(full, blends, min_blend_samples=3)
    assert model.f == pytest.approx(F, abs=1e-6)
    assert model.b == pytest.approx(B, abs=1e-6)  # the measured load seconds are taken out before the fit
    assert model.full_samples == 5 and model.blend_samples == 4


def test_fit_ties_attention_to_linear_work_with_one_length_and_prices_blend_by_the_prior():
    model = CostModel.fit([(512, 512, 0.2), (512, 512, 0.2)], [])
    f0, f1, f2 = model.f
    assert f2 == pytest.approx(0.3 * f1) and model.full(512, 512) == pytest.approx(0.2, rel=1e-6)
    assert model.b[2] == PRIOR_G and model.blend_samples == 0
    assert "conservative prior" in model.describe()
    with pytest.raises(ValueError, match="at least one measured full prefill"):
        CostModel.fit([], [])


def _router(**settings) -> Router:
    router = Router(RouteSettings(**settings), host="cpu-avx2")
    for n in (256, 1024, 2048, 4096, 6000):
        router.add_full(n, n, _full_ttft(n))
    return router


def _long_ok() -> QualityTable:
    cell = QualityCell("long", "long", 8, 6000, 600, 0.75, 0.9, 0.02, 0.1, -0.01, 0.0, 0.0, True, "gold NLL -1.0%")
    bad = QualityCell("short", "short", 8, 1300, 130, 0.25, 0.6, 0.04, 0.05, 0.13, 0.0, 0.0, False, "gold NLL +13%")
    return QualityTable([cell, bad])


def test_blend_is_chosen_exactly_when_the_predicted_speedup_reaches_route_min_speedup():
    inp = _blend_inputs(6000, 0.15, passage=600)
    router = _router()
    speedup = router.model.full(6000, 6000) / router.model.blend(inp)
    above = Router(RouteSettings(min_speedup=speedup * 0.999), "cpu-avx2")
    below = Router(RouteSettings(min_speedup=speedup * 1.001), "cpu-avx2")
    for r in (above, below):
        for n in (256, 1024, 2048, 4096, 6000):
            r.add_full(n, n, _full_ttft(n))
    yes, no = above.decide(inp, _long_ok()), below.decide(inp, _long_ok())
    assert (yes.mode, yes.rule) == ("blend", "faster") and "calibrated" in yes.reason
    assert (no.mode, no.rule) == ("full", "slower")
    assert f"below route.min_speedup {speedup * 1.001:g}" in no.reason and "6,000-token prompt" in no.reason
    assert yes.predicted_speedup == pytest.approx(speedup)


def test_quality_gate_sends_a_class_the_table_fails_to_full_prefill_whatever_the_speed():
    router = _router(min_speedup=0.01)
    short = _blend_inputs(1300, 0.4, passage=130)
    route = router.decide(short, _long_ok())
    assert (route.mode, route.rule) == ("full", "quality")
    assert "gold NLL +13%" in route.reason and "calibrated" in route.reason


def test_prior_gate_blends_only_over_passages_of_route_min_passage_tokens():
    router = _router(min_speedup=0.01, min_passage_tokens=400)
    at = router.decide(_blend_inputs(3000, passage=400), None)
    under = router.decide(_blend_inputs(3000, passage=399), None)
    assert at.mode == "blend" and "prior" in at.reason
    assert (under.mode, under.rule) == ("full", "quality") and "route.min_passage_tokens = 400" in under.reason


def test_a_stale_quality_table_is_not_used_and_the_reason_says_why():
    router = _router(min_speedup=0.01)
    stale = "the index's quality table was measured under other settings (engine.dtype = 'float32')"
    route = router.decide(_blend_inputs(1300, passage=130), None, stale=stale)
    assert route.rule == "quality" and stale in route.reason and "prior" in route.reason


def test_no_chunks_means_full_prefill_and_the_decision_costs_under_5_ms():
    router = _router()
    inp = RouteInputs(prompt_tokens=40, ctx_tokens=0, tail_tokens=40, chunks=0, passage_tokens=0.0,
                      recompute_tokens=0)
    assert router.decide(inp, None).rule == "no_context"
    t0 = time.perf_counter()
    routes = [router.decide(_blend_inputs(6000, passage=600), _long_ok()) for _ in range(200)]
    assert (time.perf_counter() - t0) / 200 < 0.005
    assert max(r.decide_s for r in routes) < 0.005
    assert router.decisions[("blend", "faster")] == 200


def test_no_measured_prefill_routes_to_full_prefill():
    router = Router(RouteSettings(), "cpu")
    route = router.decide(_blend_inputs(6000, passage=600), None)
    assert (route.mode, route.rule) == ("full", "slower") and route.full_s is None


def test_predicted_budget_follows_the_ratio_or_recent_adaptive_blends():
    router = _router()
    args = dict(ratio=0.15, min_tokens=384, max_ratio=0.5, max_tokens=768)
    assert router.recompute_tokens(6000, 6030, adaptive=False, **args) == 900
    assert router.recompute_tokens(1000, 1030, adaptive=False, **args) == 384  # the floor
    assert router.recompute_tokens(6000, 6030, adaptive=True, **args) == 900  # upper bound: max(ratio's, 768)
    assert router.recompute_tokens(1300, 1330, adaptive=True, **args) == 650  # 0.5 x 1300
    for budget in (300, 400, 500):  # three adaptive blends of the short class measured
        router.observe(_metrics(prompt_tokens=1330, ctx_tokens=1300, recompute_budget=budget,
                                budget_reason="adaptive: ..."))
    router.observe(_metrics(prompt_tokens=1330, ctx_tokens=1300, recompute_budget=1300))  # a fixed budget: not counted
    assert router.recompute_tokens(1300, 1330, adaptive=True, **args) == 400


def _metrics(**fields):
    base = dict(mode="blend", ttft_s=0.5, load_s=0.01, load_error="", prompt_tokens=6030, ctx_tokens=6000,
                num_cached_tokens=6000, recompute_budget=900, recomputed_tokens=900, missing_computed_tokens=0,
                chunk_tiers=["cpu"] * 10, budget_reason="ratio 0.15")
    base.update(fields)
    return RequestMetrics(**base)  # the record the engine hands Router.observe


def test_observed_requests_refit_the_model_and_remember_the_tier_of_each_chunk():
    router = _router(min_blend_samples=3)
    assert router.model.blend_samples == 0
    keys = [f"k{i}" for i in range(10)]
    for _ in range(3):
        router.observe(_metrics(chunk_tiers=["disk"] * 5 + ["cpu"] * 5), keys)
    router.observe(_metrics(mode="full", ttft_s=9.0, prompt_tokens=8000, num_cached_tokens=0))
    assert router.model.blend_samples == 3 and router.model.full_samples == 6
    # five chunks last served from disk, one from RAM, one never seen (priced as a disk read)
    assert router.tier_tokens(keys[:6] + ["unseen"], [100] * 7) == {"disk": 600, "cpu": 100}
    router.observe(_metrics(missing_computed_tokens=600, chunk_tiers=["computed"] * 10), keys)
    assert router.model.blend_samples == 3  # a blend that computed missing chunks is not a blend's price
    assert router.tier_tokens(keys[:2], [100, 100]) == {"cpu": 200}  # computed chunks are stored now


def test_host_class_names_the_fastest_matrix_unit():
    assert host_class("cpu", ("avx2", "avx512f", "amx_bf16")) == "cpu-amx"
    assert host_class("cpu", ("avx2", "avx512f", "avx512_bf16")) == "cpu-avx512_bf16"
    assert host_class("cpu", ("avx2",)) == "cpu-avx2"
    assert host_class("cuda:0", ()) == "cuda"


def test_classes_and_the_quality_table_round_trip_through_a_calibration_record():
    assert [prompt_class(n) for n in (1300, 2500, 3500, 5000, 6000)] == ["short", "mid", "mid", "long", "long"]
    assert [passage_class(n) for n in (130, 200, 330, 400, 600)] == ["short", "mid", "mid", "long", "long"]
    table = _long_ok()
    cal = Calibration(ratio=0.15, max_kl=0.05, selection="question", model_fingerprint="m", n=8, source="probes",
                      full_ttft_median_s=1.0, quality=table.to_list())
    from dataclasses import asdict
    again = Calibration.from_dict(asdict(cal)).quality_table
    assert again == table and again.cell("long", "long").passes and again.cell("mid", "long") is None


def test_blends_of_one_length_scale_the_prior_instead_of_splitting_costs_they_cannot_tell_apart():
    full = [(n, n, _full_ttft(n)) for n in (256, 1024, 2048, 4096)]
    prior = CostModel.fit(full, [])
    inp = _blend_inputs(2000, 0.3)
    measured = [(inp, 2 * prior.blend(inp) + 0.05, 0.05)] * 3  # every blend took twice the prior's price
    model = CostModel.fit(full, measured, min_blend_samples=3)
    assert model.b == pytest.approx(tuple(2 * c for c in prior.b))
    long = _blend_inputs(6000, 0.15)
    assert model.blend(long) == pytest.approx(2 * prior.blend(long))  # extrapolated with the prior's shape


def test_a_class_the_index_did_not_measure_takes_its_passages_verdict_at_the_nearest_prompt_length():
    router = _router(min_speedup=0.01, min_passage_tokens=0)  # the prior alone would blend
    failing = QualityTable([QualityCell("short", "long", 3, 2200, 450, 0.0, 0.55, 0.02, 0.1, None, 0.0, 0.0, False,
                                        "answers agree with full prefill's at Rouge-L 0.55")])
    route = router.decide(_blend_inputs(5600, passage=460), failing)
    assert (route.mode, route.rule) == ("full", "quality")
    assert "Rouge-L 0.55" in route.reason and "calibrated on short prompts with these passages" in route.reason
    assert failing.nearest("long", "short") is None  # other passages: the prior decides
    assert router.decide(_blend_inputs(5600, passage=130), failing).mode == "blend"
    two = QualityTable([*failing.cells, QualityCell("mid", "long", 3, 3500, 450, 0.5, 0.9, 0.02, 0.1, None, 0.0, 0.0,
                                                    True, "ok")])
    assert two.nearest("long", "long").prompt_class == "mid"  # nearer than short
