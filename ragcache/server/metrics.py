"""Prometheus metrics of ``ragcache serve`` (GET /metrics), with prometheus-client.

Owns: the metric definitions, how one answered request moves them (:meth:`ServerMetrics.observe`)
and the KV store snapshot behind the per-tier gauges. Names start with ``ragcache_`` (Prometheus
reserves ``:`` for recording rules; vLLM's own metrics are ``vllm:*``); label values are bounded:
``tier`` (device, cpu, disk, remote), ``index`` (indexes served), ``mode`` (full, prefix, reuse,
blend), ``outcome`` (completed, aborted, error), ``tenant`` (who asked: ``default`` for the shared
key or a server without keys, else the tenant of the scoped key in ``serve.keys_file``) — never
chunk ids, request ids or keys. Its own registry, so /metrics shows exactly these. Imports
prometheus_client and ragcache.pipeline types.

Per request (after it completes):
  ragcache_time_to_first_token_seconds{index,mode}   histogram of vLLM's first-token latency
                                                      (queueing + chunk KV load/blend + prefill of the tail)
  ragcache_e2e_request_latency_seconds{index,mode}   histogram, question arrival to last token
  ragcache_retrieval_seconds{index}                  histogram, question embedding + search
  ragcache_prompt_tokens_total{index,mode,tenant}    prompt tokens
  ragcache_cached_prompt_tokens_total{index,mode,tenant}  of which not computed for the request (usage.cached_tokens)
  ragcache_recomputed_tokens_total{index,mode,tenant}     context tokens recomputed (blend's HKVD tokens)
  ragcache_output_tokens_total{index,mode,tenant}    tokens decoded
  ragcache_chunk_lookups_total{tier}                 retrieved chunks looked up in each tier (a chunk
                                                      served by disk was looked up in cpu, then disk)
  ragcache_chunk_hits_total{tier}                    retrieved chunks served by each tier; lookups
                                                      minus hits are misses, so hits/lookups is the hit rate
  ragcache_requests_total{index,mode,outcome,tenant} requests that got an answer (completed), whose
                                                      client went away (aborted) or that failed (error)
  ragcache_context_load_errors_total{index,mode}     completed requests whose cached context the worker could
                                                      not serve (vLLM prefilled it in full instead)
Now:
  ragcache_requests_in_flight                        chat completions being answered
  ragcache_engine_unfinished_requests                requests vLLM holds (waiting or running) at the scrape
  ragcache_tier_bytes{tier}                          bytes of chunk KV each tier holds (at the last scrape)
  ragcache_evictions_total{tier}                     entries each tier evicted since the server started
  ragcache_corrupt_entries_total{tier}               damaged entries each tier found (bad header, truncated,
                                                      checksum mismatch, non-finite scales or K/V) and deleted
  ragcache_foreign_entries_total{tier}               entries each tier found of another model, layout, stored
                                                      form or format (left in place, not served)
  ragcache_keys_file_state{state}                    1 for the state serve.keys_file is in (ok, empty, missing,
                                                      invalid), 0 for the others; no series without a keys file
  ragcache_keys_file_state_since_seconds             when it entered that state (unix time)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ragcache.engine.messages import StoreStats
from ragcache.pipeline import Answer
from ragcache.server.keys import DEFAULT_TENANT, KEYS_FILE_STATES, KeysFileStatus
from ragcache.server.responses import cached_tokens

#: seconds; TTFT spans ~0.05 s (blend, short prompt) to ~60 s (full prefill of 6k tokens on 2 CPU cores)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
RETRIEVAL_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

#: what a retrieved chunk's KV tier is called when it was missing and computed during the request
COMPUTED = "computed"


class _StoreCollector:
    """``ragcache_tier_bytes``, ``ragcache_evictions_total``, ``ragcache_corrupt_entries_total`` and
    ``ragcache_foreign_entries_total`` from the last store snapshot."""

    def __init__(self) -> None:
        self.stats = StoreStats()

    def collect(self) -> Iterable[Any]:
        size = GaugeMetricFamily("ragcache_tier_bytes", "Bytes of chunk KV held by each tier", labels=["tier"])
        evicted = CounterMetricFamily("ragcache_evictions", "Entries evicted by each tier to stay within its "
                                      "capacity, since the server started", labels=["tier"])
        corrupt = CounterMetricFamily("ragcache_corrupt_entries", "Damaged chunk KV entries each tier found (bad "
                                      "header, truncated, checksum mismatch, non-finite scales or K/V) and deleted, "
                                      "since the server started", labels=["tier"])
        foreign = CounterMetricFamily("ragcache_foreign_entries", "Chunk KV entries each tier found of another model, "
                                      "layout, stored form or format (left in place, not served), since the server "
                                      "started", labels=["tier"])
        for tier, s in self.stats.tiers.items():
            size.add_metric([tier], float(s.occupancy_bytes))
            evicted.add_metric([tier], float(s.evictions))
            corrupt.add_metric([tier], float(s.corrupt))
            foreign.add_metric([tier], float(s.foreign))
        yield from (size, evicted, corrupt, foreign)


class _KeysCollector:
    """``ragcache_keys_file_state`` and ``ragcache_keys_file_state_since_seconds`` from the keys
    file's status at the scrape (no series without a keys file)."""

    def __init__(self) -> None:
        self.status: Callable[[], KeysFileStatus | None] = lambda: None

    def collect(self) -> Iterable[Any]:
        status = self.status()
        if status is None:
            return
        state = GaugeMetricFamily("ragcache_keys_file_state", "1 for the state serve.keys_file is in (ok, empty: "
                                  "every scoped key refused, missing or invalid: every key refused unless "
                                  "serve.keys_invalid = keep), 0 for the others", labels=["state"])
        for name in KEYS_FILE_STATES:
            state.add_metric([name], 1.0 if name == status.state else 0.0)
        yield state
        yield GaugeMetricFamily("ragcache_keys_file_state_since_seconds", "When serve.keys_file entered its state "
                                "(unix time)", value=status.since)


