"""One typed request path: QueryOptions built and validated once where a request enters (SDK, CLI
flags, HTTP body), handed on unchanged to the engine, and the metrics record read back whole over
HTTP. No model: the engine's request building runs on an EngineBase without vLLM's engine."""

from __future__ import annotations

import inspect
import json
import re

import pytest
from pydantic import ValidationError

from ragcache.config import MaxTokens, Ratio, Settings, TopK, range_text
from ragcache.conversation import Question, Turn, check_question
from ragcache.engine.messages import TRANSFER_KEY, BlendParams, RequestMetrics, StoreStats
from ragcache.options import (
    DEFAULTS, QueryOptions, QueryOptionsError, SamplingOptions, SelectionSpec, check_request, options_from,
)
from ragcache.prompt import AssembledPrompt, Segment
from ragcache.server.client import answer_from
from ragcache.server.responses import ChatCompletionResponse, RagcacheResult
from ragcache.server.schemas import ChatCompletionRequest, RagcacheOptions

USER = [{"role": "user", "content": "What is kelmet?"}]


def test_options_share_the_settings_ranges_and_name_the_option_and_the_rule():
    assert range_text(Ratio) == range_text(Settings.model_fields["blend"].annotation.model_fields["fallback_ratio"])
    assert range_text(TopK) == "must be in [1, 100]" and range_text(MaxTokens) == "must be >= 1"
    for fields, words in (({"top_k": 0}, "top_k 0: must be in [1, 100] (the range of the setting retrieval.top_k)"),
                          ({"recompute_ratio": 1.5}, "recompute_ratio 1.5: must be in [0, 1]"),
                          ({"max_tokens": 0}, "max_tokens 0: must be >= 1"),
                          ({"sampling": {"temperature": 3}}, "sampling.temperature 3: must be in [0, 2]"),
                          ({"selection": "question/0"}, "selection.granule 0: must be in [1, 256]"),
                          ({"selection": "attention"}, "'deviation', 'question' or 'hybrid'"),
                          ({"mode": "fast"}, "'full', 'prefix', 'reuse', 'blend' or 'auto'"),
                          ({"max_tokens": 2, "sampling": {"min_tokens": 4}},
                           "min_tokens (4) is larger than max_tokens (2)")):
        with pytest.raises(QueryOptionsError) as e:
            QueryOptions.parse(fields)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(QueryOptionsError, match=r"^--recompute-ratio 2.0: must be in \[0, 1\]") as e:
        QueryOptions.parse({"recompute_ratio": 2.0}, {"recompute_ratio": "--recompute-ratio"})
    assert (e.value.field, e.value.name, e.value.value) == ("recompute_ratio", "--recompute-ratio", 2.0)
    with pytest.raises(TypeError, match="unknown query option"):
        QueryOptions.parse({"topk": 3})


def test_blend_only_options_are_refused_with_another_mode_not_ignored():
    with pytest.raises(QueryOptionsError, match=r"^--recompute-ratio 0.3: applies in blend or auto mode only, and "
                       r"the request's mode is 'full': drop it, or ask in blend mode$") as e:
        QueryOptions.parse({"mode": "full", "recompute_ratio": 0.3}, {"recompute_ratio": "--recompute-ratio"})
    assert e.value.field == "recompute_ratio"
    with pytest.raises(QueryOptionsError, match="selection question/16: applies in blend or auto mode only.*'reuse'"):
        QueryOptions.parse({"mode": "reuse", "selection": "question/16"})
    # blend and auto (routed to blend or full prefill), or no mode (the default decides: check_request), take them
    assert QueryOptions.parse({"mode": "blend", "recompute_ratio": 0.3}).recompute_ratio == 0.3
    assert QueryOptions.parse({"mode": "auto", "mass_left": 0.1, "budget": "adaptive"}).mass_left == 0.1
    assert QueryOptions.parse({"recompute_ratio": 0.3, "selection": "deviation"}).selection.strategy == "deviation"
    assert QueryOptions.parse({"mode": "full"}).recompute_ratio is None
    # the same rule at the HTTP edge, naming the field of the body
    with pytest.raises(ValidationError) as http:
        ChatCompletionRequest.model_validate({"model": "docs", "messages": USER,
                                              "ragcache": {"mode": "prefix", "recompute_ratio": 0.2}})
    err = http.value.errors()[0]
    assert err["loc"] == ("ragcache", "recompute_ratio") and "blend or auto mode only" in err["msg"]


