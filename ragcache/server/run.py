"""Running ``ragcache serve``: the start-up checks, the engine and uvicorn.

Owns: :func:`check_serve_settings` (a non-loopback address needs a key; the keys file must be
valid; the default index must exist) and :func:`serve`: the engine starts first, then the mode
requests get is settled (reuse/blend unavailable: refuse to start, or ``serve.blend_fallback``),
then uvicorn serves in the same event loop until SIGINT/SIGTERM shut it down gracefully. uvicorn
runs with h11, through :class:`~ragcache.server.limits.HeadLimitedH11Protocol`: ``serve.max_header_bytes``
is the limit on a request's line and headers however they arrive (uvicorn's httptools parser has
no such limit). Never imports app/ or ui/.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from ragcache.config import ConfigError, Settings

log = logging.getLogger(__name__)

#: request-body bytes a prompt may take per token of ``engine.max_model_len``, as JSON: the longest
#: token of SmolLM2's vocabulary is 82 bytes (a run of 80 '#' or spaces), ordinary text 4-7
BODY_BYTES_PER_TOKEN = 128


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_serve_settings(settings: Settings) -> None:
    """Refuse to start what would be unsafe or useless (and warn when ``serve.max_body_bytes`` is
    below what a prompt of ``engine.max_model_len`` tokens may take, :data:`BODY_BYTES_PER_TOKEN`).

    Raises:
        ConfigError: ``serve.host`` is not a loopback address and neither ``serve.api_key`` nor
            ``serve.keys_file`` is set; the keys file is missing or invalid (see
            :func:`ragcache.server.keys.read_keys_file`).
        IndexNotFoundError: the default index (``serve.index``) does not exist.
        PgUnavailableError: ``ingest.vector_store = "pgvector"`` and its database cannot be reached.
    """
    from ragcache.index.catalog import catalog
    from ragcache.index.manifest import IndexNotFoundError
    from ragcache.server.keys import KeyRing

    s = settings.serve
    if not is_loopback(s.host) and not s.api_key and not s.keys_file:
        raise ConfigError(f"serve.host {s.host!r} accepts connections from other machines: set serve.api_key "
                          "(e.g. RAGCACHE_SERVE__API_KEY=...) or serve.keys_file so clients must send a key, "
                          "or bind 127.0.0.1")
    KeyRing.from_settings(s)
    need = BODY_BYTES_PER_TOKEN * settings.engine.max_model_len
    if s.max_body_bytes < need:
        log.warning("serve.max_body_bytes = %d may refuse (413) prompts that engine.max_model_len = %d tokens "
                    "allows: a prompt may take up to %d bytes of JSON (%d per token); raise serve.max_body_bytes",
                    s.max_body_bytes, settings.engine.max_model_len, need, BODY_BYTES_PER_TOKEN)
    cat = catalog(settings)
    names = cat.names()
    if s.index not in names:
        others = f" (existing: {', '.join(names)})" if names else ""
        where = settings.ingest.index_dir if cat.backend == "faiss" else cat.describe(s.index)
        raise IndexNotFoundError(f"the default index {s.index!r} is not under {where}{others}: "
                                 f"run `ragcache ingest PATH --index {s.index}` or pass --index NAME")


def serve(settings: Settings, *, log_level: str = "info") -> None:
    """Start the engine, then serve on ``serve.host:serve.port`` until interrupted (SIGINT/SIGTERM
    shut down gracefully); the engine is closed on the way out.

    Raises:
        ConfigError / IndexNotFoundError: see :func:`check_serve_settings`.
        BlendUnavailableError: reuse/blend is unavailable on this model or host, ``engine.mode``
            needs it and ``serve.blend_fallback`` is ``"refuse"`` (nothing was bound).
    """
    check_serve_settings(settings)
    asyncio.run(_serve(settings, log_level))


async def _serve(settings: Settings, log_level: str) -> None:
    import uvicorn

    from ragcache.engine import AsyncBlendEngine
    from ragcache.server.app import create_app, serving_mode
    from ragcache.server.limits import HeadLimitedH11Protocol

    engine = await AsyncBlendEngine.start(settings)  # the engine binds to this loop, uvicorn's too
    try:
        mode = serving_mode(settings, engine.blend_support)  # refuse before binding the port
        app = create_app(settings, engine=engine, mode=mode, close_engine=True)  # closed at uvicorn's shutdown
        config = uvicorn.Config(app, host=settings.serve.host, port=settings.serve.port, log_level=log_level,
                                timeout_graceful_shutdown=10, http=HeadLimitedH11Protocol,
                                h11_max_incomplete_event_size=settings.serve.max_header_bytes)
        await uvicorn.Server(config).serve()
    finally:
        engine.close()  # idempotent: for a failure before (or instead of) uvicorn's shutdown
