"""Batch ingestion: files -> llama-index documents -> LLM-token chunks -> embeddings -> FAISS or
pgvector index.

Owns: walking the inputs (files are read by :mod:`ragcache.ingest.readers`), sentence-aware splitting in LLM tokens (llama-index ``SentenceSplitter``), fixing each
chunk's token ids, embedding (llama-index ``HuggingFaceEmbedding``), incremental updates driven by
per-file fingerprints, the staged write + swap of the index folder (:mod:`ragcache.index.folder`) or the
one-transaction publish of a pgvector index (:mod:`ragcache.index.pg_index`), and the KV-precompute hook.
Must not import vLLM, nor ``app/`` or ``ui/``, nor the engine or pipeline: the KV precompute step
comes in as a callable (:data:`KVHook`). Reading, chunking, embedding and KV precompute are methods
an executor can run elsewhere (:mod:`ragcache.ingest.ray_ingestor`: Ray Data); the plan (what changed), the
manifest and the publish stay here, so every executor keeps the same rules.

Incremental rule: a file whose sha256 is unchanged is not read again. A changed or new file is
read; each of its documents whose content (title + text) is already indexed keeps its chunks, the
others are chunked and embedded, and documents no file refers to any more lose their chunks.
Documents: one per text/markdown/HTML/PDF file (doc id = the file's absolute path), one per
distinct passage of a JSON/JSONL QA file (records with ``ctxs: [{title, text}]``; doc id = hash of
title + text, so a passage repeated across records or files is indexed once).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from ragcache.chunks import Chunk, chunk_id_for
from ragcache.config import ConfigError, check_namespace
from ragcache.index.faiss_index import Index
from ragcache.index.folder import (
    CALIBRATION,
    check_index_folder,
    readable_path,
    recover,
    resolve_index_path,
    staging_prefix,
    swap_in,
)
from ragcache.index.manifest import BuildInfo, DocEntry, FileEntry, IndexMismatchError, IngestError, Manifest
from ragcache.index.nodes import chunk_to_node
from ragcache.models import TokenizerInfo, load_embed_model, load_tokenizer
from ragcache.util.progress import progress

if TYPE_CHECKING:  # llama-index loads when an ingest runs: the input checks stay light
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.schema import Document, TextNode

    from ragcache.config import Settings

log = logging.getLogger("ragcache.ingest")  # the name its lines have always carried


#: Called with the chunks added by an ingest and the index's own KV namespace ("" = none; see
#: :attr:`ragcache.index.manifest.Manifest.namespace`), after they are indexed and before the new index is
#: published; raising aborts the ingest and keeps the previous index.
KVHook = Callable[[list[Chunk], str], None]

MB = 1_000_000  # bytes; settings.toml: sizes in (M|G)B are powers of 10
_EMBED_BATCH = 64  # chunks per embedding call


class KVPrecomputeError(IngestError):
    """The KV hook raised; nothing was published."""


class NoInputError(IngestError):
    """None of the paths given to an ingest exists; nothing was read or changed."""


def check_inputs_exist(paths: Sequence[str | os.PathLike[str]]) -> None:
    """Refuse an ingest none of whose paths exists (cheap: run it before any model is loaded).

    Raises:
        NoInputError: every path is missing (a few are named, with the fix).
    """
    missing = [os.fspath(p) for p in paths if not Path(p).expanduser().exists()]
    if paths and len(missing) == len(paths):
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise NoInputError(f"no such file or folder: {shown}; check the path (nothing was ingested)")


# -------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class SkippedInput:
    """An input left out of the index, with the reason shown to users."""

    path: str
    reason: str


@dataclass
class IngestReport:
    """What one ingest did.

    Attributes:
        index_path: the index folder. files_ingested: new or changed files read and applied.
        files_unchanged: files whose sha256 matched the manifest (not read).
        files_pruned: manifest files removed because they no longer exist (``prune=True``).
        skipped: inputs not ingested, each with its reason.
        left_out: parts of ingested files that were left out while the rest was kept (a JSONL line
            that is not JSON), each as the file and ``"line N: reason"``.
        chunks_added / chunks_removed: chunk nodes written / deleted. tokens_added: LLM tokens over
        the added chunks. total_chunks: chunks in the index afterwards. seconds: wall time.
        written: whether a new index version was published. new_chunks: the added chunks, where this
        process holds them (empty after a Ray ingest into pgvector, whose rows stay in the database).
        namespace: the index's own KV namespace ("" = none). location: where the index lives when
        it is not the folder ``index_path`` (a pgvector index: its name and database).
    """

    index_path: Path
    files_ingested: int = 0
    files_unchanged: int = 0
    files_pruned: int = 0
    skipped: list[SkippedInput] = field(default_factory=list)
    left_out: list[SkippedInput] = field(default_factory=list)
    chunks_added: int = 0
    chunks_removed: int = 0
    tokens_added: int = 0
    total_chunks: int = 0
    seconds: float = 0.0
    written: bool = False
    new_chunks: list[Chunk] = field(default_factory=list, repr=False)
    namespace: str = ""
    location: str = ""

    @property
    def nothing_usable(self) -> bool:
        """No input gave a file to index (every one was skipped), whether or not the index exists."""
        return self.files_ingested == 0 and self.files_unchanged == 0 and self.files_pruned == 0

    @property
    def files_skipped(self) -> int:
        return len(self.skipped)

    def summary(self) -> str:
        """One line: files ingested/unchanged/skipped(/pruned), chunks added/removed, tokens, seconds."""
        pruned = f", {self.files_pruned} pruned" if self.files_pruned else ""
        head = "" if self.written else "nothing changed: "
        return (
            f"{head}{self.files_ingested} files ingested, {self.files_unchanged} unchanged, "
            f"{self.files_skipped} skipped{pruned}; {self.chunks_added} chunks added, "
            f"{self.chunks_removed} removed ({self.total_chunks} in {self.location or self.index_path}); "
            f"{self.tokens_added} tokens; {self.seconds:.1f} s"
        )


# ------------------------------------------------------------------------------------ ingestor


def content_sha256(title: str, text: str) -> str:
    """A document's content fingerprint (title + text) in the manifest: an unchanged one keeps its chunks."""
    return hashlib.sha256(f"{title}\x00{text}".encode()).hexdigest()