#: the option combinations that contradict each other in one request: (options, the field refused, words)
CONTRADICTIONS = [
    ({"budget": "fixed", "mass_left": 0.01}, "mass_left", "the request's budget is 'fixed'"),
    ({"selection": "deviation", "mass_left": 0.01}, "mass_left", "the request's selection 'deviation' does not read"),
    ({"selection": "deviation", "budget": "adaptive"}, "budget", "the request's selection 'deviation' does not read"),
]


@pytest.mark.parametrize("fields, field, words", CONTRADICTIONS)
def test_contradictory_options_are_one_named_error_in_the_sdk_and_over_http(tmp_path, fields, field, words):
    from ragcache.pipeline import RAGPipeline
    from ragcache.server.schemas import validation_error

    with pytest.raises(QueryOptionsError, match=re.escape(words)) as e:
        QueryOptions.parse(fields)
    assert e.value.field == field and str(e.value).startswith(f"{field} ") and "\n" not in str(e.value)
    with pytest.raises(ValidationError):
        QueryOptions(**fields)  # built directly, too
    rag = RAGPipeline(Settings.load(ingest={"index_dir": str(tmp_path)}), "docs", engine=None)
    with pytest.raises(QueryOptionsError, match=re.escape(words)):
        rag.query("What is kelmet?", **fields)  # refused before anything is looked up
    with pytest.raises(ValidationError) as http:
        ChatCompletionRequest.model_validate({"model": "docs", "messages": USER, "ragcache": fields})
    err = validation_error(http.value)
    assert err.status == 400 and err.param == f"ragcache.{field}" and words in err.message
    other = next(f for f in fields if f != field)
    assert other in err.message  # both fields named


def test_a_default_that_does_not_apply_gives_way_and_the_engine_is_told_what_runs(tmp_path):
    """Only what the request itself sets can contradict: a setting's default that does not apply to
    the request's own choice is not applied (and the connector's parameters say so), while a
    request's option that the settings would drop is refused, naming the setting."""
    settings = Settings.load(ingest={"index_dir": str(tmp_path)})
    assert settings.blend.budget == "adaptive" and settings.blend.selection == "question"

    def params(blend, **fields):
        options = QueryOptions.parse({"mode": "blend", **fields})
        check_request(options, blend, default_mode="blend")
        return BlendParams.from_options(blend, options, mode="blend", ctx_len=30, lead_in_len=10,
                                        segments=()).blend

    assert params(settings.blend, selection="deviation").budget == "fixed"  # blend.budget's adaptive gives way
    assert params(settings.blend).budget == "adaptive"
    fixed = settings.blend.model_copy(update={"budget": "fixed"})
    assert params(fixed, mass_left=0.02).budget == "adaptive"  # a request's mass_left asks for the adaptive budget
    assert params(fixed, selection="deviation", budget="fixed").budget == "fixed"
    # the settings' selection does not read the question: the request's adaptive budget would be dropped
    deviation = settings.blend.model_copy(update={"selection": "deviation"})
    assert params(deviation).budget == "fixed"  # the setting's adaptive budget gives way to its own selection
    for fields, field in (({"mass_left": 0.02}, "mass_left"), ({"budget": "adaptive"}, "budget")):
        with pytest.raises(QueryOptionsError, match=r"no selection given: the setting blend\.selection\) does not "
                           r"read it: drop .*, or select by question or hybrid") as e:
            params(deviation, **fields)
        assert e.value.field == field
    assert params(deviation, selection="question", mass_left=0.02).budget == "adaptive"
    # a hybrid reads the question only with blend.question_weight > 0
    no_question = settings.blend.model_copy(update={"question_weight": 0.0})
    with pytest.raises(QueryOptionsError, match=r"selection 'hybrid' with blend\.question_weight = 0\.0 does not "
                       r"read it: drop budget, or change blend\.question_weight"):
        params(no_question, selection="hybrid", budget="adaptive")
    assert params(settings.blend, selection="hybrid", budget="adaptive").budget == "adaptive"


