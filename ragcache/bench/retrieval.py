"""Retrieval latency, p50 and p99 in milliseconds, at 1k, 10k and 100k chunks (``ragcache bench retrieval``).

For each size an in-memory :class:`ragcache.index.faiss_index.Index` is filled with synthetic chunks whose
embeddings are random unit vectors (384 floats, the all-MiniLM-L6-v2 dimension), through the same
llama-index VectorStoreIndex + FAISS (IndexIDMap2 over IndexFlatIP, exact search) that ingest
builds. Three latencies per query, top-k chunks each:

- ``faiss``: the vector store's query alone (llama-index FaissMapVectorStore -> FAISS search),
  with FAISS's default OpenMP threads and again with one thread (``faiss1``): on a busy machine
  one-query searches are faster single-threaded;
- ``search``: the llama-index retriever given the query embedding: FAISS + docstore lookup + nodes;
- ``e2e``: :meth:`ragcache.index.retrieval.Retriever.retrieve` from question text: query embedding with
  the real embedding model on CPU, search, conversion to Chunks (the dataset's questions).

``build_s`` is the time to insert the synthetic nodes (embeddings given, nothing embedded). No LLM,
no vLLM. Never app/ or ui/.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

from ragcache.bench.common import BenchConfigError, Progress


def _percentiles(samples_s: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds."""
    ms = sorted(s * 1e3 for s in samples_s)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return statistics.median(ms), p99


def _unit_vectors(rng: Any, n: int, dim: int) -> Any:
    import numpy as np

    v = rng.standard_normal((n, dim), dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _synthetic_index(n: int, dim: int, embed_model: Any, rng: Any, batch: int = 10_000) -> Any:
    from ragcache.chunks import Chunk, chunk_id_for
    from ragcache.index.faiss_index import Index
    from ragcache.index.manifest import BuildInfo
    from ragcache.index.nodes import chunk_to_node

    build = BuildInfo(chunk_size=512, chunk_overlap=0, llm="synthetic", llm_fingerprint="0",
                      embedding_model="synthetic", dim=dim)
    index = Index.create(build, embed_model)
    for start in range(0, n, batch):
        nodes = []
        for i, vec in enumerate(_unit_vectors(rng, min(batch, n - start), dim), start=start):
            text = f"synthetic chunk {i}"
            node = chunk_to_node(Chunk(chunk_id_for(text), f"doc{i // 8}", "", i % 8, text, tuple(range(16))))
            node.embedding = vec.tolist()
            nodes.append(node)
        index.add_nodes(nodes)
    return index


def run_retrieval(settings: Any, questions: Sequence[str], *, sizes: Sequence[int] = (1000, 10_000, 100_000),
                  queries: int = 200, top_k: int = 5, dim: int = 384, seed: int = 0,
                  progress: Progress | None = None) -> dict[str, Any]:
    """Search latencies at each index size (see the module docstring).

    Args:
        settings: ragcache settings (the embedding model).
        questions: asked end to end (``e2e``), each once, after one untimed question.
        sizes: chunks per synthetic index.
        queries: random query vectors timed for ``faiss``, ``faiss1`` and ``search``.

    Returns:
        ``{"benchmark": "retrieval", "results": [{"chunks", "build_s", "<path>_p50_ms", "<path>_p99_ms"}...],
        "query_embedding_p50_ms", ...}``; milliseconds, ``build_s`` in seconds.

    Raises:
        BenchConfigError: no questions, or a size or count below 1.
    """
    import faiss
    import numpy as np
    from llama_index.core.schema import QueryBundle
    from llama_index.core.vector_stores.types import VectorStoreQuery

    from ragcache.index.retrieval import Retriever
    from ragcache.models import load_embed_model

    if not questions or min(sizes, default=0) < 1 or queries < 1 or top_k < 1:
        raise BenchConfigError("bench retrieval needs questions, and sizes, --queries and --top-k of at least 1")
    say = progress or (lambda _msg: None)
    embed_model = load_embed_model(settings)
    rng = np.random.default_rng(seed)
    embed_model.get_query_embedding("warm-up")
    embed_times = []
    for q in questions:
        t = time.perf_counter()
        embed_model.get_query_embedding(q)
        embed_times.append(time.perf_counter() - t)

    rows = []
    for n in sizes:
        t0 = time.perf_counter()
        index = _synthetic_index(n, dim, embed_model, rng)
        build_s = time.perf_counter() - t0
        store = index.vector_index.vector_store
        retriever = Retriever(index, top_k=top_k)
        llama = retriever.llama_retriever(top_k)
        vectors = _unit_vectors(rng, queries, dim).tolist()
        timings: dict[str, list[float]] = {"faiss": [], "faiss1": [], "search": [], "e2e": []}
        for q in vectors[:5]:  # warm-up
            llama.retrieve(QueryBundle(query_str="", embedding=q))
        for q in vectors:
            t = time.perf_counter()
            res = store.query(VectorStoreQuery(query_embedding=q, similarity_top_k=top_k))
            timings["faiss"].append(time.perf_counter() - t)
            assert len(res.ids) == min(top_k, n)
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)
        for q in vectors:
            t = time.perf_counter()
            store.query(VectorStoreQuery(query_embedding=q, similarity_top_k=top_k))
            timings["faiss1"].append(time.perf_counter() - t)
        faiss.omp_set_num_threads(threads)
        for q in vectors:
            t = time.perf_counter()
            llama.retrieve(QueryBundle(query_str="", embedding=q))
            timings["search"].append(time.perf_counter() - t)
        for q in questions:
            t = time.perf_counter()
            found = retriever.retrieve(q)
            timings["e2e"].append(time.perf_counter() - t)
            assert len(found) == min(top_k, n)
        row: dict[str, Any] = {"chunks": n, "build_s": round(build_s, 2)}
        for name, samples in timings.items():
            p50, p99 = _percentiles(samples)
            row[f"{name}_p50_ms"], row[f"{name}_p99_ms"] = round(p50, 3), round(p99, 3)
        rows.append(row)
        say(f"{n} chunks done ({build_s:.1f} s to build)")
        del index, retriever, llama, store

    emb_p50, emb_p99 = _percentiles(embed_times)
    return {"benchmark": "retrieval", "units": "milliseconds; build_s in seconds", "top_k": top_k, "dim": dim,
            "queries": queries, "e2e_queries": len(questions), "faiss_index": "IndexIDMap2(IndexFlatIP), exact",
            "faiss_omp_threads": faiss.omp_get_max_threads(), "embedding_model": settings.models.embedding_model,
            "query_embedding_p50_ms": round(emb_p50, 3), "query_embedding_p99_ms": round(emb_p99, 3),
            "results": rows}
