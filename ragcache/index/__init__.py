"""Where chunks are kept and found: the index, on FAISS (a local folder) or pgvector (PostgreSQL).

Modules: ``manifest`` (an index's record of itself and the errors every backend raises), ``nodes``
(a chunk as a llama-index node), ``folder`` (a FAISS index's folder: names, paths, atomic
replacement), ``faiss_index`` (the FAISS :class:`~ragcache.index.faiss_index.Index`), ``pg_index``
(the pgvector index and its registry), ``catalog`` (which indexes exist, on either backend) and
``retrieval`` (search and the stable order of retrieved chunks). Written by :mod:`ragcache.ingest`,
read by the pipeline. Must not import vLLM, the engine, the pipeline, ``app/`` or ``ui/``.
Importing this package imports none of its modules: import each from its own path.
"""