def test_blend_only_options_follow_the_mode_the_request_gets_whoever_set_it(tmp_path):
    """The request's own mode, else the default (``engine.mode``, or a server's fallback): the same
    error when it never blends, naming where the mode came from; blend and auto take them."""
    from ragcache.pipeline import RAGPipeline

    blend = Settings.load().blend
    ratio = QueryOptions.parse({"recompute_ratio": 0.3})
    with pytest.raises(QueryOptionsError, match=r"^--recompute-ratio 0\.3: applies in blend or auto mode only, and "
                       r"the request's mode is 'full' \(no mode given: the setting engine\.mode\): drop it, or ask "
                       r"in blend mode$") as e:
        check_request(ratio, blend, default_mode="full", names={"recompute_ratio": "--recompute-ratio"})
    assert e.value.field == "recompute_ratio"
    with pytest.raises(QueryOptionsError, match=r"'prefix' \(no mode given: serve\.blend_fallback = 'prefix'.*: "
                       r"drop it$"):
        check_request(QueryOptions.parse({"budget": "fixed"}), blend, default_mode="prefix",
                      mode_from="no mode given: serve.blend_fallback = 'prefix'")
    for mode in ("blend", "auto"):
        check_request(ratio, blend, default_mode=mode)  # taken
    check_request(QueryOptions.parse({"mode": "blend", "recompute_ratio": 0.3}), blend, default_mode="full")
    check_request(QueryOptions.parse({"mode": "full", "top_k": 2}), blend, default_mode="blend")
    with pytest.raises(QueryOptionsError, match=r"--recompute-ratio auto: .*the request's mode is 'reuse': drop it"):
        check_request(QueryOptions.parse({"mode": "reuse"}), blend, default_mode="blend",
                      names={"recompute_ratio": "--recompute-ratio"}, given={"recompute_ratio": "auto"})
    # the SDK: refused before retrieval (no index exists here, which would be the next error)
    full = Settings.load(ingest={"index_dir": str(tmp_path)}, engine={"mode": "full"})
    rag = RAGPipeline(full, "docs", engine=None)
    with pytest.raises(QueryOptionsError, match=r"selection question: applies .*\(no mode given: the setting "
                       r"engine\.mode\)"):
        rag.query("What is kelmet?", selection="question")
    with pytest.raises(QueryOptionsError, match="engine.mode"):
        rag.prepare("What is kelmet?", QueryOptions(mass_left=0.1))


@pytest.mark.parametrize("fields, param", [
    ({"ragcache": {"recompute_ratio": True}}, "ragcache.recompute_ratio"),
    ({"ragcache": {"recompute_ratio": "0.1"}}, "ragcache.recompute_ratio"),
    ({"ragcache": {"mass_left": "0.1"}}, "ragcache.mass_left"),
    ({"ragcache": {"top_k": True}}, "ragcache.top_k"),
    ({"ragcache": {"top_k": "3"}}, "ragcache.top_k"),
    ({"ragcache": {"top_k": 3.0}}, "ragcache.top_k"),
    ({"ragcache": {"selection": {"strategy": "question", "granule": "16"}}}, "ragcache.selection.granule"),
    ({"max_tokens": "3"}, "max_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": True}, "top_p"),
    ({"seed": "7"}, "seed"),
    ({"n": True}, "n"),
    ({"min_tokens": False}, "min_tokens"),
])
def test_numbers_are_strict_over_http(fields, param):
    from ragcache.server.schemas import validation_error

    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "docs", "messages": USER, **fields})
    err = validation_error(e.value)
    assert err.status == 400 and err.param == param and "Input should be a valid" in err.message, err.message


def test_numbers_are_strict_in_the_sdk_and_an_integer_is_a_number():
    for fields, name in (({"recompute_ratio": True}, "recompute_ratio True"), ({"recompute_ratio": "0.1"},
                         "recompute_ratio '0.1'"), ({"top_k": True}, "top_k True"), ({"top_k": "3"}, "top_k '3'"),
                         ({"max_tokens": "9"}, "max_tokens '9'"), ({"mass_left": False}, "mass_left False"),
                         ({"sampling": {"temperature": "1"}}, "sampling.temperature '1'"),
                         ({"sampling": {"seed": True}}, "sampling.seed True")):
        with pytest.raises(QueryOptionsError, match=f"^{re.escape(name)}: Input should be a valid"):
            QueryOptions.parse(fields)
    o = QueryOptions.parse({"recompute_ratio": 1, "mass_left": 0.5, "sampling": {"temperature": 1}})
    assert o.recompute_ratio == 1.0 and isinstance(o.recompute_ratio, float)
    body = ChatCompletionRequest.model_validate({"model": "docs", "messages": USER, "temperature": 1,
                                                 "ragcache": {"recompute_ratio": 0}})
    assert body.temperature == 1.0 and body.options.recompute_ratio == 0.0


