"""An index's record of itself, shared by both backends: ``manifest.json`` in a FAISS folder, a
registry row in PostgreSQL; and the errors an index raises.

Owns: :class:`Manifest` (build settings, input files, documents, the KV namespace) with its entries
(:class:`FileEntry`, :class:`DocEntry`, :class:`BuildInfo`), the index format version, and the
exceptions every index backend and ingest share. Imports nothing from ragcache.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
#: Bump when the folder layout or the manifest schema changes incompatibly.
INDEX_FORMAT_VERSION = 1


class IndexNotFoundError(FileNotFoundError):
    """No index at the given path (or the folder is empty): it has to be ingested first."""


class IndexMismatchError(ValueError):
    """The index was built with other settings (chunk size, LLM tokenizer, embedding model,
    namespace), or the folder is not an index at all."""


class IndexNameError(ValueError):
    """An index name that cannot name an index folder (empty, ``.``, ``..``, hidden)."""


class IngestError(RuntimeError):
    """An ingest could not complete; the previous index (if any) is unchanged (raised by
    :mod:`ragcache.ingest.ingestor` and by the pgvector index's ingest lock, :mod:`ragcache.index.pg_index`)."""


@dataclass
class FileEntry:
    """Fingerprint of one ingested input file and the documents it produced.

    Attributes:
        size: bytes. mtime: seconds since the epoch. sha256: hex digest of the file's bytes.
        doc_ids: ids of the documents read from the file (one per file, or one per passage).
    """

    size: int
    mtime: float
    sha256: str
    doc_ids: list[str]


@dataclass
class DocEntry:
    """One indexed document.

    Attributes:
        title: the document title (may be empty).
        content_sha256: hex digest of title + text; an unchanged digest means the chunks are reused.
        node_ids: ids of its chunk nodes in the docstore / FAISS store, in position order.
        tokens: LLM tokens over all its chunks.
    """

    title: str
    content_sha256: str
    node_ids: list[str]
    tokens: int = 0


@dataclass
class BuildInfo:
    """Settings an index was built with; chunks are only comparable within one build.

    Attributes:
        chunk_size, chunk_overlap: in LLM tokens.
        llm: the ``models.model`` setting; llm_fingerprint: its weights' fingerprint (token ids
        and KV depend on it). embedding_model: the ``models.embedding_model`` setting;
        dim: embedding dimension; metric: FAISS metric (inner product of unit vectors = cosine).
    """

    chunk_size: int
    chunk_overlap: int
    llm: str
    llm_fingerprint: str
    embedding_model: str
    dim: int
    metric: str = "inner_product"


@dataclass
class Manifest:
    """ragcache's record of an index: build settings, input files and documents (manifest.json).

    Attributes:
        namespace: the index's own KV namespace, set at its first ingest ("" = none: its chunk
            keys are in the store namespace alone and shared with every index there; see
            :func:`ragcache.chunks.kv_namespace`).
    """

    build: BuildInfo
    files: dict[str, FileEntry] = field(default_factory=dict)
    docs: dict[str, DocEntry] = field(default_factory=dict)
    format: int = INDEX_FORMAT_VERSION
    namespace: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        """Raises: IndexNotFoundError when manifest.json is missing or unreadable."""
        damaged = f"; the index is damaged: delete {folder} and ingest again"
        try:
            raw = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise IndexNotFoundError(f"{folder / MANIFEST} cannot be read ({exc}){damaged}") from None
        return cls.from_dict(raw, str(folder), str(folder / MANIFEST))

    @classmethod
    def from_dict(cls, raw: Any, where: str, source: str | None = None) -> "Manifest":
        """The manifest in ``raw`` (parsed JSON), read from the index described by ``where``.

        Raises:
            IndexMismatchError: another index format. IndexNotFoundError: fields are missing.
        """
        if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT_VERSION:
            found = raw.get("format") if isinstance(raw, dict) else None
            raise IndexMismatchError(
                f"index {where} has format {found}, this ragcache reads "
                f"{INDEX_FORMAT_VERSION}; re-ingest into a new --index"
            )
        try:
            return cls(
                build=BuildInfo(**raw["build"]),
                files={k: FileEntry(**v) for k, v in raw["files"].items()},
                docs={k: DocEntry(**v) for k, v in raw["docs"].items()},
                namespace=str(raw.get("namespace", "")),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise IndexNotFoundError(f"{source or where} lacks {exc}; the index is damaged: delete {where} and "
                                     "ingest again") from None

    def write(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(self.to_json(), encoding="utf-8")

    @property
    def num_chunks(self) -> int:
        return sum(len(d.node_ids) for d in self.docs.values())
