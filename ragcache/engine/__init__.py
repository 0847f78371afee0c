"""The vLLM adapter: KV connector (scheduler + worker side), worker extension, BlendEngine facade.

Modules: ``messages`` (typed data crossing the driver/worker boundary), ``engine`` (BlendEngine,
the driver side), ``connector`` (the KV connector vLLM loads by module path), ``worker`` (the
worker runtime and extension), ``ops`` (DecoderOps adapters per model family, one registry),
``selfcheck`` (the start-up self-check and the gate that keeps reuse/blend off when it fails).
Importing this package does not import vLLM; ``BlendEngine`` does when constructed.
"""

from ragcache.engine.engine import BlendEngine, Generation
from ragcache.engine.messages import ContextStats, RequestMetrics
from ragcache.engine.selfcheck import BlendSupport, BlendUnavailableError, ContextBeyondWindowError

__all__ = ["BlendEngine", "Generation", "RequestMetrics", "ContextStats", "BlendSupport", "BlendUnavailableError",
           "ContextBeyondWindowError"]
