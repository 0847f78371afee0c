"""The fault probes as tests, on the real engine: KV removed (files, every tier, `cache clear`,
`cache drop`), damaged (checksums, truncation, on disk and in Redis), Redis killed and back, the disk
full, and two tenants' namespaces. Each asserts the answer is unchanged, that nothing is served from
damaged KV, and that the store's counters agree with each request's tier hits (one lookup per
retrieved chunk, the head apart: per-tier hits + misses = chunk lookups).

One engine for the module (real SmolLM2 through vLLM), without a cpu tier so that every lookup
reaches the disk (on a real 64 MiB tmpfs where the machine allows mounting one) and a real
redis-server on a loopback port.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis as redis_py
from redis_server import start_redis
from small_fs import fill, mount, skip_reason, unmount

from app.cli import main
from kv_fixtures import poison
from ragcache.kvstore import DiskTier
from ragcache_testing.services import RedisServer
from tests.conftest import ZORBIA_DOCS

pytestmark = pytest.mark.integration

MiB = 1 << 20
FS_SIZE = 64 * MiB
TOP_K = 3
DOCS = ZORBIA_DOCS
QUESTIONS = ("What is the capital of Zorbia?", "What is kelmet made of?")


@dataclass
class Probe:
    root: Path
    settings_file: Path
    kv: Path
    mounted: str | None  # None: the disk tier is on a mounted tmpfs; else why not
    redis: RedisServer
    engine: object
    rag: object
    corpus: Path
    baseline: dict[str, str]

    @property
    def disk(self) -> DiskTier:
        return DiskTier(self.kv)

    def keys(self, rag=None) -> list[str]:
        rag = rag or self.rag
        return [self.engine.prompts.key(c, rag.namespace) for c in rag.retriever.index.chunks()]

    def cli(self, *argv: str) -> int:
        return main(["--settings", str(self.settings_file), *argv])


def ask(probe: Probe, question: str, rag=None):
    """Answer in blend mode and check the books: the store counted one lookup per retrieved chunk,
    each tier's hits equal the chunks the request says it served, the misses the computed ones."""
    rag = rag or probe.rag
    before = probe.engine.store_stats()
    answer = rag.query(question, mode="blend", top_k=TOP_K)
    after = probe.engine.store_stats()
    tiers = answer.metrics.tier_hits
    assert sum(tiers.values()) == len(answer.sources) == TOP_K
    lookups = {name: after.tiers[name].lookups - before.tiers[name].lookups for name in after.tiers}
    assert set(lookups.values()) == {TOP_K}
    for name in after.tiers:
        assert after.tiers[name].hits - before.tiers[name].hits == tiers.get(name, 0), (name, tiers)
        assert after.tiers[name].hits + after.tiers[name].misses == after.tiers[name].lookups
    served = sum(after.tiers[n].hits - before.tiers[n].hits for n in after.tiers)
    assert TOP_K - served == tiers.get("computed", 0)
    return answer


def write_corpus(folder: Path, docs: dict[str, str] = DOCS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    from ragcache.config import Settings
    from ragcache.engine import BlendEngine
    from ragcache.pipeline import RAGPipeline

    root = tmp_path_factory.mktemp("faults")
    kv = root / "kv"
    mounted = mount(kv, FS_SIZE)
    server = start_redis(root)
    settings_file = root / "settings.toml"
    settings_file.write_text(
        f'[store]\ncpu_kv_pool_gb = 0.0\nssd_cache_dir = "{kv}"\nremote_url = "{server.url}"\n'
        f'[engine]\nmax_model_len = 2048\nkv_cache_memory_bytes = {256 * MiB}\nmax_tokens = 16\nin_process = false\n'
        f'[ingest]\nindex_dir = "{root / "indexes"}"\n'
    )
    settings = Settings.load(settings_file)
    engine = BlendEngine(settings)
    try:
        rag = RAGPipeline(settings, "zorbia", engine)
        corpus = write_corpus(root / "docs")
        report = rag.ingest([corpus])
        assert report.chunks_added == len(DOCS)
        p = Probe(root, settings_file, kv, mounted, server, engine, rag, corpus, {})
        for q in QUESTIONS:
            answer = ask(p, q)
            assert answer.metrics.tier_hits == {"disk": TOP_K}  # precomputed at ingest
            p.baseline[q] = answer.text
        yield p
    finally:
        engine.close()
        server.stop()
        if mounted is None:
            unmount(kv)


def assert_answers_unchanged(probe: Probe, expect_tiers: dict[str, int] | None = None) -> None:
    for q in QUESTIONS:
        answer = ask(probe, q)
        assert answer.text == probe.baseline[q]
        if expect_tiers is not None:
            assert answer.metrics.tier_hits == expect_tiers
            expect_tiers = None  # the first request stores what it computed; later ones hit


def test_kv_removed_four_ways_is_computed_again_and_the_answer_is_unchanged(probe):
    for key in probe.keys():  # 1. files deleted by hand: Redis still has them
        os.unlink(probe.disk.path(key))
    assert_answers_unchanged(probe, {"remote": TOP_K})

    probe.engine.forget(list(probe.rag.retriever.index.chunks()))  # 2. every tier, through the SDK
    assert_answers_unchanged(probe, {"computed": TOP_K})

    assert probe.cli("cache", "clear") == 0  # 3. `ragcache cache clear`: disk folder and Redis
    assert list(probe.disk.keys()) == []
    assert_answers_unchanged(probe, {"computed": TOP_K})

    assert probe.cli("cache", "drop", "--index", "zorbia") == 0  # 4. one index's chunks only
    head = probe.engine.prompts.head_segment(probe.rag.namespace).key
    assert list(probe.disk.keys()) == [head]
    assert_answers_unchanged(probe, {"computed": TOP_K})
    assert ask(probe, QUESTIONS[0]).metrics.tier_hits == {"disk": TOP_K}


def _flip_last_bytes(path: Path) -> None:
    with open(path, "r+b") as f:  # the last layer's V: the header stays valid, only its checksum fails
        f.seek(-8, os.SEEK_END)
        tail = f.read(8)
        f.seek(-8, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))


