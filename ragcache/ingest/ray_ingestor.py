"""Corpus-scale ingest on Ray Data: read -> split and embed -> KV precompute -> index rows, on the workers.

Owns: :class:`RayIngestor`, an :class:`~ragcache.ingest.ingestor.Ingestor` whose reading, chunking,
embedding, KV precompute and index writes run on a Ray cluster (``ingest.ray_address``; a local Ray
started for the ingest when empty), and :func:`plan_pools`, which sizes its actor pools from the
cluster's resources. What changed (file fingerprints against the manifest), the manifest itself,
the publish and its crash safety stay in :class:`~ragcache.ingest.ingestor.Ingestor`, so both executors
follow the same rules and produce the same manifest, chunks, embeddings and KV keys. Must not import
vLLM at module level (the KV actors do, on the workers), nor ``app/`` or ``ui/``.

Stages (Ray Data operators; Ray retries a failed task and restarts a dead actor, so a killed
worker's batch is computed again; KV entries are keyed by content and index rows by node id, so a
retried batch is never duplicated):

1. read: one task per changed file (``read_file``); the documents stay in Ray's object store, and
   the driver receives per document only what the manifest records (id, title, content hash);
2. (driver) the same document de-duplication as the local path picks the documents to index;
3. split and embed: a pool of actors, each with the LLM tokenizer, llama-index's splitter and the
   embedding model, turns documents into chunk rows with their embeddings;
4. KV precompute: a pool of actors, each with its own :class:`~ragcache.engine.BlendEngine`, computes
   and stores each chunk's KV in that engine's tiers (the shared remote tier, for other machines);
5. index rows, written by Ray write tasks (a :class:`ray.data.Datasink`): for a pgvector index into
   a staging table of the database, which the publish moves into the index in its one transaction
   (:func:`ragcache.index.pg_index.create_staging`); for a FAISS index, which is one local folder, as
   Parquet shards (chunk records and embeddings) in a staging folder beside the index, written on
   the driver's node, which the driver merges into the new index version before the usual folder
   swap. Rows never travel through the driver process; a shard or staged row of a write task that
   died is never read (the driver reads only the shards its write tasks reported; the publish keeps
   one row per node id).

Crash safety is the local path's: nothing is published until every stage has finished, a failed
stage leaves the previous index as it was, and the staging folder or table of an ingest that died
is removed by the next ingest into the same index.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import tempfile
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from ragcache.chunks import Chunk
from ragcache.engine.messages import PrecomputeReport
from ragcache.ingest.ingestor import IngestError, Ingestor, KVPrecomputeError, ReadDoc, _Pending

if TYPE_CHECKING:
    from ragcache.config import Settings

log = logging.getLogger("ragcache.ray_ingest")  # the name its lines have always carried

#: documents per block of the documents to index: one split-and-embed task each, whose chunks are one
#: KV precompute task (fewer documents per block on a small corpus, so that every actor has work)
DOC_BATCH = 16
#: share of the cluster's CPUs the actor pools ask Ray for; the rest is left to the write tasks and Ray
POOL_CPU_SHARE = 0.9
#: seconds a pool's actors may take to start (a vLLM engine: up to minutes on a busy CPU host)
ACTOR_START_S = 1800
#: CPUs each index write task asks for (it writes one Parquet shard or one COPY)
WRITE_CPUS = 0.05
#: fault injection for tests: a file path; the first embedding batch that finds no file there creates
#: it and kills its worker process (os._exit), so Ray must retry the batch on a restarted actor
FAULT_ENV = "RAGCACHE_RAY_KILL_EMBED_ONCE"
#: the columns of a chunk row between the stages (plus ``kv_report`` after the KV stage)
ROW_COLUMNS = ("chunk_id", "doc_id", "title", "position", "text", "token_ids", "source", "embedding")


class RayNotInstalledError(IngestError):
    """``--executor ray`` without the ray package."""


# ------------------------------------------------------------------------------------ sizing


@dataclass(frozen=True)
class PoolPlan:
    """The actor pools of one Ray ingest and what each actor asks Ray for.

    Attributes:
        embed_actors / kv_actors: actors in the split-and-embed and KV precompute pools.
        embed_cpus / kv_cpus: logical CPUs each actor of the pool asks for (Ray's accounting only;
            together at most :data:`POOL_CPU_SHARE` of the cluster's CPUs, so every actor is placed).
        kv_gpus: GPUs each KV actor asks for (1 on a cluster with GPUs, else 0).
        threads: ``OMP_NUM_THREADS`` of every actor: its node's CPUs shared among the actors of a stage.
    """

    embed_actors: int
    kv_actors: int
    embed_cpus: float
    kv_cpus: float
    kv_gpus: float
    threads: int


def plan_pools(nodes: list[dict[str, float]], actors: int = 0, *, kv: bool = True) -> PoolPlan:
    """Size the split-and-embed and KV precompute pools for a Ray cluster.

    Args:
        nodes: the resources of each live node (``ray.nodes()[i]["Resources"]``: ``CPU``, ``GPU``).
        actors: actors per pool; 0 = from the resources: one KV actor per GPU on a cluster with GPUs
            (each engine on its own accelerator), else one per node (a vLLM CPU engine computes with
            all of its node's cores), and one split-and-embed actor per node.
        kv: whether the KV pool runs (else the embedding pool gets the CPUs).

    Raises:
        ValueError: ``actors`` < 0.
    """
    if actors < 0:
        raise ValueError(f"actors {actors}: must be >= 0 (0 = sized from the cluster's resources)")
    cpu_nodes = [n for n in nodes if n.get("CPU", 0) > 0] or [{"CPU": 1.0}]
    total_cpus = sum(n["CPU"] for n in cpu_nodes)
    gpus = int(sum(n.get("GPU", 0) for n in nodes))
    embed_n = actors or len(cpu_nodes)
    kv_n = actors or (gpus if gpus >= 1 else len(cpu_nodes))
    kv_gpus = 1.0 if kv and gpus >= 1 else 0.0
    share = POOL_CPU_SHARE * total_cpus

    def floor2(x: float) -> float:
        return max(0.01, math.floor(x * 100) / 100)

    if not kv:
        embed_cpus, kv_cpus = floor2(share / embed_n), 0.0
    elif kv_gpus:  # the engines compute on their GPUs: a CPU each at most, the rest for embedding
        kv_cpus = floor2(min(1.0, share / (2 * kv_n)))
        embed_cpus = floor2((share - kv_cpus * kv_n) / embed_n)
    else:
        embed_cpus = kv_cpus = floor2(share / (embed_n + kv_n))
    busiest = max(embed_n, kv_n if kv and not kv_gpus else 0)
    threads = max(1, int(min(n["CPU"] for n in cpu_nodes) * len(cpu_nodes) // busiest))
    return PoolPlan(embed_n, kv_n if kv else 0, embed_cpus, kv_cpus, kv_gpus, threads)


def precompute_engine_settings(settings: "Settings") -> "Settings":
    """The settings of a KV actor's engine: those given, with the memory it would hold for nothing cut.

    - vLLM's paged KV cache: the least vLLM accepts (one request of ``engine.max_model_len``;
      :func:`ragcache.engine.limits.kv_bytes_per_request`). The precompute computes chunk KV in
      ragcache's own layer-wise forward, never in the paged cache.
    - the memory tiers (``store.cpu_kv_pool_gb``, ``store.gpu_kv_pool_gb``) off where a persistent tier
      (disk, remote) takes the KV: they would die with the actor, and every actor would hold up to
      their size in copies no question ever reads.
    """
    from ragcache.engine.dtype import resolve_dtype
    from ragcache.engine.limits import default_block_size, kv_bytes_per_request, read_kv_shape
    from ragcache.models import resolve_llm

    llm = resolve_llm(settings.models.model, settings.models.cache_dir)
    least = kv_bytes_per_request(read_kv_shape(llm.path), settings.engine.max_model_len,
                                 resolve_dtype(settings.engine.dtype).dtype, default_block_size())
    out = settings.model_copy(deep=True)
    out.engine.kv_cache_memory_bytes = min(least, settings.engine.kv_cache_memory_bytes)
    if settings.store.ssd_cache_max_gb > 0 or settings.store.remote_url:
        out.store.cpu_kv_pool_gb = out.store.gpu_kv_pool_gb = 0.0
    return out


# ---------------------------------------------------------------------------------- rows


def _chunk_row(c: Chunk, source: str) -> dict[str, Any]:
    return {"chunk_id": c.chunk_id, "doc_id": c.doc_id, "title": c.title, "position": c.position, "text": c.text,
            "token_ids": list(c.token_ids), "source": source}


def _row_chunk(r: dict[str, Any]) -> Chunk:
    return Chunk(chunk_id=str(r["chunk_id"]), doc_id=str(r["doc_id"]), title=str(r["title"]),
                 position=int(r["position"]), text=str(r["text"]), token_ids=tuple(int(t) for t in r["token_ids"]))


def _row_node(r: dict[str, Any]) -> Any:
    """The llama-index node of a chunk row, carrying the row's embedding (see
    :func:`ragcache.index.nodes.chunk_to_node`)."""
    from ragcache.index.nodes import chunk_to_node

    node = chunk_to_node(_row_chunk(r), source=str(r["source"]))
    node.embedding = [float(x) for x in r["embedding"]]
    return node


def _rows(batch: Any) -> list[dict[str, Any]]:
    """A Ray Data batch (dict of columns) as a list of row dicts."""
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    return [{k: batch[k][i] for k in keys} for i in range(n)]


def _columns(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list[Any]]:
    """Rows as a batch of the columns ``keys`` (empty columns for no rows: a document without text)."""
    return {k: [r[k] for r in rows] for k in keys}


def _block_rows(blocks: Iterable[Any]) -> list[dict[str, Any]]:
    """The rows of a write task's blocks, as dicts."""
    from ray.data.block import BlockAccessor

    return [dict(r) for b in blocks for r in BlockAccessor.for_block(b).iter_rows(public_row_format=True)]


