"""Two `ragcache serve` replicas behind HAProxy, sharing one pgvector index and one Redis Cluster
KV tier — every component real and started here:

- a document set ingested once by another process (`ragcache ingest`, with KV precompute) is
  answered by each replica on its first ask with every chunk's KV from the shared tier (source tier
  "remote", `cached_tokens` > 0, no chunk computed);
- a replica killed with SIGKILL in the middle of a streamed answer: the balancer's next request goes
  to the other replica and is answered;
- the Redis Cluster masters that hold the chunks' KV killed: a replica that needs the shared tier
  answers with the same text (the chunk KV computed locally), the tier counted down and its misses
  honest.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from ragcache_testing.services import ReplicaProcess
from tests.conftest import REPO, ZORBIA_DOCS
from tests.services import haproxy, start_postgres, start_redis_cluster

pytestmark = [pytest.mark.slow, pytest.mark.integration]

INDEX = "zorbia"
QUESTION = "What is the capital of Zorbia?"


def replica_env(pg_url: str, redis_url: str, kv_dir) -> dict[str, str]:
    """Settings of one process of the deployment: shared index and KV tier, its own disk folder."""
    return {
        "RAGCACHE_INGEST__VECTOR_STORE": "pgvector", "RAGCACHE_INGEST__PG_URL": pg_url,
        "RAGCACHE_STORE__REMOTE_URL": redis_url, "RAGCACHE_STORE__REMOTE_CLUSTER": "true",
        "RAGCACHE_STORE__SSD_CACHE_DIR": str(kv_dir), "RAGCACHE_STORE__CPU_KV_POOL_GB": "0.5",
        "RAGCACHE_ENGINE__MAX_MODEL_LEN": "2048", "RAGCACHE_ENGINE__KV_CACHE_MEMORY_BYTES": str(256 << 20),
        "RAGCACHE_ENGINE__MAX_TOKENS": "16",
        "RAGCACHE_BLEND__MIN_RECOMPUTE_TOKENS": "0",  # short documents: the floor would recompute every token
    }


def remote_counts(url: str) -> tuple[int, int, int]:
    """The replica's remote-tier (lookups, hits, unavailable) so far."""
    t = httpx.get(f"{url}/v1/cache", timeout=30).json()["tiers"]["remote"]
    return t["lookups"], t["hits"], t["unavailable"]


def ask(url: str, question: str = QUESTION, **extra) -> httpx.Response:
    body = {"model": INDEX, "max_tokens": 16, "messages": [{"role": "user", "content": question}],
            "ragcache": {"top_k": 3, "mode": "blend"}, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale")
    pg = start_postgres()
    cluster = start_redis_cluster(tmp)
    replicas: list[ReplicaProcess] = []
    balancer = None
    try:
        corpus = tmp / "corpus"
        corpus.mkdir()
        for name, text in ZORBIA_DOCS.items():
            (corpus / name).write_text(text)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
        env.update(replica_env(pg.url, cluster.url, tmp / "kv-ingest"), PYTHONPATH=str(REPO))
        out = subprocess.run([sys.executable, "-m", "app.cli", "ingest", str(corpus), "--index", INDEX, "--quiet"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "remote 3" in out.stdout, out.stdout  # the chunk KV went to the shared tier
        # replica1 keeps chunk KV in its RAM tier; replica2 has none, so each of its asks uses the shared tier
        envs = [replica_env(pg.url, cluster.url, tmp / f"kv-replica{i}") for i in (1, 2)]
        envs[1]["RAGCACHE_STORE__CPU_KV_POOL_GB"] = "0"
        replicas = [ReplicaProcess(e, INDEX, tmp / f"replica{i}.log").start() for i, e in enumerate(envs, 1)]
        for r in replicas:
            r.wait_ready(900)
        balancer = haproxy(tmp, [r.address for r in replicas]).start()
        yield {"pg": pg, "cluster": cluster, "replicas": replicas, "balancer": balancer}
    finally:
        if balancer is not None:
            balancer.stop()
        for r in replicas:
            r.stop()
        cluster.stop()
        pg.stop()


def test_each_replica_answers_its_first_ask_from_the_shared_tier(deployment):
    texts = []
    for replica in deployment["replicas"]:
        before = remote_counts(replica.url)
        r = ask(replica.url)
        assert r.status_code == 200, r.text
        body = r.json()
        tiers = [s["tier"] for s in body["ragcache"]["sources"]]
        assert tiers == ["remote"] * 3, tiers  # 0 computed chunks
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert body["ragcache"]["metrics"]["tier_hits"] == {"remote": 3}
        after = remote_counts(replica.url)
        assert (after[0] - before[0], after[1] - before[1]) == (3, 3)  # 3 chunk lookups, 3 remote hits
        texts.append(body["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]  # the same chunk KV, the same greedy answer on both replicas
    deployment["answer"] = texts[0]

    with_ram, without_ram = deployment["replicas"]
    assert ask(with_ram.url).json()["ragcache"]["metrics"]["tier_hits"] == {"cpu": 3}  # promoted to its RAM
    assert ask(without_ram.url).json()["ragcache"]["metrics"]["tier_hits"] == {"remote": 3}


def test_lost_redis_masters_degrade_to_local_compute_with_the_same_answer(deployment):
    replica = deployment["replicas"][1]  # no RAM tier: every ask needs the shared tier
    before = remote_counts(replica.url)
    cluster = deployment["cluster"]
    # the masters that hold the chunks' KV (which ones depends on the keys' hash slots, and a key
    # holds the model and dtype): losing only a master that holds none of them would not be met
    holders = [i for i, n in enumerate(cluster.key_counts()) if n > 0]
    assert holders, "the ingest wrote no chunk KV to the cluster"
    for i in holders:
        cluster.kill(i)
    r = ask(replica.url)
    assert r.status_code == 200, r.text
    body = r.json()
    assert "remote" not in body["ragcache"]["metrics"]["tier_hits"]
    assert body["choices"][0]["message"]["content"] == deployment["answer"]
    after = remote_counts(replica.url)
    assert after[0] - before[0] == 3 and after[1] == before[1]  # 3 lookups, none served by the lost tier
    assert after[2] > before[2]  # counted as unavailable
    assert not httpx.get(f"{replica.url}/v1/cache", timeout=30).json()["tiers"]["remote"]["up"]


def test_a_replica_killed_mid_stream_the_next_request_is_answered_by_the_other(deployment):
    balancer, replicas = deployment["balancer"], deployment["replicas"]
    body = {"model": INDEX, "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": QUESTION}],
            "ragcache": {"top_k": 3}, "ignore_eos": True}
    victim, done = None, False
    try:
        with httpx.stream("POST", f"{balancer.url}/v1/chat/completions", json=body, timeout=300) as resp:
            assert resp.status_code == 200
            victim = replicas[int(resp.headers["x-ragcache-replica"].removeprefix("replica")) - 1]
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"content"' in line and victim.alive:
                    victim.kill()  # mid-stream: the first text piece has arrived
                done |= line == "data: [DONE]"
    except httpx.HTTPError:
        pass  # the stream broke with its replica
    assert victim is not None and not victim.alive and not done
    survivor = next(r for r in replicas if r is not victim)

    r = ask(balancer.url)
    assert r.status_code == 200, r.text
    assert r.headers["x-ragcache-replica"] == f"replica{replicas.index(survivor) + 1}"
    assert r.json()["choices"][0]["message"]["content"]
