"""Per-index calibration (ragcache.calibrate, `ragcache calibrate`) and blend.recompute_ratio = "auto"."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ragcache.calibrate import Calibration, RatioScore, probe_questions, read_calibration, write_calibration
from ragcache.chunks import Chunk


def chunk(text: str) -> Chunk:
    return Chunk(text[:8], "d", "", 0, text, (1, 2, 3))


def cal(fp: str, ratio: float | None, selection: str = "question") -> Calibration:
    return Calibration(ratio=ratio, max_kl=0.05, selection=selection, model_fingerprint=fp, n=3, source="probes",
                       full_ttft_median_s=1.0, scores=[RatioScore(0.1, 0.02, 0.01, 0.3, True)], created="now")


def test_calibration_round_trips_per_model_and_selection(tmp_path):
    assert read_calibration(tmp_path, "fp", "question") is None
    write_calibration(tmp_path, cal("fp", 0.1))
    write_calibration(tmp_path, cal("other", None))
    write_calibration(tmp_path, cal("fp", 0.3, selection="deviation"))
    assert read_calibration(tmp_path, "fp", "question") == cal("fp", 0.1)
    assert read_calibration(tmp_path, "other", "question").ratio is None
    assert read_calibration(tmp_path, "fp", "deviation").ratio == 0.3
    (tmp_path / "calibration.json").write_text("{not json")
    assert read_calibration(tmp_path, "fp", "question") is None  # unreadable: ignored with a warning


def test_the_recomputed_share_is_kept_and_shows_when_the_floor_raised_a_ratio(tmp_path, capsys):
    from app.calibrate_cmd import print_calibration

    scores = [RatioScore(0.05, 0.09, 0.2, 0.8, False, speedup=2.9, good=False, recomputed_share=0.182),
              RatioScore(0.15, 0.09, 0.2, 0.8, False, speedup=2.9, good=False, recomputed_share=0.182),
              RatioScore(0.3, 0.03, 0.04, 1.1, True, speedup=2.1, good=True, recomputed_share=0.301)]
    record = Calibration(ratio=0.3, max_kl=0.05, selection="question", model_fingerprint="fp", n=3, source="probes",
                         full_ttft_median_s=2.3, scores=scores, created="now")
    write_calibration(tmp_path, record)
    assert read_calibration(tmp_path, "fp", "question") == record
    assert [s.raised_by_floor for s in scores] == [True, True, False]
    assert not RatioScore(0.1, 0.1, None, 1.0, False).raised_by_floor  # a record from before the field: unknown
    print_calibration(record, 384)
    out = capsys.readouterr().out
    assert "recomputed" in out.splitlines()[0]
    assert [line.split()[1] for line in out.splitlines()[1:4]] == ["18.2%", "18.2%", "30.1%"]
    assert "blend.min_recompute_tokens (384 tokens) set a floor" in out and "noisy" not in out
    print_calibration(dataclasses.replace(record, n=1), 384)  # one prompt: the verdict is called noisy
    out = capsys.readouterr().out
    assert "over 1 probe;" in out and "note: measured on 1 prompt only" in out
    print_calibration(cal("fp", 0.1))  # no share recorded: a dash, no floor line
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[1] == "-" and "min_recompute_tokens" not in out and "whole context" not in out


def test_a_ratio_over_the_whole_context_is_marked_and_never_meets(capsys):
    from app.calibrate_cmd import print_calibration

    # contexts under the floor: every ratio recomputes all of them, and load noise made one look 2x sooner
    scores = [RatioScore(0.05, 0.0, 0.0, 0.5, False, speedup=2.0, good=True, recomputed_share=1.0),
              RatioScore(0.15, 0.0, 0.0, 1.0, False, speedup=1.0, good=True, recomputed_share=0.9995)]
    assert all(s.whole_context for s in scores) and not RatioScore(0.9, 0, 0, 1, False, recomputed_share=0.99).whole_context
    assert not RatioScore(0.1, 0.1, None, 1.0, False).whole_context  # a record from before the field: unknown
    print_calibration(Calibration(ratio=None, max_kl=0.05, selection="question", model_fingerprint="fp", n=3,
                                  source="probes", full_ttft_median_s=1.0, scores=scores, created="now",
                                  recommendation="full", reason="every ratio tried recomputes the whole context"))
    out = capsys.readouterr().out
    assert "100%: the ratio recomputed the whole context" in out and "recommendation: full prefill" in out


def test_under_the_adaptive_budget_each_centre_ratio_gets_a_row_and_the_cheapest_candidate_is_recorded(capsys):
    from app.calibrate_cmd import print_calibration
    from ragcache.calibrate import _cheapest

    def score(ratio, mass, meets, share):
        return RatioScore(ratio, 0.01, 0.0, 1.0, meets, speedup=2.0, good=meets, recomputed_share=share,
                          mass_left=mass)

    # per centre ratio the largest threshold that meets is its candidate; the least recomputing candidate wins
    scores = [score(0.1, 0.05, False, 0.12), score(0.1, 0.02, True, 0.31),
              score(0.3, 0.05, True, 0.22), score(0.3, 0.02, True, 0.35)]
    assert _cheapest(scores) is scores[2]
    assert _cheapest(scores[:2]) is scores[1] and _cheapest(scores[:1]) is None
    fixed = [RatioScore(0.1, 0.2, 0.2, 1.0, False), RatioScore(0.2, 0.0, 0.0, 1.0, True, recomputed_share=0.5),
             RatioScore(0.3, 0.0, 0.0, 1.0, True, recomputed_share=0.3)]
    assert _cheapest(fixed) is fixed[1]  # a fixed budget: the smallest ratio that meets, as before
    record = Calibration(ratio=0.3, mass_left=0.05, max_kl=0.05, selection="question", model_fingerprint="fp", n=3,
                         source="probes", full_ttft_median_s=1.0, scores=scores, created="now")
    print_calibration(record)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["ratio", "mass_left"]
    assert [line.split()[:2] for line in lines[1:5]] == [["0.1", "0.05"], ["0.1", "0.02"], ["0.3", "0.05"], ["0.3", "0.02"]]
    assert "around the ratio of its row" in lines[5]
    print_calibration(dataclasses.replace(record, scores=scores[2:]))  # one centre: no ratio column
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "mass_left" and "around ratio 0.3;" in lines[3]


def test_calibrate_ratios_are_given_or_left_to_the_budget():
    from app.calibrate_cmd import _check
    from app.cli import build_parser

    parser = build_parser()
    assert _check(parser.parse_args(["calibrate"])) is None  # fixed: the default grid; adaptive: the settings' ratio
    assert _check(parser.parse_args(["calibrate", "--ratios", "0.3"])) == [0.3]
    assert _check(parser.parse_args(["calibrate", "--ratios", "0.3,0.1,0.3"])) == [0.1, 0.3]


def test_probe_questions_are_seeded_and_about_the_chunks():
    chunks = [chunk(f"Passage {i} tells of the river number {i} and its bridges.") for i in range(10)]
    a, b = probe_questions(chunks, 4, seed=1), probe_questions(chunks, 4, seed=1)
    assert a == b and len(a) == 4 and a != probe_questions(chunks, 4, seed=2)
    assert all(q.startswith("What do the documents say about Passage") for q in a)
    many = probe_questions(chunks, 11)  # more probes than chunks: then the next words of each chunk
    assert len(many) == 11 and set(probe_questions(chunks, 10)) == set(many[:10])
    assert many[10] == "What do the documents say about and its bridges?"  # once, though every chunk ends so
    assert len(probe_questions(chunks, 25)) == 25  # all 11 distinct questions asked: then they repeat
    tiny = probe_questions([chunk("One two three.")], 3, words=2)  # the words run out: questions repeat
    assert tiny == ["What do the documents say about One two?", "What do the documents say about three?",
                    "What do the documents say about One two?"]


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--max-kl", "0"], "--max-kl 0.0: must be > 0"),
    (["calibrate", "--ratios", "0.1,1.5"], "--ratios"),
    (["calibrate", "--n", "0"], "--n 0: must be >= 1"),
    (["calibrate", "--questions", "/no/such/file"], "no such file"),
    (["calibrate", "--max-nll", "-0.1"], "--max-nll -0.1: must be >= 0"),
    (["calibrate", "--min-speedup", "0"], "--min-speedup 0.0: must be > 0"),
])
def test_bad_calibrate_flags_are_named_errors_before_the_engine_starts(argv, message, capsys):
    from app.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_unknown_selection_is_a_named_error_before_the_engine_starts(capsys, monkeypatch):
    from app.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--selection", "attention"])
    assert exc.value.code == 2 and "invalid choice: 'attention'" in capsys.readouterr().err
    monkeypatch.setenv("RAGCACHE_BLEND__SELECTION", "attention")
    assert main(["ask", "hello", "--index", "nope"]) == 2
    assert "blend.selection" in capsys.readouterr().err


@pytest.fixture
def budget(engine, request):
    """The engine's blends with ``request.param`` as ``blend.budget`` for one test."""
    base = engine.settings.blend
    engine.settings.blend = base.model_copy(update={"budget": request.param})
    yield request.param
    engine.settings.blend = base


