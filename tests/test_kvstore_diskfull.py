"""The disk tier on a real, small filesystem (a size-limited tmpfs): its capacity is what the
filesystem can hold, writes that cannot fit warn once and are counted, and nothing is evicted for an
entry that cannot fit anyway. ENOSPC comes from the kernel; nothing is mocked."""

from __future__ import annotations

import logging

import kv_fixtures
import pytest
import torch
from kv_fixtures import SPEC
from small_fs import fill, free_bytes, small_fs

from ragcache.config import StoreSettings
from ragcache.kvstore import CpuTier, DiskTier, TieredStore

TOKENS = 800  # 409,600 bytes of K/V per entry: a 2 MiB filesystem holds four or five
MiB = 1 << 20


def make_kv(seed: int = 0, tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_fixtures.make_kv(seed, tokens)


@pytest.fixture
def fs(tmp_path):
    with small_fs(tmp_path / "fs", 2 * MiB) as folder:
        yield folder


def test_capacity_is_what_the_filesystem_can_hold_not_the_setting(fs):
    store = TieredStore.from_settings(StoreSettings(ssd_cache_dir=fs / "kv", ssd_cache_max_gb=20.0,
                                                    cpu_kv_pool_gb=0.0, kv_compression="none"), spec=SPEC)
    row = store.stats()["disk"]
    assert row["configured_capacity_bytes"] == 20 * 10**9
    assert 1.5 * MiB < row["capacity_bytes"] <= 2 * MiB and row["free_bytes"] <= 2 * MiB
    store.put("a", *make_kv(), 0)
    row = store.stats()["disk"]
    assert row["capacity_bytes"] <= 2 * MiB and row["occupancy_bytes"] > 400_000


def test_a_full_filesystem_evicts_the_oldest_entries_and_keeps_every_new_one(fs):
    disk = DiskTier(fs / "kv")
    store = TieredStore(SPEC, [(disk, 10**12)])  # the setting allows far more than the filesystem
    kept = {}
    for i in range(8):
        kept[f"k{i}"] = make_kv(i)
        assert store.put(f"k{i}", *kept[f"k{i}"], 0) == ("disk",)
    on_disk = sorted(disk.keys(), key=lambda k: int(k[1:]))
    assert 3 <= len(on_disk) < 8 and on_disk == [f"k{i}" for i in range(8 - len(on_disk), 8)]
    for key in on_disk:
        entry, tier = store.get(key)
        assert tier == "disk" and torch.equal(entry.k, kept[key][0])
    row = store.stats()["disk"]
    assert row["evictions"] == 8 - len(on_disk) and row["not_stored"] == 0 and row["write_errors"] == 0


def test_an_entry_that_cannot_fit_evicts_nothing_warns_once_and_is_counted(fs, caplog):
    disk = DiskTier(fs / "kv")
    store = TieredStore(SPEC, [(CpuTier(), 10**9), (disk, 10**12)])
    store.put("small", *make_kv(0, tokens=100), 0)
    fill(fs, leave_bytes=300_000)  # another program takes the space
    with caplog.at_level(logging.WARNING, logger="ragcache.kvstore"):
        for i in range(3):
            k, v = make_kv(i + 1)  # 410 KB > 300 KB free + the 60 KB entry stored
            assert store.put(f"big{i}", k, v, 0) == ("cpu",)  # kept in memory, not on disk
    assert sorted(disk.keys()) == ["small"]  # never evicted for an entry that could not fit anyway
    warnings = [r.getMessage() for r in caplog.records if "not stored" in r.getMessage()]
    assert len(warnings) == 1 and "disk tier full" in warnings[0] and "MB free" in warnings[0]
    assert "evicted: entry" in warnings[0] and "::" not in warnings[0]
    row = store.stats()["disk"]
    assert row["not_stored"] == 3 and row["evictions"] == 0 and row["write_errors"] == 0
    entry, tier = store.get("big0")
    assert tier == "cpu" and torch.equal(entry.k, make_kv(1)[0])


def test_an_entry_that_fits_once_older_entries_go_evicts_just_enough(fs):
    disk = DiskTier(fs / "kv")
    store = TieredStore(SPEC, [(disk, 10**12)])
    for i in range(3):
        store.put(f"old{i}", *make_kv(i, tokens=200), 0)  # ~103 KB each
    fill(fs, leave_bytes=250_000)  # the new 410 KB entry fits once two of the ~106 KB files go
    assert free_bytes(fs) < 410_000
    assert store.put("new", *make_kv(9), 0) == ("disk",)
    assert "new" in set(disk.keys()) and "old2" in set(disk.keys())  # the most recent old one stays
    assert "old0" not in set(disk.keys()) and "old1" not in set(disk.keys())  # least recently used first
    assert store.stats()["disk"]["evictions"] == 2 and store.stats()["disk"]["not_stored"] == 0


def test_ingest_on_a_small_filesystem_counts_what_the_disk_really_holds_and_warns_once_at_start(tmp_path):
    """`ragcache ingest` (the real CLI, a real engine) with the disk tier on an 8 MiB filesystem and
    the default 20 GB setting: 16 chunk entries of 1.5-3 MB do not all fit, later ones evict earlier
    ones, and the summary says how many the disk holds at the end, not how many it took."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    from ragcache.config import Settings
    from ragcache.index.faiss_index import read_chunks
    from ragcache.index.folder import resolve_index_path
    from ragcache.models import load_tokenizer, resolve_llm
    from ragcache.prompt import PromptBuilder

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(16):
        (docs / f"note{i:02d}.txt").write_text(
            f"Almanac note {i}: the harbour of Velmora logged {i + 3} ships on the day of the glass festival, "
            f"and the keeper wrote their names in the red ledger number {100 + i} before the tide turned.")
    with small_fs(tmp_path / "fs", 8 * MiB) as fs:
        settings_file = tmp_path / "settings.toml"
        settings_file.write_text(f"""[engine]
max_model_len = 2048
kv_cache_memory_bytes = {1 << 30}

[store]
ssd_cache_dir = "{fs / 'kv'}"
cpu_kv_pool_gb = 0.5
remote_url = ""

[ingest]
index_dir = "{tmp_path / 'idx'}"
chunk_size = 64
""")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_") or k == "RAGCACHE_ENGINE__DTYPE"}
        env.update(RAGCACHE_SETTINGS_FILE=str(settings_file), PYTHONPATH=str(REPO))
        r = subprocess.run([sys.executable, "-m", "app.cli", "ingest", str(docs), "--index", "small", "--quiet"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-4000:]

        capped = [line for line in r.stderr.splitlines() if "its setting allows 20.0 GB but the filesystem holds" in line]
        assert len(capped) == 1, r.stderr[-4000:]  # one warning, at start

        # what the disk really holds: the files of this index's chunk keys
        settings = Settings.load(settings_file)
        _, chunks = read_chunks(resolve_index_path("small", settings.ingest.index_dir))
        assert len(chunks) == 16
        llm = resolve_llm(settings.models.model, settings.models.cache_dir)
        dtype = next(line for line in r.stderr.splitlines() if "engine ready" in line).split("dtype ")[1].split()[0]
        builder = PromptBuilder(load_tokenizer(settings).tokenizer, settings.prompt, llm.fingerprint,
                                store_namespace=settings.store.namespace, compute_dtype=dtype,
                                kv_compression=settings.store.kv_compression)
        disk = DiskTier(fs / "kv")
        on_disk = sum(disk.path(builder.key(c)).exists() for c in chunks)
        assert 0 < on_disk < 16

        summary = next(line for line in r.stdout.splitlines() if line.startswith("KV precompute:"))
        assert summary.startswith("KV precompute: 16 entries computed")
        assert summary.endswith(f"stored on cpu 16 (this process's memory), disk {on_disk}"), summary
        warning = next(line for line in r.stderr.splitlines() if "new entries are not on the disk tier" in line)
        assert warning.startswith(f"warning: {16 - on_disk} of 16 new entries are not on the disk tier (")
        assert "its filesystem is smaller than the setting (20 GB)" in warning and "evicted" in warning
