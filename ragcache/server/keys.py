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

A running server reads the file again on every request (:class:`KeySource`), so a key added or
removed counts from the next request, and revocation fails closed. The file's state
(:data:`KEYS_FILE_STATES`) is one of: ``ok``; ``empty`` (no ``[[key]]`` table: no scoped key, every
one refused with 401, the shared key still works); ``missing`` (deleted: every key refused, the
shared key too, with 503 naming the file, until it is back); ``invalid`` (not TOML, or an entry
wrong: the same 503 by default; with ``serve.keys_invalid = "keep"`` the keys read before stay
valid). At start a missing or invalid file stops the server instead; an empty one starts it with
a warning.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragcache.config import NAMESPACE_PATTERN, ConfigError

log = logging.getLogger(__name__)

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


class KeysFileMissingError(ConfigError):
    """The keys file does not exist (deleted, or never written)."""


def read_keys_file(path: str | Path, content: bytes | None = None) -> dict[str, Access]:
    """The scoped keys of a keys file: ``{sha256 hex: Access}`` (see the module docstring), ``{}``
    for a file without a ``[[key]]`` table (an empty file: no keys). ``content``: the file's
    bytes, when already read.

    Raises:
        KeysFileMissingError: the file does not exist. ConfigError: it is unreadable, is not TOML,
            or an entry is invalid (the message names the file, the entry and the field); two
            entries share a sha256.
    """
    path = Path(path).expanduser()
    try:
        data = tomllib.loads((path.read_bytes() if content is None else content).decode("utf-8"))
    except FileNotFoundError:
        raise KeysFileMissingError(f"serve.keys_file {str(path)!r} does not exist; point serve.keys_file at an "
                                   "existing TOML file, or set it to \"\"") from None
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
    if not isinstance(entries, list):
        raise ConfigError(f"serve.keys_file {str(path)!r}: key must be [[key]] tables, one per key")
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
        scoped: ``{sha256 hex: Access}`` from a keys file; None = no keys file, ``{}`` = a keys
            file without keys (every scoped key refused).

    With no shared key and no keys file, every caller is let in with :data:`EVERYTHING`.
    """

    def __init__(self, shared_key: str = "", scoped: dict[str, Access] | None = None):
        self._shared = shared_key
        self._file = scoped is not None
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
        """Whether callers must send a key (a shared key, or a keys file, even one without keys)."""
        return bool(self._shared or self._file)

    @property
    def size(self) -> int:
        """How many scoped keys it holds."""
        return len(self._scoped)

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


#: the states of a keys file, as /health and the ``ragcache_keys_file_state`` gauge name them
KEYS_FILE_STATES = ("ok", "empty", "missing", "invalid")


@dataclass(frozen=True)
class KeysFileStatus:
    """The state of ``serve.keys_file`` as last read.

    Attributes:
        state: one of :data:`KEYS_FILE_STATES`.
        since: when the file entered that state, as seen by the server (unix time, seconds).
        problem: what is wrong with a missing or invalid file ("" otherwise).
        keys: scoped keys accepted now (those read before, for an invalid file kept).
    """

    state: str
    since: float
    problem: str = ""
    keys: int = 0


class KeysUnavailableError(Exception):
    """No key can be checked: the keys file is missing, or invalid and ``serve.keys_invalid`` is
    ``"refuse"``; the message names the file, what is wrong and the fix (the server answers 503)."""


class KeySource:
    """The keys a running server accepts, from the ``[serve]`` settings (``api_key``,
    ``keys_file``, ``keys_invalid``), read again on every :meth:`keyring` call: a change of either
    setting or of the file's content (whatever its mtime) counts from the next call. A file of
    many keys reads in microseconds.

    Args:
        serve: the ``[serve]`` settings, read on every call (a change to them counts too).

    Raises (on construction):
        ConfigError: the keys file is missing or invalid at start (an empty one is accepted, with
            a warning: every scoped key is refused).
    """

    def __init__(self, serve: Any):
        self._serve = serve
        self._stamp: tuple[Any, ...] | None = None
        self._ring = KeyRing()
        self._refusal: str | None = None
        self.status: KeysFileStatus | None = None  # None: no keys file
        self.keyring()

    def keyring(self) -> KeyRing:
        """The keys accepted now.

        Raises:
            KeysUnavailableError: the keys file is missing, or invalid with ``keys_invalid = "refuse"``.
            ConfigError: the first read (at start) found it missing or invalid.
        """
        s = self._serve
        content: bytes | str | None = None
        if s.keys_file:
            try:
                content = Path(s.keys_file).expanduser().read_bytes()
            except OSError as exc:  # reported by read_keys_file below, once per change
                content = f"{type(exc).__name__}: {exc}"
        stamp = (s.api_key, s.keys_file, s.keys_invalid, content)
        if stamp != self._stamp:
            self._update(s, content if isinstance(content, bytes) else None)
            self._stamp = stamp
        if self._refusal is not None:
            raise KeysUnavailableError(self._refusal)
        return self._ring

    def _update(self, s: Any, content: bytes | None) -> None:
        first = self._stamp is None
        if not s.keys_file:
            self._ring, self._refusal, self.status = KeyRing(s.api_key), None, None
            return
        try:
            scoped = read_keys_file(s.keys_file, content)
        except ConfigError as exc:
            if first:
                raise
            missing = isinstance(exc, KeysFileMissingError)
            self._set("missing" if missing else "invalid", str(exc), self._ring.size)
            if not missing and s.keys_invalid == "keep":
                self._refusal = None
                log.warning("%s; the keys read before still apply (serve.keys_invalid = \"keep\")", exc)
                return
            fix = "back" if missing else "fixed (serve.keys_invalid = \"keep\" keeps the keys read before)"
            self._refusal = f"{exc}; every key is refused until the file is {fix}"
            log.error("%s", self._refusal)
            return
        self._ring, self._refusal = KeyRing(s.api_key, scoped), None
        self._set("ok" if scoped else "empty", "", len(scoped))
        if not scoped:
            log.warning("serve.keys_file %r holds no [[key]] table: every scoped key is refused", s.keys_file)

    def _set(self, state: str, problem: str, keys: int) -> None:
        since = self.status.since if self.status is not None and self.status.state == state else time.time()
        self.status = KeysFileStatus(state, since, problem, keys)
