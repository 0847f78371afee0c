"""The engine's typed seam and the connector's scheduler half, without a model.

The scheduler half of RagcacheConnector is plain bookkeeping over vLLM's request and scheduler
objects; here those are minimal stand-ins carrying only the attributes the connector reads (the
full path through a real engine is covered by tests/test_engine_blend.py).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from ragcache.config import BlendSettings
from ragcache.engine.connector import RagcacheConnector, RagcacheConnectorMetadata, RagcacheWorkerMetadata
from ragcache.engine.messages import (
    TRANSFER_KEY,
    BlendParams,
    ContextStats,
    LoadRequest,
    RequestMetrics,
    Rpc,
    SegmentRef,
)
from ragcache.engine.worker import RagcacheWorkerExtension
from ragcache.options import QueryOptions
from ragcache.strategies import Selection

SEGMENTS = (SegmentRef("head", 0, 10), SegmentRef("c1", 10, 20), SegmentRef("c2", 30, 15))


def params(mode="blend", **kw) -> BlendParams:
    return BlendParams.from_options(BlendSettings(), QueryOptions(**kw), mode=mode, ctx_len=45, lead_in_len=10,
                                    segments=SEGMENTS)


def request(req_id: str, p: BlendParams | None, n_prompt: int = 60):
    kv = {TRANSFER_KEY: p.to_dict()} if p is not None else None
    return SimpleNamespace(request_id=req_id, kv_transfer_params=kv, num_prompt_tokens=n_prompt,
                           prompt_token_ids=list(range(n_prompt)))


def scheduler_connector(**extra) -> RagcacheConnector:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
                             cache_config=SimpleNamespace(block_size=16))
    return RagcacheConnector(config, KVConnectorRole.SCHEDULER, SimpleNamespace())


@pytest.fixture
def scheduler_side():
    return scheduler_connector()


def schedule(conn, *reqs):
    """Allocate and schedule ``reqs`` as new requests in one step; returns the step's metadata."""
    for r in reqs:
        n, is_async = conn.get_num_new_matched_tokens(r, 0)
        assert is_async is False
        conn.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],)), n)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=([7, 8, 9],)) for r in reqs],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
    )
    return conn.build_connector_meta(out)


def test_blend_params_round_trip_through_plain_data():
    p = params(recompute_ratio=0.3)
    d = p.to_dict()
    assert d["segments"] == [dataclasses.asdict(s) for s in SEGMENTS]
    assert BlendParams.from_dict(d) == p and p.blend.recompute_ratio == 0.3
    assert params().blend.recompute_ratio == BlendSettings().recompute_ratio  # the default lives in config
    auto = BlendParams.from_options(BlendSettings(recompute_ratio="auto", fallback_ratio=0.2), QueryOptions(),
                                    mode="blend", ctx_len=45, lead_in_len=10, segments=SEGMENTS)
    assert auto.blend.recompute_ratio == 0.2  # "auto" unresolved by the caller: the fallback
    with pytest.raises(ValueError, match="malformed"):
        BlendParams.from_dict({k: v for k, v in d.items() if k != "ctx_len"})
    # every setting has its default in config alone: the record restates none, and travels whole
    assert set(d["blend"]) == set(BlendSettings.model_fields)
    budget = ("budget", "mass_left", "max_recompute_ratio", "max_recompute_tokens")
    assert {k: d["blend"][k] for k in budget} == BlendSettings().model_dump(include=set(budget))
    for key in budget:
        with pytest.raises(ValueError, match="malformed"):
            BlendParams.from_dict({**d, "blend": {k: v for k, v in d["blend"].items() if k != key}})
    with pytest.raises(ValueError, match="modes"):
        params(mode="full")
    assert params(selection="hybrid").blend.selection == "hybrid"
    spec = params(selection="question/16").blend
    assert (spec.selection, spec.granule) == ("question", 16)
    assert params().blend.granule == BlendSettings().granule
    # the blend parameters travel as one nested record, the settings' knobs as the worker's Selection reads them
    assert d["blend"] == BlendParams.from_dict(d).blend.model_dump()
    assert BlendParams.from_dict(d).blend.token_selection == Selection.from_settings(BlendSettings())
    with pytest.raises(ValueError, match=r"(?s)malformed.*selection.*Input should be 'deviation'"):
        BlendParams.from_dict({**d, "blend": {**d["blend"], "selection": "attention"}})
    with pytest.raises(ValueError, match="malformed"):
        BlendParams.from_dict({**d, "blend": "question"})
    with pytest.raises(ValueError, match="malformed"):
        BlendParams.from_dict({**d, "selection": "question"})
    # the options were validated when they were built (tests/test_options.py); nothing here checks again
    unchecked = QueryOptions.model_construct(recompute_ratio=1.5, selection=None)
    assert BlendParams.from_options(BlendSettings(), unchecked, mode="blend", ctx_len=45, lead_in_len=10,
                                    segments=SEGMENTS).blend.recompute_ratio == 1.5


