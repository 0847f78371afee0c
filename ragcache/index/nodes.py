"""A chunk as a llama-index node: the form both index backends (FAISS, pgvector) store it in.

Owns: the node metadata keys ragcache writes, the deterministic node id of a chunk occurrence, and
the conversion between :class:`ragcache.chunks.Chunk` and llama-index's ``TextNode``.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from ragcache.chunks import Chunk

if TYPE_CHECKING:  # heavy imports stay lazy: `ragcache --help` must not load torch
    from llama_index.core.schema import BaseNode, TextNode

#: node metadata keys written by ragcache (see :func:`chunk_to_node`)
META_DOC_ID, META_TITLE, META_POSITION = "doc_id", "title", "position"
META_CHUNK_ID, META_TOKEN_IDS, META_SOURCE = "chunk_id", "token_ids", "source"
_ALL_META = (META_DOC_ID, META_TITLE, META_POSITION, META_CHUNK_ID, META_TOKEN_IDS, META_SOURCE)


def node_id_for(doc_id: str, position: int, chunk_id: str) -> str:
    """Deterministic docstore/FAISS node id of a chunk occurrence (32 hex chars)."""
    return hashlib.sha256(f"{doc_id}\x00{position}\x00{chunk_id}".encode()).hexdigest()[:32]


def chunk_to_node(chunk: Chunk, source: str = "") -> "TextNode":
    """A llama-index TextNode carrying ``chunk``; only the title enters the embedding text and
    no metadata enters the LLM text (the LLM sees exactly ``chunk.token_ids``)."""
    from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode

    metadata = {
        META_DOC_ID: chunk.doc_id,
        META_TITLE: chunk.title,
        META_POSITION: chunk.position,
        META_CHUNK_ID: chunk.chunk_id,
        META_TOKEN_IDS: list(chunk.token_ids),
        META_SOURCE: source,
    }
    embed_excluded = [k for k in _ALL_META if k != META_TITLE or not chunk.title]
    return TextNode(
        id_=node_id_for(chunk.doc_id, chunk.position, chunk.chunk_id),
        text=chunk.text,
        metadata=metadata,
        excluded_embed_metadata_keys=embed_excluded,
        excluded_llm_metadata_keys=list(_ALL_META),
        relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=chunk.doc_id)},
    )


def node_to_chunk(node: "BaseNode") -> Chunk:
    """The :class:`Chunk` stored in a node written by :func:`chunk_to_node`.

    Raises:
        KeyError: the node lacks ragcache's metadata (not written by ragcache ingest).
    """
    m = node.metadata
    return Chunk(
        chunk_id=m[META_CHUNK_ID],
        doc_id=m[META_DOC_ID],
        title=m.get(META_TITLE, ""),
        position=int(m[META_POSITION]),
        text=node.get_content(),
        token_ids=tuple(m[META_TOKEN_IDS]),
    )
