"""Retrieval: question -> top-k chunks with scores -> stable order.

Owns: :class:`Retriever` (query embedding + search over a persisted index: FAISS through
llama-index (:class:`~ragcache.index.faiss_index.Index`) or pgvector (:class:`~ragcache.index.pg_index.PgIndex`)), :class:`RetrievedChunk`, and the *stable order* rule that turns a
set of retrieved chunks into one deterministic sequence (:func:`stable_order`, also as the
llama-index node postprocessor :class:`StableOrderPostprocessor`). Must not import vLLM, nor
``app/`` or ``ui/``, nor the engine or pipeline.

Why a stable order: the prompt is assembled at token level from the chunks in the order given, and
the engine reuses each chunk's KV; the same set of chunks must always give the same token
sequence, whatever order the scores put them in (scores move with the question; the set often
does not). The rule (:func:`stable_order_key`): by ``doc_id``, then ``position`` in the document,
then ``chunk_id`` — so chunks of one document keep their reading order and documents are ordered
by id. Plain string/integer comparison: independent of locale, platform and Python hash seed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, TypeVar

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from ragcache.chunks import Chunk
from ragcache.index.faiss_index import Index
from ragcache.index.manifest import IndexMismatchError, IndexNotFoundError
from ragcache.index.nodes import META_CHUNK_ID, META_DOC_ID, META_POSITION

if TYPE_CHECKING:
    from ragcache.config import Settings

__all__ = [
    "Index", "IndexNotFoundError", "IndexMismatchError", "RetrievedChunk", "Retriever",
    "stable_order", "stable_order_key", "StableOrderPostprocessor",
]


@dataclass(frozen=True)
class RetrievedChunk:
    """A chunk found for a question.

    Attributes:
        chunk: the chunk, with its token ids fixed at ingest.
        score: cosine similarity between the question and chunk embeddings (unit vectors, FAISS
            inner product), in [-1, 1]; higher is closer.
    """

    chunk: Chunk
    score: float


def stable_order_key(chunk: Chunk) -> tuple[str, int, str]:
    """Sort key of the stable order: ``(doc_id, position, chunk_id)``."""
    return (chunk.doc_id, chunk.position, chunk.chunk_id)


T = TypeVar("T", Chunk, RetrievedChunk)


def stable_order(chunks: Iterable[T]) -> list[T]:
    """``chunks`` (Chunk or RetrievedChunk) sorted by doc_id, then position, then chunk_id.

    The same set always gives the same list, whatever the input order (the sort is total on
    distinct chunks; exact duplicates are interchangeable). Scores play no part.
    """
    return sorted(chunks, key=lambda c: stable_order_key(c.chunk if isinstance(c, RetrievedChunk) else c))


def _node_key(nws: NodeWithScore) -> tuple[str, int, str]:
    m = nws.node.metadata
    if META_DOC_ID in m and META_POSITION in m:
        return (str(m[META_DOC_ID]), int(m[META_POSITION]), str(m.get(META_CHUNK_ID, nws.node.node_id)))
    # a node not written by ragcache ingest: its source document and node id stand in
    return (str(nws.node.ref_doc_id or ""), 0, nws.node.node_id)


class StableOrderPostprocessor(BaseNodePostprocessor):
    """llama-index node postprocessor applying :func:`stable_order` to retrieved nodes.

    Keeps every node and its score; only the order changes. Use it last in a query engine's
    ``node_postprocessors`` so the LLM sees chunks in the stable order.
    """

    @classmethod
    def class_name(cls) -> str:
        return "StableOrderPostprocessor"

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        return sorted(nodes, key=_node_key)


class Retriever:
    """Top-k chunk search over an :class:`Index` (llama-index VectorIndexRetriever on FAISS).

    Args:
        index: a loaded index.
        top_k: default number of chunks per question (``retrieval.top_k``).
    """

    def __init__(self, index: Index, top_k: int = 5) -> None:
        self.index = index
        self.top_k = top_k
        self._retrievers: dict[int, Any] = {}

    @classmethod
    def from_settings(cls, settings: "Settings", index: str | os.PathLike[str]) -> "Retriever":
        """Load the index ``index`` (name or folder; a name with ``ingest.vector_store =
        "pgvector"``) and use ``retrieval.top_k``.

        Raises:
            IndexNotFoundError: no index there; IndexMismatchError: other embedding model.
            PgUnavailableError: pgvector's database cannot be reached.
        """
        from ragcache.index.catalog import catalog

        return cls(catalog(settings).load(index), top_k=settings.retrieval.top_k)

    def llama_retriever(self, top_k: int) -> Any:
        """The underlying llama-index retriever (for query engines; FAISS indexes only), cached per ``top_k``."""
        if top_k not in self._retrievers:
            self._retrievers[top_k] = self.index.vector_index.as_retriever(similarity_top_k=top_k)
        return self._retrievers[top_k]

    def retrieve(self, question: str, top_k: int | None = None) -> list[RetrievedChunk]:
        """The ``top_k`` chunks closest to ``question``, best first (ties by the stable order).

        Chunks with identical text (same chunk_id, e.g. the same passage in two files) are
        returned once, with the best score. Fewer than ``top_k`` come back when the index is small.

        Raises:
            ValueError: ``top_k`` < 1.
        """
        k = self.top_k if top_k is None else top_k
        if k < 1:
            raise ValueError(f"top_k must be >= 1, got {k}")
        found: dict[str, RetrievedChunk] = {}
        for chunk, score in self.index.search(question, k * 2):  # headroom for duplicate texts
            best = found.get(chunk.chunk_id)
            if best is None or score > best.score:
                found[chunk.chunk_id] = RetrievedChunk(chunk, score)
        ranked = sorted(found.values(), key=lambda r: (-r.score, stable_order_key(r.chunk)))
        return ranked[:k]
