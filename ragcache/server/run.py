"""Running ``ragcache serve``: the start-up checks and uvicorn.

Owns: :func:`check_serve_settings` (a non-loopback address needs ``serve.api_key``; the default
index must exist) and :func:`serve` (uvicorn in this process, until SIGINT/SIGTERM shut it down
gracefully). Never imports app/ or ui/.
"""

from __future__ import annotations

import ipaddress

from ragcache.config import ConfigError, Settings


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_serve_settings(settings: Settings) -> None:
    """Refuse to start what would be unsafe or useless.

    Raises:
        ConfigError: ``serve.host`` is not a loopback address and ``serve.api_key`` is empty.
        IndexNotFoundError: the default index (``serve.index``) does not exist.
        PgUnavailableError: ``ingest.vector_store = "pgvector"`` and its database cannot be reached.
    """
    from ragcache.catalog import catalog
    from ragcache.index import IndexNotFoundError

    s = settings.serve
    if not is_loopback(s.host) and not s.api_key:
        raise ConfigError(f"serve.host {s.host!r} accepts connections from other machines: set serve.api_key "
                          "(e.g. RAGCACHE_SERVE__API_KEY=...) so clients must send it, or bind 127.0.0.1")
    cat = catalog(settings)
    names = cat.names()
    if s.index not in names:
        others = f" (existing: {', '.join(names)})" if names else ""
        where = settings.ingest.index_dir if cat.backend == "faiss" else cat.describe(s.index)
        raise IndexNotFoundError(f"the default index {s.index!r} is not under {where}{others}: "
                                 f"run `ragcache ingest PATH --index {s.index}` or pass --index NAME")


def serve(settings: Settings, *, log_level: str = "info") -> None:
    """Serve on ``serve.host:serve.port`` until interrupted (SIGINT/SIGTERM shut down gracefully).

    Raises:
        ConfigError / IndexNotFoundError: see :func:`check_serve_settings`.
    """
    import uvicorn

    from ragcache.server.app import create_app

    check_serve_settings(settings)
    config = uvicorn.Config(create_app(settings), host=settings.serve.host, port=settings.serve.port,
                            log_level=log_level, timeout_graceful_shutdown=10)
    uvicorn.Server(config).run()
