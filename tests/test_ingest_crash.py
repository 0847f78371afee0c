"""An ingest killed with SIGKILL while it writes chunk KV, and a second ingest started beside it:
the previous index stays whole and answers as before, the shared KV folder holds no damaged entry,
the second ingest is refused in one line, and re-running the ingest completes it.

Real processes: the ingest runs as ``python -m app.cli ingest`` (its own vLLM engine) and is killed
with ``kill -9`` once it has written KV entries; the answers come from the session's engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli import main
from tests.conftest import REPO

pytestmark = pytest.mark.integration

FIRST = {
    "zorbia.txt": "Zorbia is a small island nation. The Zorbian capital is Velmora, a city on the river Aster.",
    "food.md": "The national dish of Zorbia is kelmet, a stew of lentils, smoked fish and saffron.",
}
QUESTION = "What is the capital of Zorbia?"


def _more_docs(folder: Path, n: int = 40) -> None:
    for i in range(n):
        (folder / f"island-{i:02d}.txt").write_text(
            f"Island number {i} of the Zorbian archipelago has {i * 37 + 11} inhabitants, {i % 7 + 2} harbours "
            f"and a lighthouse built in {1700 + i * 5}. Its fishermen catch mostly herring and cod, and its "
            f"school teaches {i % 4 + 1} languages. The ferry to Velmora leaves at {6 + i % 12} o'clock.")


def test_kill_9_mid_ingest_and_a_concurrent_ingest_lose_nothing(engine, engine_settings, tmp_path, capsys):
    from ragcache.index.faiss_index import Index
    from ragcache.index.folder import readable_path
    from ragcache.pipeline import RAGPipeline

    settings = engine_settings.model_copy(deep=True)
    settings.ingest.index_dir = tmp_path / "indexes"
    kv_dir = Path(settings.store.ssd_cache_dir)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in FIRST.items():
        (corpus / name).write_text(text)
    rag = RAGPipeline(settings, "crash", engine)
    assert rag.ingest([corpus]).chunks_added == len(FIRST)
    before = rag.query(QUESTION, mode="blend")
    index_path = tmp_path / "indexes" / "crash"

    _more_docs(corpus)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAGCACHE_INGEST__INDEX_DIR": str(tmp_path / "indexes"),
           "RAGCACHE_STORE__SSD_CACHE_DIR": str(kv_dir), "RAGCACHE_STORE__REMOTE_URL": "",
           "RAGCACHE_ENGINE__MAX_MODEL_LEN": "2048", "RAGCACHE_ENGINE__KV_CACHE_MEMORY_BYTES": str(256 << 20)}
    entries_before = {p.name for p in kv_dir.glob("*.safetensors")}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "ingest", str(corpus), "--index", "crash", "--quiet"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        staged = written = False
        while time.monotonic() < deadline and proc.poll() is None:
            staged = staged or any(index_path.parent.glob(".crash.staging-*"))
            if staged and not written:
                # a second ingest into the same index while the first holds it: refused in one line
                capsys.readouterr()
                assert main(["ingest", str(corpus), "--index", str(index_path), "--quiet"]) == 2
                err = capsys.readouterr().err.strip().splitlines()
                assert len(err) == 1 and "another ingest into" in err[0] and "is running; wait for it" in err[0]
                written = True
            new = {p.name for p in kv_dir.glob("*.safetensors")} - entries_before
            if written and len(new) >= 3:  # mid-way through the KV precompute
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the ingest ended before it could be killed: {proc.communicate()[1][-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL

    # the previous version is whole: same chunks, same answer from the same KV
    assert readable_path(index_path) == index_path
    assert len(Index.load(index_path, settings)) == len(FIRST)
    rag._retriever = None
    again = rag.query(QUESTION, mode="blend")
    assert again.text == before.text and [s.chunk_id for s in again.sources] == [s.chunk_id for s in before.sources]
    # what the killed process wrote into the shared KV folder is whole (atomic renames), or not there
    assert main(["--settings", str(_settings_file(tmp_path, kv_dir)), "cache", "verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["tiers"]["disk"]
    assert report["corrupt"] == 0 and report["checked"] >= report["ok"] > 0

    # running it again completes it (and removes the killed run's staging folder)
    done = rag.ingest([corpus])
    assert done.chunks_added == 40 and done.total_chunks == len(FIRST) + 40
    assert not any(index_path.parent.glob(".crash.staging-*"))
    assert rag.query("How many inhabitants does island number 3 have?", mode="blend").sources


def _settings_file(tmp_path: Path, kv_dir: Path) -> Path:
    path = tmp_path / "verify.toml"
    path.write_text(f'[store]\nssd_cache_dir = "{kv_dir}"\nremote_url = ""\n')
    return path