# -------------------------------------------------------------------------------- actors


class _SplitEmbed:
    """Ray actor: documents -> chunk rows with their embeddings (tokenizer, splitter and embedding
    model load once per actor)."""

    def __init__(self, settings: "Settings") -> None:
        from ragcache.models import load_embed_model

        self.ingestor = Ingestor(settings, "ray-split", show_progress=False)
        self.model = load_embed_model(settings)

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        from llama_index.core.schema import Document, MetadataMode

        from ragcache.index.nodes import chunk_to_node

        rows = []
        for r in _rows(batch):
            doc = Document(text=str(r["text"]), id_=str(r["doc_id"]))
            rows.extend(_chunk_row(c, str(r["path"])) for c in self.ingestor.chunk_document(doc, str(r["title"])))
        marker = os.environ.get(FAULT_ENV)
        if marker and not os.path.exists(marker):
            Path(marker).write_text(str(os.getpid()))
            os._exit(137)  # a killed worker, mid-batch
        nodes = [chunk_to_node(_row_chunk(r), source=str(r["source"])) for r in rows]
        vectors = self.model.get_text_embedding_batch([n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes])
        for r, v in zip(rows, vectors):
            r["embedding"] = [float(x) for x in v]
        return _columns(rows, ROW_COLUMNS)