class ServerMetrics:
    """The server's Prometheus registry (see the module docstring for every metric).

    Args:
        tiers: the KV store's tiers, top-down (``store_stats().names``); a chunk served by a
            tier counts as a lookup in that tier and every tier above it.
    """

    def __init__(self, tiers: Sequence[str] = ()):
        disable_created_metrics()  # no `*_created` series (process-wide in prometheus-client)
        r = self.registry = CollectorRegistry()
        im = ["index", "mode"]
        imt = [*im, "tenant"]
        self.ttft = Histogram("ragcache_time_to_first_token_seconds", "Time to first token (vLLM's first-token "
                              "latency: queueing, chunk KV load and blend, prefill of the tail)", im,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ragcache_e2e_request_latency_seconds", "Question arrival to last token", im,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.retrieval = Histogram("ragcache_retrieval_seconds", "Question embedding and search", ["index"],
                                   buckets=RETRIEVAL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("ragcache_prompt_tokens", "Prompt tokens", imt, registry=r)
        self.cached_tokens = Counter("ragcache_cached_prompt_tokens", "Prompt tokens whose KV was not computed "
                                     "for the request (reused chunk KV, or prefix-cache hits)", imt, registry=r)
        self.recomputed_tokens = Counter("ragcache_recomputed_tokens", "Context tokens recomputed (the blend's "
                                         "HKVD tokens and the layers before its check layer)", imt, registry=r)
        self.output_tokens = Counter("ragcache_output_tokens", "Tokens decoded", imt, registry=r)
        self.lookups = Counter("ragcache_chunk_lookups", "Retrieved chunks looked up in each KV tier", ["tier"],
                               registry=r)
        self.hits = Counter("ragcache_chunk_hits", "Retrieved chunks served by each KV tier", ["tier"], registry=r)
        self.requests = Counter("ragcache_requests", "Chat completions by outcome (completed, aborted, error) and "
                                "tenant", ["index", "mode", "outcome", "tenant"], registry=r)
        self.context_load_errors = Counter("ragcache_context_load_errors", "Completed requests whose cached context "
                                           "the worker could not serve (vLLM prefilled it in full; the server log "
                                           "has the error)", im, registry=r)
        self.routes = Counter("ragcache_routed_requests", "Completed requests by the path that ran (route: blend, "
                              "full, or an explicit mode) and why (rule: faster, slower, quality, no_context, "
                              "unavailable under engine.mode = auto; explicit otherwise)", ["index", "route", "rule"],
                              registry=r)
        self.in_flight = Gauge("ragcache_requests_in_flight", "Chat completions being answered now", registry=r)
        self.engine_unfinished = Gauge("ragcache_engine_unfinished_requests", "Requests vLLM holds now (waiting "
                                       "or running); 0 when idle, or a request leaked", registry=r)
        self.store = _StoreCollector()
        r.register(self.store)
        self.keys = _KeysCollector()
        r.register(self.keys)
        self.tiers: list[str] = []
        self.set_tiers(tiers)

    def watch_keys(self, status: Callable[[], KeysFileStatus | None]) -> None:
        """Report the keys file's state from ``status`` (called at every scrape)."""
        self.keys.status = status

    def set_tiers(self, tiers: Sequence[str]) -> None:
        """The store's tiers, top-down; their lookup and hit series start at 0."""
        self.tiers = list(tiers)
        for t in self.tiers:
            self.lookups.labels(t)
            self.hits.labels(t)

    def observe(self, index: str, answer: Answer, tenant: str = DEFAULT_TENANT) -> None:
        """Count one completed request of ``tenant``."""
        m = answer.metrics
        key = (index, m.mode)
        self.ttft.labels(*key).observe(m.ttft_s)
        self.e2e.labels(*key).observe(m.total_s)
        self.retrieval.labels(index).observe(m.retrieval_s)
        self.prompt_tokens.labels(*key, tenant).inc(m.prompt_tokens)
        self.cached_tokens.labels(*key, tenant).inc(cached_tokens(answer))
        self.recomputed_tokens.labels(*key, tenant).inc(m.recomputed_tokens)
        self.output_tokens.labels(*key, tenant).inc(m.output_tokens)
        for tier in m.chunk_tiers:
            self._count_chunk(tier)
        self.requests.labels(index, m.mode, "completed", tenant).inc()
        self.routes.labels(index, m.route or m.mode, m.route_rule or "explicit").inc()
        if m.load_error:
            self.context_load_errors.labels(*key).inc()

    def _count_chunk(self, tier: str) -> None:
        if tier in self.tiers:
            for t in self.tiers[: self.tiers.index(tier) + 1]:
                self.lookups.labels(t).inc()
            self.hits.labels(tier).inc()
        elif tier == COMPUTED:  # missed in every tier, computed during the request
            for t in self.tiers:
                self.lookups.labels(t).inc()

    def count_outcome(self, index: str, mode: str, outcome: str, tenant: str = DEFAULT_TENANT) -> None:
        """Count a request of ``tenant`` that did not complete: ``aborted`` (the client left) or ``error``."""
        self.requests.labels(index, mode, outcome, tenant).inc()

    def render(self, store_stats: StoreStats | None = None) -> bytes:
        """The Prometheus text exposition, with the per-tier gauges from ``store_stats`` when given."""
        if store_stats is not None:
            self.store.stats = store_stats
        return generate_latest(self.registry)
