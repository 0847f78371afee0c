#!/usr/bin/env python
"""Retrieval latency, p50 and p99 in milliseconds, at 1k, 10k and 100k chunks.

For each size an in-memory :class:`ragcache.index.Index` is filled with synthetic chunks whose
embeddings are random unit vectors (384 floats, the all-MiniLM-L6-v2 dimension), through the same
llama-index VectorStoreIndex + FAISS (IndexIDMap2 over IndexFlatIP, exact search) that ingest
builds. Three latencies per query, top-k chunks each:

- ``faiss``: the vector store's query alone (llama-index FaissMapVectorStore -> FAISS search),
  with FAISS's default OpenMP threads and again with one thread (``faiss1``): on a busy machine
  one-query searches are faster single-threaded;
- ``search``: the llama-index retriever given the query embedding: FAISS + docstore lookup + nodes;
- ``e2e``: :meth:`ragcache.retrieval.Retriever.retrieve` from question text: query embedding with
  the real embedding model on CPU, search, conversion to Chunks (HotpotQA questions when
  ../shared/data is present, else generated sentences).

``build_s`` is the time to insert the synthetic nodes (embeddings given, nothing embedded).

    .venv/bin/python scripts/bench_retrieval.py --out results/bench_retrieval.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragcache.chunks import Chunk, chunk_id_for  # noqa: E402
from ragcache.config import Settings  # noqa: E402
from ragcache.index import BuildInfo, Index, chunk_to_node  # noqa: E402
from ragcache.models import load_embed_model  # noqa: E402
from ragcache.retrieval import Retriever  # noqa: E402

HOTPOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "hotpotqa" / "hotpotqa_distractor_100.json"


def percentiles(samples_s: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds."""
    ms = sorted(s * 1e3 for s in samples_s)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return statistics.median(ms), p99


def unit_vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim), dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def synthetic_index(n: int, dim: int, embed_model, rng: np.random.Generator, batch: int = 10_000) -> Index:
    build = BuildInfo(chunk_size=512, chunk_overlap=0, llm="synthetic", llm_fingerprint="0",
                      embedding_model="synthetic", dim=dim)
    index = Index.create(build, embed_model)
    for start in range(0, n, batch):
        vecs = unit_vectors(rng, min(batch, n - start), dim)
        nodes = []
        for i, vec in enumerate(vecs, start=start):
            text = f"synthetic chunk {i}"
            node = chunk_to_node(Chunk(chunk_id_for(text), f"doc{i // 8}", "", i % 8, text, tuple(range(16))))
            node.embedding = vec.tolist()
            nodes.append(node)
        index.add_nodes(nodes)
    return index


def questions(n: int) -> list[str]:
    if HOTPOT.is_file():
        qs = [r["question"] for r in json.loads(HOTPOT.read_text())]
    else:
        qs = [f"Which year did the event number {i} described in the archive take place?" for i in range(100)]
    return [qs[i % len(qs)] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000", help="comma-separated chunk counts")
    ap.add_argument("--queries", type=int, default=200, help="queries timed for faiss and search")
    ap.add_argument("--e2e-queries", type=int, default=50, help="queries timed end to end (with embedding)")
    ap.add_argument("--top-k", type=int, default=5, help="chunks per query")
    ap.add_argument("--dim", type=int, default=384, help="embedding dimension")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench_retrieval.json", help="JSON results file")
    args = ap.parse_args()

    import faiss
    from llama_index.core.schema import QueryBundle
    from llama_index.core.vector_stores.types import VectorStoreQuery

    settings = Settings.load()
    embed_model = load_embed_model(settings)
    rng = np.random.default_rng(args.seed)
    qs = questions(args.e2e_queries)
    embed_model.get_query_embedding("warm-up")
    embed_times = []
    for q in qs:
        t = time.perf_counter()
        embed_model.get_query_embedding(q)
        embed_times.append(time.perf_counter() - t)

    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        t0 = time.perf_counter()
        index = synthetic_index(n, args.dim, embed_model, rng)
        build_s = time.perf_counter() - t0
        store = index.vector_index.vector_store
        retriever = Retriever(index, top_k=args.top_k)
        llama = retriever.llama_retriever(args.top_k)
        queries = unit_vectors(rng, args.queries, args.dim).tolist()

        faiss_t, faiss1_t, search_t, e2e_t = [], [], [], []
        for q in queries[:5]:  # warm-up
            llama.retrieve(QueryBundle(query_str="", embedding=q))
        for q in queries:
            t = time.perf_counter()
            res = store.query(VectorStoreQuery(query_embedding=q, similarity_top_k=args.top_k))
            faiss_t.append(time.perf_counter() - t)
            assert len(res.ids) == min(args.top_k, n)
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)
        for q in queries:
            t = time.perf_counter()
            store.query(VectorStoreQuery(query_embedding=q, similarity_top_k=args.top_k))
            faiss1_t.append(time.perf_counter() - t)
        faiss.omp_set_num_threads(threads)
        for q in queries:
            t = time.perf_counter()
            llama.retrieve(QueryBundle(query_str="", embedding=q))
            search_t.append(time.perf_counter() - t)
        for q in qs:
            t = time.perf_counter()
            found = retriever.retrieve(q)
            e2e_t.append(time.perf_counter() - t)
            assert len(found) == min(args.top_k, n)
        row = {"chunks": n, "build_s": round(build_s, 2)}
        for name, samples in (("faiss", faiss_t), ("faiss1", faiss1_t), ("search", search_t), ("e2e", e2e_t)):
            p50, p99 = percentiles(samples)
            row[f"{name}_p50_ms"], row[f"{name}_p99_ms"] = round(p50, 3), round(p99, 3)
        rows.append(row)
        print(f"  {n} chunks done ({build_s:.1f} s to build)", file=sys.stderr)
        del index, retriever, llama, store

    emb_p50, emb_p99 = percentiles(embed_times)
    cols = [("faiss", "faiss"), ("faiss 1 thread", "faiss1"), ("search", "search"), ("e2e", "e2e")]
    print(f"{'chunks':>8} {'build s':>8}" + "".join(f"  {name + ' p50/p99 ms':>26}" for name, _ in cols))
    for r in rows:
        cells = "".join(f"  {r[k + '_p50_ms']:>12.2f} / {r[k + '_p99_ms']:<11.2f}" for _, k in cols)
        print(f"{r['chunks']:>8} {r['build_s']:>8.1f}{cells}")
    print(f"query embedding alone: p50 {emb_p50:.1f} ms, p99 {emb_p99:.1f} ms "
          f"({len(embed_times)} questions, {'HotpotQA' if HOTPOT.is_file() else 'generated'})")

    import torch

    result = {
        "benchmark": "retrieval latency",
        "units": "milliseconds; build_s in seconds",
        "top_k": args.top_k, "dim": args.dim, "queries": args.queries, "e2e_queries": args.e2e_queries,
        "faiss_index": "IndexIDMap2(IndexFlatIP), exact",
        "faiss_omp_threads": faiss.omp_get_max_threads(),
        "embedding_model": settings.models.embedding_model,
        "query_embedding_p50_ms": round(emb_p50, 3), "query_embedding_p99_ms": round(emb_p99, 3),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "load_avg_1m": os.getloadavg()[0], "python": platform.python_version()},
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