def test_damaged_kv_is_never_served_and_each_damage_is_counted_as_a_miss(probe):
    ask(probe, QUESTIONS[0])  # every chunk on disk and in Redis
    keys = probe.keys()
    before = probe.engine.store_stats()

    for key in keys:  # checksum damage found mid-read: the chunk is computed, not served
        _flip_last_bytes(probe.disk.path(key))
    assert_answers_unchanged(probe, {"computed": TOP_K})
    for key in keys:  # truncation found at open: the good copy in Redis serves
        os.truncate(probe.disk.path(key), probe.disk.path(key).stat().st_size // 2)
    assert_answers_unchanged(probe, {"remote": TOP_K})
    client = redis_py.Redis.from_url(probe.redis.url)
    for key in keys:  # damage in Redis as well, with no disk copy: computed again
        value = bytearray(client.get(f"ragcache:kv:{key}"))
        value[-5] ^= 0xFF
        client.set(f"ragcache:kv:{key}", bytes(value))
        probe.disk.path(key).unlink(missing_ok=True)  # the truncated copy was deleted when found
    assert_answers_unchanged(probe, {"computed": TOP_K})

    after = probe.engine.store_stats()
    assert after.tiers["disk"].corrupt - before.tiers["disk"].corrupt == 2 * TOP_K
    assert after.tiers["remote"].corrupt - before.tiers["remote"].corrupt == TOP_K
    assert probe.cli("cache", "verify", "--json") == 0  # what is left is intact


def assert_recomputed(probe: Probe, question: str, missing_tokens: int) -> None:
    """The chunks of ``question`` were recomputed after a failed read, each counted as a chunk missing
    at its lookup is (``missing_tokens``, and seconds), and the answer is the intact one."""
    answer = ask(probe, question)
    m = answer.metrics
    assert answer.text == probe.baseline[question] and m.tier_hits == {"computed": TOP_K}
    assert m.missing_computed_tokens == missing_tokens
    assert m.stages["missing_compute_s"] > 0 and m.compute_s >= m.stages["missing_compute_s"]


def test_non_finite_scales_behind_rewritten_checksums_are_never_served_and_cache_verify_names_them(probe, capsys):
    probe.engine.forget(list(probe.rag.retriever.index.chunks()))  # missing at their lookup: the reference
    missing = ask(probe, QUESTIONS[0]).metrics.missing_computed_tokens
    assert missing >= sum(c.num_tokens for c in probe.rag.retriever.index.chunks())
    keys = probe.keys()  # every chunk now on disk and in Redis, int8 (the default stored form)
    client = redis_py.Redis.from_url(probe.redis.url)
    before = probe.engine.store_stats()

    for key in keys:  # disk: every V scale of layer 3 NaN, its crc32 rewritten; found in the batched pass
        path = probe.disk.path(key)
        path.write_bytes(poison(path.read_bytes(), "v_scale.3"))
    assert_recomputed(probe, QUESTIONS[0], missing)
    assert_answers_unchanged(probe, {"disk": TOP_K})  # what was recomputed is stored and served again

    for key in keys:  # Redis alone: K scales of layer 7 infinite; found layer by layer (a network tier streams)
        value = client.get(f"ragcache:kv:{key}")
        client.set(f"ragcache:kv:{key}", poison(value, "k_scale.7", float("inf")))
        probe.disk.path(key).unlink()
    assert_recomputed(probe, QUESTIONS[0], missing)
    assert_answers_unchanged(probe, {"disk": TOP_K})

    after = probe.engine.store_stats()
    assert after.tiers["disk"].corrupt - before.tiers["disk"].corrupt == TOP_K
    assert after.tiers["remote"].corrupt - before.tiers["remote"].corrupt == TOP_K

    victim = keys[0]  # `cache verify` checks the scales too, and names the entry
    for tier, damage in (("disk", "v_scale.0"), ("remote", "v_scale.29")):
        if tier == "disk":
            probe.disk.path(victim).write_bytes(poison(probe.disk.path(victim).read_bytes(), damage))
        else:
            client.set(f"ragcache:kv:{victim}", poison(client.get(f"ragcache:kv:{victim}"), damage))
    capsys.readouterr()
    assert probe.cli("cache", "verify") == 0
    out = capsys.readouterr().out
    assert f"  removed {victim}: non-finite values in v_scale.0" in out
    assert f"  removed {victim}: non-finite values in v_scale.29" in out
    assert not probe.disk.path(victim).exists() and not client.exists(f"ragcache:kv:{victim}")
    answer = ask(probe, QUESTIONS[0])
    assert answer.text == probe.baseline[QUESTIONS[0]] and answer.metrics.tier_hits == {"disk": 2, "computed": 1}


def test_redis_killed_and_back_costs_nothing_but_hits(probe):
    ask(probe, QUESTIONS[0])
    keys = probe.keys()
    probe.redis.stop()
    try:
        before = probe.engine.store_stats()
        for key in keys:
            probe.disk.path(key).unlink(missing_ok=True)
        assert_answers_unchanged(probe, {"computed": TOP_K})  # Redis down: counted, skipped
        after = probe.engine.store_stats()
        assert after.tiers["remote"].up is False
        assert after.tiers["remote"].unavailable - before.tiers["remote"].unavailable >= TOP_K
    finally:
        probe.redis.start()  # the same port, empty (no persistence)
    deadline = time.monotonic() + 30
    while not probe.engine.store_stats().tiers["remote"].up and time.monotonic() < deadline:
        time.sleep(1)  # the tier is retried after its back-off (2-10 s)
    assert probe.engine.store_stats().tiers["remote"].up
    probe.engine.forget(list(probe.rag.retriever.index.chunks()))
    assert ask(probe, QUESTIONS[0]).metrics.tier_hits == {"computed": TOP_K}  # written through to Redis again
    assert probe.engine.store_stats().tiers["remote"].entries >= TOP_K
    for key in keys:
        os.unlink(probe.disk.path(key))
    assert_answers_unchanged(probe, {"remote": TOP_K})


def test_a_full_disk_says_how_many_entries_it_could_not_keep_and_answers_stay_right(probe, capsys):
    if probe.mounted is not None:
        pytest.skip(skip_reason(FS_SIZE, probe.mounted))
    from app.ingest_cmd import EngineKVHook
    from ragcache.config import Settings
    from ragcache.ingest.ingestor import Ingestor
    from ragcache.pipeline import RAGPipeline

    stats = probe.engine.store_stats().tiers["disk"]
    assert stats.capacity_bytes <= FS_SIZE < stats.configured_capacity_bytes
    assert probe.cli("cache", "clear") == 0
    filler = fill(probe.kv, leave_bytes=MiB)  # another program fills the disk: 1 MB left
    try:
        settings = Settings.load(probe.settings_file)
        hook = EngineKVHook(settings, show_progress=False)
        hook.engine = probe.engine
        report = Ingestor(settings, "full", kv_hook=hook, show_progress=False, namespace="full").ingest([probe.corpus])
        assert report.chunks_added == len(DOCS)
        lines = hook.summary()
        assert lines[0].startswith(f"KV precompute: {len(DOCS)} entries computed")
        full = RAGPipeline(settings, "full", probe.engine)
        on_disk = sum(probe.disk.path(key).exists() for key in probe.keys(full))  # what the disk really holds
        assert on_disk < len(DOCS)  # a 16-bit entry may fit once the head is evicted; not all of them
        assert f"stored on disk {on_disk}, remote 3" in lines[0]
        # compressed entries may all be written and the oldest evicted, 16-bit ones may find no room at all:
        # either way the warning counts the entries the disk does not hold and says why
        warning = [line for line in lines if line.startswith(
            f"warning: {len(DOCS) - on_disk} of {len(DOCS)} new entries are not on the disk tier (")]
        assert len(warning) == 1 and ("no room:" in warning[0] or "evicted to make room" in warning[0]), lines
        row = probe.engine.store_stats().tiers["disk"]
        assert row.not_stored + row.evictions >= 1 and row.capacity_bytes <= 2 * MiB
        served = {t: n for t, n in (("disk", on_disk), ("remote", TOP_K - on_disk)) if n}
        for q in QUESTIONS:  # served from Redis (and the disk); the same answer as from the first index's disk KV
            answer = ask(probe, q, rag=full)
            assert answer.text == probe.baseline[q] and answer.metrics.tier_hits == served
    finally:
        filler.unlink()
    assert probe.cli("cache", "stats") == 0
    out = capsys.readouterr().out
    assert "not stored" in out and "disk capacity is what its filesystem can hold" in out


def test_two_namespaces_never_share_kv_on_any_tier(probe):
    from ragcache.config import Settings
    from ragcache.pipeline import RAGPipeline

    settings = Settings.load(probe.settings_file)
    tenant_a = RAGPipeline(settings, "tenant-a", probe.engine)
    tenant_b = RAGPipeline(settings, "tenant-b", probe.engine)
    first = tenant_a.ingest([probe.corpus], namespace="tenant-a")
    second = tenant_b.ingest([probe.corpus], namespace="tenant-b")  # the very same text
    assert first.chunks_added == second.chunks_added == len(DOCS)
    keys_a, keys_b = set(probe.keys(tenant_a)), set(probe.keys(tenant_b))
    assert not keys_a & keys_b
    assert all(k.startswith("default/tenant-a:") for k in keys_a)
    assert all(k.startswith("default/tenant-b:") for k in keys_b)
    client = redis_py.Redis.from_url(probe.redis.url)
    redis_a = {k.decode() for k in client.scan_iter(match="ragcache:kv:default/tenant-a:*")}
    redis_b = {k.decode() for k in client.scan_iter(match="ragcache:kv:default/tenant-b:*")}
    assert {f"ragcache:kv:{k}" for k in keys_a} <= redis_a and {f"ragcache:kv:{k}" for k in keys_b} <= redis_b

    # tenant B's KV gone from every tier: B gets no hit on A's identical chunks anywhere, Redis included
    probe.engine.forget(list(tenant_b.retriever.index.chunks()), namespace="tenant-b")
    for q in QUESTIONS:
        answer = ask(probe, q, rag=tenant_b)
        assert answer.text == probe.baseline[q]
        assert set(answer.metrics.tier_hits) <= {"computed", "disk"}
        assert "remote" not in answer.metrics.tier_hits
    answer = ask(probe, QUESTIONS[0], rag=tenant_a)
    assert answer.text == probe.baseline[QUESTIONS[0]] and "computed" not in answer.metrics.tier_hits

    # `cache clear --namespace` takes one tenant's entries and leaves the other's
    assert probe.cli("cache", "clear", "--namespace", "default/tenant-b") == 0
    assert not any(probe.disk.path(k).exists() for k in keys_b)
    assert client.exists(*[f"ragcache:kv:{k}" for k in keys_b]) == 0
    assert all(client.exists(f"ragcache:kv:{k}") for k in keys_a)

    # within one namespace, indexes share as before: a second index over the same text computes nothing
    ask(probe, QUESTIONS[0])  # the first index's KV is stored (an earlier test may have cleared it)
    shared = RAGPipeline(settings, "zorbia-again", probe.engine)
    before = probe.engine.store_stats()
    shared.ingest([probe.corpus])
    assert probe.engine.store_stats().tiers["disk"].bytes_written == before.tiers["disk"].bytes_written
    assert ask(probe, QUESTIONS[0], rag=shared).metrics.tier_hits.get("computed", 0) == 0


def test_counters_add_up_across_processes_in_cache_stats(probe, capsys):
    from ragcache.engine.messages import Rpc

    ask(probe, QUESTIONS[1])
    # the worker writes its counts at most every 5 s, and when the engine closes: what close() does first
    probe.engine.llm.collective_rpc(Rpc.STORE_FLUSH)
    live = probe.engine.store_stats()
    assert probe.cli("cache", "stats", "--json") == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["cumulative"] is True and stats["since"] and stats["updated"]
    n = stats["lookups"]["lookups"]
    assert n == live.lookups >= 20  # this worker is the only one that counted here
    assert stats["lookups"]["head_lookups"] >= 1
    assert all(stats["tiers"][t]["hits"] == live.tiers[t].hits for t in live.tiers)
    assert sum(t["hits"] for t in stats["tiers"].values()) + stats["lookups"]["misses"] == n
    assert all(t["hits"] + t["misses"] == n for t in stats["tiers"].values())