def test_each_option_is_declared_once_and_the_http_object_the_client_body_and_the_cli_flags_follow():
    """RequestOptions' fields are the HTTP ragcache object's (plus index and what to return), the
    client's ragcache body and, with max_tokens, the CLI's query flags; a body the client writes
    comes back through the server's schema as the same QueryOptions."""
    from app.ask_cmd import QUERY_FLAGS, query_options
    from app.cli import build_parser
    from ragcache.options import RequestOptions
    from ragcache.server.client import RemotePipeline

    declared = set(RequestOptions.model_fields)
    assert declared == {"mode", "top_k", "recompute_ratio", "selection", "budget", "mass_left"}
    assert set(RagcacheOptions.model_fields) == declared | {"index", "return_sources", "return_prompt"}
    assert set(QUERY_FLAGS) == declared | {"max_tokens"} and QUERY_FLAGS["mass_left"] == "--mass-left"

    options = QueryOptions(mode="blend", top_k=2, selection="question/16", budget="adaptive", mass_left=0.1,
                           max_tokens=9, sampling=SamplingOptions(temperature=0.5, stop=("\n",), seed=3),
                           history=(Turn("user", "hi"), Turn("assistant", "Hello.")))
    body = RemotePipeline("http://127.0.0.1:1", "docs")._body("What is kelmet?", options, stream=False)
    assert body["ragcache"] == {"mode": "blend", "top_k": 2, "selection": "question/16", "budget": "adaptive",
                                "mass_left": 0.1}
    request = ChatCompletionRequest.model_validate(json.loads(json.dumps(body)))
    question, history = request.conversation()
    assert question == "What is kelmet?" and request.query_options(history) == options

    args = build_parser().parse_args(["ask", "q?", "--mode", "blend", "--top-k", "2", "--selection", "question/16",
                                      "--budget", "adaptive", "--mass-left", "0.1", "--max-tokens", "9"])
    assert query_options(args) == options.model_copy(update={"sampling": SamplingOptions(), "history": ()})


def test_a_selection_is_typed_once_from_its_string_form():
    o = QueryOptions.parse({"selection": "question/16", "top_k": None})  # None: not given
    assert o.selection == SelectionSpec(strategy="question", granule=16) and str(o.selection) == "question/16"
    assert o.top_k is None and QueryOptions(selection="hybrid").selection.granule is None
    with pytest.raises(ValueError, match="integer"):
        SelectionSpec.parse("question/x")


def test_the_sdk_takes_options_or_keyword_fields_and_checks_the_question_once():
    given = QueryOptions(mode="full", top_k=2)
    assert options_from(given, {}) is given  # handed on as built
    assert options_from(None, {}) is DEFAULTS
    assert options_from(None, {"top_k": 3, "history": [Turn("user", "hi")]}).history == (Turn("user", "hi"),)
    with pytest.raises(TypeError, match="not both"):
        options_from(given, {"top_k": 3})
    with pytest.raises(TypeError, match="QueryOptions"):
        options_from("full", {})  # the mode as a keyword (mode="full"), not positionally
    q = check_question("What is kelmet?")
    assert isinstance(q, Question) and check_question(q) is q  # checked once: a Question passes as is


def _engine_base(settings: Settings):
    """The request-building half of an engine (what both engines share), without vLLM's engine."""
    from ragcache.engine.base import EngineBase

    base = EngineBase.__new__(EngineBase)
    base.settings = settings
    base.blend_support = None
    return base


def _prompt() -> AssembledPrompt:
    segments = [Segment("default:" + "a" * 32, 0, 10, None), Segment("default:" + "b" * 32, 10, 20, "c1")]
    return AssembledPrompt(list(range(40)), segments, 30, 10)


def test_the_ratio_walks_from_the_http_body_to_the_connector_as_typed_objects_validated_once(tmp_path):
    from ragcache.pipeline import RAGPipeline

    settings = Settings.load(ingest={"index_dir": str(tmp_path)})
    body = ChatCompletionRequest.model_validate({
        "model": "docs", "messages": USER, "max_tokens": 7, "temperature": 0.5,
        "ragcache": {"mode": "blend", "recompute_ratio": 0.25, "selection": "question/16", "top_k": 2}})
    question, history = body.conversation()
    options = body.query_options(history)  # assembled from the validated body, not validated again
    assert isinstance(question, Question) and isinstance(options, QueryOptions)
    assert (options.recompute_ratio, options.top_k, options.max_tokens) == (0.25, 2, 7)
    assert options.sampling.temperature == 0.5
    engine_opts, source = RAGPipeline(settings, "docs", engine=None)._for_engine(options)
    assert engine_opts is options and source == "request"  # the pipeline hands it on unchanged
    req = _engine_base(settings)._request(_prompt(), engine_opts)
    params = BlendParams.from_dict(req.sampling.extra_args["kv_transfer_params"][TRANSFER_KEY])
    assert (params.blend.recompute_ratio, params.blend.selection, params.blend.granule) == (0.25, "question", 16)
    assert (req.sampling.max_tokens, req.sampling.temperature, req.recompute_ratio) == (7, 0.5, 0.25)
    # the one check is at the edge: a bad ratio stops at the body, naming the field
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "docs", "messages": USER, "ragcache": {"recompute_ratio": 1.5}})
    assert e.value.errors()[0]["loc"] == ("ragcache", "recompute_ratio")
    # ...and nothing after it checks again: a value that skipped the edge goes through as it is
    unchecked = QueryOptions.model_construct(mode="blend", recompute_ratio=1.5, selection=None, max_tokens=None,
                                             sampling=SamplingOptions())
    sent = _engine_base(settings)._request(_prompt(), unchecked).sampling.extra_args["kv_transfer_params"]
    assert sent[TRANSFER_KEY]["blend"]["recompute_ratio"] == 1.5


