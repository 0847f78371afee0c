"""KV of another precision is never served, and the start-up self-check never reads the user's KV.

Through the real CLI (``python -m app.cli``, in-process engines) on one KV folder: an index ingested
in bfloat16, then asked in float32 (its chunk KV is computed again, in float32, during the request:
the bf16 entries are under other keys), in bfloat16 (the ingested bf16 KV is served from disk) and
in float32 again (now the float32 KV is served, and the answer is the one computed the first time).
Entries planted under the keys an old self-check would have read (the store namespace's prompt head
and probe chunk, in float32, with wrong values) neither fail the check nor get read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, ZORBIA_DOCS

pytestmark = pytest.mark.integration

QUESTION = "What is the national dish of Zorbia?"


def cli(root: Path, dtype: str, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
    env.update(RAGCACHE_SETTINGS_FILE=str(root / "settings.toml"), RAGCACHE_ENGINE__DTYPE=dtype,
               PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "app.cli", *argv], cwd=root, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def plant_wrong_kv(root: Path) -> list[Path]:
    """Entries with random values under the float32 keys of the self-check's segments in the store
    namespace (where the self-check used to look); returns their files."""
    import torch

    from ragcache.config import Settings
    from ragcache.engine.selfcheck import probe_chunks
    from ragcache.kvstore import DiskTier, KVSpec, TieredStore
    from ragcache.models import load_tokenizer, resolve_llm
    from ragcache.prompt import PromptBuilder

    settings = Settings.load(root / "settings.toml")
    llm = resolve_llm(settings.models.model, settings.models.cache_dir)
    tokenizer = load_tokenizer(settings).tokenizer
    builder = PromptBuilder(tokenizer, settings.prompt, llm.fingerprint, store_namespace=settings.store.namespace,
                            compute_dtype="float32")
    chunk = probe_chunks(tokenizer)[0]
    spec = KVSpec.from_hf_config(llm.path, llm.fingerprint, dtype=torch.float32)
    disk = DiskTier(settings.store.ssd_cache_dir)
    store = TieredStore(spec, [(disk, None)])
    g = torch.Generator().manual_seed(0)
    for key, n, start in ((builder.head_key, len(builder.head_ids), 0),
                          (builder.key(chunk), len(builder.unit_ids(chunk)), len(builder.head_ids))):
        shape = (spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
        assert store.put(key, 5 * torch.randn(shape, generator=g), 5 * torch.randn(shape, generator=g), start) == ("disk",)
    store.close()
    return [disk.path(builder.head_key), disk.path(builder.key(chunk))]


def ask(root: Path, dtype: str) -> tuple[dict, str]:
    r = cli(root, dtype, "ask", QUESTION, "--index", "zorbia", "--top-k", "2", "--json")
    return json.loads(r.stdout), r.stderr


def test_kv_of_another_precision_is_recomputed_and_the_self_check_never_reads_the_users_store(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in ZORBIA_DOCS.items():
        (docs / name).write_text(text)
    kv = tmp_path / "kv"
    (tmp_path / "settings.toml").write_text(f"""[engine]
mode = "blend"  # the ask below checks which KV a blend is served
max_model_len = 4096
kv_cache_memory_bytes = {1 << 30}
max_tokens = 12

[store]
ssd_cache_dir = "{kv}"
cpu_kv_pool_gb = 0.5
remote_url = ""

[ingest]
index_dir = "{tmp_path / 'idx'}"

[blend]
min_recompute_tokens = 0  # two short documents: the default floor would recompute every token
""")
    planted = plant_wrong_kv(tmp_path)
    planted_mtimes = [p.stat().st_mtime_ns for p in planted]

    out = cli(tmp_path, "bfloat16", "ingest", str(docs), "--index", "zorbia", "--namespace", "zorbia", "--quiet")
    assert f"KV precompute: {len(ZORBIA_DOCS)} entries computed" in out.stdout

    fp32, log = ask(tmp_path, "float32")
    assert "self-check passed" in log and "disabled" not in log, log[-3000:]
    m = fp32["metrics"]
    assert m["mode"] == "blend" and m["reused_tokens"] > 0
    # the bf16 chunk KV on disk was not served to the float32 engine: computed now, in float32
    assert [s["tier"] for s in fp32["sources"]] == ["computed", "computed"]

    bf16, log = ask(tmp_path, "bfloat16")
    assert "self-check passed" in log
    assert [s["tier"] for s in bf16["sources"]] == ["disk", "disk"]  # the ingested bf16 KV

    again, _ = ask(tmp_path, "float32")
    assert [s["tier"] for s in again["sources"]] == ["disk", "disk"]  # the float32 KV the first ask stored
    assert again["answer"] == fp32["answer"]  # served as computed: exact

    # the planted entries were never read (a hit would have refreshed their mtime) nor removed, and the
    # self-checks left nothing in their private namespaces
    assert [p.stat().st_mtime_ns for p in planted] == planted_mtimes
    left = [p.name for p in kv.glob("*.safetensors") if "_self-check" in p.name]
    assert left == []
