"""What a chunk KV entry is: its expected shape (KVSpec), its metadata (KVMeta), the entry itself.

Owns: :class:`KVSpec`, :class:`KVMeta`, :class:`KVEntry`, the storage dtype names and the errors
the tiers raise. Imports only torch and :mod:`ragcache.chunks`; must not import vLLM.

Shapes used throughout the store:

- ``k``, ``v`` of an entry: ``[num_layers, num_tokens, num_kv_heads, head_dim]``; K is stored
  *before* RoPE, V as is.
- Inside the tiers both travel as one tensor ``kv`` holding one *record* per layer, so one
  layer's K and V are adjacent in memory and on disk and a per-layer read is a single contiguous
  read: uncompressed (``store.kv_compression = "none"``) ``[num_layers, 2, num_tokens,
  num_kv_heads, head_dim]`` (index 0 = K, 1 = V); quantised (``int8``, ``int4``) uint8
  ``[num_layers, record bytes]`` (values and scales, :mod:`ragcache.kvstore.codec`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ragcache.chunks import KV_LAYOUT_VERSION
from ragcache.kvstore.codec import Part, layer_parts, record_nbytes

#: storage dtypes the store understands, by their name in KVMeta.dtype / settings
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

#: keys accepted by the store: ``str(ChunkKey)`` (``namespace:digest``) and similar ids (at most 160 characters)
KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]{0,159}")


class TierError(Exception):
    """A tier could not carry out an operation (the store logs it and treats it as a miss)."""


class TierUnavailableError(TierError):
    """A tier's backing service cannot be reached (e.g. Redis down); the store backs off."""


