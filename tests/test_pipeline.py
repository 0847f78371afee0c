"""RAGPipeline SDK, llama-index integration and the `ragcache` CLI on a small real index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, ZORBIA_DOCS

pytestmark = pytest.mark.integration

DOCS = ZORBIA_DOCS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def rag(engine, engine_settings, corpus, tmp_path_factory):
    from ragcache.pipeline import RAGPipeline

    index_dir = tmp_path_factory.mktemp("indexes")
    settings = engine_settings.model_copy(deep=True)
    settings.ingest.index_dir = index_dir
    pipe = RAGPipeline(settings, "zorbia", engine)
    report = pipe.ingest([corpus])
    assert report.chunks_added == len(DOCS)
    return pipe


def test_ingest_precomputes_kv_of_every_new_chunk(rag):
    chunks = [r.chunk for r in rag.retrieve("Zorbia", top_k=10)]
    assert len(chunks) == len(DOCS)
    assert all(tier is not None for tier in rag.engine.stored_tiers(chunks))


def test_query_returns_sources_and_metrics_with_reuse(rag):
    answer = rag.query("What is the capital of Zorbia?", mode="blend", top_k=3)
    assert answer.text
    assert len(answer.sources) == 3 and any("Velmora" in s.text for s in answer.sources)
    assert all(s.tier in ("cpu", "disk", "device", "remote") for s in answer.sources)
    m = answer.metrics
    assert m.mode == "blend" and m.reused_tokens > 0 and m.recomputed_tokens > 0
    assert m.ttft_s > 0 and m.retrieval_s > 0 and m.total_s >= m.retrieval_s
    assert sum(m.tier_hits.values()) == 3
    # stable order: same set of chunks, same prompt, whatever the score order
    again = rag.query("Velmora capital Zorbia?", mode="blend", top_k=3)
    assert [s.chunk_id for s in again.sources] == [s.chunk_id for s in answer.sources]


def test_lazy_ingest_computes_kv_at_first_retrieval_stores_it_and_serves_it_from_a_tier_after(
        engine, engine_settings, corpus, tmp_path):
    """``kv = "lazy"``: the ingest stores no KV; the first blend computes each retrieved chunk's KV in
    the request (tier "computed") and stores it; the same question again is served from a tier,
    with the same answer (float32: the stored KV is the KV that was computed)."""
    from ragcache.pipeline import RAGPipeline

    settings = engine_settings.model_copy(deep=True)
    settings.ingest.index_dir = tmp_path / "indexes"
    pipe = RAGPipeline(settings, "lazy", engine)
    # an index namespace of its own: no other test's stored KV (the same texts) can serve these chunks
    report = pipe.ingest([corpus], kv="lazy", namespace="lazy-kv")
    assert report.chunks_added == len(DOCS)
    question = "What is the capital of Zorbia?"
    chunks = [r.chunk for r in pipe.retrieve(question, top_k=2)]
    assert engine.stored_tiers(chunks, "lazy-kv") == [None, None]  # nothing computed at ingest

    first = pipe.query(question, mode="blend", top_k=2)
    assert [s.chunk_id for s in first.sources] == [c.chunk_id for c in chunks]
    assert [s.tier for s in first.sources] == ["computed", "computed"] and first.text.strip()
    m = first.metrics
    assert m.tier_hits == {"computed": 2} and m.head_tier == "computed"  # the prompt head's KV too
    assert m.missing_computed_tokens >= sum(c.num_tokens for c in chunks) and m.reused_tokens > 0
    assert all(t in ("cpu", "disk") for t in engine.stored_tiers(chunks, "lazy-kv"))  # stored by the request

    second = pipe.query(question, mode="blend", top_k=2)
    assert all(s.tier in ("cpu", "disk") for s in second.sources)
    assert "computed" not in second.metrics.tier_hits and second.metrics.missing_computed_tokens == 0
    assert second.text == first.text

def test_full_mode_reuses_nothing(rag):
    answer = rag.query("What is kelmet?", mode="full", top_k=2)
    assert answer.metrics.reused_tokens == 0 and all(s.tier == "" for s in answer.sources)


def test_stream_yields_text_then_answer(rag):
    items = list(rag.stream("Where does the parliament meet?", top_k=2, max_tokens=16))
    answer = items[-1]
    assert all(isinstance(i, str) for i in items[:-1]) and answer.metrics.reused_tokens > 0
    assert "".join(items[:-1]).strip() == answer.text


def test_bad_questions_get_clear_errors(rag, engine, engine_settings, tmp_path):
    from ragcache.index.manifest import IndexNotFoundError
    from ragcache.pipeline import RAGPipeline
    from ragcache.prompt import PromptTooLongError

    with pytest.raises(ValueError, match="empty"):
        rag.query("   ")
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        rag.query("why? " * 9000)
    settings = engine_settings.model_copy(deep=True)
    settings.ingest.index_dir = tmp_path
    with pytest.raises(IndexNotFoundError, match="ragcache ingest"):
        RAGPipeline(settings, "nothing-here", engine).query("anything?")


def test_llama_index_query_engine_and_llm(rag):
    from ragcache.integrations.llama_index import RagcacheLLM, RagcacheQueryEngine

    qe = RagcacheQueryEngine(pipeline=rag, top_k=2)
    resp = qe.query("What is the capital of Zorbia?")
    assert str(resp) and len(resp.source_nodes) == 2
    assert resp.metadata["reused_tokens"] > 0 and resp.metadata["mode"] == "blend"
    assert resp.source_nodes[0].node.metadata["kv_tier"]

    streaming = RagcacheQueryEngine(pipeline=rag, top_k=2, streaming=True).query("What is kelmet?")
    text = "".join(streaming.response_gen)
    assert text.strip() and len(streaming.source_nodes) == 2 and streaming.metadata["ttft_s"] > 0

    llm = RagcacheLLM(rag.engine, max_tokens=12)
    prompt = "The capital of France is"
    done = llm.complete(prompt)
    pieces = list(llm.stream_complete(prompt))
    assert done.text and pieces[-1].text == done.text


def test_cli_ingest_then_ask_json(corpus, tmp_path):
    env = dict(os.environ, RAGCACHE_INGEST__INDEX_DIR=str(tmp_path / "idx"),
               RAGCACHE_STORE__SSD_CACHE_DIR=str(tmp_path / "kv"), RAGCACHE_ENGINE__MAX_TOKENS="16",
               RAGCACHE_ENGINE__KV_CACHE_MEMORY_BYTES=str(1 << 30),
               RAGCACHE_BLEND__MIN_RECOMPUTE_TOKENS="0")  # short documents: no recompute floor
    cli = [sys.executable, "-m", "app.cli"]
    r = subprocess.run(cli + ["ingest", str(corpus), "--index", "cli", "--quiet"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "3 chunks added" in r.stdout and "KV" in r.stdout
    r = subprocess.run(cli + ["ask", "What is the capital of Zorbia?", "--index", "cli", "--json", "--top-k", "2",
                              "--mode", "blend"], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)  # stdout is exactly the JSON object (engine logs go to stderr)
    assert set(out) == {"answer", "sources", "metrics"}
    # the explicit mode overrides engine.mode = "auto" (which sends these ~40-token passages to full prefill)
    assert (out["metrics"]["route"], out["metrics"]["route_rule"]) == ("blend", "explicit")
    assert len(out["sources"]) == 2 and out["metrics"]["reused_tokens"] > 0
    assert out["sources"][0]["tier"] in ("cpu", "disk")
    r = subprocess.run(cli + ["ask", "anything?", "--index", "missing"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "ragcache ingest" in r.stderr
    r = subprocess.run(cli + ["ask", "anything?", "--index", "cli", "--recompute-ratio", "2"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--recompute-ratio 2.0: must be in [0, 1]" in r.stderr


def test_aquery_and_astream_on_the_sync_engine_match_query_and_stream(rag):
    """On a BlendEngine the async methods run the sync call in a worker thread: same answers."""
    import asyncio

    from ragcache.pipeline import Answer

    question = "What is the capital of Zorbia?"
    alone = rag.query(question, top_k=2, max_tokens=12)

    async def run() -> tuple[Answer, list]:
        answer = await rag.aquery(question, top_k=2, max_tokens=12)
        items = [item async for item in rag.astream(question, top_k=2, max_tokens=12)]
        return answer, items

    answer, items = asyncio.run(run())
    assert answer.text == alone.text and answer.metrics.reused_tokens > 0
    assert isinstance(items[-1], Answer) and "".join(items[:-1]).strip() == items[-1].text == alone.text


def test_a_follow_up_sees_the_conversation_and_retrieves_with_the_previous_question(rag):
    from ragcache.conversation import Turn

    follow_q = "Tell me more about that."  # no content of its own: only the rule can find the right document
    alone = rag.retrieve(follow_q, top_k=1)[0].chunk.doc_id
    q1 = next(q for q in ("What is the capital of Zorbia?", "What is kelmet?", "How many seats has the Amber Hall?")
              if rag.retrieve(q, top_k=1)[0].chunk.doc_id != alone)
    first = rag.query(q1, top_k=1, max_tokens=12)
    follow = rag.query(follow_q, top_k=1, max_tokens=12, history=[Turn("user", q1), Turn("assistant", first.text)])
    assert follow.sources[0].doc_id == first.sources[0].doc_id != alone
    tail = rag.engine.tokenizer.decode(follow.prompt.token_ids[follow.prompt.ctx_len:])
    assert f"Assistant: {first.text}" in tail and follow.metrics.reused_tokens > 0
