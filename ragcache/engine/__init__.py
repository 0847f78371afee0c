"""The vLLM adapter: KV connector (scheduler + worker side), worker extension, engine facades.

Modules: ``messages`` (typed data crossing the driver/worker boundary), ``base`` (what both
engines share: engine arguments, request building, Generation), ``engine`` (BlendEngine over
``vllm.LLM``, the default), ``async_engine`` (AsyncBlendEngine over vLLM's AsyncLLM, for servers),
``connector`` (the KV connector vLLM loads by module path), ``worker`` (the worker runtime and
extension), ``ops`` (DecoderOps adapters per model family, one registry), ``selfcheck`` (the
start-up self-check and the gate that keeps reuse/blend off when it fails).
Importing this package does not import vLLM; the engines do when constructed.
"""

from ragcache.engine.async_engine import AsyncBlendEngine
from ragcache.engine.base import Generation
from ragcache.engine.engine import BlendEngine
from ragcache.engine.messages import ContextStats, RequestMetrics, StoreStats
from ragcache.engine.selfcheck import BlendSupport, BlendUnavailableError, ContextBeyondWindowError
from ragcache.options import QueryOptions, SamplingOptions

__all__ = ["BlendEngine", "AsyncBlendEngine", "Generation", "QueryOptions", "SamplingOptions", "RequestMetrics",
           "ContextStats", "StoreStats", "BlendSupport", "BlendUnavailableError", "ContextBeyondWindowError"]
