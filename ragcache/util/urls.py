"""A service URL made safe to print: :func:`redact`. Imports nothing from the rest of ragcache."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact(url: str) -> str:
    """``url`` without its password (for messages, logs and recorded commands):
    ``postgresql://u:pw@h/db`` -> ``postgresql://u:***@h/db``; a URL without one is returned as is.
    A comma-separated list (``store.remote_url``'s Redis Cluster nodes) is redacted node by node."""
    return ",".join(_redact_one(part) for part in url.split(","))


def _redact_one(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))
