"""Chunks and their content-addressed keys.

Owns: :class:`Chunk` (a piece of a document with its exact LLM token ids) and :class:`ChunkKey`
(the key its KV cache is stored under). Imports nothing from the rest of ragcache.

Two identities, on purpose:

- ``chunk_id`` names the *text*: sha256 of the chunk's text, so the same passage always gets the
  same id whichever file or ingest run it comes from (used by the index and for stable ordering).
- ``ChunkKey`` names the *KV cache*: sha256 over (model fingerprint, KV layout version, compute
  dtype, stored form, KV namespace, context, token ids). The KV of the same text differs per model,
  per layout (canonical lead-in, canonical start position, pre-RoPE K), per precision it was
  computed in (bfloat16 KV is not float32 KV rounded: every layer saw bf16 activations) and per
  form it is stored in (``store.kv_compression``: int8 KV is not the floats it was quantised
  from), so each of those is part of the key; an entry written for another model, layout, compute
  dtype or stored form is simply never looked up, and its chunk is computed again (the store also
  refuses an entry whose header names another form).

KV namespaces keep tenants apart: the store's namespace (``store.namespace``) and an index's own
namespace (set at ingest) form the key's namespace (:func:`kv_namespace`), which is hashed into the
digest *and* written in front of it (``default/tenant-a:3f2c...``), so every tier (a disk file
name, a Redis key) files the entry under its namespace. Two namespaces never share an entry, so
one tenant cannot learn from a hit (or a faster answer) that another holds the same text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

#: Bump when the way chunk KV is computed or laid out changes (lead-in, start position, RoPE).
KV_LAYOUT_VERSION = 1

#: separates a store namespace from an index namespace in a key's namespace
NAMESPACE_SEPARATOR = "/"

#: a namespace part starting with this is private to ragcache itself (the start-up self-check's KV):
#: users cannot name one (:data:`ragcache.config.NAMESPACE_PATTERN` starts with a letter or digit),
#: and the KV store leaves its lookups out of every counter (:func:`is_private_key`)
PRIVATE_NAMESPACE_PREFIX = "_"


def kv_namespace(store_namespace: str, index_namespace: str = "") -> str:
    """The namespace of chunk keys: ``store`` alone, or ``store/index`` when the index has its own.

    Names are validated where users give them (``ragcache.config.check_namespace``).
    """
    return f"{store_namespace}{NAMESPACE_SEPARATOR}{index_namespace}" if index_namespace else store_namespace


def is_private_key(key: str) -> bool:
    """Whether the store key ``key`` (``str(ChunkKey)``) lies in a private namespace: one of its
    namespace parts starts with :data:`PRIVATE_NAMESPACE_PREFIX` (e.g. ``default/_self-check-1a2b:...``)."""
    namespace = key.rpartition(":")[0]
    return any(part.startswith(PRIVATE_NAMESPACE_PREFIX) for part in namespace.split(NAMESPACE_SEPARATOR))


def chunk_id_for(text: str) -> str:
    """Content id of a chunk's text: first 16 hex chars of sha256(utf-8 text)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class Chunk:
    """A document chunk with fixed LLM token ids.

    Attributes:
        chunk_id: content id of ``text`` (see :func:`chunk_id_for`).
        doc_id: id of the source document (its path, or a passage hash for QA sets).
        title: document title, may be empty.
        position: 0-based index of the chunk in its document.
        text: the chunk's text.
        token_ids: the chunk's LLM token ids, fixed once at ingest (no BOS).
    """

    chunk_id: str
    doc_id: str
    title: str
    position: int
    text: str
    token_ids: tuple[int, ...] = field(repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ChunkKey:
    """Key of one chunk's KV cache entry in the tiered store.

    Attributes:
        digest: 32 hex chars of sha256(model fingerprint, layout version, compute dtype, stored form,
            namespace, context, token ids).
        namespace: the KV namespace (:func:`kv_namespace`); "" = none.

    ``str(key)`` is the store key: ``"<namespace>:<digest>"`` (just the digest without a namespace).
    """

    digest: str
    namespace: str = ""

    @classmethod
    def of(
        cls, token_ids: Sequence[int], model_fingerprint: str, namespace: str = "", context: str = "",
        layout_version: int = KV_LAYOUT_VERSION, compute_dtype: str = "", kv_compression: str = "none",
    ) -> "ChunkKey":
        """Key for ``token_ids`` computed by the model with ``model_fingerprint``.

        Args:
            namespace: the KV namespace the entry belongs to (:func:`kv_namespace`).
            context: what else the KV depends on, e.g. a hash of the lead-in it was computed after.
            compute_dtype: the dtype the model computed the KV in (``"float32"``, ``"bfloat16"``,
                ``"float16"``; the engine's ``dtype.dtype``), not the dtype it is stored in; "" only
                for keys that no engine computes (tests, tools).
            kv_compression: the form the KV is stored in (``store.kv_compression``: "none", "int8",
                "int4"); "none" leaves the key as it was before stored forms existed.
        """
        h = hashlib.sha256()
        dtype = f"|dtype={compute_dtype}" if compute_dtype else ""
        form = f"|form={kv_compression}" if kv_compression != "none" else ""
        h.update(f"ragcache-kv|{model_fingerprint}|v{layout_version}{dtype}{form}|ns={namespace}|{context}|".encode())
        h.update(b",".join(str(t).encode() for t in token_ids))
        return cls(h.hexdigest()[:32], namespace)

    def __str__(self) -> str:
        return f"{self.namespace}:{self.digest}" if self.namespace else self.digest
