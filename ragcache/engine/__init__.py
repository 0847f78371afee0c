"""The vLLM adapter: KV connector (scheduler + worker side), worker extension, BlendEngine facade.

Importing this package does not import vLLM; ``BlendEngine`` does when constructed.
"""

from ragcache.engine.engine import BlendEngine, Generation, GenerationMetrics

__all__ = ["BlendEngine", "Generation", "GenerationMetrics"]
