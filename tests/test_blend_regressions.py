"""Blend answers that once went wrong, through the real engine on the real SmolLM2 in the dtype
``auto`` picks on the host, i.e. what a user gets there: bfloat16 on AVX512-BF16/AMX CPUs whose
bf16 matmul is measured faster (where they were found), float32 elsewhere (where bf16 is emulated
or slower: 83 s against 31 s for this module on an Ice Lake-class Xeon; the heapq answer is
loop-free in both dtypes there).

The heapq loop (issue "Blend answers like full prefill on unseen data"): on the demo corpus, "What
does heapq.heappush do?" retrieves three heapq and two shutil pydoc chunks (~2.1k tokens). With
the question's attention scored token by token, the 15% budget went to the tokens that draw
attention whatever the question: " the", ".", whitespace runs, and 142 of 318 to the last tenth of
the context; none of the 31 "heap" tokens of the passages was recomputed, and the answer looped on
their stale KV ("The heapq.heapq.heapq.heapq..."). Chosen in aligned runs of 8 tokens (the
default ``blend.granule``), each high-attention token brings its neighbours, content words
included, and the answer is about heappush, as full prefill's is.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def demo_rag(tmp_path_factory):
    from app.demo_cmd import render_corpus
    from ragcache.config import Settings
    from ragcache.pipeline import RAGPipeline

    work = tmp_path_factory.mktemp("demo")
    paths = [p for p in render_corpus(work / "docs") if p.stem in ("heapq", "shutil")]
    settings = Settings.load(
        store={"ssd_cache_dir": str(work / "kv"), "remote_url": "", "cpu_kv_pool_gb": 1.0},
        engine={"dtype": "auto", "kv_cache_memory_bytes": 512 << 20, "in_process": True, "max_tokens": 32},
        ingest={"index_dir": str(work / "indexes")},
    )
    rag = RAGPipeline.open(settings, index="demo")
    rag.ingest(paths)
    yield rag
    rag.engine.close()


def test_the_heapq_question_is_answered_without_a_repetition_loop(demo_rag):
    question = "What does heapq.heappush do?"
    blend = demo_rag.query(question, mode="blend")
    full = demo_rag.query(question, mode="full")
    assert [s.title or s.doc_id for s in blend.sources].count("heapq") >= 2
    assert not full.metrics.repetition_loop, full.text
    assert not blend.metrics.repetition_loop, blend.text
    assert "heappush" in blend.text or "heap" in blend.text.lower(), blend.text
