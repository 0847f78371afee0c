"""ragcache: RAG whose LLM never re-prefills a chunk it has seen.

Each chunk's KV cache is computed once at ingest, kept in tiers (device -> cpu -> disk -> Redis)
and, at query time, reused at its new position by an embedded vLLM engine that recomputes only
the HKVD tokens (CacheBlend, Yao et al., EuroSys'25).
"""

import os as _os

_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ragcache.config import ConfigError, Settings  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Settings", "ConfigError", "__version__"]
