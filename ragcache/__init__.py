"""ragcache: RAG whose LLM never re-prefills a chunk it has seen.

Each chunk's KV cache is computed once at ingest, kept in tiers (device -> cpu -> disk -> Redis)
and, at query time, reused at its new position by an embedded vLLM engine that recomputes only
the HKVD tokens (CacheBlend, Yao et al., EuroSys'25).
"""

import os as _os

_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ragcache.util import lifeline as _lifeline  # noqa: E402

_lifeline.hold()  # in a vLLM process started by a ragcache engine: die with that engine's process

from ragcache.util import logs as _logs  # noqa: E402

_logs.inherit()  # in a process a quiet ragcache process started: quiet from the first import on

from ragcache.config import ConfigError, Settings  # noqa: E402
from ragcache.options import QueryOptions, QueryOptionsError, SamplingOptions  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Settings", "ConfigError", "QueryOptions", "QueryOptionsError", "SamplingOptions", "RAGPipeline", "Answer",
           "Source", "RequestMetrics", "__version__"]


def __getattr__(name: str):
    # heavy parts load on first use: `import ragcache` stays light (no torch, no vLLM)
    if name in ("RAGPipeline", "Answer", "Source"):
        from ragcache import pipeline

        return getattr(pipeline, name)
    if name == "RequestMetrics":
        from ragcache.engine.messages import RequestMetrics

        return RequestMetrics
    raise AttributeError(f"module 'ragcache' has no attribute {name!r}")