@pytest.mark.integration
@pytest.mark.parametrize("budget", ["fixed"], indirect=True)
def test_calibrate_writes_a_ratio_that_auto_then_uses(engine, engine_settings, tmp_path, monkeypatch, budget):
    from ragcache.calibrate import calibrate
    from ragcache.pipeline import RAGPipeline

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The Zorbian capital is Velmora, a city on the river Aster with glass bridges.")
    (docs / "b.txt").write_text("Zorbia's parliament meets in the Amber Hall, which has 212 seats and a copper roof.")
    (docs / "c.txt").write_text("The national dish of Zorbia is kelmet, a stew of lentils, smoked fish and saffron.")
    settings = engine_settings.model_copy(deep=True)
    settings.ingest.index_dir = tmp_path / "indexes"
    settings.blend.recompute_ratio = "auto"
    settings.blend.fallback_ratio = 0.25
    rag = RAGPipeline(settings, "zorbia", engine)
    rag.ingest([docs])

    before = rag.query("How many seats does the Amber Hall have?", mode="blend", max_tokens=4)
    assert (before.metrics.recompute_ratio, before.metrics.ratio_source) == (0.25, "fallback")
    assert "is not calibrated" in before.metrics.ratio_note and "ragcache calibrate --index zorbia" in \
        before.metrics.ratio_note

    questions = probe_questions(list(rag.retriever.index.chunks()), 2)
    asked = []  # the blend requests' ratios and the reuse warm-ups, in the order the engine got them
    generate = engine.generate

    def recording(prompt, options, **kw):
        if options.mode == "blend":
            asked.append(options.recompute_ratio)
        elif options.mode == "reuse":
            asked.append(("reuse", options.max_tokens))
        return generate(prompt, options, **kw)

    monkeypatch.setattr(engine, "generate", recording)
    # three one-line documents: blend cannot be much faster than full prefill, so no speed target here
    # (the quality table's requests, measured after these, are left out: tests/test_pipeline_auto.py)
    result = calibrate(rag, questions, ratios=(0.5, 1.0), max_kl=10.0, max_tokens=4, min_speedup=0.01,
                       quality_top_ks=None)
    # per question an untimed one-token reuse reads the chunk KV first, then the ratios, rotated
    assert asked == [("reuse", 1), 0.5, 1.0, ("reuse", 1), 1.0, 0.5]
    monkeypatch.undo()
    assert [s.ratio for s in result.scores] == [0.5, 1.0]
    assert result.scores[-1].kl_mean <= 1e-3 and result.scores[-1].good  # ratio 1 answers as full prefill does
    assert result.scores[-1].recomputed_share == 1.0 and 0.4 <= result.scores[0].recomputed_share < 1.0
    # ... but recomputes the whole context: full prefill through the blend's path, never recorded
    assert result.scores[-1].whole_context and not result.scores[-1].meets and not result.scores[0].whole_context
    assert result.recommendation == "blend" and all(s.speedup > 0 for s in result.scores) and result.scores[0].meets
    slow = calibrate(rag, questions, ratios=(0.5,), max_kl=10.0, max_tokens=4, min_speedup=50.0)
    assert slow.scores[0].good and not slow.scores[0].meets  # good enough, but not 50x faster
    assert slow.ratio is None and slow.recommendation == "full" and "faster than full prefill" in slow.reason
    whole = calibrate(rag, questions[:1], ratios=(1.0,), max_kl=10.0, max_tokens=4, min_speedup=0.01)
    assert whole.scores[0].good and not whole.scores[0].meets and whole.recommendation == "full"
    assert "recomputes the whole context" in whole.reason and whole.ratio is None
    assert "no longer than blend.min_recompute_tokens" not in whole.reason  # ratio 1 is not the floor's doing
    assert result.ratio == 0.5 and result.model_fingerprint == engine.llm_info.fingerprint
    path = write_calibration(rag.index_path, result)
    assert json.loads(path.read_text())  # in the index folder

    after = rag.query("How many seats does the Amber Hall have?", mode="blend", max_tokens=4)
    assert (after.metrics.recompute_ratio, after.metrics.ratio_source) == (result.ratio, "calibration")
    assert after.metrics.ratio_note == ""
    # the record keeps what it was measured under; a change to one of those settings voids it
    assert result.settings["blend.granule"] == engine.settings.blend.granule
    assert result.settings["engine.dtype"] == engine.dtype.dtype and "blend.recompute_depth" in result.settings
    assert result.settings["prompt.kv_context_tokens"] == engine.settings.prompt.kv_context_tokens
    monkeypatch.setattr(engine.settings.blend, "granule", 2 * engine.settings.blend.granule)
    assert rag.calibration() is None and rag.calibration_changes() == [
        f"blend.granule = {engine.settings.blend.granule} (calibrated with {result.settings['blend.granule']})"]
    stale = rag.query("How many seats does the Amber Hall have?", mode="blend", max_tokens=4)
    assert (stale.metrics.recompute_ratio, stale.metrics.ratio_source) == (0.25, "fallback")
    assert "measured under other settings (blend.granule = " in stale.metrics.ratio_note
    assert "ragcache calibrate --index zorbia" in stale.metrics.ratio_note
    monkeypatch.undo()
    assert rag.calibration() == result and rag.calibration_changes() == []
    other = 1.0 if result.ratio == 0.5 else 0.5
    settings.blend.recompute_ratio = other  # a number as set, against the calibration
    as_set = rag.query("How many seats does the Amber Hall have?", mode="blend", max_tokens=4)
    assert as_set.metrics.ratio_source == "settings"
    assert f"calibrated to ratio {result.ratio:g}" in as_set.metrics.ratio_note
    assert as_set.to_dict()["metrics"]["ratio_note"] == as_set.metrics.ratio_note  # what the server sends
    settings.blend.recompute_ratio = "auto"
    explicit = rag.query("How many seats does the Amber Hall have?", mode="blend", max_tokens=4, recompute_ratio=0.1)
    assert (explicit.metrics.recompute_ratio, explicit.metrics.ratio_source) == (0.1, "request")

    (docs / "d.txt").write_text("Zorbian children learn the seven-string harp from the age of five.")
    assert rag.ingest([docs]).chunks_added == 1  # a new version of the index keeps its calibration
    assert read_calibration(rag.index_path, engine.llm_info.fingerprint, settings.blend.selection) == result


