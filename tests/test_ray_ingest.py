"""`ragcache ingest --executor ray`: read, split and embed, KV precompute and the index writes as Ray
Data stages on a local Ray (started by the ingest). Pins: the pool sizes follow the cluster's
resources; the Ray ingest of a corpus gives the same manifest and chunks as the local ingest; with 2
actors per pool it writes exactly the local path's rows (chunk ids, texts, embeddings) into a FAISS
folder and into pgvector, and its KV precompute stores exactly the chunk keys the local path would;
an embedding worker killed mid-batch is retried, nothing lost or duplicated; the staging left by an
ingest that died is removed by the next one.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from ragcache.config import Settings
from ragcache.ingest.ingestor import Ingestor, KVPrecomputeError
from tests.conftest import ZORBIA_DOCS, clear_ragcache_env

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install 'ray[data]'); Ray ingest tests skipped")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    clear_ragcache_env(monkeypatch)
    monkeypatch.chdir(tmp_path)


def corpus(folder: Path, n: int = 12) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in ZORBIA_DOCS.items():
        (folder / name).write_text(text)
    for i in range(n):
        (folder / f"island-{i:02d}.txt").write_text(
            f"Island {i} of the Zorbian archipelago has {i * 37 + 11} inhabitants and {i % 7 + 2} harbours. "
            f"Its lighthouse was built in {1700 + i * 5}; the ferry to Velmora leaves at {6 + i % 12} o'clock.")
    (folder / "empty.txt").write_text("")
    return folder


@pytest.mark.slow
@needs_ray
def test_ray_ingest_equals_the_local_ingest_and_survives_a_killed_worker(tmp_path, monkeypatch):
    from ragcache.index.catalog import catalog
    from ragcache.ingest.ray_ingestor import FAULT_ENV, RayIngestor

    docs = corpus(tmp_path / "corpus")
    settings = Settings.load(ingest={"index_dir": str(tmp_path / "indexes")})
    local = Ingestor(settings, "local", show_progress=False).ingest([docs])
    marker = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, str(marker))
    remote = RayIngestor(settings, "ray", precompute_kv=False, show_progress=False).ingest([docs])
    assert marker.exists()  # an embedding worker died mid-batch; its batch was retried
    assert (remote.chunks_added, remote.files_ingested, len(remote.skipped)) == \
        (local.chunks_added, local.files_ingested, len(local.skipped)) == (15, 15, 1)
    cat = catalog(settings)
    ml, cl = cat.read_chunks("local")
    mr, cr = cat.read_chunks("ray")
    assert mr.docs == ml.docs and mr.files == ml.files and mr.build == ml.build
    assert sorted(cr, key=lambda c: (c.doc_id, c.position)) == sorted(cl, key=lambda c: (c.doc_id, c.position))

    (docs / "island-00.txt").write_text("Island 0 was renamed Kelmar in 1901.")  # incremental, as the local path
    again = RayIngestor(settings, "ray", precompute_kv=False, show_progress=False).ingest([docs])
    assert (again.files_ingested, again.files_unchanged, again.chunks_added, again.chunks_removed) == (1, 14, 1, 1)

    # a stage that fails (the KV actors' engine refuses its settings) publishes nothing and leaves no staging
    before = cat.read_chunks("ray")
    (docs / "island-01.txt").write_text("Island 1 was sold to Velmora in 1888.")
    broken = settings.model_copy(deep=True)
    broken.engine.max_model_len = 10**6  # above the model's maximum: the engine refuses to start
    with pytest.raises(KVPrecomputeError, match="the Ray ingest failed .* the index is unchanged"):
        RayIngestor(broken, "ray", show_progress=False).ingest([docs])
    assert cat.read_chunks("ray") == before
    assert not list((tmp_path / "indexes").glob(".ray.staging-*"))



def test_pools_are_sized_from_the_cluster_or_the_actors_asked_for():
    from ragcache.ingest.ray_ingestor import POOL_CPU_SHARE, plan_pools

    one = plan_pools([{"CPU": 2.0}])  # this machine: one node, no GPU
    assert (one.embed_actors, one.kv_actors, one.kv_gpus, one.threads) == (1, 1, 0.0, 2)
    two = plan_pools([{"CPU": 2.0}], actors=2)
    assert (two.embed_actors, two.kv_actors, two.threads) == (2, 2, 1)
    assert 2 * (two.embed_cpus + two.kv_cpus) <= POOL_CPU_SHARE * 2  # every actor can be placed
    cluster = plan_pools([{"CPU": 16.0}, {"CPU": 16.0}, {"CPU": 16.0}, {"CPU": 0.0}])  # 3 CPU nodes and a head
    assert (cluster.embed_actors, cluster.kv_actors, cluster.threads) == (3, 3, 16)
    gpus = plan_pools([{"CPU": 32.0, "GPU": 4.0}, {"CPU": 32.0, "GPU": 4.0}])
    assert (gpus.embed_actors, gpus.kv_actors, gpus.kv_gpus, gpus.kv_cpus) == (2, 8, 1.0, 1.0)
    assert gpus.embed_actors * gpus.embed_cpus + gpus.kv_actors * gpus.kv_cpus <= POOL_CPU_SHARE * 64
    lazy = plan_pools([{"CPU": 8.0}], kv=False)
    assert (lazy.kv_actors, lazy.embed_cpus) == (0, POOL_CPU_SHARE * 8)
    with pytest.raises(ValueError, match="actors -1: must be >= 0"):
        plan_pools([{"CPU": 2.0}], actors=-1)


def faiss_rows(path: Path) -> dict[str, tuple]:
    """Every row of a FAISS index folder by node id: (doc id, position, chunk id, title, text, token ids,
    source, embedding as float32)."""
    import faiss
    from llama_index.core.storage.docstore import SimpleDocumentStore

    from ragcache.index.faiss_index import ID_MAP

    store = SimpleDocumentStore.from_persist_dir(str(path))
    vectors = faiss.read_index(str(path / "default__vector_store.json"))
    fid = {nid: int(f) for f, nid in json.loads((path / ID_MAP).read_text()).items()}
    out = {}
    for nid, node in store.docs.items():
        m = node.metadata
        out[nid] = (m["doc_id"], m["position"], m["chunk_id"], m["title"], node.get_content(), tuple(m["token_ids"]),
                    m["source"], vectors.reconstruct(fid[nid]))
    return out


def assert_same_rows(got: dict[str, tuple], want: dict[str, tuple]) -> None:
    assert sorted(got) == sorted(want) and want
    for nid, row in want.items():
        assert got[nid][:7] == row[:7], nid
        np.testing.assert_allclose(got[nid][7], row[7], atol=2e-5)  # embedded in other batches: float rounding


@pytest.mark.slow
@pytest.mark.integration
@needs_ray
def test_ray_ingest_with_two_actors_writes_the_local_rows_and_kv_keys(tmp_path):
    from ragcache.engine.dtype import resolve_dtype
    from ragcache.index.catalog import catalog
    from ragcache.index.folder import staging_prefix
    from ragcache.ingest.ray_ingestor import RayIngestor
    from ragcache.kvstore.disk import DiskTier
    from ragcache.models import load_tokenizer, resolve_llm
    from ragcache.prompt import PromptBuilder

    docs = corpus(tmp_path / "corpus", n=3)
    kv_dir = tmp_path / "kv"
    settings = Settings.load(ingest={"index_dir": str(tmp_path / "indexes")},
                             store={"ssd_cache_dir": str(kv_dir), "remote_url": "", "cpu_kv_pool_gb": 0.5},
                             engine={"max_model_len": 2048, "kv_cache_memory_bytes": 256 << 20})
    local = Ingestor(settings, "local", show_progress=False).ingest([docs])
    stale = tmp_path / "indexes" / (staging_prefix(tmp_path / "indexes" / "raykv") + "shards-dead")
    stale.mkdir(parents=True)  # the shard folder of a Ray ingest that died
    ing = RayIngestor(settings, "raykv", actors=2, show_progress=False)
    report = ing.ingest([docs])
    assert (ing.pools.embed_actors, ing.pools.kv_actors, ing.kv_actors_used) == (2, 2, 2)  # both computed
    assert report.chunks_added == local.chunks_added == 6 and ing.kv_totals.computed == 6
    assert ing.kv_totals.stored.get("disk") == 6 and report.tokens_added == local.tokens_added
    assert_same_rows(faiss_rows(tmp_path / "indexes" / "raykv"), faiss_rows(tmp_path / "indexes" / "local"))
    assert not stale.exists() and not list((tmp_path / "indexes").glob(".raykv.staging-*"))  # no staging left

    manifest, chunks = catalog(settings).read_chunks("raykv")
    assert manifest.docs == catalog(settings).read_chunks("local")[0].docs
    llm = resolve_llm(settings.models.model, settings.models.cache_dir)
    builder = PromptBuilder(load_tokenizer(settings).tokenizer, settings.prompt, llm.fingerprint,
                            store_namespace=settings.store.namespace,
                            compute_dtype=resolve_dtype(settings.engine.dtype).dtype,  # part of every key
                            kv_compression=settings.store.kv_compression)
    expected = {builder.key(c, manifest.namespace) for c in chunks}
    stored = set(DiskTier(kv_dir).keys())
    assert expected <= stored and len(stored - expected) <= 1  # plus the prompt head's entry


@pytest.mark.slow
@needs_ray
def test_ray_ingest_into_pgvector_writes_the_local_rows_from_the_workers(tmp_path):
    from ragcache.index.pg_index import PgDatabase, chunks_table, create_staging, staging_tables
    from ragcache.ingest.ray_ingestor import RayIngestor
    from tests.services import start_postgres

    docs = corpus(tmp_path / "corpus", n=6)
    faiss = Settings.load(ingest={"index_dir": str(tmp_path / "indexes")})
    Ingestor(faiss, "local", show_progress=False).ingest([docs])
    want = faiss_rows(tmp_path / "indexes" / "local")
    server = start_postgres()
    try:
        pg = Settings.load(ingest={"index_dir": str(tmp_path / "indexes"), "vector_store": "pgvector",
                                   "pg_url": server.url})
        dead = create_staging(pg, "rows")  # the staging table of a Ray ingest that died
        ing = RayIngestor(pg, "rows", precompute_kv=False, actors=2, show_progress=False)
        report = ing.ingest([docs])
        assert report.chunks_added == len(want) and ing.pools.embed_actors == 2
        db = PgDatabase.of(server.url)
        rows = db.run(lambda c: c.execute(
            f"SELECT node_id, doc_id, position, chunk_id, title, text, token_ids, source, embedding::text "
            f"FROM {chunks_table('rows')}").fetchall())
        got = {r[0]: (r[1], r[2], r[3], r[4], r[5], tuple(r[6]), r[7], np.array(json.loads(r[8]), dtype=np.float32))
               for r in rows}
        assert_same_rows(got, want)
        assert dead and db.run(lambda c: staging_tables(c, "rows")) == []  # the dead ingest's table, and its own
        from ragcache.index.catalog import catalog

        assert catalog(pg).read_chunks("rows")[0].docs == catalog(faiss).read_chunks("local")[0].docs
    finally:
        server.stop()
