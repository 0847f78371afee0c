"""Who may call ``ragcache serve`` and which indexes each caller may read: the shared key and scoped keys.

Owns: :class:`Access` (one caller's tenant name and the indexes it may read), :class:`KeyRing`
(the bearer keys a server accepts, built from ``serve.api_key`` and ``serve.keys_file``) and the
keys file's format. Imports only the standard library and ragcache.config; no FastAPI, no engine.

The simple default is one shared key (``serve.api_key``): whoever holds it reads every index, as
tenant ``default``; with neither a key nor a keys file every caller does (loopback only). A keys
file adds keys scoped to indexes, one TOML table per key, the key itself stored only as its sha256::

    [[key]]
    tenant = "acme"                          # who asked, as /metrics labels it (1-32 of [A-Za-z0-9_-])
    sha256 = "3b1f...64 hex digits"          # printf %s 'THE-KEY' | sha256sum
    indexes = ["acme", "acme-archive"]       # index names it may read; ["*"] = every index
    namespaces = ["acme"]                    # and/or every index whose own KV namespace is one of these

A scoped key reads only its indexes (HTTP 403 for the others, which /v1/models does not list);
only a key that may read every index (the shared key, or ``indexes = ["*"]``) may read the
server-wide /v1/cache and /metrics.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragcache.config import NAMESPACE_PATTERN, ConfigError

#: tenant of the shared key (``serve.api_key``) and of every caller of a server without keys
DEFAULT_TENANT = "default"
#: what a keys file's ``indexes`` may hold to grant every index
EVERY_INDEX = "*"

_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"tenant", "sha256", "indexes", "namespaces"}


def key_digest(key: str) -> str:
    """The sha256 of a bearer key as the keys file stores it (64 lower-case hex digits)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Access:
    """What one authenticated caller may read.

    Attributes:
        tenant: the caller's name in /metrics (``default`` for the shared key).
        indexes: index names it may read; None = every index.
        namespaces: index KV namespaces (an index's own, set at ingest with ``--namespace``) whose
            indexes it may read as well.
    """

    tenant: str = DEFAULT_TENANT
    indexes: frozenset[str] | None = None
    namespaces: frozenset[str] = field(default_factory=frozenset)

    @property
    def every_index(self) -> bool:
        """Whether this caller may read every index (and so the server-wide /v1/cache and /metrics)."""
        return self.indexes is None

    def may_read(self, index: str, namespace: str | None) -> bool:
        """Whether the caller may read ``index``, whose own KV namespace is ``namespace`` (None:
        not known, e.g. the index does not exist)."""
        if self.indexes is None or index in self.indexes:
            return True
        return bool(namespace) and namespace in self.namespaces

    def describe(self) -> str:
        """What it may read, for error messages: ``indexes acme, b; namespaces acme``."""
        parts = []
        if self.indexes:
            parts.append("indexes " + ", ".join(sorted(self.indexes)))
        if self.namespaces:
            parts.append("indexes of namespaces " + ", ".join(sorted(self.namespaces)))
        return "; ".join(parts) or "no index"


#: the access of the shared key, and of everyone on a server without keys
EVERYTHING = Access()