@pytest.mark.integration
@pytest.mark.parametrize("budget", ["adaptive"], indirect=True)
def test_calibrate_fits_the_adaptive_budget_threshold_that_auto_then_uses(engine, tmp_path, monkeypatch, budget):
    from ragcache.calibrate import calibrate, probe_questions
    from ragcache.pipeline import RAGPipeline

    assert engine.settings.blend.adapts()  # adaptive budget, question selection
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, fact in enumerate(["The Zorbian capital is Velmora, a city on the river Aster with glass bridges.",
                              "Zorbia's parliament meets in the Amber Hall, which has 212 seats and a copper roof.",
                              "The national dish of Zorbia is kelmet, a stew of lentils, smoked fish and saffron."]):
        (docs / f"{i}.txt").write_text(fact)
    settings = engine.settings.model_copy(deep=True)
    settings.ingest.index_dir = tmp_path / "indexes"
    settings.blend.recompute_ratio = "auto"
    rag = RAGPipeline(settings, "zorbia", engine)
    rag.ingest([docs])
    questions = probe_questions(list(rag.retriever.index.chunks()), 2)
    cal = calibrate(rag, questions, masses=(0.3, 0.001), max_kl=10.0, max_nll_rel=10.0, max_tokens=4,
                    min_speedup=0.01)
    # the thresholds are tried cheapest first, around the settings' ratio; the tighter recomputes more
    assert [s.mass_left for s in cal.scores] == [0.3, 0.001]
    assert {s.ratio for s in cal.scores} == {settings.blend.fallback_ratio}
    assert cal.scores[0].recomputed_share < cal.scores[1].recomputed_share
    # the largest threshold that meets the (loose) targets is recorded with its ratio
    assert cal.scores[0].meets and (cal.ratio, cal.mass_left) == (settings.blend.fallback_ratio, 0.3)
    assert cal.settings["blend.budget"] == "adaptive" and "blend.max_recompute_ratio" in cal.settings
    write_calibration(rag.index_path, cal)
    after = rag.query("How many seats does the Amber Hall have?", mode="blend", max_tokens=4)
    assert after.metrics.ratio_source == "calibration" and "(target 0.3)" in after.metrics.budget_reason
    asked = rag.query("How many seats does the Amber Hall have?", mode="blend", max_tokens=4, mass_left=0.05)
    assert "(target 0.05)" in asked.metrics.budget_reason  # a request's own threshold wins

    # ratios given (`calibrate --ratios`): the budgets are centred on them, each with every threshold
    blends = []
    generate = engine.generate

    def recording(prompt, options, **kw):
        if options.mode == "blend":
            blends.append((options.recompute_ratio, options.mass_left, options.budget))
        return generate(prompt, options, **kw)

    monkeypatch.setattr(engine, "generate", recording)
    centred = calibrate(rag, questions[:1], ratios=(0.5, 0.3), masses=(0.3,), max_kl=10.0, max_nll_rel=10.0,
                        max_tokens=4, min_speedup=0.01, quality_top_ks=None)
    monkeypatch.undo()
    assert [(s.ratio, s.mass_left) for s in centred.scores] == [(0.3, 0.3), (0.5, 0.3)]
    assert sorted(set(blends)) == [(0.3, 0.3, "adaptive"), (0.5, 0.3, "adaptive")]
    meeting = [s for s in centred.scores if s.meets]
    assert meeting and (centred.ratio, centred.mass_left) == (min(meeting, key=lambda s: s.recomputed_share).ratio, 0.3)
    assert f"around ratio {centred.ratio:g}" in centred.reason