@dataclass(frozen=True)
class ReadDoc:
    """A document as an ingest plans it: its id, title and content fingerprint, and its text where this
    process holds it (``doc``; None when an executor keeps the text on its workers)."""

    doc_id: str
    title: str
    content_sha256: str
    doc: "Document | None" = None

    @classmethod
    def of(cls, doc: "Document") -> "ReadDoc":
        title = str(doc.metadata.get("title", ""))
        return cls(doc.id_, title, content_sha256(title, doc.text), doc)


@dataclass
class _Pending:
    """A document to (re)chunk and embed in this run.

    ``node_ids`` and ``tokens`` (its chunks' node ids, by position, and LLM tokens) are set by every
    executor's ``_embed``; ``chunks`` and ``nodes`` (with embeddings) only where the rows are held in
    this process.
    """

    ref: ReadDoc
    chunks: list[Chunk]
    source: str
    nodes: list["TextNode"] = field(default_factory=list)
    node_ids: list[str] = field(default_factory=list)
    tokens: int = 0


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class _IngestLock:
    """Exclusive lock on an index's ingest (fcntl on ``.NAME.lock`` beside the folder)."""

    def __init__(self, path: Path) -> None:
        self.lock_path = path.parent / f".{path.name}.lock"
        self._fh: Any = None

    def __enter__(self) -> "_IngestLock":
        self._fh = open(self.lock_path, "w")
        try:
            fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fh.close()
            raise IngestError(f"another ingest into {self.lock_path.parent / self.lock_path.name[1:-5]} "
                              "is running; wait for it to finish") from None
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fh, fcntl.LOCK_UN)
        self._fh.close()


