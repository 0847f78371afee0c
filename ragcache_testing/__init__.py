"""Test support shared by the benchmarks (``ragcache bench``) and tests/: throwaway services on
loopback ports (``services``: redis-server, a Redis Cluster, PostgreSQL with pgvector, HAProxy,
``ragcache serve`` replicas) and a cold page cache.

Not part of the SDK: ragcache's core never imports it (only ``ragcache.bench`` does), and it imports
nothing from ragcache, app/ or ui/.
"""