def test_the_ratio_note_says_when_a_blend_ratio_goes_against_the_index_calibration(monkeypatch):
    from ragcache.pipeline import RAGPipeline

    rag = RAGPipeline.__new__(RAGPipeline)  # no engine or index needed: only the calibration is read
    rag.index_name = "docs"
    full = Calibration(ratio=None, max_kl=0.05, selection="question", model_fingerprint="fp", n=3, source="probes",
                       full_ttft_median_s=1.0, scores=[], created="now", recommendation="full",
                       reason="no ratio tried answers like full prefill")
    found = {"cal": full, "changes": []}
    monkeypatch.setattr(rag, "calibration", lambda: found["cal"])
    monkeypatch.setattr(rag, "calibration_changes", lambda: found["changes"])
    note = rag.ratio_note("settings", 0.15)
    assert note.startswith("the calibration of index docs recommends full prefill (no ratio tried")
    assert "blend.recompute_ratio = 0.15 as set" in note
    assert "blend.fallback_ratio = 0.15" in rag.ratio_note("fallback", 0.15)
    for source in ("calibration", "request", ""):  # auto read it, or the request chose
        assert rag.ratio_note(source, 0.15) == ""
    found["cal"] = cal("fp", 0.3)
    assert "calibrated to ratio 0.3" in rag.ratio_note("settings", 0.15)
    assert rag.ratio_note("settings", 0.3) == ""  # the same ratio: nothing to say
    found["cal"] = None
    assert rag.ratio_note("settings", 0.15) == ""
    assert "is not calibrated" in rag.ratio_note("fallback", 0.15)
    found["changes"] = ["blend.recompute_depth = 0.9 (calibrated with 1.0)"]  # measured under other settings
    note = rag.ratio_note("fallback", 0.15)
    assert "measured under other settings (blend.recompute_depth = 0.9 (calibrated with 1.0))" in note
    assert "blend.fallback_ratio = 0.15" in note and "`ragcache calibrate --index docs`" in note
    assert rag.ratio_note("settings", 0.15) == ""  # a number as set: the stale record says nothing about it


