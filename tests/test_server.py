"""`ragcache serve` end to end: a real uvicorn server on a free loopback port, the real AsyncBlendEngine
(SmolLM2 through vLLM), the real `openai` client and httpx. One server for the whole module."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from ragcache.options import QueryOptions
from tests.test_pipeline import DOCS  # the three Zorbia documents

pytestmark = pytest.mark.integration

INDEX = "zorbia"
MAX_MODEL_LEN = 8192
ASK = dict(model=INDEX, max_tokens=12, extra_body={"ragcache": {"top_k": 2}})


class ServerThread:
    """uvicorn serving ``app`` in a thread of this process (so tests can reach the app's engine)."""

    def __init__(self, app, port: int):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="ragcache-test-server", daemon=True)

    def start(self, timeout_s: float = 600) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            assert self.thread.is_alive(), "the server thread died during start-up (see the log above)"
            assert time.monotonic() < deadline, "the server did not start in time"
            time.sleep(0.2)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(120)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, ServerState) of a server over a freshly ingested index. The chunk KV is not
    precomputed: the first request computes and stores it (tier "computed"), later ones reuse it."""
    from ragcache.config import Settings
    from ragcache.ingest.ingestor import Ingestor
    from ragcache.server import create_app
    from ragcache_testing.services import free_port

    root = tmp_path_factory.mktemp("serve")
    docs = root / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    settings = Settings.load(
        store={"ssd_cache_dir": str(root / "kv"), "remote_url": "", "cpu_kv_pool_gb": 1.0},
        # blend by default, as the tests of blend's answers here expect; auto is asked per request
        engine={"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 1 << 30, "max_tokens": 16, "mode": "blend"},
        ingest={"index_dir": str(root / "idx")}, serve={"index": INDEX, "max_in_flight": 16},
        blend={"min_recompute_tokens": 0},  # short documents: the default floor would recompute every token
    )
    assert Ingestor(settings, INDEX).ingest([docs]).chunks_added == len(DOCS)
    app = create_app(settings)
    port = free_port()
    thread = ServerThread(app, port)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        client(url).chat.completions.create(messages=user("What is Zorbia?"), model=INDEX,
                                            extra_body={"ragcache": {"top_k": 3}}, max_tokens=2)  # computes chunk KV
        yield url, app.state.server
    finally:
        thread.stop()


def client(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300, **kwargs)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(metrics: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= set(ls))


def wait_idle(url: str, timeout_s: float = 30) -> dict:
    """/health once no request is in flight in the server nor in vLLM."""
    deadline = time.monotonic() + timeout_s
    while True:
        h = httpx.get(f"{url}/health", timeout=10).json()
        if h["in_flight"] == 0 and h["engine_unfinished_requests"] == 0:
            return h
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s: {h}"
        time.sleep(0.2)


# ---- completions ---------------------------------------------------------------------------------


def test_models_list_one_entry_per_index_and_health_reports_the_engine(served):
    url, _ = served
    assert [m.id for m in client(url).models.list().data] == [INDEX]
    h = httpx.get(f"{url}/health").json()
    assert h["status"] == "ok" and h["default_index"] == INDEX and h["device"]


def test_completion_returns_text_sources_and_reused_tokens_in_blend_and_none_in_full(served):
    url, _ = served
    c = client(url)
    blend = c.chat.completions.create(messages=user("What is the capital of Zorbia?"), **ASK)
    assert blend.choices[0].message.content and blend.choices[0].finish_reason in ("stop", "length")
    rc = blend.model_extra["ragcache"]
    assert rc["index"] == INDEX and len(rc["sources"]) == 2
    assert any("Velmora" in s["snippet"] for s in rc["sources"])
    assert all(s["tier"] in ("cpu", "disk") and s["chunk_id"] and s["doc_id"] for s in rc["sources"])
    m = rc["metrics"]
    assert m["mode"] == "blend" and m["ttft_s"] > 0 and m["retrieval_s"] > 0 and m["recompute_ratio"] == 0.15
    assert m["ratio_source"] == "settings" and m["chunk_tiers"] == [s["tier"] for s in rc["sources"]]
    assert m["reused_tokens"] > 0 and m["recomputed_tokens"] > 0 and sum(m["tier_hits"].values()) == 2
    cached = blend.usage.prompt_tokens_details.cached_tokens
    assert cached == m["reused_tokens"] and 0 < cached < blend.usage.prompt_tokens

    full = c.chat.completions.create(messages=user("What is the capital of Zorbia?"), model=INDEX, max_tokens=12,
                                     extra_body={"ragcache": {"top_k": 2, "mode": "full"}})
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert full.usage.prompt_tokens == blend.usage.prompt_tokens  # the same prompt, served without reuse
    rc = full.model_extra["ragcache"]
    assert rc["metrics"]["mode"] == "full" and rc["metrics"]["recompute_ratio"] is None
    assert [s["tier"] for s in rc["sources"]] == [None, None]


def test_auto_routes_each_request_and_says_why_and_an_explicit_mode_overrides_it(served):
    """``"mode": "auto"``: the Zorbia passages (~40 tokens) are far under ``route.min_passage_tokens`` on an
    uncalibrated index, so auto answers by full prefill (nothing reused) and says why; ``"mode": "blend"``
    blends the same prompt. /metrics counts both by route and rule."""
    url, _ = served
    c = client(url)
    before = scrape(url)
    auto = c.chat.completions.create(messages=user("What is the capital of Zorbia?"), model=INDEX, max_tokens=8,
                                     extra_body={"ragcache": {"top_k": 2, "mode": "auto"}})
    m = auto.model_extra["ragcache"]["metrics"]
    assert (m["route"], m["route_rule"], m["mode"]) == ("full", "quality", "full")
    assert "route.min_passage_tokens" in m["route_reason"] and 0 <= m["route_s"] < 0.05
    assert m["reused_tokens"] == 0 and m["recomputed_tokens"] == 0 and m["chunk_tiers"] == []
    assert auto.usage.prompt_tokens_details.cached_tokens == 0
    blend = c.chat.completions.create(messages=user("What is the capital of Zorbia?"), model=INDEX, max_tokens=8,
                                      extra_body={"ragcache": {"top_k": 2, "mode": "blend"}})
    m = blend.model_extra["ragcache"]["metrics"]
    assert (m["route"], m["route_rule"], m["mode"]) == ("blend", "explicit", "blend") and m["reused_tokens"] > 0
    after = scrape(url)
    for route, rule in (("full", "quality"), ("blend", "explicit")):
        moved = (total(after, "ragcache_routed_requests_total", route=route, rule=rule)
                 - total(before, "ragcache_routed_requests_total", route=route, rule=rule))
        assert moved == 1, (route, rule)


def test_stream_sends_sources_first_then_text_then_a_usage_chunk_only_when_asked_then_done(served):
    url, _ = served
    question = "What is kelmet made of?"
    alone = client(url).chat.completions.create(messages=user(question), **ASK).choices[0].message.content
    chunks = list(client(url).chat.completions.create(messages=user(question), stream=True, **ASK,
                                                      stream_options={"include_usage": True}))
    first, last = chunks[0], chunks[-1]
    assert first.choices[0].delta.role == "assistant"
    assert [s["tier"] for s in first.model_extra["ragcache"]["sources"]] == [None, None]  # not served yet
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == alone
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert last.choices == [] and last.usage.prompt_tokens_details.cached_tokens > 0
    rc = last.model_extra["ragcache"]
    assert rc["metrics"]["reused_tokens"] == last.usage.prompt_tokens_details.cached_tokens
    assert all(s["tier"] in ("cpu", "disk") for s in rc["sources"])
    # without stream_options.include_usage (OpenAI's default) no usage chunk: the finish chunk is last
    plain = list(client(url).chat.completions.create(messages=user(question), stream=True, **ASK))
    assert all(c.choices and c.usage is None for c in plain)
    assert plain[-1].choices[0].finish_reason in ("stop", "length")
    assert plain[-1].model_extra["ragcache"]["metrics"]["reused_tokens"] > 0  # the ragcache object moves there
    assert "".join(c.choices[0].delta.content or "" for c in plain).strip() == alone
    # the wire: only data: lines (no custom event names), ending with [DONE]
    body = {"model": INDEX, "messages": user(question), "stream": True, "max_tokens": 4}
    raw = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).text
    lines = [ln for ln in raw.splitlines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert not any('"usage"' in ln for ln in lines)


def test_eight_concurrent_streams_finish_and_each_answers_its_own_question(served):
    """In float32 each concurrent answer equals its answer asked alone. In bfloat16 batching may
    change tokens (batch numerics, docs/serving.md "Batching and bf16": 3 of 16 answers on Zen 4),
    from the first token on where two are nearly tied (one blend pass per engine step multiplies the
    step's requests together): there most answers must equal their solo answers and none may be
    another question's solo answer (what KV of another request would produce). Word prefixes do not
    tell the two apart: a changed answer opening "The answer is" shares more words with another
    question's answer of that opening than with its own. tests/test_server_cli.py and
    tests/test_engine_batched.py assert concurrent and batched blends exactly in float32."""
    url, state = served
    questions = ["What is the capital of Zorbia?", "Who founded Velmora?", "What is kelmet?",
                 "How many seats has the Amber Hall?", "When was Velmora founded?", "Where does parliament meet?",
                 "What river flows through Velmora?", "How often are elections held in Zorbia?"]
    c = client(url)
    alone = [c.chat.completions.create(messages=user(q), **ASK).choices[0].message.content.strip() for q in questions]

    async def one(aclient: openai.AsyncOpenAI, q: str) -> str:
        stream = await aclient.chat.completions.create(messages=user(q), stream=True, **ASK)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices]).strip()

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, q) for q in questions))

    batched = asyncio.run(together())
    if state.engine.dtype.dtype == "float32":
        assert batched == alone
    else:
        for i, answer in enumerate(batched):  # KV of another request would answer that other question
            others = [solo for j, solo in enumerate(alone) if j != i and solo != alone[i]]
            assert answer == alone[i] or answer not in others, (questions[i], answer, alone)
        assert sum(b == a for b, a in zip(batched, alone)) >= len(questions) // 2, (batched, alone)
    wait_idle(url)


def test_second_turn_prompt_holds_the_first_turn_after_the_chunks(served):
    url, _ = served
    c = client(url)
    q1 = "What is the capital of Zorbia?"
    first = c.chat.completions.create(messages=user(q1), **ASK)
    a1 = first.choices[0].message.content
    turns = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1},
             {"role": "user", "content": "Who founded it?"}]
    second = c.chat.completions.create(messages=turns, model=INDEX, max_tokens=12,
                                       extra_body={"ragcache": {"top_k": 2, "return_prompt": True}})
    rc = second.model_extra["ragcache"]
    prompt = rc["prompt"]
    history = prompt.index("Conversation so far:")
    assert prompt.index(f"Assistant: {a1.strip()}") > history > prompt.index("Velmora was founded")  # after chunks
    assert prompt.index("Question: Who founded it?") > prompt.index(a1.strip())
    # the follow-up retrieved with the previous question too, and still reused the chunk KV
    assert any("Velmora" in s["snippet"] for s in rc["sources"])
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_a_blend_against_the_index_calibration_carries_a_note_and_the_log_says_it_once(served, caplog):
    from ragcache.index.folder import CALIBRATION, readable_path
    from ragcache.quality.records import Calibration, write_calibration

    url, state = served
    folder = readable_path(state.pipeline(INDEX).index_path)
    cal = Calibration(ratio=None, max_kl=0.05, selection=state.settings.blend.selection,
                      model_fingerprint=state.engine.llm_info.fingerprint, n=2, source="probes",
                      full_ttft_median_s=1.0, recommendation="full", reason="no ratio tried was faster")
    write_calibration(folder, cal)
    try:
        with caplog.at_level("WARNING", logger="ragcache.server.app"):
            notes = [client(url).chat.completions.create(messages=user(q), **ASK).model_extra["ragcache"]["metrics"]
                     ["ratio_note"] for q in ("What is the capital of Zorbia?", "How many seats has the Amber Hall?")]
        assert notes[0] == notes[1] and "recommends full prefill (no ratio tried was faster)" in notes[0]
        assert "blend.recompute_ratio = 0.15 as set" in notes[0]
        assert [r.getMessage() for r in caplog.records if "recommends full prefill" in r.getMessage()] == [notes[0]]
    finally:
        (folder / CALIBRATION).unlink()
    after = client(url).chat.completions.create(messages=user("What is the capital of Zorbia?"), **ASK)
    assert after.model_extra["ragcache"]["metrics"]["ratio_note"] == ""  # no calibration: nothing to say


def test_metrics_move_by_the_right_amounts(served):
    url, _ = served
    c = client(url)
    before = scrape(url)
    answers = [c.chat.completions.create(messages=user(q), **ASK)
               for q in ("What is kelmet?", "Where is the Amber Hall?")]
    full = c.chat.completions.create(messages=user("What is kelmet?"), model=INDEX, max_tokens=4,
                                     extra_body={"ragcache": {"top_k": 2, "mode": "full"}})
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    blend = {"index": INDEX, "mode": "blend"}
    assert delta("ragcache_requests_total", outcome="completed", **blend) == 2
    assert delta("ragcache_requests_total", outcome="completed", index=INDEX, mode="full") == 1
    assert delta("ragcache_time_to_first_token_seconds_count", **blend) == 2
    assert delta("ragcache_e2e_request_latency_seconds_count", index=INDEX) == 3
    assert delta("ragcache_retrieval_seconds_count", index=INDEX) == 3
    assert delta("ragcache_prompt_tokens_total", **blend) == sum(a.usage.prompt_tokens for a in answers)
    assert delta("ragcache_cached_prompt_tokens_total", **blend) == sum(
        a.usage.prompt_tokens_details.cached_tokens for a in answers)
    assert delta("ragcache_recomputed_tokens_total", **blend) == sum(
        a.model_extra["ragcache"]["metrics"]["recomputed_tokens"] for a in answers)
    assert delta("ragcache_prompt_tokens_total", index=INDEX, mode="full") == full.usage.prompt_tokens
    assert delta("ragcache_cached_prompt_tokens_total", index=INDEX, mode="full") == 0
    assert delta("ragcache_output_tokens_total", index=INDEX) == sum(
        a.usage.completion_tokens for a in [*answers, full])
    assert delta("ragcache_chunk_hits_total") == 4  # 2 blend requests x 2 chunks; full mode loads no chunk KV
    assert delta("ragcache_chunk_lookups_total", tier="cpu") == 4  # every lookup starts at the cpu tier
    assert total(after, "ragcache_requests_in_flight") == 0
    assert total(after, "ragcache_tier_bytes", tier="cpu") > 0
    assert ("ragcache_evictions_total", (("tier", "cpu"),)) in after
    assert not any(":" in name for name, _ in after)


def test_metrics_count_corrupt_and_foreign_entries_per_tier_and_answers_stay_right(served):
    from kv_fixtures import poison

    from ragcache.kvstore import DiskTier

    url, state = served
    rag, eng = state.pipeline(INDEX), state.engine
    three = dict(model=INDEX, max_tokens=12, extra_body={"ragcache": {"top_k": 3}})  # every chunk of the index
    question = user("Where is the Amber Hall?")
    intact = client(url).chat.completions.create(messages=question, **three).choices[0].message.content
    chunks = list(rag.retriever.index.chunks())
    disk = DiskTier(state.settings.store.ssd_cache_dir)
    files = [disk.path(eng.prompts.key(c, rag.namespace)) for c in chunks]
    saved = [f.read_bytes() for f in files]  # written through to disk when first computed
    asyncio.run_coroutine_threadsafe(eng.forget(chunks), state.loop).result(timeout=60)  # gone from the cpu tier too
    files[0].write_bytes(poison(saved[0], "v_scale.3"))  # int8, the default: NaN scales behind a valid crc32
    files[1].write_bytes(poison(saved[1], "k_scale.0", float("inf")))
    files[2].write_bytes(saved[2].replace(b'"ragcache-kv/2"', b'"ragcache-kv/9"', 1))  # a format not read here
    before = scrape(url)
    answer = client(url).chat.completions.create(messages=question, **three)
    after = scrape(url)

    def delta(name: str, tier: str) -> float:
        return total(after, name, tier=tier) - total(before, name, tier=tier)

    assert answer.choices[0].message.content == intact
    assert answer.model_extra["ragcache"]["metrics"]["tier_hits"] == {"computed": 3}
    assert (delta("ragcache_corrupt_entries_total", "disk"), delta("ragcache_foreign_entries_total", "disk")) == (2, 1)
    assert (delta("ragcache_corrupt_entries_total", "cpu"), delta("ragcache_foreign_entries_total", "cpu")) == (0, 0)
    cache = httpx.get(f"{url}/v1/cache", timeout=30).json()["tiers"]  # the same counts as GET /v1/cache
    for tier in ("cpu", "disk"):
        assert total(after, "ragcache_corrupt_entries_total", tier=tier) == cache[tier]["corrupt"]
        assert total(after, "ragcache_foreign_entries_total", tier=tier) == cache[tier]["foreign"]


def test_a_client_disconnect_mid_stream_aborts_its_vllm_request(served):
    url, _ = served
    before = scrape(url)
    body = {"model": INDEX, "messages": user("Tell me everything about Zorbia."), "stream": True,
            "max_tokens": 4000, "ignore_eos": True}  # a minute or more of decoding unless aborted
    t0 = time.monotonic()
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            chunk = json.loads(line[len("data: "):]) if line.startswith("data: {") else {}
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                break  # the first decoded piece: hang up
    assert httpx.get(f"{url}/health").json()["in_flight"] in (0, 1)
    wait_idle(url, timeout_s=30)
    assert time.monotonic() - t0 < 60
    after = scrape(url)
    assert total(after, "ragcache_requests_total", outcome="aborted") - total(
        before, "ragcache_requests_total", outcome="aborted") == 1
    assert total(after, "ragcache_requests_in_flight") == 0


def test_stop_strings_seed_and_max_tokens_are_honoured(served):
    url, _ = served
    c = client(url)
    question = user("What is the capital of Zorbia?")
    greedy = c.chat.completions.create(messages=question, **ASK).choices[0].message.content
    word = greedy.split()[-1].strip(".")  # the last word the model says
    stopped = c.chat.completions.create(messages=question, stop=[word], **ASK).choices[0]
    assert word not in stopped.message.content and greedy.startswith(stopped.message.content.strip())
    assert stopped.finish_reason == "stop"
    sampled = [c.chat.completions.create(messages=question, temperature=1.0, seed=7, **ASK).choices[0].message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1]
    short = c.chat.completions.create(messages=question, model=INDEX, max_tokens=2,
                                      extra_body={"ragcache": {"top_k": 2}})
    assert short.usage.completion_tokens == 2 and short.choices[0].finish_reason == "length"


def test_the_remote_pipeline_answers_with_the_sdk_objects(served):
    from ragcache.conversation import Turn
    from ragcache.pipeline import Answer
    from ragcache.server.client import RemotePipeline, ServerError, server_indexes

    url, _ = served
    assert server_indexes(url) == [INDEX]
    remote = RemotePipeline(url, INDEX)
    items = list(remote.stream("Who founded it?", top_k=2, max_tokens=12,
                               history=[Turn("user", "What is the capital of Zorbia?"), Turn("assistant", "Velmora.")]))
    answer = items[-1]
    assert isinstance(answer, Answer) and "".join(items[:-1]).strip() == answer.text
    assert answer.metrics.mode == "blend" and answer.metrics.reused_tokens > 0 and answer.metrics.ttft_s > 0
    assert answer.metrics.ratio_source == "settings" and answer.metrics.prompt_tokens > 0  # the whole record
    assert len(answer.sources) == 2 and all(s.tier in ("cpu", "disk") for s in answer.sources)
    assert sum(answer.metrics.tier_hits.values()) == 2
    full = remote.query("What is kelmet?", mode="full", top_k=2, max_tokens=4)
    assert full.metrics.mode == "full" and full.metrics.num_cached_tokens == 0 and full.text
    assert "cpu" in remote.cache_stats().tiers
    with pytest.raises(ServerError, match="names no index"):
        RemotePipeline(url, "nope").query("hi")


# ---- errors --------------------------------------------------------------------------------------


def test_errors_come_in_openai_shape_naming_the_field_and_the_fix(served):
    url, _ = served
    c = client(url)
    with pytest.raises(openai.NotFoundError, match="'nope' names no index") as e:
        c.chat.completions.create(model="nope", messages=user("hi"))
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="less than or equal to 2") as e:
        c.chat.completions.create(model=INDEX, messages=user("hi"), temperature=5)
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=INDEX, messages=user("hi"), extra_body={"ragcache": {"mode": "fast"}})
    assert e.value.body["param"] == "ragcache.mode"
    with pytest.raises(openai.BadRequestError, match="must be a non-empty user message"):
        c.chat.completions.create(model=INDEX, messages=[{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "hello"}])
    with pytest.raises(openai.BadRequestError, match=f"context is {MAX_MODEL_LEN}") as e:
        c.chat.completions.create(model=INDEX, messages=user("why? " * 6000))
    assert e.value.body["code"] == "context_length_exceeded"
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_out_of_range_seeds_and_lone_surrogates_are_400s_naming_the_field_and_leak_no_engine_request(served):
    url, state = served
    wait_idle(url)
    c = client(url)
    for seed, rule in ((2**70, "less than or equal to 9223372036854775807"),
                       (-(2**63) - 1, "greater than or equal to -9223372036854775808")):
        with pytest.raises(openai.BadRequestError, match=rule) as e:
            c.chat.completions.create(messages=user("What is kelmet?"), seed=seed, **ASK)
        assert e.value.body["param"] == "seed"
    assert c.chat.completions.create(messages=user("What is kelmet?"), seed=2**63 - 1, temperature=1.0,
                                     **ASK).choices[0].message.content  # the edge of the range is served
    # a lone UTF-16 surrogate: JSON allows the escape, UTF-8 does not (httpx cannot even encode it: raw bytes)
    for content, param in ((b'"x \\ud800 y"', "messages[0].content"),
                           (b'[{"type": "text", "text": "x \\udfff"}]', "messages[0].content")):
        raw = b'{"model": "zorbia", "max_tokens": 4, "messages": [{"role": "user", "content": ' + content + b"}]}"
        r = httpx.post(f"{url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400, r.text  # refused at the door, before retrieval (the embedder failed with 500)
        err = r.json()["error"]
        assert err["param"] == param and "lone UTF-16 surrogate" in err["message"]
    r = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": "zorbia", "stop": ["\\ud800"], "messages": '
                   b'[{"role": "user", "content": "hi"}]}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert httpx.get(f"{url}/health").json()["engine_unfinished_requests"] == 0
    assert total(scrape(url), "ragcache_engine_unfinished_requests") == 0

    # the engine itself: a seed vLLM cannot carry fails, and its request does not stay behind
    from ragcache.engine import SamplingOptions

    async def bad_seed() -> BaseException:
        prompt = state.engine.prompts.build("What is kelmet?", [])
        try:
            # SamplingOptions refuses the seed itself (as the HTTP schema does): built unchecked here
            # to show what vLLM does with one
            sampling = SamplingOptions.model_construct(temperature=1.0, top_p=1.0, stop=(), seed=2**70,
                                                       ignore_eos=False, min_tokens=0)
            await state.engine.generate(prompt, QueryOptions(mode="full", max_tokens=2, sampling=sampling))
        except Exception as exc:  # noqa: BLE001 - whatever vLLM raises
            return exc
        raise AssertionError("vLLM took a seed of 2**70")

    for _ in range(3):
        asyncio.run_coroutine_threadsafe(bad_seed(), state.loop).result(timeout=120)
    assert state.engine.num_unfinished_requests == 0
    wait_idle(url)


def test_an_empty_body_is_a_400_that_says_what_to_send(served):
    url, _ = served
    r = httpx.post(f"{url}/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "request body is empty" in r.json()["error"]["message"] and "None" not in r.json()["error"]["message"]


def test_over_max_in_flight_gets_429_and_a_missing_key_401(served):
    url, state = served
    serve = state.settings.serve
    body = {"model": INDEX, "messages": user("Describe Zorbia."), "stream": True, "max_tokens": 4000,
            "ignore_eos": True}
    serve.max_in_flight = 1
    try:
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            first = next(it)  # the first chunk: the request holds the only slot
            h = httpx.get(f"{url}/health").json()
            outcomes = {k: v for k, v in scrape(url).items() if k[0] == "ragcache_requests_total"}
            assert h["in_flight"] == 1, (first, h, outcomes, [next(it, None) for _ in range(6)])
            with pytest.raises(openai.RateLimitError, match="serve.max_in_flight = 1"):
                client(url).chat.completions.create(model=INDEX, messages=user("hi"), max_tokens=2)
    finally:
        serve.max_in_flight = 16
    wait_idle(url)
    serve.api_key = "s3cret"
    try:
        with pytest.raises(openai.AuthenticationError, match="Authorization: Bearer"):
            client(url).models.list()
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert [m.id for m in openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret").models.list().data] == [INDEX]
        assert httpx.get(f"{url}/health").status_code == 200  # liveness stays open
    finally:
        serve.api_key = ""


# ---- SDK -----------------------------------------------------------------------------------------


def test_sdk_aquery_and_astream_on_the_async_engine_match_the_server(served):
    from ragcache.pipeline import Answer, RAGPipeline

    url, state = served
    question = "What is the capital of Zorbia?"
    over_http = client(url).chat.completions.create(messages=user(question), **ASK).choices[0].message.content
    rag = RAGPipeline(state.settings, state.pipeline(INDEX).index_path, state.engine)

    async def sdk() -> tuple[Answer, list]:
        answer = await rag.aquery(question, top_k=2, max_tokens=12)
        items = [item async for item in rag.astream(question, top_k=2, max_tokens=12)]
        return answer, items

    answer, items = asyncio.run_coroutine_threadsafe(sdk(), state.loop).result(timeout=300)
    assert answer.text == over_http and answer.metrics.reused_tokens > 0 and len(answer.sources) == 2
    assert isinstance(items[-1], Answer) and "".join(items[:-1]).strip() == items[-1].text == over_http
    with pytest.raises(TypeError, match="aquery"):
        rag.query(question)


def test_the_async_engine_precomputes_batches_and_scores_as_the_sync_one_does(served):
    """The server's AsyncBlendEngine has BlendEngine's methods (awaited): precompute, stored_where,
    generate_many and continuation_logprobs serve as they do on the sync engine."""
    from tests.test_engine_blend import make_chunks

    _, state = served
    eng = state.engine
    chunks = make_chunks(eng, ["Zorbian ferries leave Velmora harbour at dawn for the outer islands."])

    async def run():
        await eng.forget(chunks)
        report = await eng.precompute(chunks)
        where = await eng.stored_where(chunks)
        prompt = eng.prompts.build("When do the ferries leave?", chunks)
        gens = await eng.generate_many([prompt, prompt], QueryOptions(mode="full", max_tokens=4), logprobs=-1)
        scores = await eng.continuation_logprobs(prompt, gens[0].token_ids, QueryOptions(mode="prefix"))
        return report, where, gens, scores

    report, where, gens, scores = asyncio.run_coroutine_threadsafe(run(), state.loop).result(timeout=300)
    assert report.computed == 1 and report.tokens == len(eng.prompts.unit_ids(chunks[0])) and where[0]
    assert len(gens) == 2 and all(g.token_ids for g in gens)
    first = gens[0].token_ids[0]
    assert len(scores) == len(gens[0].token_ids) and all(lp <= 0 for lp in scores)
    # the same first-token log-probability by both routes (prefill of the prompt vs of prompt + answer;
    # bf16 rounds the two forwards apart by up to a few hundredths)
    assert scores[0] == pytest.approx(gens[0].first_token_logprobs[first], abs=0.1)

