"""``"auto"`` (the default ``engine.mode``; asked per request here, as the shared test engine blends by
default) through the SDK on the real engine: the route reported is the path that ran, an explicit
mode overrides it, ``ragcache calibrate`` writes the per-class quality table that
auto then routes by, and a table measured under other settings is reported and not used."""

from __future__ import annotations

import json

import pytest

from ragcache.config import RouteSettings
from tests.conftest import ZORBIA_DOCS

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of Zorbia?"


@pytest.fixture(scope="module")
def rag(engine, engine_settings, tmp_path_factory):
    from ragcache.pipeline import RAGPipeline

    folder = tmp_path_factory.mktemp("docs")
    for name, text in ZORBIA_DOCS.items():
        (folder / name).write_text(text)
    settings = engine_settings.model_copy(deep=True)
    settings.ingest.index_dir = tmp_path_factory.mktemp("indexes")
    pipe = RAGPipeline(settings, "auto", engine)
    assert pipe.ingest([folder]).chunks_added == len(ZORBIA_DOCS)
    return pipe


def _route(engine, monkeypatch, **settings) -> None:
    monkeypatch.setattr(engine.router, "settings", RouteSettings(**settings))


def test_auto_blends_where_quality_and_speed_pass_and_the_route_is_the_path_that_ran(rag, engine, monkeypatch):
    assert engine.router.model is not None  # the start-up measurement priced full prefill on this host
    _route(engine, monkeypatch, min_speedup=0.01, min_passage_tokens=0)
    a = rag.query(QUESTION, top_k=2, mode="auto")
    m = a.metrics
    assert (m.route, m.route_rule, m.mode) == ("blend", "faster", "blend")
    assert m.route_reason.startswith("blend: predicted") and "prior" in m.route_reason
    assert m.reused_tokens > 0 and len(m.chunk_tiers) == 2 and all(s.tier for s in a.sources)
    assert m.recompute_ratio is not None and m.ratio_source == "settings"


def test_auto_takes_full_prefill_below_the_quality_gate_or_the_speed_target_and_reuses_nothing(
        rag, engine, monkeypatch):
    _route(engine, monkeypatch, min_speedup=0.01, min_passage_tokens=10_000)
    a = rag.query(QUESTION, top_k=2, mode="auto")
    m = a.metrics
    assert (m.route, m.route_rule, m.mode) == ("full", "quality", "full")
    assert "route.min_passage_tokens = 10000" in m.route_reason
    assert m.reused_tokens == m.recomputed_tokens == m.num_cached_tokens == 0 and m.chunk_tiers == []
    assert [s.tier for s in a.sources] == ["", ""] and m.recompute_ratio is None and m.ratio_source == ""
    _route(engine, monkeypatch, min_speedup=1000.0, min_passage_tokens=0)
    m = rag.query(QUESTION, top_k=2, mode="auto").metrics
    assert (m.route, m.route_rule) == ("full", "slower") and "below route.min_speedup 1000" in m.route_reason
    assert m.reused_tokens == 0
    streamed = list(rag.stream(QUESTION, top_k=2, mode="auto"))[-1].metrics  # the stream takes the same route
    assert (streamed.route, streamed.route_rule, streamed.reused_tokens) == ("full", "slower", 0)


def test_an_explicit_mode_overrides_auto(rag, engine, monkeypatch):
    _route(engine, monkeypatch, min_speedup=0.01, min_passage_tokens=10_000)  # auto would take full prefill
    m = rag.query(QUESTION, top_k=2, mode="blend").metrics
    assert (m.route, m.route_rule, m.mode) == ("blend", "explicit", "blend") and m.reused_tokens > 0
    assert m.route_reason == "blend: asked by the request"
    _route(engine, monkeypatch, min_speedup=0.01, min_passage_tokens=0)  # auto would blend
    m = rag.query(QUESTION, top_k=2, mode="full").metrics
    assert (m.route, m.route_rule, m.mode) == ("full", "explicit", "full") and m.reused_tokens == 0


def test_calibrate_writes_the_quality_table_auto_routes_by_it_and_a_stale_one_is_reported_not_used(
        rag, engine, monkeypatch):
    from ragcache.calibrate import calibrate, probe_questions
    from ragcache.index.folder import CALIBRATION
    from ragcache.quality.records import write_calibration
    from ragcache.quality.table import passage_class, prompt_class

    questions = probe_questions(list(rag.retriever.index.chunks()), 2)
    cal = calibrate(rag, questions, ratios=[0.5], max_tokens=4, quality_top_ks=[2])
    table = cal.quality_table
    assert table is not None and table.cells and sum(c.n for c in table.cells) == 2
    write_calibration(rag.index_path, cal)
    assert rag.index_quality().table == table and rag.index_quality().note == ""

    _route(engine, monkeypatch, min_speedup=0.01, min_passage_tokens=0)  # the prior alone would blend
    prompt = rag.prepare(QUESTION, rag_options(top_k=2)).prompt
    cell = table.cell(prompt_class(len(prompt.token_ids)),
                      passage_class(sum(s.length for s in prompt.segments[1:]) / 2))
    assert cell is not None  # the question's class was measured
    m = rag.query(QUESTION, top_k=2, mode="auto").metrics
    assert m.route == ("blend" if cell.passes else "full") and m.route_reason.endswith("; calibrated)")
    assert cell.why in m.route_reason

    path = rag.index_path / CALIBRATION  # the same record, measured on another kind of host
    data = json.loads(path.read_text())
    for entry in data.values():
        entry["settings"]["host"] = "cpu-elsewhere"
    path.write_text(json.dumps(data))
    stale = rag.index_quality()
    assert stale.table is None and "host = " in stale.note and "cpu-elsewhere" in stale.note
    m = rag.query(QUESTION, top_k=2, mode="auto").metrics
    assert (m.route, m.route_rule) == ("blend", "faster")  # the prior, which passes at min_passage_tokens 0
    assert "measured under other settings" in m.route_reason and not m.route_reason.endswith("; calibrated)")


def rag_options(**fields):
    from ragcache.options import QueryOptions

    return QueryOptions(**fields)