def test_a_calibration_holds_only_under_the_settings_it_was_measured_under(tmp_path, capsys):
    from app.calibrate_cmd import print_calibration
    from ragcache.config import BlendSettings

    blend = BlendSettings()
    measured = {**blend.calibrated_settings(), "engine.dtype": "float32"}
    assert measured["blend.check_layer"] == 0  # "auto" resolved for question selection
    assert "blend.question_weight" not in measured and "blend.deviation" not in measured  # not read by question
    record = dataclasses.replace(cal("fp", 0.2), settings=measured)
    write_calibration(tmp_path, record)
    back = read_calibration(tmp_path, "fp", "question")
    assert back == record and back.changed(measured) == []
    assert back.changed({**measured, "engine.dtype": "bfloat16"}) == [
        "engine.dtype = 'bfloat16' (calibrated with 'float32')"]
    deeper = BlendSettings(recompute_depth=0.9, question_weight=0.1)  # the weight: not read by question selection
    assert back.changed({**deeper.calibrated_settings(), "engine.dtype": "float32"}) == [
        "blend.recompute_depth = 0.9 (calibrated with 1.0)"]
    hybrid = BlendSettings(selection="hybrid").calibrated_settings()
    assert hybrid["blend.check_layer"] == 1 and {"blend.question_weight", "blend.deviation"} <= set(hybrid)
    assert cal("fp", 0.2).changed(measured) == []  # a record from before settings were kept: cannot be checked
    print_calibration(record)
    assert "measured under min_recompute_tokens = 384, recompute_depth = 1.0" in capsys.readouterr().out


def test_ask_prints_the_ratio_note_once_on_stderr():
    from types import SimpleNamespace

    from app.ask_cmd import note_line

    assert note_line(SimpleNamespace(ratio_note="", load_error="")) == ""
    assert note_line(SimpleNamespace(ratio_note="the index x is calibrated to ratio 0.3", load_error="")) == \
        "note: the index x is calibrated to ratio 0.3"
