"""``ragcache serve``: an OpenAI-compatible RAG server on vLLM's async engine.

Modules: ``schemas`` (the wire format: requests, responses, stream chunks, errors), ``metrics``
(Prometheus), ``app`` (the FastAPI application: routes, streaming, errors), ``keys`` (who may
read which index), ``limits`` (request head and body sizes), ``run`` (start-up checks, uvicorn),
``client`` (a client that answers with the SDK's objects). Built on
the SDK (ragcache.pipeline and ragcache.engine.AsyncBlendEngine); never imports app/ or ui/.
Importing this package imports neither FastAPI nor vLLM.

Example::

    from ragcache import Settings
    from ragcache.server import serve
    serve(Settings.load(serve={"port": 8000, "index": "docs"}))   # until Ctrl-C

    # any OpenAI client:
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    r = client.chat.completions.create(model="docs", messages=[{"role": "user", "content": "..."}])
    r.model_extra["ragcache"]["sources"], r.usage.prompt_tokens_details.cached_tokens
"""

from ragcache.server.run import check_serve_settings, serve


def create_app(*args, **kwargs):
    """See :func:`ragcache.server.app.create_app` (imported on call: FastAPI loads only when used)."""
    from ragcache.server.app import create_app as make

    return make(*args, **kwargs)


__all__ = ["create_app", "serve", "check_serve_settings"]
