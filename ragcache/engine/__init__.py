"""The vLLM adapter: KV connector (scheduler + worker side), worker extension, BlendEngine facade.

Modules: ``messages`` (typed data crossing the driver/worker boundary), ``engine`` (BlendEngine,
the driver side), ``connector`` (the KV connector vLLM loads by module path), ``worker`` (the
worker runtime and extension), ``ops`` (DecoderOps over vLLM's model modules).
Importing this package does not import vLLM; ``BlendEngine`` does when constructed.
"""

from ragcache.engine.engine import BlendEngine, Generation
from ragcache.engine.messages import ContextStats, RequestMetrics

__all__ = ["BlendEngine", "Generation", "RequestMetrics", "ContextStats"]