class Ingestor:
    """Ingests files into one persisted index (see the module docstring for the rules).

    Args:
        settings: ragcache settings (``ingest.*``, ``models.*``).
        index: index name under ``ingest.index_dir``, or a folder path (:func:`resolve_index_path`).
        kv_hook: called with the newly added chunks after they are indexed and before the new
            index is published; None skips KV precompute.
        show_progress: progress on stderr (reading: files and chunks; embedding: chunks, tok/s): bars
            on a terminal, a line every few seconds in a log (:func:`ragcache.util.progress.progress`).
        embed_model / tokenizer: already loaded models to reuse (default: the configured ones).
        namespace: the index's own KV namespace, recorded at its first ingest; None = keep the
            recorded one ("" for a new index: the store namespace alone).

    Raises:
        ConfigError: ``ingest.chunk_overlap`` is not smaller than ``ingest.chunk_size``, or a
            malformed ``namespace``.
        IndexNameError: ``index`` cannot name an index folder.
    """

    def __init__(self, settings: "Settings", index: str | os.PathLike[str] = "default", *,
                 kv_hook: KVHook | None = None, show_progress: bool = True,
                 embed_model: "BaseEmbedding | None" = None, tokenizer: TokenizerInfo | None = None,
                 namespace: str | None = None) -> None:
        ing = settings.ingest
        if ing.chunk_overlap >= ing.chunk_size:
            raise ConfigError(
                f"invalid setting ingest.chunk_overlap = {ing.chunk_overlap}: must be smaller than "
                f"ingest.chunk_size ({ing.chunk_size})"
            )
        if namespace:
            check_namespace(namespace, "--namespace")
        self.namespace = namespace
        self.settings = settings
        self.path = resolve_index_path(index, ing.index_dir)
        #: the pgvector index name (ingest.vector_store = "pgvector"), else None (a FAISS folder)
        self.pg_name: str | None = None
        if ing.vector_store == "pgvector":
            from ragcache.index.catalog import PgCatalog

            self.pg_name = PgCatalog.name(index)
        self.kv_hook = kv_hook
        self.show_progress = show_progress
        self._embed_model = embed_model
        self._tokenizer = tokenizer
        self._left_out: dict[str, list[str]] = {}  # per file read in this run: the parts left out
        self._splitter: Any = None

    # ---- models (loaded on first use)
    @property
    def tokenizer(self) -> TokenizerInfo:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.settings)
        return self._tokenizer

    @property
    def embed_model(self) -> "BaseEmbedding":
        if self._embed_model is None:
            self._embed_model = load_embed_model(self.settings)
        return self._embed_model

    def _build_info(self, dim: int) -> BuildInfo:
        s = self.settings
        return BuildInfo(
            chunk_size=s.ingest.chunk_size, chunk_overlap=s.ingest.chunk_overlap, llm=s.models.model,
            llm_fingerprint=self.tokenizer.fingerprint, embedding_model=s.models.embedding_model, dim=dim,
        )

    # ---- chunking
    def _count(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def split(self, text: str) -> list[str]:
        """Sentence-aware pieces of ``text``, each at most ``ingest.chunk_size`` LLM tokens."""
        from llama_index.core.node_parser import SentenceSplitter

        if self._splitter is None:
            self._splitter = SentenceSplitter(
                chunk_size=self.settings.ingest.chunk_size, chunk_overlap=self.settings.ingest.chunk_overlap,
                tokenizer=self._count,
            )
        return [piece for raw in self._splitter.split_text(text) for piece in self._fit(raw)]

    def _fit(self, text: str, depth: int = 0) -> list[str]:
        """``text`` as pieces of at most chunk_size tokens.

        SentenceSplitter sums the token counts of its splits (the joined text can tokenize longer)
        and its overlap can push a chunk past chunk_size; the rare oversize chunk is split again
        with a proportionally smaller budget, and as a last resort cut at token boundaries.
        """
        from llama_index.core.node_parser import SentenceSplitter

        limit = self.settings.ingest.chunk_size
        ids = self._count(text)
        if len(ids) <= limit:
            return [text] if text.strip() else []
        pieces: list[str] = []
        if depth < 4:
            budget = max(8, limit * limit // len(ids) - 2 - depth * limit // 8)
            try:
                pieces = SentenceSplitter(chunk_size=budget, chunk_overlap=0, tokenizer=self._count).split_text(text)
            except ValueError:
                pieces = []
        if len(pieces) <= 1:  # no sentence or word boundary left: cut by tokens
            dec = self.tokenizer.tokenizer.decode
            pieces = [dec(ids[i:i + limit - 8]).strip() for i in range(0, len(ids), limit - 8)]
        return [q for p in pieces for q in self._fit(p, depth + 1)]

    def chunk_document(self, doc: Document, title: str) -> list[Chunk]:
        """Chunks of one document with their token ids fixed (no BOS), positions 0..n-1."""
        out = []
        for position, text in enumerate(self.split(doc.text)):
            out.append(Chunk(chunk_id=chunk_id_for(text), doc_id=doc.id_, title=title, position=position,
                             text=text, token_ids=tuple(self._count(text))))
        return out

    # ---- inputs
    def _collect(self, paths: Iterable[str | os.PathLike[str]], report: IngestReport) -> list[Path]:
        """Input files, sorted per argument, hidden files and index folders excluded."""
        index_root = Path(self.settings.ingest.index_dir).expanduser().resolve()
        own = self.path.resolve()

        def excluded(p: Path) -> bool:
            rp = p.resolve()
            return rp == own or rp == index_root or rp.name.startswith(f".{own.name}.")

        files: list[Path] = []
        seen: set[Path] = set()
        for raw in paths:
            p = Path(raw).expanduser()
            if p.is_dir():
                for root, dirs, names in os.walk(p):
                    dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not excluded(Path(root) / d))
                    for n in sorted(names):
                        if not n.startswith("."):
                            f = (Path(root) / n).resolve()
                            if f not in seen:
                                seen.add(f)
                                files.append(f)
            elif p.is_file():
                f = p.resolve()
                if f not in seen:
                    seen.add(f)
                    files.append(f)
            else:
                report.skipped.append(SkippedInput(str(p), "does not exist" if not p.exists() else "not a regular file"))
        return files

    # ---- the run
    def ingest(self, paths: Sequence[str | os.PathLike[str]], *, prune: bool = False) -> IngestReport:
        """Add new and changed files under ``paths`` to the index, optionally pruning vanished ones.

        Args:
            paths: files and folders (recursive).
            prune: remove the chunks of every manifest file that no longer exists.

        Returns:
            The :class:`IngestReport`; ``report.summary()`` is the one-line summary.

        Raises:
            NoInputError: none of ``paths`` exists (nothing is loaded or changed).
            IndexMismatchError: the index was built with another chunk size/overlap, LLM,
                embedding model or namespace, or the folder is not an index.
            KVPrecomputeError: the kv_hook raised (nothing published).
            IngestError: another ingest into the same index is running.
            ModelNotFoundError: a configured model is not available.
            Any exception from llama-index or the embedding model propagates unchanged; in every
            error case the previous index stays as it was.
        """
        t0 = time.perf_counter()
        check_inputs_exist(paths)
        if self.pg_name is not None:
            from ragcache.index.catalog import PgCatalog
            from ragcache.index.pg_index import ingest_lock

            report = IngestReport(index_path=Path(self.pg_name),
                                  location=PgCatalog(self.settings).describe(self.pg_name))
            with ingest_lock(self.settings, self.pg_name):
                self._run(paths, prune, report)
        else:
            check_index_folder(self.path)
            report = IngestReport(index_path=self.path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _IngestLock(self.path):
                recover(self.path)
                self._run(paths, prune, report)
        report.seconds = time.perf_counter() - t0
        return report

    def _load_existing(self) -> Any:
        """The published index (FAISS :class:`Index` or :class:`~ragcache.index.pg_index.PgIndex`), or None."""
        if self.pg_name is not None:
            from ragcache.index.pg_index import PgDatabase, PgIndex, require_url, version_of

            if version_of(PgDatabase.of(require_url(self.settings)), self.pg_name) == 0:
                return None
            return PgIndex.load(self.pg_name, self.settings, lazy_embed=True)
        return Index.load(self.path, self.settings, embed_model=self.embed_model) if readable_path(self.path) else None

    def _create(self, build: BuildInfo) -> Any:
        if self.pg_name is not None:
            from ragcache.index.pg_index import PgIndex

            return PgIndex.create(self.pg_name, self.settings, build, self.embed_model)
        return Index.create(build, self.embed_model)

    def _run(self, paths: Sequence[str | os.PathLike[str]], prune: bool, report: IngestReport) -> None:
        from ragcache.ingest.readers import SkipFile

        index = self._load_existing()
        if index is not None:
            self._check_build(index.manifest.build)
            self._check_namespace(index.manifest.namespace)
        manifest = index.manifest if index is not None else Manifest(build=self._build_info(dim=0))
        report.namespace = manifest.namespace if index is not None else (self.namespace or "")
        limit = self.settings.ingest.max_file_mb * MB

        files = self._collect(paths, report)
        pending: dict[str, _Pending] = {}
        file_updates: dict[str, FileEntry] = {}
        n_chunks = 0
        changed: list[tuple[Path, os.stat_result, str]] = []
        for path in files:
            key = str(path)
            try:
                st = path.stat()
                if st.st_size == 0:
                    raise SkipFile("empty file (0 bytes)")
                if st.st_size > limit:
                    raise SkipFile(f"larger than ingest.max_file_mb ({st.st_size / MB:.1f} MB > "
                                   f"{self.settings.ingest.max_file_mb:g} MB)")
                sha = _sha256_file(path)
            except SkipFile as exc:
                report.skipped.append(SkippedInput(key, str(exc)))
                continue
            except OSError as exc:
                report.skipped.append(SkippedInput(key, f"cannot read: {exc.strerror or exc}"))
                continue
            old = manifest.files.get(key)
            if old is not None and old.sha256 == sha:
                report.files_unchanged += 1
                continue
            changed.append((path, st, sha))
        bar = progress(total=len(changed), desc="reading", unit="file", disable=not self.show_progress)
        self._left_out = {}
        for (path, st, sha), docs in zip(changed, self._read_files([p for p, _, _ in changed])):
            key = str(path)
            bar.update(1)
            if isinstance(docs, SkipFile):
                report.skipped.append(SkippedInput(key, str(docs)))
                continue
            report.left_out.extend(SkippedInput(key, part) for part in self._left_out.pop(key, ()))
            doc_ids: list[str] = []
            for ref in docs:
                if ref.doc_id not in doc_ids:
                    doc_ids.append(ref.doc_id)
                known = manifest.docs.get(ref.doc_id)
                if ref.doc_id in pending or (known is not None and known.content_sha256 == ref.content_sha256):
                    continue  # same content already indexed (or queued): reuse its chunks
                chunks = self._chunks_of(ref)
                pending[ref.doc_id] = _Pending(ref, chunks, key)
                n_chunks += len(chunks)
            file_updates[key] = FileEntry(size=st.st_size, mtime=st.st_mtime, sha256=sha, doc_ids=doc_ids)
            report.files_ingested += 1
            bar.set_postfix(chunks=n_chunks)
        bar.close()

        pruned = []
        if prune:
            pruned = [k for k in manifest.files if k not in file_updates and not os.path.exists(k)]
        report.files_pruned = len(pruned)
        if not file_updates and not pruned:
            report.total_chunks = manifest.num_chunks
            return  # nothing to add or remove: keep the published index as it is

        # the new manifest's files, and the documents that lose their chunks
        new_files = {k: v for k, v in manifest.files.items() if k not in pruned}
        new_files.update(file_updates)
        referenced = {d for entry in new_files.values() for d in entry.doc_ids}
        dropped = [d for d in manifest.docs if d not in referenced or d in pending]
        removed_nodes = [nid for d in dropped for nid in manifest.docs[d].node_ids]
        pending_list = [p for p in pending.values() if p.ref.doc_id in referenced]

        self._namespace = report.namespace
        self._embed(pending_list, sum(len(p.chunks) for p in pending_list))
        new_chunks = [c for p in pending_list for c in p.chunks]
        if index is None:
            dim = self._embedding_dim(pending_list)
            if dim is None:
                return  # nothing could be ingested and there is no index: write nothing
            index = self._create(self._build_info(dim=dim))
            manifest = index.manifest
            manifest.namespace = report.namespace
        index.delete_nodes(removed_nodes)
        self._add_new(index, pending_list)
        for d in dropped:
            del manifest.docs[d]
        for p in pending_list:
            manifest.docs[p.ref.doc_id] = DocEntry(title=p.ref.title, content_sha256=p.ref.content_sha256,
                                                   node_ids=list(p.node_ids), tokens=p.tokens)
        manifest.files = new_files

        report.chunks_added = sum(len(p.node_ids) for p in pending_list)
        report.chunks_removed = len(removed_nodes)
        report.tokens_added = sum(p.tokens for p in pending_list)
        report.total_chunks = manifest.num_chunks
        report.new_chunks = new_chunks
        self._publish(index, new_chunks)
        report.written = True

    # ---- the stages an executor may run elsewhere (ragcache.ingest.ray_ingestor runs them on Ray Data)
    def _read_files(self, paths: list[Path]) -> Iterator["list[ReadDoc] | Exception"]:
        """The documents of each file, in order (a :class:`~ragcache.ingest.readers.SkipFile` in place of
        a file that is skipped); read lazily, one file at a time. What was left out of a file that
        was read (a bad JSONL line) goes to ``self._left_out[str(path)]``."""
        from ragcache.ingest.readers import SkipFile, read_file

        for path in paths:
            left_out: list[str] = []
            try:
                docs = read_file(path, left_out)
            except SkipFile as exc:
                yield exc
                continue
            if left_out:
                self._left_out[str(path)] = left_out
            yield [ReadDoc.of(d) for d in docs]

    def _chunks_of(self, ref: ReadDoc) -> list[Chunk]:
        """The chunks of a document to (re)index, computed now (an executor may defer them to :meth:`_embed`)."""
        return self.chunk_document(ref.doc, ref.title)

    def _check_namespace(self, recorded: str) -> None:
        if self.namespace is not None and self.namespace != recorded:
            raise IndexMismatchError(
                f"index {self.path} has KV namespace {recorded or '(none)'!r}, not {self.namespace!r}: "
                "an index keeps the namespace of its first ingest; leave out --namespace, or ingest into a "
                "new --index"
            )

    def _check_build(self, built: BuildInfo) -> None:
        now = self._build_info(dim=built.dim)
        diffs = [f"{k} {getattr(built, k)!r} -> {getattr(now, k)!r}"
                 for k in ("chunk_size", "chunk_overlap", "llm_fingerprint", "embedding_model")
                 if getattr(built, k) != getattr(now, k)]
        if diffs:
            raise IndexMismatchError(
                f"index {self.path} was built with other settings ({'; '.join(diffs)}); its chunks "
                "cannot be mixed with new ones: ingest into a new --index, or delete the folder to rebuild"
            )

    def _embed(self, pending: list[_Pending], total: int) -> None:
        """Embed the pending chunks in batches (llama-index embedding model) and build their nodes."""
        nodes = []
        for p in pending:
            p.nodes = [chunk_to_node(c, source=p.source) for c in p.chunks]
            p.node_ids = [n.node_id for n in p.nodes]
            p.tokens = sum(c.num_tokens for c in p.chunks)
            nodes.extend(zip(p.nodes, p.chunks))
        if not nodes:
            return
        from llama_index.core.schema import MetadataMode

        embed_model = self.embed_model  # load before the bar starts: tok/s is embedding only
        t0, tokens = time.perf_counter(), 0
        with progress(total=total, desc="embedding", unit="chunk", disable=not self.show_progress) as bar:
            for i in range(0, len(nodes), _EMBED_BATCH):
                batch = nodes[i:i + _EMBED_BATCH]
                vectors = embed_model.get_text_embedding_batch(
                    [n.get_content(metadata_mode=MetadataMode.EMBED) for n, _ in batch]
                )
                for (node, _), vec in zip(batch, vectors):
                    node.embedding = vec
                tokens += sum(c.num_tokens for _, c in batch)
                bar.update(len(batch))
                bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")

    def _embedding_dim(self, pending: list[_Pending]) -> int | None:
        """Floats per embedding of this run's new chunks (for a new index), or None when there are none."""
        first = next((n for p in pending for n in p.nodes), None)
        return None if first is None else len(first.embedding)

    def _add_new(self, index: Any, pending: list[_Pending]) -> None:
        """Add this run's new chunk nodes (with their embeddings) to the index being built."""
        index.add_nodes([n for p in pending for n in p.nodes])

    def _run_kv_hook(self, new_chunks: list[Chunk], namespace: str, where: str) -> None:
        if self.kv_hook is not None and new_chunks:
            try:
                self.kv_hook(new_chunks, namespace)
            except Exception as exc:
                raise KVPrecomputeError(
                    f"KV precompute failed ({type(exc).__name__}: {exc}); the index at {where} "
                    "is unchanged (re-run the ingest, or pass --no-kv to index without KV)"
                ) from exc

    def _publish(self, index: Any, new_chunks: list[Chunk]) -> None:
        """FAISS: write the index into a staging sibling, run the KV hook, swap it in. pgvector:
        run the KV hook, then write every change and the manifest in one transaction."""
        if self.pg_name is not None:
            self._run_kv_hook(new_chunks, index.manifest.namespace, f"pgvector index {self.pg_name!r}")
            version = index.publish()
            log.info("published pgvector index %s version %d: %d chunks", self.pg_name, version,
                     index.manifest.num_chunks)
            return
        staging = Path(tempfile.mkdtemp(prefix=staging_prefix(self.path), dir=self.path.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes 0700; the index is an ordinary folder
        try:
            index.persist(staging)
            previous = readable_path(self.path)
            if previous is not None and (previous / CALIBRATION).is_file():  # calibration outlives an ingest
                shutil.copy2(previous / CALIBRATION, staging / CALIBRATION)
            self._run_kv_hook(new_chunks, index.manifest.namespace, str(self.path))
            swap_in(staging, self.path)
            log.info("published %s: %d chunks", self.path, index.manifest.num_chunks)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