def test_without_a_ratio_of_its_own_the_pipeline_fills_in_its_resolved_one(tmp_path):
    from ragcache.pipeline import RAGPipeline

    settings = Settings.load(ingest={"index_dir": str(tmp_path)}, blend={"recompute_ratio": 0.3})
    rag = RAGPipeline(settings, "docs", engine=None)
    opts, source = rag._for_engine(QueryOptions(mode="blend", top_k=2))
    assert (opts.recompute_ratio, opts.top_k, source) == (0.3, 2, "settings")
    full = QueryOptions(mode="full")
    assert rag._for_engine(full) == (full, "")  # no ratio outside blend


def test_metrics_travel_over_http_as_the_one_record_both_ways():
    from ragcache.pipeline import Answer, Source

    m = RequestMetrics(mode="blend", ttft_s=0.123456789, total_s=0.5, retrieval_s=0.01, prompt_tokens=300,
                       output_tokens=7, num_cached_tokens=250, ctx_tokens=250, reused_tokens=200,
                       recomputed_tokens=50, missing_computed_tokens=0, chunk_tiers=["cpu", "computed"],
                       head_tier="cpu", load_s=0.02, worker_s=0.03, stages={"open_s": 0.001},
                       recompute_ratio=0.15, ratio_source="calibration", repetition_loop=True)
    answer = Answer("q", "An answer.", [Source("d", "t", "text", 0.5, "c", "cpu"), Source("e", "u", "x", 0.4, "f",
                                                                                          "computed")], m, "stop")
    wire = ChatCompletionResponse.of("chatcmpl-1", "docs", answer,
                                     RagcacheResult.of("docs", answer=answer)).model_dump_json()
    body = ChatCompletionResponse.model_validate_json(wire)  # as the client reads it
    back = answer_from("q", body.choices[0].message.content, "stop", body.ragcache)
    assert back.metrics == m and back.metrics.ratio_source == "calibration"  # nothing lost, nothing rounded
    assert [s.tier for s in back.sources] == ["cpu", "computed"]


def test_store_stats_are_one_typed_record_on_both_sides_of_the_seam(tmp_path):
    import torch

    from ragcache.kvstore import CpuTier, DiskTier, KVSpec, TieredStore

    spec = KVSpec(model_fingerprint="fp", layout_version=1, num_layers=2, num_kv_heads=1, head_dim=4,
                  dtype=torch.float32)
    store = TieredStore(spec, [(CpuTier(), 10**9), (DiskTier(tmp_path / "kv"), 10**9)])
    store.put("default:" + "a" * 32, torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4), 0)
    assert store.get("default:" + "a" * 32)[1] == "cpu" and store.get("default:" + "b" * 32) is None
    stats = StoreStats.from_dict(json.loads(json.dumps(store.stats())))  # as the worker's reply arrives
    assert stats.names == ["cpu", "disk"] and (stats.lookups, stats.hits, stats.misses) == (2, 1, 1)
    assert stats.hit_rate == 0.5 and stats.tiers["disk"].entries == 1 and stats.tiers["cpu"].up
    assert StoreStats.from_dict(stats.to_dict()) == stats
    store.close()


def test_both_engines_offer_the_same_methods_with_the_same_arguments():
    from ragcache.engine import AsyncBlendEngine, BlendEngine

    shared = ("precompute", "generate", "generate_many", "stream", "continuation_logprobs", "ops_probe",
              "store_stats", "stored_tiers", "stored_where", "store_holders", "forget", "forget_prompt", "flush", "close",
              "reset_prefix_cache", "num_unfinished_requests")
    for name in shared:
        sync, asyn = getattr(BlendEngine, name), getattr(AsyncBlendEngine, name)
        if isinstance(sync, property):
            assert isinstance(asyn, property), name
            continue
        assert inspect.signature(sync).parameters.keys() == inspect.signature(asyn).parameters.keys(), name
        if name != "close":
            assert inspect.iscoroutinefunction(asyn) or inspect.isasyncgenfunction(asyn), name
