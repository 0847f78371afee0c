"""The pgvector index backend against a real PostgreSQL with pgvector (started here): round trip
against the FAISS backend, incremental ingest (add, change, prune), an ingest killed with SIGKILL
in the middle of its transaction, a concurrent ingest refused, an ingest by another process seen
by a reader at once, and the one-line errors for a missing or unreachable database.

Real llama-index splitting, the real tokenizer and embedding model; no vLLM (``kv_hook`` is None
or a recorder).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ragcache.config import Settings
from ragcache.ingest.ingestor import IngestError, Ingestor, KVPrecomputeError
from tests.conftest import REPO, ZORBIA_DOCS, clear_ragcache_env
from tests.services import start_postgres

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    clear_ragcache_env(monkeypatch)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def postgres():
    server = start_postgres()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def models():
    from ragcache.models import load_embed_model, load_tokenizer

    s = Settings.load()
    return load_tokenizer(s), load_embed_model(s)


def pg_settings(postgres, tmp_path: Path) -> Settings:
    return Settings.load(ingest={"vector_store": "pgvector", "pg_url": postgres.url,
                                 "index_dir": str(tmp_path / "indexes")})


def ingestor(settings: Settings, models, index: str, kv_hook=None) -> Ingestor:
    tok, emb = models
    return Ingestor(settings, index, kv_hook=kv_hook, show_progress=False, embed_model=emb, tokenizer=tok)


def write_docs(folder: Path, docs: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (folder / name).write_text(text)
    return folder


def test_pgvector_round_trip_matches_the_faiss_index(postgres, models, tmp_path):
    from ragcache.index.catalog import catalog
    from ragcache.index.retrieval import Retriever

    corpus = write_docs(tmp_path / "corpus", ZORBIA_DOCS)
    pg = pg_settings(postgres, tmp_path)
    faiss = Settings.load(ingest={"index_dir": str(tmp_path / "indexes")})
    rp = ingestor(pg, models, "roundtrip").ingest([corpus])
    rf = ingestor(faiss, models, "roundtrip").ingest([corpus])
    assert rp.written and rp.chunks_added == rf.chunks_added == len(ZORBIA_DOCS)
    assert "pgvector index 'roundtrip'" in rp.summary()

    cp, cf = catalog(pg), catalog(faiss)
    assert "roundtrip" in cp.names() and cp.version("roundtrip") == 1
    mp, mf = cp.manifest("roundtrip"), cf.manifest("roundtrip")
    assert mp.docs == mf.docs and mp.files == mf.files and mp.build == mf.build
    _, chunks_p = cp.read_chunks("roundtrip")
    _, chunks_f = cf.read_chunks("roundtrip")
    assert sorted(chunks_p, key=lambda c: c.chunk_id) == sorted(chunks_f, key=lambda c: c.chunk_id)

    tok, emb = models
    for question in ("What is the capital of Zorbia?", "How many seats has the Amber Hall?"):
        hp = Retriever(cp.load("roundtrip", embed_model=emb), top_k=3).retrieve(question)
        hf = Retriever(cf.load("roundtrip", embed_model=emb), top_k=3).retrieve(question)
        assert [h.chunk for h in hp] == [h.chunk for h in hf]
        assert [h.score for h in hp] == pytest.approx([h.score for h in hf], abs=1e-5)


def test_pgvector_incremental_ingest_adds_replaces_and_prunes(postgres, models, tmp_path):
    from ragcache.index.catalog import catalog

    settings = pg_settings(postgres, tmp_path)
    corpus = write_docs(tmp_path / "corpus", ZORBIA_DOCS)
    cat = catalog(settings)
    first = ingestor(settings, models, "incr").ingest([corpus])
    assert first.chunks_added == 3 and cat.version("incr") == 1

    again = ingestor(settings, models, "incr").ingest([corpus])
    assert not again.written and again.files_unchanged == 3 and cat.version("incr") == 1

    (corpus / "food.md").write_text("# Zorbian food\n\nThe national dish of Zorbia is morrel pie with plums.")
    (corpus / "harbour.txt").write_text("The harbour of Velmora has nine piers and a tide clock.")
    changed = ingestor(settings, models, "incr").ingest([corpus])
    assert (changed.chunks_added, changed.chunks_removed, changed.total_chunks) == (2, 1, 4)
    assert cat.version("incr") == 2
    texts = {c.text for c in cat.read_chunks("incr")[1]}
    assert any("morrel pie" in t for t in texts) and not any("kelmet" in t for t in texts)

    (corpus / "parliament.txt").unlink()
    pruned = ingestor(settings, models, "incr").ingest([corpus], prune=True)
    assert (pruned.files_pruned, pruned.chunks_removed, pruned.total_chunks) == (1, 1, 3)
    manifest, chunks = cat.read_chunks("incr")
    assert len(chunks) == manifest.num_chunks == 3
    assert not any(k.endswith("parliament.txt") for k in manifest.files)


def test_failed_kv_precompute_commits_nothing(postgres, models, tmp_path):
    from ragcache.index.catalog import catalog

    settings = pg_settings(postgres, tmp_path)
    corpus = write_docs(tmp_path / "corpus", {"zorbia.txt": ZORBIA_DOCS["zorbia.txt"]})
    ingestor(settings, models, "kvfail").ingest([corpus])
    (corpus / "food.md").write_text(ZORBIA_DOCS["food.md"])

    def broken(chunks, namespace):
        raise RuntimeError("engine died")

    with pytest.raises(KVPrecomputeError, match="pgvector index 'kvfail' is unchanged"):
        ingestor(settings, models, "kvfail", kv_hook=broken).ingest([corpus])
    cat = catalog(settings)
    assert cat.version("kvfail") == 1 and len(cat.read_chunks("kvfail")[1]) == 1


KILLER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import ragcache.index.pg_index as pgi
    from ragcache.config import Settings
    from ragcache.ingest.ingestor import Ingestor

    real, rows = pgi._node_row, []
    def dying_row(node):
        rows.append(node)
        if len(rows) == 3:  # inside the COPY of the publish transaction
            os.kill(os.getpid(), signal.SIGKILL)
        return real(node)
    pgi._node_row = dying_row
    settings = Settings.load(ingest={{"vector_store": "pgvector", "pg_url": {url!r}}})
    Ingestor(settings, "crash", show_progress=False).ingest([{corpus!r}])
""")


