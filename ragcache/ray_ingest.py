"""Corpus-scale ingest on Ray Data: read -> split -> embed -> KV precompute as Ray Data stages.

Owns: :class:`RayIngestor`, an :class:`~ragcache.ingest.Ingestor` whose reading, chunking,
embedding and KV precompute run on a Ray cluster (``ingest.ray_address``; a local Ray started for
the ingest when empty), with actors holding the tokenizer, the embedding model and the vLLM
engine. What changed (file fingerprints against the manifest), the manifest itself, the publish
and its crash safety stay in :class:`~ragcache.ingest.Ingestor`, so both executors follow the same
rules and produce the same manifest, chunks and KV keys. Must not import vLLM at module level (the
KV actor does, on the worker), nor ``app/`` or ``ui/``.

Stages (each a Ray Data operator; Ray retries a failed task and restarts a dead actor, so a killed
worker's batch is computed again; rows are keyed by node id and KV entries by content, so a retried
batch is never duplicated):

1. read: one task per changed file (``read_file``), results gathered in file order;
2. (driver) the same document de-duplication as the local path picks the documents to index;
3. split: an actor with the LLM tokenizer and llama-index's splitter turns documents into chunks;
4. embed: an actor with the embedding model embeds batches of chunks;
5. KV precompute: an actor with a :class:`~ragcache.engine.BlendEngine` computes and stores each
   chunk's KV in the configured tiers (the shared remote tier, for other machines to use).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ragcache.chunks import Chunk
from ragcache.engine.messages import PrecomputeReport
from ragcache.ingest import IngestError, Ingestor, KVPrecomputeError, _Pending

if TYPE_CHECKING:
    from llama_index.core.schema import Document

    from ragcache.config import Settings

log = logging.getLogger(__name__)

#: chunks per embedding / KV batch
BATCH = 32
#: fault injection for tests: a file path; the first embedding batch that finds no file there creates
#: it and kills its worker process (os._exit), so Ray must retry the batch on a restarted actor
FAULT_ENV = "RAGCACHE_RAY_KILL_EMBED_ONCE"


class RayNotInstalledError(IngestError):
    """``--executor ray`` without the ray package."""


def _chunk_row(c: Chunk, source: str) -> dict[str, Any]:
    return {"chunk_id": c.chunk_id, "doc_id": c.doc_id, "title": c.title, "position": c.position, "text": c.text,
            "token_ids": list(c.token_ids), "source": source}


def _row_chunk(r: dict[str, Any]) -> Chunk:
    return Chunk(chunk_id=str(r["chunk_id"]), doc_id=str(r["doc_id"]), title=str(r["title"]),
                 position=int(r["position"]), text=str(r["text"]), token_ids=tuple(int(t) for t in r["token_ids"]))


def _rows(batch: Any) -> list[dict[str, Any]]:
    """A Ray Data batch (dict of columns) as a list of row dicts."""
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    return [{k: batch[k][i] for k in keys} for i in range(n)]


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {k: [r[k] for r in rows] for k in (rows[0] if rows else {})}


class _Splitter:
    """Ray actor: documents -> chunk rows (the LLM tokenizer and the splitter load once)."""

    def __init__(self, settings: "Settings") -> None:
        self.ingestor = Ingestor(settings, "ray-split", show_progress=False)

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        from llama_index.core.schema import Document

        out = []
        for r in _rows(batch):
            doc = Document(text=str(r["text"]), id_=str(r["doc_id"]))
            out.extend(_chunk_row(c, str(r["source"])) for c in self.ingestor.chunk_document(doc, str(r["title"])))
        return _columns(out)


class _Embedder:
    """Ray actor: chunk rows -> the same rows with their embedding (the model loads once)."""

    def __init__(self, settings: "Settings") -> None:
        from ragcache.models import load_embed_model

        self.model = load_embed_model(settings)

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        from llama_index.core.schema import MetadataMode

        from ragcache.index import chunk_to_node

        rows = _rows(batch)
        marker = os.environ.get(FAULT_ENV)
        if marker and not os.path.exists(marker):
            Path(marker).write_text(str(os.getpid()))
            os._exit(137)  # a killed worker, mid-batch
        nodes = [chunk_to_node(_row_chunk(r), source=str(r["source"])) for r in rows]
        vectors = self.model.get_text_embedding_batch([n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes])
        for r, v in zip(rows, vectors):
            r["embedding"] = [float(x) for x in v]
        return _columns(rows)


class _KVPrecompute:
    """Ray actor: computes and stores each chunk's KV with its own vLLM engine (started once)."""

    def __init__(self, settings: "Settings", namespace: str) -> None:
        from ragcache.engine import BlendEngine

        self.engine = BlendEngine(settings)
        self.namespace = namespace

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        rows = _rows(batch)
        out = self.engine.precompute([_row_chunk(r) for r in rows], show_progress=False, namespace=self.namespace)
        for r in rows:  # per row: what the batch did (the driver sums distinct batches)
            r["kv_computed"] = out.computed
            r["kv_tokens"] = out.tokens
            r["kv_batch"] = min(str(x["chunk_id"]) for x in rows) + f":{len(rows)}"
            r["kv_stored"] = ",".join(f"{t}={n}" for t, n in out.stored.items())
        return _columns(rows)