def test_metrics_round_trip_and_read_the_worker_stats_from_the_output():
    stats = ContextStats(ctx_tokens=45, reused_tokens=38, recomputed_tokens=7, chunk_tiers=["cpu", "disk"],
                         head_tier="cpu", worker_s=0.25, stages={"compute_s": 0.2})
    out = SimpleNamespace(metrics=SimpleNamespace(first_token_latency=0.5), num_cached_tokens=45,
                          outputs=[SimpleNamespace(token_ids=[1, 2, 3])],
                          kv_transfer_params={TRANSFER_KEY: stats.to_dict()})
    m = RequestMetrics.from_output(mode="blend", prompt_tokens=60, output=out, total_s=1.0, recompute_ratio=0.15)
    assert (m.ttft_s, m.num_cached_tokens, m.output_tokens, m.reused_tokens, m.worker_s) == (0.5, 45, 3, 38, 0.25)
    assert m.tier_hits == {"cpu": 1, "disk": 1} and m.to_dict()["tier_hits"] == {"cpu": 1, "disk": 1}
    assert RequestMetrics.from_dict(m.to_dict()) == m
    full = RequestMetrics.from_output(mode="full", prompt_tokens=60, output=None, total_s=1.0, recompute_ratio=0.15)
    assert full.recompute_ratio is None and full.reused_tokens == 0 and full.chunk_tiers == []
    # a DELTA stream's last output holds its last piece only: the whole answer's ids are given
    streamed = RequestMetrics.from_output(mode="blend", prompt_tokens=60, output=out, total_s=1.0,
                                          token_ids=[7, 8, 7, 8, 7, 8, 9])
    assert streamed.output_tokens == 7 and streamed.repetition_loop and not m.repetition_loop


