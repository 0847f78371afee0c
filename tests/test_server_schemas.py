"""ragcache.server without a model: request validation and its errors, response bodies, metrics, start-up checks."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from ragcache.config import ConfigError, Settings
from ragcache.conversation import Turn
from ragcache.engine.messages import RequestMetrics, StoreStats
from ragcache.pipeline import Answer, Source
from ragcache.server.metrics import ServerMetrics
from ragcache.server.run import check_serve_settings, is_loopback
from ragcache.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    Delta,
    RagcacheResult,
    Usage,
    cached_tokens,
)
from ragcache.server.schemas import APIError, ChatCompletionRequest, RagcacheOptions, validation_error

USER = [{"role": "user", "content": "What is kelmet?"}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "docs", "messages": USER, **fields})


@pytest.mark.parametrize("fields, param, words", [
    ({"temperature": 3}, "temperature", "less than or equal to 2 (got 3)"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"n": 2}, "n", "less than or equal to 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop sequences"),
    ({"ragcache": {"mode": "fast"}}, "ragcache.mode", "'full', 'prefix', 'reuse', 'blend' or 'auto'"),
    ({"ragcache": {"recompute_ratio": 1.5}}, "ragcache.recompute_ratio", "less than or equal to 1"),
    ({"ragcache": {"topk": 3}}, "ragcache.topk", "Extra inputs are not permitted"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "'system', 'developer', 'user' or"),
    ({"messages": []}, "messages", "at least 1 item"),
])
def test_a_bad_field_is_a_400_naming_the_field_and_the_rule(fields, param, words):
    with pytest.raises(ValidationError) as e:
        request(**fields)
    err = validation_error(e.value)
    assert err.status == 400 and err.param == param and words in err.message and err.message.startswith(param)
    assert err.response().model_dump()["error"]["type"] == "invalid_request_error"


def test_missing_model_and_other_openai_fields_are_handled():
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": USER})
    assert validation_error(e.value).message == "model is required"
    r = request(presence_penalty=0.5, user="abc", stream_options={"include_usage": True})  # accepted, ignored
    assert r.answer_tokens is None and r.options == RagcacheOptions()
    assert request(max_completion_tokens=7, max_tokens=3).answer_tokens == 7


def test_the_conversation_and_the_sampling_options_come_from_the_request():
    r = request(messages=[{"role": "user", "content": "What is kelmet?"}, {"role": "assistant", "content": "A stew."},
                          {"role": "user", "content": [{"type": "text", "text": "And its"}, {"type": "text",
                                                                                            "text": "origin?"}]}],
                temperature=0.7, top_p=0.9, stop="\n", seed=3, ignore_eos=True, min_tokens=2, max_tokens=5)
    question, history = r.conversation()
    assert question == "And its\norigin?"
    assert history == [Turn("user", "What is kelmet?"), Turn("assistant", "A stew.")]
    s = r.sampling()
    assert (s.temperature, s.top_p, s.stop, s.seed, s.ignore_eos, s.min_tokens) == (0.7, 0.9, ("\n",), 3, True, 2)
    assert request().sampling().temperature == 0.0  # greedy unless asked
    with pytest.raises(APIError, match=r"messages\[0\]\.content\[0\] has type 'image_url'") as e:
        image = {"type": "image_url", "image_url": {"url": "x"}}
        request(messages=[{"role": "user", "content": [image]}]).conversation()
    assert e.value.param == "messages[0].content"
    with pytest.raises(ValidationError, match="min_tokens"):
        request(min_tokens=9, max_tokens=4)


def _answer(mode: str, tiers: list[str]) -> Answer:
    m = RequestMetrics(mode=mode, ttft_s=0.2, total_s=0.5, retrieval_s=0.01, prompt_tokens=300, output_tokens=7,
                       num_cached_tokens=250, ctx_tokens=250 if tiers else 0, reused_tokens=200 if tiers else 0,
                       recomputed_tokens=50 if tiers else 0, chunk_tiers=tiers,
                       recompute_ratio=0.15 if mode == "blend" else None)
    sources = [Source(f"d{i}", f"t{i}", "some   chunk\ntext", 0.5, f"c{i}", t) for i, t in enumerate(tiers or ["", ""])]
    return Answer("q", "An answer.", sources, m, "length")


def test_responses_carry_usage_cached_tokens_sources_and_metrics():
    blend = _answer("blend", ["cpu", "disk"])
    assert cached_tokens(blend) == 200 and cached_tokens(_answer("full", [])) == 0
    assert cached_tokens(_answer("prefix", [])) == 250  # vLLM's prefix-cache hits
    extra = RagcacheResult.of("docs", answer=blend)
    body = json.loads(ChatCompletionResponse.of("chatcmpl-1", "docs", blend, extra).model_dump_json())
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "ragcache"]
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "An answer."},
                                "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 300, "completion_tokens": 7, "total_tokens": 307,
                             "prompt_tokens_details": {"cached_tokens": 200}}
    assert list(body["ragcache"]) == ["index", "sources", "metrics"]  # no prompt unless asked: left out, not null
    assert [s["tier"] for s in body["ragcache"]["sources"]] == ["cpu", "disk"]
    assert body["ragcache"]["sources"][0] == {"doc_id": "d0", "title": "t0", "chunk_id": "c0", "score": 0.5,
                                              "tier": "cpu", "snippet": "some chunk text"}
    assert body["ragcache"]["metrics"] == blend.metrics.to_dict()
    assert body["ragcache"]["metrics"]["tier_hits"] == {"cpu": 1, "disk": 1}
    first = RagcacheResult.of("docs", sources=blend.sources).model_dump()
    assert [s["tier"] for s in first["sources"]] == [None, None] and "metrics" not in first
    assert "sources" not in RagcacheResult.of("docs", answer=blend, with_sources=False).model_dump()
    asked = RagcacheResult.of("docs", answer=blend, prompt="P")
    assert asked.model_dump()["prompt"] == "P"


def test_stream_chunks_carry_a_delta_or_the_usage_and_leave_out_what_they_do_not_carry():
    blend = _answer("blend", ["cpu", "disk"])

    def wire(chunk: ChatCompletionChunk) -> dict:
        return json.loads(chunk.model_dump_json())

    first = wire(ChatCompletionChunk.of("c", "docs", 1, delta=Delta(role="assistant", content=""),
                                        extra=RagcacheResult.of("docs", sources=blend.sources)))
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                 "logprobs": None}]
    assert list(first) == ["id", "object", "created", "model", "choices", "ragcache"]  # no usage key
    piece = wire(ChatCompletionChunk.of("c", "docs", 1, delta=Delta(content="Vel")))
    assert piece == {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "docs",
                     "choices": [{"index": 0, "delta": {"content": "Vel"}, "finish_reason": None, "logprobs": None}]}
    finish = wire(ChatCompletionChunk.of("c", "docs", 1, finish="stop"))
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "stop"
    usage = wire(ChatCompletionChunk.of("c", "docs", 1, usage=Usage.of(blend),
                                        extra=RagcacheResult.of("docs", answer=blend)))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 307 and "metrics" in usage["ragcache"]
    error = APIError(429, "too many", code="too_many_requests").response().model_dump()
    assert error == {"error": {"message": "too many", "type": "rate_limit_error", "param": None,
                               "code": "too_many_requests"}}


def test_metrics_count_lookups_down_to_the_serving_tier_and_never_label_chunks():
    m = ServerMetrics(["cpu", "disk"])
    m.observe("docs", _answer("blend", ["cpu", "disk", "computed"]))
    m.count_outcome("docs", "blend", "aborted")
    failed = _answer("blend", [])
    # full prefill answered: the worker could not serve the context
    failed.metrics = failed.metrics.replace(load_error="ValueError: check_layer must be in [0, 30), got 99")
    m.observe("docs", failed)
    stats = StoreStats.from_dict({"cpu": {"occupancy_bytes": 123, "evictions": 2}, "disk": {"occupancy_bytes": 0}})
    text = m.render(stats).decode()
    for line in ('ragcache_chunk_lookups_total{tier="cpu"} 3.0', 'ragcache_chunk_lookups_total{tier="disk"} 2.0',
                 'ragcache_chunk_hits_total{tier="cpu"} 1.0', 'ragcache_chunk_hits_total{tier="disk"} 1.0',
                 'ragcache_tier_bytes{tier="cpu"} 123.0', 'ragcache_evictions_total{tier="cpu"} 2.0',
                 'ragcache_cached_prompt_tokens_total{index="docs",mode="blend",tenant="default"} 200.0',
                 'ragcache_requests_total{index="docs",mode="blend",outcome="aborted",tenant="default"} 1.0',
                 'ragcache_requests_in_flight 0.0',
                 'ragcache_requests_total{index="docs",mode="blend",outcome="completed",tenant="default"} 2.0',
                 'ragcache_context_load_errors_total{index="docs",mode="blend"} 1.0'):
        assert line in text
    assert "c0" not in text and "_created" not in text


def test_serving_beyond_loopback_needs_an_api_key_and_the_default_index_must_exist(tmp_path):
    from ragcache.index.manifest import IndexNotFoundError

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    s = Settings.load(serve={"host": "0.0.0.0"}, ingest={"index_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="set serve.api_key"):
        check_serve_settings(s)
    s = Settings.load(serve={"host": "0.0.0.0", "api_key": "k", "index": "docs"}, ingest={"index_dir": str(tmp_path)})
    with pytest.raises(IndexNotFoundError, match="ragcache ingest PATH --index docs"):
        check_serve_settings(s)
    with pytest.raises(ConfigError, match="http://"):
        Settings.load(ui={"server_url": "localhost:8000"})


def test_a_keys_file_is_checked_at_start_with_the_entry_and_field_named(tmp_path):
    from ragcache.server.keys import KeyRing, key_digest

    (tmp_path / "idx" / "docs").mkdir(parents=True)
    (tmp_path / "idx" / "docs" / "manifest.json").write_text("{}")
    digest = key_digest("k1")

    def check(text: str | None) -> None:
        path = tmp_path / "keys.toml"
        if text is not None:
            path.write_text(text)
        elif path.exists():
            path.unlink()
        check_serve_settings(Settings.load(serve={"host": "0.0.0.0", "keys_file": str(path), "index": "docs"},
                                           ingest={"index_dir": str(tmp_path / "idx")}))

    cases = [
        (None, "does not exist"),
        ("[[key]\n", "is not valid TOML"),
        ('key = "k1"\n', "key must be [[key]] tables"),
        (f'[[key]]\ntenant = "a"\nsha256 = "k1"\nindexes = ["docs"]\n', "key[0].sha256: expected the key's sha256"),
        (f'[[key]]\ntenant = "a b"\nsha256 = "{digest}"\nindexes = ["docs"]\n', "key[0].tenant 'a b'"),
        (f'[[key]]\ntenant = "a"\nsha256 = "{digest}"\n', "grants nothing"),
        (f'[[key]]\ntenant = "a"\nsha256 = "{digest}"\nindex = ["docs"]\n', "unknown field(s) index"),
        (f'[[key]]\ntenant = "a"\nsha256 = "{digest}"\nindexes = "docs"\n', "key[0].indexes: expected a list"),
        (f'[[key]]\ntenant = "a"\nsha256 = "{digest}"\nindexes = ["docs"]\n' * 2, "key[1] repeats the sha256"),
    ]
    for text, words in cases:
        with pytest.raises(ConfigError, match=re.escape(words)):
            check(text)
    check(f'[[key]]\ntenant = "a"\nsha256 = "{digest}"\nindexes = ["docs"]\n')  # a valid file serves beyond loopback

    ring = KeyRing.from_settings(Settings.load(serve={"api_key": "shared", "keys_file": str(tmp_path / "keys.toml")}).serve)
    assert ring.authenticate("shared").every_index and ring.authenticate("k1").tenant == "a"
    assert ring.authenticate("k1").may_read("docs", "") and not ring.authenticate("k1").may_read("other", "")
    assert ring.authenticate("nope") is None and ring.authenticate(None) is None
    assert KeyRing().authenticate(None).every_index  # no keys at all: loopback serving for everyone
    check("# every key revoked\n")  # an empty file starts: no keys, every scoped key refused
    empty = KeyRing.from_settings(Settings.load(serve={"keys_file": str(tmp_path / "keys.toml")}).serve)
    assert empty.required and empty.authenticate("k1") is None and empty.authenticate(None) is None


def _keys_file(*keys: str) -> str:
    from ragcache.server.keys import key_digest

    return "".join(f'[[key]]\ntenant = "t{i}"\nsha256 = "{key_digest(k)}"\nindexes = ["docs"]\n\n'
                   for i, k in enumerate(keys))


def test_a_keys_file_emptied_deleted_or_broken_refuses_the_removed_key_on_the_next_read(tmp_path):
    """Revocation fails closed: empty = no keys (None: 401), deleted or invalid = every key refused
    (KeysUnavailableError: 503 naming the file), the state and since when kept for /health and
    /metrics; ``keys_invalid = "keep"`` keeps the keys read before an invalid file."""
    from ragcache.server.keys import KeySource, KeysUnavailableError

    path = tmp_path / "keys.toml"
    path.write_text(_keys_file("k1", "k2"))
    serve = Settings.load(serve={"api_key": "shared", "keys_file": str(path)}).serve
    source = KeySource(serve)
    assert source.keyring().authenticate("k1").tenant == "t0" and source.status.state == "ok"
    assert source.status.keys == 2
    ok_since = source.status.since

    path.write_text("")  # emptied: every scoped key refused, the shared key still works
    ring = source.keyring()
    assert ring.authenticate("k1") is None and ring.authenticate(None) is None
    assert ring.authenticate("shared").every_index
    assert source.status.state == "empty" and source.status.since >= ok_since and source.status.keys == 0

    path.write_text(_keys_file("k2"))
    assert source.keyring().authenticate("k2") is not None and source.status.state == "ok"
    path.unlink()  # deleted: nothing can be checked, every key refused
    for _ in range(2):
        with pytest.raises(KeysUnavailableError, match=re.escape(f"serve.keys_file {str(path)!r} does not exist")):
            source.keyring()
    assert source.status.state == "missing"
    since = source.status.since
    path.write_text("[[key]\n")  # invalid (and the removed key's entry gone with it)
    with pytest.raises(KeysUnavailableError, match=r"is not valid TOML .*every key is refused until the file is "
                       r"fixed \(serve.keys_invalid = \"keep\""):
        source.keyring()
    assert source.status.state == "invalid" and source.status.since >= since
    assert "not valid TOML" in source.status.problem
    invalid_since = source.status.since
    path.write_text("[[key]\nbroken")  # still invalid: since stays
    with pytest.raises(KeysUnavailableError):
        source.keyring()
    assert source.status.since == invalid_since

    # keep: the keys read before stay valid through an invalid file, the state still says invalid
    path.write_text(_keys_file("k1", "k2"))
    keep = KeySource(Settings.load(serve={"keys_file": str(path), "keys_invalid": "keep"}).serve)
    path.write_text(_keys_file("k1") + "[[key]\n")  # k2 removed and the file broken in one write
    assert keep.keyring().authenticate("k2") is not None and keep.status.state == "invalid"
    assert keep.status.keys == 2
    path.unlink()  # keep does not keep a deleted file's keys
    with pytest.raises(KeysUnavailableError, match="does not exist"):
        keep.keyring()
    # without a keys file there is no state to show
    assert KeySource(Settings.load(serve={"api_key": "shared"}).serve).status is None


def test_the_keys_file_state_is_a_gauge_with_its_since():
    from prometheus_client.parser import text_string_to_metric_families

    from ragcache.server.keys import KeysFileStatus

    def samples(m: ServerMetrics) -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}

    m = ServerMetrics()
    assert not any(n.startswith("ragcache_keys_file") for n, _ in samples(m))  # no keys file: no series
    status = KeysFileStatus("invalid", 1767000000.5, "not TOML", 2)
    m.watch_keys(lambda: status)
    got = samples(m)
    assert got[("ragcache_keys_file_state", (("state", "invalid"),))] == 1.0
    assert got[("ragcache_keys_file_state", (("state", "ok"),))] == 0.0
    assert {ls for n, ls in got if n == "ragcache_keys_file_state"} == {(("state", s),) for s in
                                                                       ("ok", "empty", "missing", "invalid")}
    assert got[("ragcache_keys_file_state_since_seconds", ())] == 1767000000.5


def test_a_body_limit_below_what_the_context_may_take_is_warned_of_at_start(tmp_path, caplog):
    (tmp_path / "idx" / "docs").mkdir(parents=True)
    (tmp_path / "idx" / "docs" / "manifest.json").write_text("{}")

    def warnings(**serve: int) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="ragcache.server.run"):
            check_serve_settings(Settings.load(serve={"index": "docs", **serve}, engine={"max_model_len": 8192},
                                               ingest={"index_dir": str(tmp_path / "idx")}))
        return [r.getMessage() for r in caplog.records]

    assert warnings() == []  # the default (8 MiB) fits 8192 tokens
    assert warnings(max_body_bytes=1 << 20) == []  # 128 bytes a token
    said = warnings(max_body_bytes=(1 << 20) - 1)
    assert len(said) == 1 and "serve.max_body_bytes = 1048575 may refuse (413)" in said[0]
    assert "engine.max_model_len = 8192" in said[0] and "raise serve.max_body_bytes" in said[0]