def _read_one(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Ray task: one file's documents as rows (a skip reason instead when it cannot be read)."""
    from ragcache.readers import SkipFile, read_file

    path = str(row["path"])
    left_out: list[str] = []
    try:
        docs = read_file(Path(path), left_out)
    except SkipFile as exc:
        return [{"path": path, "order": row["order"], "skip": str(exc), "doc_id": "", "text": "", "meta": "{}",
                 "left_out": "[]"}]
    import json

    gone = json.dumps(left_out)  # parts of the file left out (a bad JSONL line), on every row of the file
    return [{"path": path, "order": row["order"], "skip": "", "doc_id": d.id_, "text": d.text,
             "meta": json.dumps(d.metadata, default=str), "left_out": gone} for d in docs] or [
        {"path": path, "order": row["order"], "skip": "", "doc_id": "", "text": "", "meta": "{}", "left_out": gone}]


class RayIngestor(Ingestor):
    """An :class:`~ragcache.ingest.Ingestor` whose stages run on Ray Data (see the module docstring).

    Args:
        settings, index, show_progress, embed_model, tokenizer, namespace: as for ``Ingestor``.
        precompute_kv: run the KV stage (``False``: ``--no-kv``).
        ray_address: the Ray cluster (``ray://host:10001`` or ``host:6379``); "" or None = a local
            Ray started (and stopped) for the ingest.

    Raises:
        RayNotInstalledError: the ray package is missing (names the install command).
    """

    def __init__(self, settings: "Settings", index: str | os.PathLike[str] = "default", *,
                 precompute_kv: bool = True, ray_address: str | None = None, show_progress: bool = True,
                 embed_model: Any = None, tokenizer: Any = None, namespace: str | None = None) -> None:
        super().__init__(settings, index, kv_hook=None, show_progress=show_progress, embed_model=embed_model,
                         tokenizer=tokenizer, namespace=namespace)
        try:
            import ray  # noqa: F401
            import ray.data  # noqa: F401
        except ImportError:
            raise RayNotInstalledError("--executor ray needs Ray Data: pip install 'ray[data]'") from None
        self.precompute_kv = precompute_kv
        self.ray_address = ray_address or ""
        #: what the KV stage did: computed, tokens, per tier the entries stored
        self.kv_totals = PrecomputeReport()  # summed over distinct batches (rows carry no seconds and no keys)
        self._started_ray = False

    # ---- Ray itself
    def _ray(self) -> Any:
        import ray

        if not self.show_progress:  # Ray Data logs every dataset's plan at INFO
            logging.getLogger("ray.data").setLevel(logging.WARNING)
        if not ray.is_initialized():
            env = {k: v for k, v in os.environ.items() if k.startswith(("RAGCACHE_", "HF_", "TRANSFORMERS_"))}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                            os.environ.get("PYTHONPATH", "")) if p)
            ray.init(address=self.ray_address or None, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, runtime_env={"env_vars": env})
            self._started_ray = not self.ray_address
            ctx = ray.data.DataContext.get_current()
            ctx.enable_progress_bars = self.show_progress
        return ray

    def close(self) -> None:
        """Stop the local Ray this ingestor started (a cluster named by ``ray_address`` is left running)."""
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def ingest(self, paths: Any, *, prune: bool = False) -> Any:
        """As :meth:`Ingestor.ingest`, with the stages on Ray; a local Ray is stopped afterwards."""
        try:
            return super().ingest(paths, prune=prune)
        finally:
            self.close()

    # ---- the stages
    def _read_files(self, paths: list[Path]) -> Iterator["list[Document] | Exception"]:
        import json

        from llama_index.core.schema import Document

        from ragcache.readers import SkipFile

        if not paths:
            return iter(())
        ray = self._ray()
        ds = ray.data.from_items([{"path": str(p), "order": i} for i, p in enumerate(paths)])
        rows = ds.flat_map(_read_one).take_all()
        by_file: dict[int, list[dict[str, Any]]] = {}
        for r in rows:
            by_file.setdefault(int(r["order"]), []).append(r)
        out: list[Any] = []
        for i in range(len(paths)):
            got = by_file.get(i, [])
            if got and got[0]["skip"]:
                out.append(SkipFile(got[0]["skip"]))
                continue
            if got and json.loads(got[0].get("left_out") or "[]"):
                self._left_out[str(paths[i])] = json.loads(got[0]["left_out"])
            out.append([Document(text=r["text"], id_=r["doc_id"], metadata=json.loads(r["meta"]))
                        for r in got if r["doc_id"]])
        return iter(out)

    def _chunks_of(self, doc: "Document", title: str) -> list[Chunk]:
        return []  # split on Ray in _embed

    def _embed(self, pending: list[_Pending], total: int) -> None:
        """Split, embed and (unless ``precompute_kv`` is off) precompute KV on Ray Data; fills each
        pending document's chunks and nodes.

        Raises:
            KVPrecomputeError: a stage failed after Ray's retries (nothing is published).
        """
        from ragcache.index import chunk_to_node

        if not pending:
            return
        ray = self._ray()
        s = self.settings
        docs = [{"doc_id": p.doc.id_, "title": p.title, "text": p.doc.text, "source": p.source} for p in pending]
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        threads = {"env_vars": {"OMP_NUM_THREADS": str(cpus)}}
        one = ray.data.ActorPoolStrategy(size=1)  # one actor per stage here; more on a cluster
        ds = ray.data.from_items(docs).map_batches(
            _Splitter, fn_constructor_args=(s,), batch_size=16, compute=one, num_cpus=0.5)
        ds = ds.map_batches(_Embedder, fn_constructor_args=(s,), batch_size=BATCH, compute=one, num_cpus=0.5,
                            runtime_env=threads)
        if self.precompute_kv:
            ns = self._namespace
            ds = ds.map_batches(_KVPrecompute, fn_constructor_args=(s, ns), batch_size=BATCH, compute=one,
                                num_cpus=1, runtime_env=threads)
        try:
            rows = ds.take_all()
        except Exception as exc:  # a stage failed after Ray's retries
            raise KVPrecomputeError(f"the Ray ingest failed ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); "
                                    "the index is unchanged (re-run the ingest)") from exc
        by_doc: dict[str, dict[int, dict[str, Any]]] = {}
        batches: dict[str, dict[str, Any]] = {}
        for r in rows:  # keyed by (doc, position): a retried batch's rows replace, never add
            by_doc.setdefault(str(r["doc_id"]), {})[int(r["position"])] = r
            if self.precompute_kv:
                batches[str(r["kv_batch"])] = r
        for b in batches.values():
            stored = dict(part.split("=") for part in filter(None, str(b["kv_stored"]).split(",")))
            self.kv_totals.add(PrecomputeReport(computed=int(b["kv_computed"]), tokens=int(b["kv_tokens"]),
                                                stored={tier: int(n) for tier, n in stored.items()}))
        for p in pending:
            found = by_doc.get(p.doc.id_, {})
            p.chunks = [_row_chunk(found[i]) for i in sorted(found)]
            p.nodes = []
            for i in sorted(found):
                node = chunk_to_node(_row_chunk(found[i]), source=p.source)
                node.embedding = list(found[i]["embedding"])
                p.nodes.append(node)