def _entry(raw: Any, where: str) -> tuple[str, Access]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table with tenant, sha256 and indexes and/or namespaces")
    unknown = set(raw) - _FIELDS
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; use {', '.join(sorted(_FIELDS))}")
    tenant = raw.get("tenant")
    if not isinstance(tenant, str) or not NAMESPACE_PATTERN.fullmatch(tenant):
        raise ConfigError(f"{where}.tenant {tenant!r}: use 1-32 letters, digits, '_' or '-', starting with a "
                          "letter or digit (it labels /metrics)")
    digest = raw.get("sha256")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest.lower()):
        raise ConfigError(f"{where}.sha256: expected the key's sha256 as 64 hex digits "
                          "(printf %s 'THE-KEY' | sha256sum), never the key itself")
    lists = {}
    for name in ("indexes", "namespaces"):
        value = raw.get(name, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{where}.{name}: expected a list of names, e.g. {name} = [\"acme\"]")
        lists[name] = frozenset(value)
    if not lists["indexes"] and not lists["namespaces"]:
        raise ConfigError(f"{where} (tenant {tenant!r}) grants nothing: give indexes = [...] and/or namespaces = "
                          "[...] (indexes = [\"*\"] for every index)")
    indexes = None if EVERY_INDEX in lists["indexes"] else lists["indexes"]
    return digest.lower(), Access(tenant, indexes, lists["namespaces"])


def read_keys_file(path: str | Path, content: bytes | None = None) -> dict[str, Access]:
    """The scoped keys of a keys file: ``{sha256 hex: Access}`` (see the module docstring).
    ``content``: the file's bytes, when already read.

    Raises:
        ConfigError: the file is missing or unreadable, is not TOML, or an entry is invalid (the
            message names the file, the entry and the field); two entries share a sha256.
    """
    path = Path(path).expanduser()
    try:
        data = tomllib.loads((path.read_bytes() if content is None else content).decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"serve.keys_file {str(path)!r} cannot be read ({exc.strerror or exc}); "
                          "point serve.keys_file at an existing TOML file, or set it to \"\"") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"serve.keys_file {str(path)!r} is not valid TOML ({exc})") from None
    unknown = set(data) - {"key"}
    if unknown:
        raise ConfigError(f"serve.keys_file {str(path)!r}: unknown top-level entries {', '.join(sorted(unknown))}; "
                          "write one [[key]] table per key")
    entries = data.get("key", [])
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"serve.keys_file {str(path)!r} holds no [[key]] table; add one per key")
    keys: dict[str, Access] = {}
    for i, raw in enumerate(entries):
        digest, access = _entry(raw, f"serve.keys_file {str(path)!r}: key[{i}]")
        if digest in keys:
            raise ConfigError(f"serve.keys_file {str(path)!r}: key[{i}] repeats the sha256 of tenant "
                              f"{keys[digest].tenant!r}; each key may appear once")
        keys[digest] = access
    return keys


class KeyRing:
    """The bearer keys one server accepts.

    Args:
        shared_key: ``serve.api_key`` (reads every index, tenant ``default``); "" = none.
        scoped: ``{sha256 hex: Access}`` from a keys file.

    With neither, every caller is let in with :data:`EVERYTHING`.
    """

    def __init__(self, shared_key: str = "", scoped: dict[str, Access] | None = None):
        self._shared = shared_key
        self._scoped = dict(scoped or {})

    @classmethod
    def from_settings(cls, serve: Any, content: bytes | None = None) -> "KeyRing":
        """From the ``[serve]`` settings (``api_key``, ``keys_file``); ``content``: the keys file's
        bytes, when already read.

        Raises:
            ConfigError: see :func:`read_keys_file`.
        """
        return cls(serve.api_key, read_keys_file(serve.keys_file, content) if serve.keys_file else None)

    @property
    def required(self) -> bool:
        """Whether callers must send a key."""
        return bool(self._shared or self._scoped)

    @property
    def tenants(self) -> list[str]:
        """Tenant names of the scoped keys (with ``default``)."""
        return sorted({DEFAULT_TENANT, *(a.tenant for a in self._scoped.values())})

    def authenticate(self, token: str | None) -> Access | None:
        """The access of the caller who sent ``token`` (the bearer key), or None when it is no key
        of this server. A server without keys lets everyone in."""
        if not self.required:
            return EVERYTHING
        if not token:
            return None
        if self._shared and hmac.compare_digest(token.encode(), self._shared.encode()):
            return EVERYTHING
        # the digest of an unknown key reveals nothing about the stored ones: a dict lookup is fine
        return self._scoped.get(key_digest(token)) if self._scoped else None
