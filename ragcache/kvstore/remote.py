"""The ``remote`` tier: KV entries shared through Redis (redis-py with the hiredis parser), e.g. by
several hosts; a single server, or a Redis Cluster (``store.remote_cluster``).

Owns: :class:`RedisTier`. Each entry is one Redis string holding the same safetensors bytes as
the disk tier's file, under ``<prefix><key>``; a key starts with its KV namespace
(``ragcache:kv:default/acme:3f2c...``, see :class:`ragcache.chunks.ChunkKey`), so one namespace's
keys share a prefix (``clear(prefix)``; a Redis ACL can confine a tenant to it). ``SET`` is
atomic, so concurrent writers of one key leave one complete value. There is no capacity setting
for this tier: size Redis itself (``maxmemory <bytes>`` with ``maxmemory-policy allkeys-lru``;
ragcache sets no TTLs; persistence is optional since every entry can be computed again). Must not
import vLLM.

The hiredis parser (``redis[hiredis]``) reads large values ~2.5x faster than redis-py's
pure-Python one (measured ~250 vs ~90 MB/s for a 64 MB value on a 2-core machine); redis-py uses
it whenever it is installed.

Failures: connection errors and timeouts raise
:class:`~ragcache.kvstore.entry.TierUnavailableError` (the store then marks the tier down and
retries after a back-off); other Redis errors (e.g. OOM on write) raise
:class:`~ragcache.kvstore.entry.TierError`. redis-py's own retries are turned off so that a dead
server costs one quick failure, not seconds of retrying.

Cluster (redis-py's ``RedisCluster``): each entry is one key, so all of a chunk's layers live in
one hash slot on one master by construction (no hash tag needed), and the keys of many chunks
spread evenly over the masters. ``SCAN``, ``STRLEN`` pipelines and ``UNLINK`` fan out over every
master. A lost master (or ``CLUSTERDOWN``) is an outage of the whole tier, not of some keys: from
the first command that meets it (a key in one of its slots, a fan-out command) the tier raises
``TierUnavailableError`` and stays unavailable until a ``PING`` to every master of the current
topology succeeds again (after a failover or a repair); until then, keys on the live masters are
served as before. Answers then come from the local
tiers (or are recomputed), never from a half-reachable store, and the store's back-off does not
flap between the keys of live and dead masters.
"""

from __future__ import annotations

from typing import Callable, Iterator, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, RedisClusterException
from redis.retry import Retry

from ragcache.kvstore.entry import KVMeta, StoredKV, TierError, TierUnavailableError
from ragcache.kvstore.format import BytesEntryReader, encode, header_length, parse_header
from ragcache.kvstore.tier import EntryStat, TierDefaults, get_then_delete
from ragcache.util.urls import redact

T = TypeVar("T")
DEFAULT_PREFIX = "ragcache:kv:"
_HEAD_GUESS = 16 * 1024  # bytes fetched to read a header (30-layer headers are ~5 KB)