def test_ingest_killed_mid_transaction_leaves_the_previous_version_and_no_lock(postgres, models, tmp_path):
    from ragcache.index.catalog import catalog
    from ragcache.index.retrieval import Retriever

    settings = pg_settings(postgres, tmp_path)
    corpus = write_docs(tmp_path / "corpus", ZORBIA_DOCS)
    ingestor(settings, models, "crash").ingest([corpus])
    for i in range(6):
        (corpus / f"island-{i}.txt").write_text(f"Island {i} of Zorbia has {i * 37 + 11} inhabitants and a lighthouse.")

    script = KILLER.format(repo=str(REPO), url=postgres.url, corpus=str(corpus))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]

    cat = catalog(settings)
    assert cat.version("crash") == 1
    manifest, chunks = cat.read_chunks("crash")
    assert len(chunks) == manifest.num_chunks == 3
    hits = Retriever(cat.load("crash", embed_model=models[1]), top_k=1).retrieve("What is the capital of Zorbia?")
    assert "Velmora" in hits[0].chunk.text

    report = ingestor(settings, models, "crash").ingest([corpus])  # the dead ingest's lock is gone
    assert report.chunks_added == 6 and cat.version("crash") == 2 and len(cat.read_chunks("crash")[1]) == 9


def test_a_second_ingest_into_the_same_index_is_refused_in_one_line(postgres, models, tmp_path):
    from ragcache.index.pg_index import ingest_lock

    settings = pg_settings(postgres, tmp_path)
    corpus = write_docs(tmp_path / "corpus", ZORBIA_DOCS)
    with ingest_lock(settings, "busy"):
        with pytest.raises(IngestError, match="another ingest into pgvector index 'busy' is running"):
            ingestor(settings, models, "busy").ingest([corpus])
    assert ingestor(settings, models, "busy").ingest([corpus]).chunks_added == 3


def test_an_ingest_by_another_process_is_seen_by_a_reader_as_soon_as_it_commits(postgres, models, tmp_path):
    from ragcache.index.catalog import catalog
    from ragcache.index.retrieval import Retriever

    settings = pg_settings(postgres, tmp_path)
    corpus = write_docs(tmp_path / "corpus", {"zorbia.txt": ZORBIA_DOCS["zorbia.txt"]})
    ingestor(settings, models, "live").ingest([corpus])
    cat = catalog(settings)
    reader = Retriever(cat.load("live", embed_model=models[1]), top_k=1)  # a replica's retriever, loaded once
    question = "How many seats has the Amber Hall?"
    assert "Amber Hall" not in reader.retrieve(question)[0].chunk.text

    (corpus / "parliament.txt").write_text(ZORBIA_DOCS["parliament.txt"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAGCACHE_INGEST__VECTOR_STORE": "pgvector",
           "RAGCACHE_INGEST__PG_URL": postgres.url}
    out = subprocess.run([sys.executable, "-m", "app.cli", "ingest", str(corpus), "--index", "live", "--no-kv",
                          "--quiet"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "1 chunks added" in out.stdout and "pgvector index 'live'" in out.stdout
    assert "Amber Hall" in reader.retrieve(question)[0].chunk.text  # the same retriever, no reload
    assert cat.version("live") == 2


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=300)


def test_missing_or_unreachable_database_is_one_line_naming_the_fix(tmp_path):
    from ragcache_testing.services import free_port

    write_docs(tmp_path / "corpus", {"a.txt": "Zorbia is an island."})
    no_url = _cli(["ingest", "corpus", "--index", "x", "--no-kv"], {"RAGCACHE_INGEST__VECTOR_STORE": "pgvector"},
                  tmp_path)
    assert no_url.returncode == 2
    assert no_url.stderr.strip().splitlines()[-1].startswith("ragcache: error: ingest.vector_store = 'pgvector' "
                                                             "needs ingest.pg_url")
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/ragcache"
    env = {"RAGCACHE_INGEST__VECTOR_STORE": "pgvector", "RAGCACHE_INGEST__PG_URL": dead}
    for args in (["ingest", "corpus", "--index", "x", "--no-kv", "--quiet"], ["ask", "Where?", "--index", "x"]):
        out = _cli(args, env, tmp_path)
        last = out.stderr.strip().splitlines()[-1]
        assert out.returncode == 2, out.stderr[-2000:]
        assert last.startswith("ragcache: error: PostgreSQL at ") and "unreachable" in last
        assert "start it or fix ingest.pg_url" in last
    bad = _cli(["ingest", "corpus", "--index", "x"], {"RAGCACHE_INGEST__PG_URL": "mysql://x"}, tmp_path)
    assert bad.returncode == 2 and "must start with postgresql://" in bad.stderr