def test_the_metrics_record_is_frozen_and_a_later_layer_adds_to_a_copy():
    m = RequestMetrics(mode="blend", ttft_s=0.5, total_s=0.6, chunk_tiers=["cpu"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.total_s = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ContextStats().load_error = "x"
    done = m.replace(retrieval_s=0.1, total_s=0.8, ratio_source="settings")
    assert (done.retrieval_s, done.total_s, done.ratio_source, done.ttft_s) == (0.1, 0.8, "settings", 0.5)
    assert (m.retrieval_s, m.total_s, m.ratio_source) == (0.0, 0.6, "")  # the engine's record is unchanged
    with pytest.raises(TypeError):
        m.replace(retrieval=0.1)


def test_an_answer_says_when_its_recomputed_tokens_stopped_before_the_last_layer():
    from app.ask_cmd import format_answer

    shallow = RequestMetrics(mode="blend", recompute_ratio=0.15, recomputed_tokens=7, recomputed_layers=27,
                             model_layers=30)
    assert shallow.partial_depth == "in 27 of 30 layers"
    answer = SimpleNamespace(text="Velmora.", sources=[], metrics=shallow)
    assert "recomputed 7 (in 27 of 30 layers) |" in format_answer(answer)
    for layers in (30, 0):  # every layer, or nothing recomputed: nothing to say
        deep = RequestMetrics(mode="blend", recomputed_tokens=7, recomputed_layers=layers, model_layers=30)
        assert deep.partial_depth == ""
        assert "recomputed 7 |" in format_answer(SimpleNamespace(text="Velmora.", sources=[], metrics=deep))
    # a short context under the recompute floor: every token recomputed at ratio 0.15, and the line says why
    short = RequestMetrics(mode="blend", recompute_ratio=0.15, recomputed_tokens=170, reused_tokens=0,
                           recomputed_layers=30, model_layers=30)
    line = format_answer(SimpleNamespace(text="Velmora.", sources=[], metrics=short))
    assert "recomputed 170 (the whole context: blend.min_recompute_tokens covers it) |" in line
    missing = dataclasses.replace(short, missing_computed_tokens=170)  # no stored KV: computed, not the floor
    assert "recomputed 170 |" in format_answer(SimpleNamespace(text="Velmora.", sources=[], metrics=missing))


def test_the_answer_line_says_where_the_ratio_came_from_and_when_max_tokens_cut_the_answer():
    from app.ask_cmd import format_answer

    m = RequestMetrics(mode="blend", recompute_ratio=0.15, ratio_source="settings", output_tokens=64)
    assert m.ratio_text == "ratio 0.15, set in blend.recompute_ratio"
    assert dataclasses.replace(m, ratio_source="").ratio_text == "ratio 0.15, as set"
    assert RequestMetrics(mode="full").ratio_text == ""
    cut = format_answer(SimpleNamespace(text="Velmora is", sources=[], metrics=m, finish_reason="length"))
    text, rest = cut.split("\n\n", 1)  # what chat prints after the streamed text starts with the cut note
    assert text == "Velmora is"
    assert rest.startswith("(cut at 64 tokens, the max_tokens limit: --max-tokens N for a longer answer)\n"
                           "Sources (in prompt order):")
    assert "mode blend (ratio 0.15, set in blend.recompute_ratio) |" in cut
    whole = format_answer(SimpleNamespace(text="Velmora.", sources=[], metrics=m, finish_reason="stop"))
    assert "cut at" not in whole and whole.split("\n\n", 1)[1].startswith("Sources (in prompt order):")


def test_a_failed_context_load_is_said_beside_the_answer_and_zeroes_the_cached_count():
    from app.ask_cmd import note_line

    stats = ContextStats(load_error="ValueError: check_layer must be in [0, 30), got 99")
    output = SimpleNamespace(metrics=None, num_cached_tokens=118, outputs=[SimpleNamespace(token_ids=[1, 2])],
                             kv_transfer_params={TRANSFER_KEY: stats.to_dict()})
    m = RequestMetrics.from_output(mode="blend", prompt_tokens=130, output=output, total_s=1.0, recompute_ratio=0.15)
    assert m.load_error == stats.load_error and m.num_cached_tokens == 0  # vLLM prefilled it all
    m = m.replace(ratio_note="the index x is calibrated to ratio 0.3")
    assert note_line(m) == ("note: the cached context could not be served (ValueError: check_layer must be in "
                            "[0, 30), got 99); full prefill answered (the engine's log has the traceback)\n"
                            "note: the index x is calibrated to ratio 0.3")
    assert note_line(m, ratio_note=False).count("note:") == 1  # chat says the ratio note once, a failure each time
    ok = dataclasses.replace(m, load_error="", ratio_note="")
    assert note_line(ok) == ""


def test_every_rpc_name_is_a_worker_extension_method():
    for name in Rpc.ALL:
        assert callable(getattr(RagcacheWorkerExtension, name)), name


def test_scheduler_claims_the_context_and_leaves_the_tail(scheduler_side):
    conn = scheduler_side
    assert conn.get_num_new_matched_tokens(request("a", params()), 0) == (45, False)
    assert conn.get_num_new_matched_tokens(request("a", params()), 16) == (29, False)  # after a local hit
    assert conn.get_num_new_matched_tokens(request("b", params(), n_prompt=45), 0) == (44, False)  # one left
    assert conn.get_num_new_matched_tokens(request("c", None), 0) == (0, False)


def test_loads_carry_the_typed_params_and_the_whole_prompt(scheduler_side):
    meta = schedule(scheduler_side, request("a", params(recompute_ratio=0.05)), request("plain", None))
    assert isinstance(meta, RagcacheConnectorMetadata) and len(meta.loads) == 1
    load = meta.loads[0]
    assert isinstance(load, LoadRequest) and load.req_id == "a" and load.block_ids == [7, 8, 9]
    assert load.params == params(recompute_ratio=0.05) and load.token_ids == list(range(60))
    assert schedule(scheduler_side).loads == []  # nothing pending any more


@pytest.mark.parametrize("finish_first", [False, True])
def test_worker_stats_come_back_with_the_finished_request(scheduler_side, finish_first):
    conn = scheduler_side
    req = request("a", params())
    schedule(conn, req)
    stats = ContextStats(ctx_tokens=45, reused_tokens=40, recomputed_tokens=5, chunk_tiers=["cpu", "cpu"])
    output = SimpleNamespace(kv_connector_worker_meta=RagcacheWorkerMetadata(stats={"a": stats.to_dict()}))
    if finish_first:  # finished in the step that loaded it: vLLM reads the worker metadata afterwards
        _, returned = conn.request_finished(req, [7])
        assert returned == {TRANSFER_KEY: {}}
        conn.update_connector_output(output)
    else:
        conn.update_connector_output(output)
        _, returned = conn.request_finished(req, [7])
    assert ContextStats.from_dict(returned[TRANSFER_KEY]) == stats
    assert not conn._stats and not conn._awaiting and not conn._loading  # nothing left behind


def test_a_request_that_never_loaded_returns_no_stats(scheduler_side):
    assert scheduler_side.request_finished(request("plain", None), []) == (False, None)
    assert scheduler_side.request_finished(request("aborted", params()), []) == (False, None)


def test_worker_metadata_aggregates_across_workers():
    a = RagcacheWorkerMetadata(stats={"x": {"ctx_tokens": 1}})
    b = RagcacheWorkerMetadata(stats={"y": {"ctx_tokens": 2}})
    assert a.aggregate(b).stats == {"x": {"ctx_tokens": 1}, "y": {"ctx_tokens": 2}}


def test_a_second_in_process_engine_is_refused_with_the_fix(monkeypatch):
    import weakref

    import ragcache.engine.engine as engine_module
    from ragcache.config import Settings
    from ragcache.engine import BlendEngine

    class Running:  # stands for the live in-process engine holding vLLM's process-global connector
        pass

    running = Running()
    monkeypatch.setattr(engine_module, "_IN_PROCESS", weakref.ref(running))
    with pytest.raises(RuntimeError, match="engine.in_process = false"):
        BlendEngine(Settings.load(engine={"in_process": True}))


def test_loads_are_paced_by_the_step_token_budget_the_first_always_goes():
    conn = scheduler_connector(step_tokens=60)  # each request claims 45 context tokens
    a, b, c = (request(r, params()) for r in ("a", "b", "c"))
    assert conn.get_num_new_matched_tokens(a, 0) == (45, False)
    conn.update_state_after_alloc(a, None, 45)
    assert conn.get_num_new_matched_tokens(b, 0) == (None, False)  # 90 > 60: b waits for the next step
    assert conn.get_num_new_matched_tokens(request("full", None), 0) == (0, False)  # full is never held
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="a", block_ids=([7, 8, 9],))],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]))
    assert [ld.req_id for ld in conn.build_connector_meta(out).loads] == ["a"]
    assert conn.get_num_new_matched_tokens(b, 0) == (45, False)  # a new step: b goes first
    big = scheduler_connector(step_tokens=10)
    assert big.get_num_new_matched_tokens(c, 0) == (45, False)  # over the budget alone, but first of its step
    unlimited = scheduler_connector(step_tokens=0)
    for r in (a, b, c):
        assert unlimited.get_num_new_matched_tokens(r, 0) == (45, False)
        unlimited.update_state_after_alloc(r, None, 45)