def _glob_escape(text: str) -> str:
    """``text`` with Redis' glob characters escaped, for ``SCAN MATCH``."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisTier(TierDefaults):
    """Entries as Redis strings.

    Args:
        url: ``redis://host:port/db``, ``rediss://...`` or ``unix:///path``; with ``cluster``, one or
            more comma-separated ``redis://host:port`` seed nodes.
        prefix: prepended to every key; ``clear`` only removes keys with this prefix.
        connect_timeout: seconds to wait for a connection (``store.remote_timeout_s`` from settings).
        timeout: seconds to wait for a reply, per socket operation (``store.remote_timeout_s``): a
            server that accepts connections but does not answer (stopped, overloaded) costs this
            long before the tier is marked down.
        cluster: the URL names node(s) of a Redis Cluster.

    Construction does not connect; the first command does (a cluster's topology is read then).
    """

    name = "remote"
    memory = False

    def __init__(
        self, url: str, prefix: str = DEFAULT_PREFIX, connect_timeout: float = 1.0, timeout: float = 10.0,
        cluster: bool = False,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.cluster = cluster
        self._degraded = False  # cluster: a node failed; every call checks all masters first
        options = dict(
            socket_connect_timeout=connect_timeout,
            socket_timeout=timeout,
            socket_read_size=1 << 20,  # large values: fewer, bigger reads
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._options = options
        self._cluster_client: "redis.RedisCluster | None" = None
        if not cluster:
            self._single = redis.Redis.from_url(url, retry_on_timeout=False, **options)

    @property
    def _r(self) -> "redis.Redis | redis.RedisCluster":
        if not self.cluster:
            return self._single
        if self._cluster_client is None:  # reads the topology from the first seed that answers
            from urllib.parse import urlsplit

            from redis.cluster import ClusterNode, RedisCluster

            seeds = [urlsplit(u.strip()) for u in self.url.split(",") if u.strip()]
            first = seeds[0]
            self._cluster_client = RedisCluster(
                startup_nodes=[ClusterNode(s.hostname or "127.0.0.1", s.port or 6379) for s in seeds],
                username=first.username, password=first.password, ssl=first.scheme == "rediss",
                require_full_coverage=False, **self._options)
        return self._cluster_client

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            if self._degraded:
                self._r.ping()  # every master of the current topology (raises while one is lost)
                self._degraded = False
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, OSError, ClusterDownError,
                RedisClusterException) as exc:
            if self.cluster:
                self._degraded = True
            raise TierUnavailableError(f"Redis at {redact(self.url)} unreachable: {exc}") from exc
        except redis.RedisError as exc:
            raise TierError(f"Redis at {redact(self.url)}: {exc}") from exc

    def ping(self) -> bool:
        """True when the server answers.

        Raises:
            TierUnavailableError: it does not.
        """
        return bool(self._call(self._r.ping))

    def contains(self, key: str) -> bool:
        return bool(self._call(lambda: self._r.exists(self._k(key))))

    def head(self, key: str) -> KVMeta | None:
        """Metadata via ``GETRANGE`` of the header only (one round trip for usual headers)."""
        k = self._k(key)
        raw = self._call(lambda: self._r.getrange(k, 0, _HEAD_GUESS - 1))
        if not raw:
            return None
        end = header_length(raw, key)
        if end > len(raw):
            raw += self._call(lambda: self._r.getrange(k, len(raw), end - 1))
        meta, _ = parse_header(raw, key, None)
        return meta

    def open(self, key: str) -> BytesEntryReader | None:
        """Fetches the whole value in one ``GET`` (consistent even if another writer replaces it)."""
        data = self._call(lambda: self._r.get(self._k(key)))
        if data is None:
            return None
        return BytesEntryReader(data, key)

    def put(self, item: StoredKV) -> int:
        data = encode(item.key, item.meta, item.kv.detach().cpu().contiguous())
        self._call(lambda: self._r.set(self._k(item.key), data))
        return len(data)

    def delete(self, key: str) -> bool:
        return bool(self._call(lambda: self._r.delete(self._k(key))))

    def pop(self, key: str) -> StoredKV | None:
        """``GET`` then ``DEL`` (not atomic: a concurrent writer's newer value may be deleted too).

        Raises:
            CorruptEntryError / ForeignEntryError: the value is damaged / not ours; it is kept.
            TierUnavailableError / TierError: as every command.
        """
        return get_then_delete(self, key)

    def _scan(self, prefix: str = "") -> list[bytes]:
        pattern = _glob_escape(self.prefix + prefix) + "*"
        return self._call(lambda: list(self._r.scan_iter(match=pattern, count=1000)))

    def scan(self) -> list[EntryStat]:
        """Every key under the prefix with its value size (``SCAN`` + pipelined ``STRLEN``), in
        Redis' own order with mtime 0.0: Redis keeps its own recency (``maxmemory-policy``).

        Raises:
            TierUnavailableError / TierError: as every command.
        """
        names = self._scan()
        if not names:
            return []

        def sizes() -> list[int]:
            pipe = self._r.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            return pipe.execute()

        n = len(self.prefix)
        return [EntryStat(name.decode()[n:], int(size)) for name, size in zip(names, self._call(sizes))]

    def keys(self) -> Iterator[str]:
        n = len(self.prefix)
        return iter([k.decode()[n:] for k in self._scan()])

    def clear(self, prefix: str = "") -> None:
        """Delete every key under the tier's prefix whose entry key starts with ``prefix``."""
        names = self._scan(prefix)
        for i in range(0, len(names), 500):
            batch = names[i:i + 500]
            self._call(lambda: self._r.unlink(*batch))

    def close(self) -> None:
        try:
            client = self._cluster_client if self.cluster else self._single
            if client is not None:
                client.close()
        except Exception:
            pass
