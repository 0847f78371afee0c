"""An index's folder: where it lives, how a new version replaces it, how it is opened.

Owns: index names and paths, the atomic replacement of a folder and its recovery after a crash, and
opening a folder's manifest against the settings. Used by :mod:`ragcache.ingest.ingestor` (writes) and
:mod:`ragcache.index.faiss_index` (reads). Must not import vLLM, nor ``app/`` or ``ui/``, nor anything
above it in ragcache (pipeline, engine).

An index folder (``indexes/NAME`` by default) holds llama-index's persisted storage context::

    docstore.json               the chunk nodes: text + metadata (doc_id, title, position,
                                chunk_id, token_ids fixed at ingest)
    index_store.json            the VectorStoreIndex structure (node ids)
    default__vector_store.json  the FAISS index (faiss.IndexIDMap2 over IndexFlatIP; binary)
    id_map.json                 FAISS id <-> node id (JSON)
    manifest.json               ragcache's own: build settings, KV namespace, per-file
                                fingerprints, per-doc nodes (:mod:`ragcache.index.manifest`)
    calibration.json            optional: the calibrated recompute ratios
                                (:mod:`ragcache.quality.records`, measured by
                                ragcache.calibrate), carried over to every new version of
                                the index

The folder is never modified in place: an ingest writes a complete new version into a temporary
sibling (``.NAME.staging-*``) and swaps it in with two renames (:func:`swap_in`). Between those
renames the previous version sits at ``.NAME.previous``; :func:`readable_path` falls back to it, so
a crash at any point leaves a loadable, complete index.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ragcache.index.manifest import MANIFEST, IndexMismatchError, IndexNameError, IndexNotFoundError, Manifest

if TYPE_CHECKING:
    from ragcache.config import Settings

CALIBRATION = "calibration.json"


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

    Call only while holding the index's ingest lock (see :mod:`ragcache.ingest.ingestor`).
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