class _KVPrecompute:
    """Ray actor: computes and stores each chunk's KV with its own vLLM engine (started once; without
    the memory it would hold for nothing: :func:`precompute_engine_settings`)."""

    def __init__(self, settings: "Settings", namespace: str) -> None:
        from ragcache.engine import BlendEngine

        self.engine = BlendEngine(precompute_engine_settings(settings))
        self.namespace = namespace
        self.actor = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        rows = _rows(batch)
        out = self.engine.precompute([_row_chunk(r) for r in rows], show_progress=False, namespace=self.namespace)
        report = json.dumps({"computed": out.computed, "skipped": out.skipped, "tokens": out.tokens,
                             "seconds": out.seconds, "stored": out.stored, "actor": self.actor})
        for i, r in enumerate(rows):  # the batch's report rides on its first row to the write task
            r["kv_report"] = report if i == 0 else ""
        return _columns(rows, (*ROW_COLUMNS, "kv_report"))


def _read_one(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Ray task: one file's documents as rows (a skip reason instead when it cannot be read)."""
    from ragcache.ingest.readers import SkipFile, read_file

    path = str(row["path"])
    empty = {"path": path, "order": row["order"], "skip": "", "doc_id": "", "key": "", "title": "",
             "content_sha256": "", "text": "", "left_out": "[]"}
    left_out: list[str] = []
    try:
        docs = read_file(Path(path), left_out)
    except SkipFile as exc:
        return [{**empty, "skip": str(exc)}]
    gone = json.dumps(left_out)  # parts of the file left out (a bad JSONL line), on every row of the file
    refs = [ReadDoc.of(d) for d in docs]
    return [{**empty, "doc_id": ref.doc_id, "key": _doc_key(path, ref.doc_id), "title": ref.title,
             "content_sha256": ref.content_sha256, "text": ref.doc.text, "left_out": gone}
            for ref in refs] or [{**empty, "left_out": gone}]


def _doc_key(source: str, doc_id: str) -> str:
    """A read document's key: the file it was taken from and its id (one file holds a document id once)."""
    return f"{source}\x00{doc_id}"


# -------------------------------------------------------------------------------- sinks


def _kv_reports(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [json.loads(r["kv_report"]) for r in rows if r.get("kv_report")]


@lru_cache(maxsize=1)
def sink_classes() -> tuple[type, type]:
    """The two :class:`ray.data.Datasink` classes of the index writes, ``(ShardSink, PgStagingSink)``
    (defined on first use: imports Ray).

    ``ShardSink(folder)`` (FAISS): each write task writes its rows as one Parquet shard (chunk records
    and embeddings, float32) into ``folder``, atomically (a temporary name, then a rename), and reports
    its name; the tasks run on the driver's node, where the index folder is.

    ``PgStagingSink(url, table)`` (pgvector): each write task COPYs its rows into the ingest's staging
    table in one transaction (a task that dies commits nothing) and reports per row what the manifest
    records (doc id, position, node id, tokens) and the embedding size.

    Both report the KV stage's batch reports that reached them; after the write the driver finds every
    task's report in the sink's ``returns``.
    """
    from ray.data import Datasink

    class ShardSink(Datasink):
        def __init__(self, folder: Path) -> None:
            self.folder = str(folder)
            self.returns: list[dict[str, Any]] = []

        @property
        def supports_distributed_writes(self) -> bool:
            return False  # the shards must land where the driver reads them

        def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
            import pyarrow as pa
            import pyarrow.parquet as pq

            rows = _block_rows(blocks)
            if not rows:
                return {"shard": "", "rows": 0, "kv": []}
            table = pa.table({
                "chunk_id": pa.array([str(r["chunk_id"]) for r in rows], pa.string()),
                "doc_id": pa.array([str(r["doc_id"]) for r in rows], pa.string()),
                "title": pa.array([str(r["title"]) for r in rows], pa.string()),
                "position": pa.array([int(r["position"]) for r in rows], pa.int32()),
                "text": pa.array([str(r["text"]) for r in rows], pa.string()),
                "token_ids": pa.array([[int(t) for t in r["token_ids"]] for r in rows], pa.list_(pa.int32())),
                "source": pa.array([str(r["source"]) for r in rows], pa.string()),
                "embedding": pa.array([[float(x) for x in r["embedding"]] for r in rows], pa.list_(pa.float32())),
            })
            name = f"shard-{uuid.uuid4().hex}.parquet"
            tmp = Path(self.folder) / f".{name}.tmp"
            pq.write_table(table, tmp)
            os.replace(tmp, Path(self.folder) / name)
            return {"shard": name, "rows": len(rows), "kv": _kv_reports(rows)}

        def on_write_complete(self, write_result: Any) -> None:
            self.returns = list(write_result.write_returns)

    class PgStagingSink(Datasink):
        def __init__(self, url: str, table: str) -> None:
            self.url, self.table = url, table
            self.returns: list[dict[str, Any]] = []

        def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
            from ragcache.index.pg_index import connect, copy_nodes

            rows = _block_rows(blocks)
            nodes = [_row_node(r) for r in rows]
            if nodes:
                conn = connect(self.url, autocommit=False)
                try:
                    with conn.transaction():
                        copy_nodes(conn, self.table, nodes)
                finally:
                    conn.close()
            return {"rows": len(rows), "dim": len(nodes[0].embedding) if nodes else 0, "kv": _kv_reports(rows),
                    "docs": [[str(r["doc_id"]), int(r["position"]), n.node_id, len(r["token_ids"])]
                             for r, n in zip(rows, nodes)]}

        def on_write_complete(self, write_result: Any) -> None:
            self.returns = list(write_result.write_returns)

    return ShardSink, PgStagingSink


# ------------------------------------------------------------------------------ ingestor


class RayIngestor(Ingestor):
    """An :class:`~ragcache.ingest.ingestor.Ingestor` whose stages run on Ray Data (see the module docstring).

    Args:
        settings, index, show_progress, embed_model, tokenizer, namespace: as for ``Ingestor``.
        precompute_kv: run the KV stage (``False``: ``--kv lazy``).
        ray_address: the Ray cluster (``ray://host:10001`` or ``host:6379``); "" or None = a local
            Ray started (and stopped) for the ingest.
        actors: actors per pool (split-and-embed, KV precompute); None = ``ingest.ray_actors``; 0 =
            sized from the cluster's resources (:func:`plan_pools`).

    Attributes:
        kv_totals: what the KV stage did (computed, skipped, tokens, worker seconds, entries per tier),
            summed over its batches (no keys: they stay on the workers).
        kv_actors_used: how many KV actors computed batches of the last run.
        pools: the :class:`PoolPlan` of the last run (None before one ran a stage).

    Raises:
        RayNotInstalledError: the ray package is missing (names the install command).
        ValueError: ``actors`` < 0.
    """

    def __init__(self, settings: "Settings", index: str | os.PathLike[str] = "default", *,
                 precompute_kv: bool = True, ray_address: str | None = None, actors: int | None = None,
                 show_progress: bool = True, embed_model: Any = None, tokenizer: Any = None,
                 namespace: str | None = None) -> None:
        super().__init__(settings, index, kv_hook=None, show_progress=show_progress, embed_model=embed_model,
                         tokenizer=tokenizer, namespace=namespace)
        try:
            import ray  # noqa: F401
            import ray.data  # noqa: F401
        except ImportError:
            raise RayNotInstalledError("--executor ray needs Ray Data: pip install 'ray[data]'") from None
        self.precompute_kv = precompute_kv
        self.ray_address = ray_address or ""
        self.actors = settings.ingest.ray_actors if actors is None else actors
        if self.actors < 0:
            raise ValueError(f"actors {self.actors}: must be >= 0 (0 = sized from the cluster's resources)")
        self.kv_totals = PrecomputeReport()
        self.kv_actors_used = 0
        self.pools: PoolPlan | None = None
        self._started_ray = False
        self._docs: Any = None  # the read documents, materialized in Ray's object store
        self._staging_table: str | None = None  # pgvector: the staging table of this run
        self._dim: int | None = None  # pgvector: the embedding size the workers wrote

    # ---- Ray itself
    def _ray(self) -> Any:
        import ray

        if not self.show_progress:  # Ray Data logs every dataset's plan at INFO
            logging.getLogger("ray.data").setLevel(logging.WARNING)
        if not ray.is_initialized():
            env = {k: v for k, v in os.environ.items() if k.startswith(("RAGCACHE_", "HF_", "TRANSFORMERS_"))}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                            os.environ.get("PYTHONPATH", "")) if p)
            ray.init(address=self.ray_address or None, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, runtime_env={"env_vars": env})
            self._started_ray = not self.ray_address
            ctx = ray.data.DataContext.get_current()
            ctx.enable_progress_bars = self.show_progress
            # a pool starts working once all of its actors are up (else the first engine takes every batch
            # while the others start); a pool that cannot be placed fails the ingest instead of waiting forever
            ctx.wait_for_min_actors_s = ACTOR_START_S
        return ray

    def close(self) -> None:
        """Stop the local Ray this ingestor started (a cluster named by ``ray_address`` is left running)."""
        self._docs = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def ingest(self, paths: Any, *, prune: bool = False) -> Any:
        """As :meth:`Ingestor.ingest`, with the stages on Ray; a local Ray is stopped afterwards, and a
        staging table the publish did not consume is dropped."""
        try:
            return super().ingest(paths, prune=prune)
        finally:
            if self._staging_table is not None:
                from ragcache.index.pg_index import PgUnavailableError, drop_staging

                try:
                    drop_staging(self.settings, self._staging_table)
                except PgUnavailableError as exc:  # the next ingest into this index drops it
                    log.warning("staging table %s left behind: %s", self._staging_table, exc)
                self._staging_table = None
            self.close()

    # ---- the stages
    def _read_files(self, paths: list[Path]) -> Iterator["list[ReadDoc] | Exception"]:
        from ragcache.ingest.readers import SkipFile

        if not paths:
            return iter(())
        ray = self._ray()
        self._docs = ray.data.from_items([{"path": str(p), "order": i} for i, p in enumerate(paths)]).flat_map(
            _read_one).materialize()
        by_file: dict[int, list[dict[str, Any]]] = {}
        for r in self._docs.drop_columns(["text"]).iter_rows():  # what the plan needs; the texts stay on Ray
            by_file.setdefault(int(r["order"]), []).append(r)
        out: list[Any] = []
        for i in range(len(paths)):
            got = by_file.get(i, [])
            if got and got[0]["skip"]:
                out.append(SkipFile(got[0]["skip"]))
                continue
            if got and json.loads(got[0].get("left_out") or "[]"):
                self._left_out[str(paths[i])] = json.loads(got[0]["left_out"])
            out.append([ReadDoc(str(r["doc_id"]), str(r["title"]), str(r["content_sha256"])) for r in got
                        if r["doc_id"]])
        return iter(out)

    def _chunks_of(self, ref: ReadDoc) -> list[Chunk]:
        return []  # split on Ray in _embed

    def _embed(self, pending: list[_Pending], total: int) -> None:
        """Split, embed, (unless ``precompute_kv`` is off) precompute KV, and write the index rows on Ray
        Data; fills each pending document's node ids and tokens (FAISS: also its chunks and nodes, merged
        from the shards).

        Raises:
            KVPrecomputeError: a stage failed after Ray's retries (nothing is published).
            IngestError: a FAISS index from a Ray Client (``ray://``) session, whose write tasks cannot
                run beside the index folder.
        """
        if not pending:
            return
        ray = self._ray()
        from ray.data.expressions import col

        pg = self.pg_name is not None
        if not pg and ray.util.client.ray.is_connected():
            raise IngestError("a FAISS index is a local folder, and Ray Client (ray://) runs the write tasks on the "
                              "cluster: use ingest.vector_store = 'pgvector', or a cluster address without ray:// "
                              "(host:6379) from one of its nodes")
        s = self.settings
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        plan = self.pools = plan_pools(nodes, self.actors, kv=self.precompute_kv)
        log.info("Ray ingest: %s", plan)
        threads = {"env_vars": {"OMP_NUM_THREADS": str(plan.threads)}}
        chosen = sorted({_doc_key(p.source, p.ref.doc_id) for p in pending})
        blocks = min(len(chosen), max(math.ceil(len(chosen) / DOC_BATCH), 2 * max(plan.embed_actors, plan.kv_actors)))
        # materialized before any actor starts: the actors take the CPUs Ray would give the repartition's tasks
        ds = self._docs.filter(expr=col("key").is_in(chosen)).repartition(blocks).materialize()
        # batch_size None: one task per block (a batch size would merge small blocks into fewer tasks)
        ds = ds.map_batches(_SplitEmbed, fn_constructor_args=(s,), batch_size=None, num_cpus=plan.embed_cpus,
                            compute=ray.data.ActorPoolStrategy(size=plan.embed_actors), runtime_env=threads)
        if self.precompute_kv:
            ds = ds.map_batches(_KVPrecompute, fn_constructor_args=(s, self._namespace), batch_size=None,
                                # one block at a time per engine: the pool's last blocks go to whichever is free
                                compute=ray.data.ActorPoolStrategy(size=plan.kv_actors,
                                                                   max_tasks_in_flight_per_actor=1),
                                num_cpus=plan.kv_cpus, num_gpus=plan.kv_gpus or None, runtime_env=threads)
        shards: Path | None = None
        if pg:
            from ragcache.index.pg_index import create_staging, require_url

            self._staging_table = create_staging(s, self.pg_name)
            sink = sink_classes()[1](require_url(s), self._staging_table)
        else:
            from ragcache.index.folder import staging_prefix

            shards = Path(tempfile.mkdtemp(prefix=staging_prefix(self.path) + "shards-", dir=self.path.parent))
            sink = sink_classes()[0](shards)
        try:
            try:
                ds.write_datasink(sink, ray_remote_args={"num_cpus": WRITE_CPUS})
            except Exception as exc:  # a stage failed after Ray's retries
                raise KVPrecomputeError(f"the Ray ingest failed ({type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); the index is "
                                        "unchanged (re-run the ingest)") from exc
            reports = [kv for r in sink.returns for kv in r["kv"]]
            for kv in reports:
                self.kv_totals.add(PrecomputeReport.from_dict(kv))
            self.kv_actors_used = len({kv["actor"] for kv in reports})
            if pg:
                self._take_staged(pending, sink.returns)
            else:
                self._merge_shards(pending, shards, sink.returns)
        finally:
            if shards is not None:
                shutil.rmtree(shards, ignore_errors=True)

    def _merge_shards(self, pending: list[_Pending], folder: Path, returns: list[dict[str, Any]]) -> None:
        """Read the shards the write tasks reported into each pending document's chunks and nodes."""
        import pyarrow.parquet as pq

        by_doc: dict[str, dict[int, dict[str, Any]]] = {}
        for r in returns:
            if not r["shard"]:
                continue
            path = folder / r["shard"]
            if not path.is_file():
                raise IngestError(f"index shard {path} written by a Ray worker is missing here; the index is "
                                  "unchanged (run the ingest on the machine that holds ingest.index_dir)")
            for row in pq.read_table(path).to_pylist():  # keyed by (doc, position): a retried batch replaces
                by_doc.setdefault(row["doc_id"], {})[row["position"]] = row
        for p in pending:
            found = by_doc.get(p.ref.doc_id, {})
            rows = [found[i] for i in sorted(found)]
            p.chunks = [_row_chunk(r) for r in rows]
            p.nodes = [_row_node(r) for r in rows]
            p.node_ids = [n.node_id for n in p.nodes]
            p.tokens = sum(c.num_tokens for c in p.chunks)

    def _take_staged(self, pending: list[_Pending], returns: list[dict[str, Any]]) -> None:
        """Each pending document's node ids and tokens from what the write tasks staged in the database."""
        by_doc: dict[str, dict[int, tuple[str, int]]] = {}
        for r in returns:
            self._dim = self._dim or r["dim"] or None
            for doc_id, position, node_id, tokens in r["docs"]:
                by_doc.setdefault(doc_id, {})[position] = (node_id, tokens)
        for p in pending:
            found = by_doc.get(p.ref.doc_id, {})
            p.node_ids = [found[i][0] for i in sorted(found)]
            p.tokens = sum(found[i][1] for i in found)

    def _embedding_dim(self, pending: list[_Pending]) -> int | None:
        return self._dim if self.pg_name is not None else super()._embedding_dim(pending)

    def _add_new(self, index: Any, pending: list[_Pending]) -> None:
        if self._staging_table is not None:
            index.add_staged(self._staging_table)
        else:
            super()._add_new(index, pending)
