"""The FAISS index: a llama-index VectorStoreIndex over a deletable FAISS store, in an index folder.

Owns: :class:`Index` (load, create, persist, search, the chunks it holds), the FAISS vector store
class every index uses, and reading an index's chunks from its docstore alone. Where the folder is
and how it is replaced is :mod:`ragcache.index.folder`'s. Must not import vLLM, nor ``app/`` or
``ui/``, nor anything above it in ragcache (pipeline, engine).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ragcache.chunks import Chunk
from ragcache.index.folder import open_manifest, readable_path, resolve_index_path
from ragcache.index.manifest import BuildInfo, IndexNotFoundError, Manifest
from ragcache.index.nodes import node_to_chunk

if TYPE_CHECKING:  # heavy imports stay lazy: `ragcache --help` must not load torch
    from llama_index.core import VectorStoreIndex
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.schema import BaseNode, TextNode

    from ragcache.config import Settings

ID_MAP = "id_map.json"


# ------------------------------------------------------------------------ FAISS vector store


@lru_cache(maxsize=1)
def deletable_faiss_store_cls() -> type:
    """The FAISS vector store class every index uses (defined on first use: imports faiss)."""
    from llama_index.vector_stores.faiss import FaissMapVectorStore
    from llama_index.vector_stores.faiss.base import FaissVectorStore

    class DeletableFaissStore(FaissMapVectorStore):
        """llama-index's FaissMapVectorStore (IndexIDMap2: deletable) with two fixes.

        - ``add`` gives each vector a fresh FAISS id. Upstream uses ``ntotal`` as the next id,
          which after a deletion collides with a live id and silently remaps the old node.
        - the id map is stored as JSON (upstream writes ``str(dict)`` and reads it with ``eval``).
        """

        def add(self, nodes: list["BaseNode"], **add_kwargs: Any) -> list[str]:
            if not nodes:
                return []
            start = max(self._faiss_id_to_node_id_map, default=-1) + 1
            ids = np.arange(start, start + len(nodes), dtype=np.int64)
            vectors = np.asarray([n.get_embedding() for n in nodes], dtype="float32")
            self._faiss_index.add_with_ids(vectors, ids)
            for fid, node in zip(ids.tolist(), nodes):
                self._node_id_to_faiss_id_map[node.node_id] = fid
                self._faiss_id_to_node_id_map[fid] = node.node_id
            return [n.node_id for n in nodes]

        def persist(self, persist_path: str, fs: Any = None) -> None:
            FaissVectorStore.persist(self, persist_path=persist_path, fs=fs)
            id_map = {str(fid): nid for fid, nid in self._faiss_id_to_node_id_map.items()}
            Path(persist_path).with_name(ID_MAP).write_text(json.dumps(id_map), encoding="utf-8")

        @classmethod
        def from_persist_path(cls, persist_path: str, fs: Any = None) -> "DeletableFaissStore":
            import faiss

            store = cls(faiss_index=faiss.read_index(persist_path))
            id_map = json.loads(Path(persist_path).with_name(ID_MAP).read_text(encoding="utf-8"))
            store._faiss_id_to_node_id_map = {int(fid): nid for fid, nid in id_map.items()}
            store._node_id_to_faiss_id_map = {nid: int(fid) for fid, nid in id_map.items()}
            return store

    return DeletableFaissStore


def new_faiss_store(dim: int) -> Any:
    """An empty deletable FAISS store for unit vectors of ``dim`` floats (inner product = cosine)."""
    import faiss

    return deletable_faiss_store_cls()(faiss_index=faiss.IndexIDMap2(faiss.IndexFlatIP(dim)))


def read_chunks(path: Path) -> tuple[Manifest, list[Chunk]]:
    """The manifest and every chunk of the index at ``path`` (its docstore only: no embedding model,
    no FAISS), e.g. to find the KV keys of an index's chunks.

    Raises:
        IndexNotFoundError: no complete index at ``path``.
    """
    from llama_index.core.storage.docstore import SimpleDocumentStore

    readable = readable_path(path)
    if readable is None:
        raise IndexNotFoundError(f"no index at {path}; check --index (`ragcache ingest PATH --index NAME` makes one)")
    manifest = Manifest.read(readable)
    with contextlib.redirect_stdout(io.StringIO()):
        docstore = SimpleDocumentStore.from_persist_dir(str(readable))
    return manifest, [node_to_chunk(node) for node in docstore.docs.values()]


# -------------------------------------------------------------------------------------- Index


class Index:
    """A loaded chunk index: llama-index VectorStoreIndex over FAISS plus ragcache's manifest.

    Build with :meth:`load` (from disk) or :meth:`create` (empty, in memory); write with
    :meth:`persist`. Reading is safe while an ingest runs: ingests never touch a published folder.
    """

    def __init__(self, vector_index: "VectorStoreIndex", manifest: Manifest,
                 embed_model: "BaseEmbedding", path: Path | None = None) -> None:
        self.vector_index = vector_index
        self.manifest = manifest
        self.embed_model = embed_model
        self.path = path
        self._retrievers: dict[int, Any] = {}

    # ---- construction
    @classmethod
    def load(cls, path: str | os.PathLike[str], settings: "Settings", *,
             embed_model: "BaseEmbedding | None" = None) -> "Index":
        """Load the index named or located by ``path`` (see :func:`resolve_index_path`).

        Raises:
            IndexNotFoundError: no complete index there (folder missing or empty).
            IndexMismatchError: the index was embedded with another embedding model.
            ModelNotFoundError: the embedding model is not available.
        """
        from llama_index.core import StorageContext, load_index_from_storage

        from ragcache.models import load_embed_model

        folder = resolve_index_path(path, settings.ingest.index_dir)
        readable, manifest = open_manifest(path, settings)
        embed_model = embed_model or load_embed_model(settings)
        store = deletable_faiss_store_cls().from_persist_dir(str(readable))
        with contextlib.redirect_stdout(io.StringIO()):  # llama-index print()s each file it loads
            storage = StorageContext.from_defaults(persist_dir=str(readable), vector_store=store)
        vector_index = load_index_from_storage(storage, embed_model=embed_model)
        return cls(vector_index, manifest, embed_model, folder)

    @classmethod
    def create(cls, build: BuildInfo, embed_model: "BaseEmbedding") -> "Index":
        """An empty in-memory index for ``build.dim``-float embeddings."""
        from llama_index.core import StorageContext, VectorStoreIndex

        storage = StorageContext.from_defaults(vector_store=new_faiss_store(build.dim))
        vector_index = VectorStoreIndex(nodes=[], storage_context=storage, embed_model=embed_model)
        return cls(vector_index, Manifest(build=build), embed_model)

    def persist(self, folder: Path) -> None:
        """Write the whole index (storage context + manifest) into ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        self.vector_index.storage_context.persist(persist_dir=str(folder))
        self.manifest.write(folder)

    backend = "faiss"

    # ---- contents
    def __len__(self) -> int:
        """Number of chunk nodes."""
        return len(self.vector_index.index_struct.nodes_dict)

    def search(self, question: str, k: int) -> list[tuple[Chunk, float]]:
        """The ``k`` chunks closest to ``question`` with their cosine similarity (FAISS inner
        product of unit vectors), best first; fewer when the index is smaller."""
        k = min(k, len(self))
        if k < 1:
            return []
        retriever = self._retrievers.get(k)
        if retriever is None:
            retriever = self._retrievers[k] = self.vector_index.as_retriever(similarity_top_k=k)
        return [(node_to_chunk(nws.node), float(nws.score if nws.score is not None else 0.0))
                for nws in retriever.retrieve(question)]

    @property
    def docstore(self) -> Any:
        return self.vector_index.docstore

    def chunks(self) -> Iterator[Chunk]:
        """Every chunk in the index (docstore order)."""
        for node in self.docstore.docs.values():
            yield node_to_chunk(node)

    def chunks_of(self, doc_id: str) -> list[Chunk]:
        """The chunks of one document, by position; empty when the document is not indexed."""
        entry = self.manifest.docs.get(doc_id)
        if entry is None:
            return []
        return [node_to_chunk(n) for n in self.docstore.get_nodes(entry.node_ids)]

    def add_nodes(self, nodes: list["TextNode"]) -> None:
        """Insert nodes that already carry their embeddings (nothing is re-embedded)."""
        if nodes:
            self.vector_index.insert_nodes(nodes)

    def delete_nodes(self, node_ids: list[str]) -> None:
        """Remove nodes from the FAISS store, the docstore and the index structure."""
        if node_ids:
            self.vector_index.delete_nodes(node_ids, delete_from_docstore=True)
