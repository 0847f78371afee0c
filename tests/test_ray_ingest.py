"""`ragcache ingest --executor ray`: read, split, embed and KV precompute as Ray Data stages on a
local Ray (started by the ingest). Pins: the Ray ingest of a corpus gives the same manifest and
chunks as the local ingest; its KV precompute stores exactly the chunk keys the local path would;
an embedding worker killed mid-batch is retried, nothing lost or duplicated.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ragcache.config import Settings
from ragcache.ingest import Ingestor
from tests.conftest import ZORBIA_DOCS, clear_ragcache_env

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ray[data]'); Ray ingest tests skipped")


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


def test_ray_ingest_equals_the_local_ingest_and_survives_a_killed_worker(tmp_path, monkeypatch):
    from ragcache.catalog import catalog
    from ragcache.ray_ingest import FAULT_ENV, RayIngestor

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


@pytest.mark.integration
def test_ray_kv_precompute_stores_the_keys_the_local_path_would(tmp_path):
    from ragcache.catalog import catalog
    from ragcache.engine.dtype import resolve_dtype
    from ragcache.kvstore.disk import DiskTier
    from ragcache.models import load_tokenizer, resolve_llm
    from ragcache.prompt import PromptBuilder
    from ragcache.ray_ingest import RayIngestor

    docs = corpus(tmp_path / "corpus", n=3)
    kv_dir = tmp_path / "kv"
    settings = Settings.load(ingest={"index_dir": str(tmp_path / "indexes")},
                             store={"ssd_cache_dir": str(kv_dir), "remote_url": "", "cpu_kv_pool_gb": 0.5},
                             engine={"max_model_len": 2048, "kv_cache_memory_bytes": 256 << 20})
    ing = RayIngestor(settings, "raykv", show_progress=False)
    report = ing.ingest([docs])
    assert report.chunks_added == 6 and ing.kv_totals.computed == 6
    assert ing.kv_totals.stored.get("disk") == 6

    manifest, chunks = catalog(settings).read_chunks("raykv")
    llm = resolve_llm(settings.models.model, settings.models.cache_dir)
    builder = PromptBuilder(load_tokenizer(settings).tokenizer, settings.prompt, llm.fingerprint,
                            store_namespace=settings.store.namespace,
                            compute_dtype=resolve_dtype(settings.engine.dtype).dtype,  # part of every key
                            kv_compression=settings.store.kv_compression)
    expected = {builder.key(c, manifest.namespace) for c in chunks}
    stored = set(DiskTier(kv_dir).keys())
    assert expected <= stored and len(stored - expected) <= 1  # plus the prompt head's entry