class CorruptEntryError(TierError):
    """A stored entry failed a check: bad header, truncated data or a checksum mismatch.

    The store deletes such an entry, counts it under ``corrupt`` and treats it as a miss.

    Attributes:
        key: the entry's key.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"corrupt KV entry {key!r}: {reason}")
        self.key = key
        self.reason = reason


class ForeignEntryError(TierError):
    """A stored entry is intact but not in a format this version of ragcache reads.

    The store leaves it in place, counts it under ``foreign`` and treats it as a miss.
    """


def check_key(key: str) -> str:
    """Return ``key`` if the store accepts it.

    Raises:
        ValueError: not a str of 1-160 characters from ``[A-Za-z0-9._:@+=/-]`` starting with a
            letter or digit (``str(ChunkKey)`` always qualifies).
    """
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise ValueError(
            f"invalid KV key {key!r}: expected 1-160 characters from [A-Za-z0-9._:@+=/-] starting "
            "with a letter or digit (use str(ChunkKey))"
        )
    return key


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``.

    Raises:
        ValueError: a dtype the store cannot keep (only float32, float16, bfloat16).
    """
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}; use one of {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class KVSpec:
    """The shape of the KV entries a store serves: one model, one KV layout.

    An entry whose metadata disagrees on fingerprint, layout version, layer count, KV head count
    or head size is *foreign* and never returned; so is, for a store, one stored in another form
    than its ``kv_compression`` (:meth:`mismatch`). The storage dtype may differ from ``dtype``:
    entries are converted (dequantised) on read.

    Attributes:
        model_fingerprint: identifies the model weights (``ragcache.models.LLMInfo.fingerprint``).
        layout_version: ``ragcache.chunks.KV_LAYOUT_VERSION`` of the code that computed the KV.
        num_layers: transformer layers.
        num_kv_heads: key/value heads per layer.
        head_dim: dimensions per head.
        dtype: dtype of the K/V tensors handed to ``put`` and returned by ``get``/``open``.
    """

    model_fingerprint: str
    layout_version: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"KVSpec.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_hf_config(
        cls,
        config: Path | str | Mapping[str, Any],
        model_fingerprint: str,
        dtype: torch.dtype = torch.float32,
        layout_version: int = KV_LAYOUT_VERSION,
    ) -> "KVSpec":
        """Spec for a Hugging Face causal LM from its ``config.json`` (a folder, file or dict).

        Reads ``num_hidden_layers``, ``num_key_value_heads`` (default ``num_attention_heads``) and
        ``head_dim`` (default ``hidden_size // num_attention_heads``).

        Raises:
            FileNotFoundError: no config.json at the given path.
            KeyError: the config lacks the layer or head counts.
        """
        if not isinstance(config, Mapping):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            config = json.loads(path.read_text(encoding="utf-8"))
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
        return cls(
            model_fingerprint=model_fingerprint,
            layout_version=layout_version,
            num_layers=int(config["num_hidden_layers"]),
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            dtype=dtype,
        )

    def mismatch(self, meta: "KVMeta", compression: str | None = None) -> str | None:
        """Why an entry with ``meta`` is foreign to this spec, or None when it matches.

        Args:
            compression: the stored form the caller serves (``store.kv_compression``); an entry in
                another form is foreign too (never served as if it were this one). None: any form.
        """
        for name in ("model_fingerprint", "layout_version", "num_layers", "num_kv_heads", "head_dim"):
            mine, theirs = getattr(self, name), getattr(meta, name)
            if mine != theirs:
                return f"{name} {theirs!r} != {mine!r}"
        if compression is not None and meta.compression != compression:
            return f"stored form {meta.compression!r} != {compression!r}"
        return None

    def check_kv(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Validate K/V handed to ``put`` and return their token count.

        Raises:
            ValueError: not floating tensors of one shape ``[num_layers, T>=1, num_kv_heads,
                head_dim]``.
        """
        expected = (self.num_layers, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 4:
                raise ValueError(f"{name} must be a floating tensor [layers, tokens, kv_heads, head_dim]")
            if (t.shape[0], t.shape[2], t.shape[3]) != expected or t.shape[1] < 1:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; expected [{self.num_layers}, T>=1, "
                    f"{self.num_kv_heads}, {self.head_dim}]"
                )
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
        return int(k.shape[1])


@dataclass(frozen=True)
class KVMeta:
    """Metadata stored with every entry (in the safetensors header on disk and in Redis).

    Attributes:
        model_fingerprint, layout_version, num_layers, num_kv_heads, head_dim: as in KVSpec.
        dtype: storage dtype name ("float32", "float16" or "bfloat16"): of K and V when
            ``compression`` is "none", of the scales ("float16") when quantised.
        num_tokens: tokens in the chunk.
        start_position: canonical position of the entry's first token when its KV was computed.
        checksums: zlib.crc32 of each stored tensor's bytes in file order, ``len(parts)`` per layer:
            K of layer 0, V of layer 0, K of layer 1, ... uncompressed; K, K's scales, V, V's scales
            of layer 0, ... quantised.
        compression: the stored form, "none", "int8" or "int4" (:mod:`ragcache.kvstore.codec`).
    """

    model_fingerprint: str
    layout_version: int
    dtype: str
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    start_position: int
    checksums: tuple[int, ...] = ()
    compression: str = "none"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's K (or V) as returned: ``(num_tokens, num_kv_heads, head_dim)``."""
        return (self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def parts(self) -> tuple[Part, ...]:
        """The stored tensors of one layer, in file order (:func:`ragcache.kvstore.codec.layer_parts`).

        Raises:
            ValueError: an unknown compression, or int4 with an odd head_dim.
        """
        return layer_parts(self.compression, self.torch_dtype, *self.layer_shape)

    @property
    def record_shape(self) -> tuple[int, ...]:
        """Shape of one stored layer: ``(2, T, H, D)`` uncompressed, ``(record bytes,)`` quantised."""
        return (2, *self.layer_shape) if self.compression == "none" else (self.layer_nbytes,)

    @property
    def record_dtype(self) -> torch.dtype:
        """dtype of the stored ``kv`` tensor: the storage dtype uncompressed, uint8 quantised."""
        return self.torch_dtype if self.compression == "none" else torch.uint8

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """Shape of the stored ``kv`` tensor: ``(num_layers, *record_shape)``."""
        return (self.num_layers, *self.record_shape)

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one stored layer (K and V, with their scales when quantised)."""
        return record_nbytes(self.parts)

    @property
    def nbytes(self) -> int:
        """Bytes of every stored layer (excluding the header)."""
        return self.num_layers * self.layer_nbytes


@dataclass
class KVEntry:
    """One chunk's KV cache as returned by ``TieredStore.get``.

    Attributes:
        key: the entry's key (``str(ChunkKey)``).
        k: pre-RoPE keys ``[num_layers, num_tokens, num_kv_heads, head_dim]`` in the spec's dtype on
            the store's device; the caller's own copy (safe to modify in place).
        v: values, same shape, dtype and device as ``k``.
        meta: stored metadata; ``meta.dtype`` is the *storage* dtype.
    """

    key: str
    k: torch.Tensor
    v: torch.Tensor
    meta: KVMeta

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens


@dataclass
class StoredKV:
    """An entry as the tiers hold it (internal to ragcache.kvstore).

    Attributes:
        key: the entry's key.
        meta: metadata with checksums of ``kv``.
        kv: one record per layer (``meta.kv_shape`` in ``meta.record_dtype``, see the module
            docstring); contiguous; on the CPU except in the device tier. Never modified in place
            once stored.
    """

    key: str
    meta: KVMeta
    kv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes
