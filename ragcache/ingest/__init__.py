"""Files -> chunks -> embeddings -> an index (and each chunk's KV, precomputed by the engine).

Modules: ``readers`` (one file -> llama-index documents: text, HTML, PDF, JSON records),
``ingestor`` (:class:`~ragcache.ingest.ingestor.Ingestor`: the plan, the local executor and the
crash-safe publish) and ``ray_ingestor`` (:class:`~ragcache.ingest.ray_ingestor.RayIngestor`: the
same stages on Ray Data). Writes through :mod:`ragcache.index`. Must not import the pipeline,
``app/`` or ``ui/``. Importing this package imports none of its modules: import each from its own
path.
"""
