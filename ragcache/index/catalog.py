"""Where indexes live: folders of FAISS indexes under ``ingest.index_dir``, or a PostgreSQL
database with pgvector (``ingest.vector_store``).

Owns: :class:`FolderCatalog`, :class:`PgCatalog` and :func:`catalog`, the one place that picks
the backend; everything that lists indexes, checks their version, reads their manifest or loads
them for search goes through it (pipeline, server, CLI, UI). Must not import vLLM, nor ``app/`` or
``ui/``, nor anything above it in ragcache (pipeline, engine).

An index is named the same way on both: ``--index docs``. With FAISS a name containing a path
separator is a folder path (:func:`ragcache.index.folder.resolve_index_path`); with pgvector an index is
a row of the registry table and a path's last component is taken as its name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragcache.chunks import Chunk
from ragcache.index.faiss_index import Index, read_chunks
from ragcache.index.folder import index_version, list_indexes, open_manifest, resolve_index_path
from ragcache.index.manifest import Manifest

if TYPE_CHECKING:
    from llama_index.core.base.embeddings.base import BaseEmbedding

    from ragcache.config import Settings
    from ragcache.index.pg_index import PgIndex


class FolderCatalog:
    """FAISS indexes as folders under ``ingest.index_dir`` (the embedded default)."""

    backend = "faiss"

    def __init__(self, settings: "Settings") -> None:
        self.settings = settings

    def path(self, index: str | os.PathLike[str]) -> Path:
        """The folder of ``index`` (see :func:`ragcache.index.folder.resolve_index_path`)."""
        return resolve_index_path(index, self.settings.ingest.index_dir)

    def names(self) -> list[str]:
        """Names of the complete indexes, sorted."""
        return list_indexes(self.settings.ingest.index_dir)

    def version(self, index: str | os.PathLike[str]) -> int:
        """A number that changes whenever the index is replaced; 0 when there is none."""
        return index_version(self.path(index))

    def created(self, index: str | os.PathLike[str]) -> int:
        """When the index was last written (seconds since the epoch); 0 when unknown."""
        try:
            return int(self.path(index).stat().st_mtime)
        except OSError:
            return 0

    def manifest(self, index: str | os.PathLike[str]) -> Manifest:
        """The index's manifest, checked against the settings (no model is loaded).

        Raises:
            IndexNotFoundError / IndexMismatchError / IndexNameError: see :func:`ragcache.index.folder.open_manifest`.
        """
        return open_manifest(index, self.settings)[1]

    def load(self, index: str | os.PathLike[str], embed_model: "BaseEmbedding | None" = None) -> Index:
        """The index, loaded for search (see :meth:`ragcache.index.faiss_index.Index.load`)."""
        return Index.load(index, self.settings, embed_model=embed_model)

    def read_chunks(self, index: str | os.PathLike[str]) -> tuple[Manifest, list[Chunk]]:
        """The manifest and every chunk (no embedding model).

        Raises:
            IndexNotFoundError: no such index.
        """
        return read_chunks(self.path(index))

    def describe(self, index: str | os.PathLike[str]) -> str:
        """Where the index lives, for messages."""
        return str(self.path(index))


class PgCatalog:
    """pgvector indexes in the database at ``ingest.pg_url`` (shared by every replica).

    Raises (every method): PgUnavailableError when the database cannot be reached or
    ``ingest.pg_url`` is empty.
    """

    backend = "pgvector"

    def __init__(self, settings: "Settings") -> None:
        from ragcache.index.pg_index import PgDatabase, require_url

        self.settings = settings
        self.db = PgDatabase.of(require_url(settings))

    @staticmethod
    def name(index: str | os.PathLike[str]) -> str:
        """The registry name of ``index`` (a path's last component).

        Raises:
            IndexNameError: not a valid pgvector index name.
        """
        from ragcache.index.pg_index import check_name

        return check_name(Path(os.fspath(index)).name if os.sep in os.fspath(index) else os.fspath(index))

    def names(self) -> list[str]:
        from ragcache.index.pg_index import list_names

        return list_names(self.db)

    def version(self, index: str | os.PathLike[str]) -> int:
        from ragcache.index.pg_index import version_of

        return version_of(self.db, self.name(index))

    def created(self, index: str | os.PathLike[str]) -> int:
        from ragcache.index.pg_index import REGISTRY

        row = self.db.run(lambda c: c.execute(
            f"SELECT extract(epoch FROM updated_at) FROM {REGISTRY} WHERE name = %s", (self.name(index),)).fetchone())
        return int(row[0]) if row else 0

    def manifest(self, index: str | os.PathLike[str]) -> Manifest:
        return self.load(index, lazy=True).manifest

    def load(self, index: str | os.PathLike[str], embed_model: "BaseEmbedding | None" = None, *,
             lazy: bool = False) -> "PgIndex":
        """The index, for search; ``lazy``: the embedding model loads on the first search."""
        from ragcache.index.pg_index import PgIndex

        return PgIndex.load(self.name(index), self.settings, embed_model=embed_model, lazy_embed=lazy)

    def read_chunks(self, index: str | os.PathLike[str]) -> tuple[Manifest, list[Chunk]]:
        idx = self.load(index, lazy=True)
        return idx.manifest, list(idx.chunks())

    def describe(self, index: str | os.PathLike[str]) -> str:
        from ragcache.util.urls import redact

        return f"pgvector index {self.name(index)!r} in {redact(self.db.url)}"


def catalog(settings: "Settings") -> Any:
    """The catalog ``ingest.vector_store`` names: :class:`FolderCatalog` or :class:`PgCatalog`.

    Raises:
        PgUnavailableError: pgvector without ``ingest.pg_url``.
    """
    return PgCatalog(settings) if settings.ingest.vector_store == "pgvector" else FolderCatalog(settings)
