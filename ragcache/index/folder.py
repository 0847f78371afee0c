"""The persisted chunk index: its folder, FAISS store, manifest, loading and atomic replacement.

Owns: what an index folder holds and how it is read and replaced; the conversion between
llama-index nodes and :class:`ragcache.chunks.Chunk`. Used by :mod:`ragcache.ingest` (writes) and
:mod:`ragcache.retrieval` (reads). Must not import vLLM, nor ``app/`` or ``ui/``, nor anything above
it in ragcache (pipeline, engine).

An index folder (``indexes/NAME`` by default) holds llama-index's persisted storage context::

    docstore.json               the chunk nodes: text + metadata (doc_id, title, position,
                                chunk_id, token_ids fixed at ingest)
    index_store.json            the VectorStoreIndex structure (node ids)
    default__vector_store.json  the FAISS index (faiss.IndexIDMap2 over IndexFlatIP; binary)
    id_map.json                 FAISS id <-> node id (JSON)
    manifest.json               ragcache's own: build settings, KV namespace, per-file
                                fingerprints, per-doc nodes
    calibration.json            optional: the calibrated recompute ratios (:class:`Calibration`,
                                measured by ragcache.calibrate), carried over to every new
                                version of the index

The folder is never modified in place: an ingest writes a complete new version into a temporary
sibling (``.NAME.staging-*``) and swaps it in with two renames (:func:`swap_in`). Between those
renames the previous version sits at ``.NAME.previous``; :func:`readable_path` falls back to it, so
a crash at any point leaves a loadable, complete index.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ragcache.chunks import Chunk

if TYPE_CHECKING:  # heavy imports stay lazy: `ragcache --help` must not load torch
    from llama_index.core import VectorStoreIndex
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.schema import BaseNode, TextNode

    from ragcache.config import Settings

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CALIBRATION = "calibration.json"
ID_MAP = "id_map.json"
#: Bump when the folder layout or the manifest schema changes incompatibly.
INDEX_FORMAT_VERSION = 1

#: node metadata keys written by ragcache (see :func:`chunk_to_node`)
META_DOC_ID, META_TITLE, META_POSITION = "doc_id", "title", "position"
META_CHUNK_ID, META_TOKEN_IDS, META_SOURCE = "chunk_id", "token_ids", "source"
_ALL_META = (META_DOC_ID, META_TITLE, META_POSITION, META_CHUNK_ID, META_TOKEN_IDS, META_SOURCE)


class IndexNotFoundError(FileNotFoundError):
    """No index at the given path (or the folder is empty): it has to be ingested first."""


class IndexMismatchError(ValueError):
    """The index was built with other settings (chunk size, LLM tokenizer, embedding model,
    namespace), or the folder is not an index at all."""


class IndexNameError(ValueError):
    """An index name that cannot name an index folder (empty, ``.``, ``..``, hidden)."""


class IngestError(RuntimeError):
    """An ingest could not complete; the previous index (if any) is unchanged (raised by
    :mod:`ragcache.ingest` and by the pgvector index's ingest lock, :mod:`ragcache.pgindex`)."""


def check_index_folder(path: Path) -> None:
    """Refuse to write an index into ``path`` when something else is there: an ingest replaces the
    whole folder, so it must be an index (or an interrupted one), an empty folder, or absent.

    Raises:
        IndexMismatchError: ``path`` is a file, or a non-empty folder without manifest.json.
    """
    if readable_path(path) is not None or not path.exists():
        return
    if not path.is_dir():
        raise IndexMismatchError(f"--index {path} is a file, not an index folder; choose another --index")
    if any(path.iterdir()):
        raise IndexMismatchError(f"--index {path} is a folder with other files (no {MANIFEST}), not an index; "
                                 "an ingest would replace it: choose a new or empty folder")


# --------------------------------------------------------------------------------------- paths


def resolve_index_path(name: str | os.PathLike[str], index_dir: str | os.PathLike[str]) -> Path:
    """Folder of the index ``name``.

    ``name`` is taken as a path when it contains a path separator (``./docs``, ``/data/idx``);
    otherwise it is a name under ``index_dir`` (``ingest.index_dir``, default ``indexes``). A bare
    name never means a folder of the working directory: ``--index docs`` run from a project root
    must not replace the project's ``docs/`` folder with an index.

    Raises:
        IndexNameError: an empty name, ``.`` or ``..`` (they would name ``index_dir`` itself or
            its parent), or a name starting with ``.`` (hidden: ragcache's own staging folders).
    """
    raw = os.fspath(name)
    if os.sep in raw or (os.altsep and os.altsep in raw):
        return Path(raw).expanduser()
    if not raw.strip() or raw.startswith("."):
        raise IndexNameError(f"--index {raw!r} is not an index name; use a name like docs (letters, digits, "
                             "'-', '_'), or a folder path like ./my-index")
    return Path(index_dir).expanduser() / raw


_PREVIOUS_SUFFIX = ".previous"


def previous_path(path: Path) -> Path:
    """Where the previous version of ``path`` sits while :func:`swap_in` runs."""
    return path.parent / f".{path.name}{_PREVIOUS_SUFFIX}"


def staging_prefix(path: Path) -> str:
    """Name prefix of the temporary siblings a new version of ``path`` is staged in."""
    return f".{path.name}.staging-"


def _is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def readable_path(path: Path) -> Path | None:
    """The complete version of the index at ``path``: ``path`` itself, else the previous version
    left by a swap interrupted between its two renames; None when there is no index."""
    if _is_complete(path):
        return path
    prev = previous_path(path)
    if not path.exists() and _is_complete(prev):
        return prev
    return None


def list_indexes(index_dir: str | os.PathLike[str]) -> list[str]:
    """Names of the complete indexes under ``index_dir`` (``ingest.index_dir``), sorted.

    An index being swapped in right now (only its previous version is on disk) is listed under
    its own name; staging folders are not.
    """
    root = Path(index_dir).expanduser()
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    names: set[str] = set()
    for entry in entries:
        name = entry.name
        if name.startswith(".") and name.endswith(_PREVIOUS_SUFFIX):
            name = name[1:-len(_PREVIOUS_SUFFIX)]
        elif name.startswith("."):
            continue
        if readable_path(root / name) is not None:
            names.add(name)
    return sorted(names)


def index_version(path: Path) -> int:
    """A number that changes whenever the index at ``path`` is replaced (its manifest's mtime in
    ns); 0 when there is no index."""
    readable = readable_path(path)
    try:
        return (readable / MANIFEST).stat().st_mtime_ns if readable is not None else 0
    except OSError:
        return 0


def recover(path: Path) -> None:
    """Finish or undo an interrupted swap and remove stale staging folders.

    Call only while holding the index's ingest lock (see :mod:`ragcache.ingest`).
    """
    prev = previous_path(path)
    if not path.exists() and _is_complete(prev):
        os.rename(prev, path)  # the swap stopped between its renames: put the old version back
    elif prev.exists():
        shutil.rmtree(prev, ignore_errors=True)  # the swap completed; only the cleanup was lost
    if path.parent.is_dir():
        for stale in path.parent.glob(staging_prefix(path) + "*"):
            shutil.rmtree(stale, ignore_errors=True)


def swap_in(staging: Path, path: Path) -> None:
    """Make the complete index in ``staging`` the index at ``path``, replacing any previous one.

    Two renames within one folder (atomic each on POSIX); a crash between them leaves the previous
    version at :func:`previous_path`, which :func:`readable_path` and :func:`recover` use.

    Raises:
        OSError: a rename failed (the previous index is then still in place or at previous_path).
    """
    _fsync_tree(staging)
    prev = previous_path(path)
    if prev.exists():
        shutil.rmtree(prev)
    if path.exists():
        os.rename(path, prev)
    os.rename(staging, path)
    _fsync_dir(path.parent)
    shutil.rmtree(prev, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ manifest


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


# ---------------------------------------------------------------------------- calibration


#: a ratio whose blend recomputed at least this share of the context tokens recomputed the whole
#: context (:attr:`RatioScore.whole_context`)
WHOLE_CONTEXT_SHARE = 0.999


@dataclass
class RatioScore:
    """Blend at one ratio against full prefill, means over the prompts (``ragcache calibrate``).

    Attributes:
        ratio: recompute ratio in [0, 1].
        kl_mean: mean first-token KL(full || blend), nats.
        answer_nll_rel: mean NLL of full's own greedy answer under blend / under full - 1.
        ttft_median_s: median blend TTFT, seconds.
        meets: good enough and worth it: every quality target met and ``speedup >= min_speedup``.
        loop_share: share of blend's answers with a repetition loop.
        speedup: median full-prefill TTFT / median blend TTFT of the same prompts.
        good: the quality targets are met (KL, answer NLL, loops no more often than full's).
        recomputed_share: mean share of the context's tokens the blend actually recomputed: above
            ``ratio`` where ``blend.min_recompute_tokens`` raised a short context's budget (then
            ratios below it recompute the same tokens), and by the rounding to runs of
            ``blend.granule`` tokens; None in records written before it was measured.
        mass_left: the adaptive budget's threshold measured (``blend.mass_left``: the share of the
            question's attention left on reused KV), or None for a fixed budget at ``ratio``.
    """

    ratio: float
    kl_mean: float
    answer_nll_rel: float | None
    ttft_median_s: float
    meets: bool
    loop_share: float = 0.0
    speedup: float | None = None
    good: bool | None = None
    recomputed_share: float | None = None
    mass_left: float | None = None

    @property
    def raised_by_floor(self) -> bool:
        """The share recomputed exceeds the ratio by more than 2 points: ``blend.min_recompute_tokens``
        raised the budget (runs of ``blend.granule`` tokens and forced tokens add less on 1k+ token
        contexts). Ratios raised to the same floor recompute the same tokens."""
        return (self.mass_left is None and self.recomputed_share is not None
                and self.recomputed_share > self.ratio + 0.02)

    @property
    def whole_context(self) -> bool:
        """The blend recomputed (nearly) every context token: ratio 1, or contexts no longer than
        ``blend.min_recompute_tokens``. That is full prefill through the blend's own path, never
        faster than vLLM's: such a ratio is never recorded, whatever its measured speedup (which is
        then load noise)."""
        return self.recomputed_share is not None and self.recomputed_share >= WHOLE_CONTEXT_SHARE


@dataclass
class Calibration:
    """The outcome of one calibration of an index for one model and selection strategy, as
    ``calibration.json`` keeps it (measured by :func:`ragcache.calibrate.calibrate`).

    Attributes:
        ratio: the smallest ratio that met every target, or None when none did (use ``--mode full``);
            with an adaptive budget, the ratio its budget is centred on.
        mass_left: with an adaptive budget (``blend.budget``), the largest ``blend.mass_left`` (the
            cheapest budget) that met every target; None for a fixed budget or when none did.
        max_kl: the KL target, nats.
        selection: the token-selection strategy measured.
        model_fingerprint: the model measured (its chunk KV is what was blended).
        n: prompts measured. source: ``"questions"`` (users' questions) or ``"probes"``.
        full_ttft_median_s: median full-prefill TTFT of the same prompts, seconds.
        scores: one :class:`RatioScore` per ratio tried, ascending.
        created: UTC time, ISO 8601.
        max_nll_rel: the answer-NLL target (relative to full's). min_speedup: the speed target.
        full_loop_share: share of full prefill's answers with a repetition loop.
        recommendation: ``"blend"`` (at ``ratio``) or ``"full"``; ``reason`` says why in one sentence.
        settings: what the blends were measured under: the blend settings that change what a blend
            at a ratio computes (:meth:`ragcache.config.BlendSettings.calibrated_settings`) and
            ``"engine.dtype"`` (the resolved dtype); None in records written before it was kept.
            A calibration holds only under the same values (:meth:`changed`).
    """

    ratio: float | None
    max_kl: float
    selection: str
    model_fingerprint: str
    n: int
    source: str
    full_ttft_median_s: float
    scores: list[RatioScore] = field(default_factory=list)
    created: str = ""
    max_nll_rel: float = 0.05
    min_speedup: float = 1.2
    full_loop_share: float = 0.0
    recommendation: str = "blend"
    reason: str = ""
    settings: dict[str, Any] | None = None
    mass_left: float | None = None

    def changed(self, current: dict[str, Any]) -> list[str]:
        """The settings whose value in ``current`` (same keys as :attr:`settings`) differs from the
        one measured, as ``"blend.granule = 16 (calibrated with 8)"``; [] when the calibration holds
        (also for a record that kept no settings: it cannot be checked)."""
        if self.settings is None:
            return []
        return [f"{name} = {current.get(name)!r} (calibrated with {self.settings.get(name)!r})"
                for name in sorted(set(self.settings) | set(current)) if self.settings.get(name) != current.get(name)]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Calibration":
        """Inverse of ``dataclasses.asdict``.

        Raises:
            TypeError: a field is missing or unknown. ValueError: a ratio outside [0, 1].
        """
        data = dict(data)
        data["scores"] = [RatioScore(**s) for s in data.get("scores", [])]
        cal = cls(**data)
        if cal.ratio is not None and not 0.0 <= float(cal.ratio) <= 1.0:
            raise ValueError(f"calibrated ratio {cal.ratio} is outside [0, 1]")
        return cal


def _calibration_key(model_fingerprint: str, selection: str) -> str:
    return f"{model_fingerprint}/{selection}"


def read_calibration(index_path: str | os.PathLike[str], model_fingerprint: str,
                     selection: str) -> Calibration | None:
    """The index's calibration for this model and selection from its ``calibration.json``, or None
    (none recorded; an unreadable file is logged as a warning and also gives None)."""
    path = Path(index_path) / CALIBRATION
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entry = data.get(_calibration_key(model_fingerprint, selection))
        return Calibration.from_dict(entry) if entry else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("cannot read %s (%s); run `ragcache calibrate` again", path, exc)
        return None


def write_calibration(index_path: str | os.PathLike[str], cal: Calibration) -> Path:
    """Record ``cal`` in the index folder's ``calibration.json`` (atomically; other models' and
    selections' entries kept). Returns the file's path.

    Raises:
        OSError: the folder cannot be written.
    """
    folder = Path(index_path)
    path = folder / CALIBRATION
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    data[_calibration_key(cal.model_fingerprint, cal.selection)] = asdict(cal)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
    return path


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


# ---------------------------------------------------------------------------- node <-> chunk


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


def open_manifest(path: str | os.PathLike[str], settings: "Settings") -> tuple[Path, Manifest]:
    """The readable folder and the manifest of the index named or located by ``path``, checked
    against ``settings`` (cheap: no model is loaded, so callers check before starting an engine).

    Raises:
        IndexNameError: ``path`` cannot name an index.
        IndexNotFoundError: no complete index there, or its manifest cannot be read.
        IndexMismatchError: another index format, or embedded with another embedding model.
    """
    folder = resolve_index_path(path, settings.ingest.index_dir)
    readable = readable_path(folder)
    if readable is None:
        raise IndexNotFoundError(
            f"no index at {folder} (the folder does not exist or is empty); "
            f"run `ragcache ingest PATH --index {os.fspath(path)}` first"
        )
    manifest = Manifest.read(readable)
    if manifest.build.embedding_model != settings.models.embedding_model:
        raise IndexMismatchError(
            f"index {folder} was embedded with {manifest.build.embedding_model!r}, settings say "
            f"{settings.models.embedding_model!r}; set models.embedding_model back or re-ingest"
        )
    return readable, manifest


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
