"""The on-disk / in-Redis format of a KV entry: a safetensors file with per-tensor checksums.

Owns: encoding an entry to safetensors bytes, parsing and validating the header, and readers that
load one layer (or all) from a file descriptor or from bytes, verifying checksums as they read.
Must not import vLLM.

Layout (plain safetensors, readable by ``safetensors.safe_open``)::

    8 bytes    little-endian header length N
    N bytes    JSON header, space-padded to a multiple of 8:
               "__metadata__": {"format": "ragcache-kv/1" (uncompressed) or "ragcache-kv/2"
                                (quantised), "key", "model_fingerprint", "layout_version",
                                "dtype", "num_layers", "num_tokens", "num_kv_heads", "head_dim",
                                "start_position", "compression" (ragcache-kv/2 only: "int8" or
                                "int4"), "crc32": "0a1b2c3d,..." (8 hex digits per tensor, file order)}
               uncompressed: "k.0", "v.0", "k.1", ...
               quantised:    "k.0", "k_scale.0", "v.0", "v_scale.0", "k.1", ...
                             (each {"dtype", "shape", "data_offsets"}; see ragcache.kvstore.codec)
    data       the tensors in that order; each layer's tensors are one contiguous record

A per-layer read is one ``pread`` of ``meta.layer_nbytes`` bytes, and the whole data area is
exactly the store's ``kv`` tensor (``meta.kv_shape``). Checksums are ``zlib.crc32`` of each
tensor's bytes (~3 GB/s), so a flipped byte in values or scales is caught; a layer whose floats
(scales, or uncompressed K and V) hold a NaN or an infinity is refused as damaged too, checksums
matching or not (no writer stores one). An uncompressed entry is
written as ``ragcache-kv/1``, byte for byte what earlier versions wrote and read; a quantised one as
``ragcache-kv/2``, which earlier versions count as foreign and leave alone.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from typing import Protocol

import numpy as np
import torch

from ragcache.kvstore.codec import FORMS, non_finite_part
from ragcache.kvstore.entry import DTYPES, CorruptEntryError, ForeignEntryError, KVMeta

FORMAT = "ragcache-kv/1"
#: the format of quantised entries (their metadata adds "compression")
FORMAT_QUANTISED = "ragcache-kv/2"
_MAX_HEADER = 16 * 1024 * 1024  # a real header is a few KB; more means garbage


def byte_view(t: torch.Tensor):
    """Flat writable uint8 numpy view over a contiguous CPU tensor's memory (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _part_spans(meta: KVMeta) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` byte offsets of each part within one layer record, in file order."""
    spans, offset = [], 0
    for p in meta.parts:
        spans.append((p.name, offset, offset + p.nbytes))
        offset += p.nbytes
    return spans


def checksums(meta: KVMeta, kv: torch.Tensor) -> tuple[int, ...]:
    """crc32 of each stored tensor of ``kv`` (``meta.kv_shape``, CPU, contiguous), in file order."""
    raw = byte_view(kv)
    n = meta.layer_nbytes
    spans = _part_spans(meta)
    return tuple(zlib.crc32(raw[i * n + a:i * n + b]) for i in range(meta.num_layers) for _, a, b in spans)


def encode_header(key: str, meta: KVMeta) -> bytes:
    """The 8-byte length prefix plus the padded JSON header for an entry."""
    md = {
        "format": FORMAT if meta.compression == "none" else FORMAT_QUANTISED,
        "key": key,
        "model_fingerprint": meta.model_fingerprint,
        "layout_version": str(meta.layout_version),
        "dtype": meta.dtype,
        "num_layers": str(meta.num_layers),
        "num_tokens": str(meta.num_tokens),
        "num_kv_heads": str(meta.num_kv_heads),
        "head_dim": str(meta.head_dim),
        "start_position": str(meta.start_position),
        "crc32": ",".join(f"{c:08x}" for c in meta.checksums),
        "created": f"{time.time():.3f}",
    }
    if meta.compression != "none":
        md["compression"] = meta.compression
    header: dict[str, object] = {"__metadata__": md}
    header.update(_tensor_entries(meta))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _tensor_entries(meta: KVMeta) -> dict[str, dict[str, object]]:
    """The header's tensor entries of ``meta``, in file order."""
    out: dict[str, dict[str, object]] = {}
    parts, n = meta.parts, meta.layer_nbytes
    for i in range(meta.num_layers):
        for p, (name, a, b) in zip(parts, _part_spans(meta)):
            out[f"{name}.{i}"] = {"dtype": p.code, "shape": list(p.shape), "data_offsets": [i * n + a, i * n + b]}
    return out


def encode(key: str, meta: KVMeta, kv: torch.Tensor) -> bytes:
    """Whole entry as safetensors bytes (used for Redis). ``kv``: CPU, contiguous, ``meta.kv_shape``."""
    return encode_header(key, meta) + byte_view(kv).tobytes()


def header_length(prefix: bytes, key: str) -> int:
    """Total bytes of length prefix + header, from the first 8 bytes.

    Raises:
        CorruptEntryError: fewer than 8 bytes or an implausible header length.
    """
    if len(prefix) < 8:
        raise CorruptEntryError(key, f"only {len(prefix)} bytes")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n < 2 or n > _MAX_HEADER:
        raise CorruptEntryError(key, f"header length {n} out of range")
    return 8 + n


def parse_header(raw: bytes, key: str, total_size: int | None) -> tuple[KVMeta, int]:
    """Parse and validate a header; return the metadata and the offset of the data area.

    Args:
        raw: at least the whole header (length prefix included).
        key: the key the entry was looked up under; must equal the header's key.
        total_size: size of the whole file/value in bytes, checked against the header; None skips.

    Raises:
        ForeignEntryError: valid safetensors that is not a ragcache KV entry of a format (or a
            compression) this version reads.
        CorruptEntryError: undecodable header, inconsistent layout, other key, or wrong size
            (truncated).
    """
    end = header_length(raw, key)
    if len(raw) < end:
        raise CorruptEntryError(key, f"header needs {end} bytes, have {len(raw)}")
    try:
        header = json.loads(raw[8:end])
    except ValueError as exc:
        raise CorruptEntryError(key, f"unreadable header ({exc.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise CorruptEntryError(key, "header is not a JSON object")
    md = header.get("__metadata__")
    fmt = md.get("format") if isinstance(md, dict) else None
    if fmt not in (FORMAT, FORMAT_QUANTISED):
        raise ForeignEntryError(f"entry {key!r} has format {fmt!r}, not {FORMAT!r} or {FORMAT_QUANTISED!r}")
    compression = "none" if fmt == FORMAT else md.get("compression")
    if fmt == FORMAT_QUANTISED and compression not in FORMS[1:]:
        raise ForeignEntryError(f"entry {key!r} is compressed as {compression!r}, which this version does not "
                                f"read (it reads {', '.join(FORMS[1:])})")
    try:
        meta = KVMeta(
            model_fingerprint=str(md["model_fingerprint"]),
            layout_version=int(md["layout_version"]),
            dtype=str(md["dtype"]),
            num_layers=int(md["num_layers"]),
            num_tokens=int(md["num_tokens"]),
            num_kv_heads=int(md["num_kv_heads"]),
            head_dim=int(md["head_dim"]),
            start_position=int(md["start_position"]),
            checksums=tuple(int(c, 16) for c in str(md["crc32"]).split(",")),
            compression=str(compression),
        )
        stored_key = md["key"]
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptEntryError(key, f"bad metadata ({exc.__class__.__name__}: {exc})") from None
    if stored_key != key:
        raise CorruptEntryError(key, f"header names key {stored_key!r}")
    if meta.dtype not in DTYPES or min(meta.num_layers, meta.num_tokens, meta.num_kv_heads, meta.head_dim) < 1:
        raise CorruptEntryError(key, "bad dtype or shape in metadata")
    try:
        parts = meta.parts
    except ValueError as exc:
        raise CorruptEntryError(key, str(exc)) from None
    if len(meta.checksums) != len(parts) * meta.num_layers:
        raise CorruptEntryError(key, f"{len(meta.checksums)} checksums for {meta.num_layers} layers")
    expected = _tensor_entries(meta)
    if len(header) != len(expected) + 1:
        raise CorruptEntryError(key, "unexpected tensors in header")
    for name, info in expected.items():
        if header.get(name) != info:
            raise CorruptEntryError(key, f"tensor {name} does not match the metadata")
    if total_size is not None and total_size != end + meta.nbytes:
        raise CorruptEntryError(key, f"size {total_size} bytes, expected {end + meta.nbytes} (truncated?)")
    return meta, end


def verify_layer(key: str, meta: KVMeta, layer: int, record: torch.Tensor) -> None:
    """Check one stored layer (``meta.record_shape``, CPU, contiguous) against its checksums, and
    that its floats (a quantised layer's scales, an uncompressed layer's K and V) are finite: a
    writer never stores a NaN or an infinity, so one is damage even where the checksums were
    rewritten to match it.

    Raises:
        CorruptEntryError: a checksum differs, or a float part holds a non-finite value.
    """
    raw = byte_view(record)
    spans = _part_spans(meta)
    for j, (name, a, b) in enumerate(spans):
        if zlib.crc32(raw[a:b]) != meta.checksums[len(spans) * layer + j]:
            raise CorruptEntryError(key, f"checksum mismatch in {name}.{layer}")
    bad = non_finite_part(meta.compression, meta.parts, record)
    if bad is not None:
        raise CorruptEntryError(key, f"non-finite values in {bad}.{layer}")


class EntryReader(Protocol):
    """Reads a stored entry layer by layer. Not thread-safe; one reader per consumer.

    Attributes:
        key: the entry's key.
        meta: validated metadata.
        stored_bytes: bytes the entry occupies in its tier (file or value size).
    """

    key: str
    meta: KVMeta
    stored_bytes: int

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stored layer ``layer``: ``meta.record_shape`` in ``meta.record_dtype`` (uncompressed:
        ``[2, T, H, D]``, index 0 = K, 1 = V; quantised: its bytes, see :mod:`ragcache.kvstore.codec`).

        ``out``, when given, is a contiguous CPU tensor of that shape and dtype to read into.

        Raises:
            CorruptEntryError: the layer's checksum does not match or its bytes are missing.
            IndexError: ``layer`` out of range.
        """
        ...

    def read_all(self) -> torch.Tensor:
        """All layers as ``meta.kv_shape`` in ``meta.record_dtype``, checksums verified.

        Raises:
            CorruptEntryError: any checksum mismatch or missing bytes.
        """
        ...

    def close(self) -> None: ...


def _check_layer_index(meta: KVMeta, layer: int) -> None:
    if not 0 <= layer < meta.num_layers:
        raise IndexError(f"layer {layer} out of range for {meta.num_layers} layers")


def _out(meta: KVMeta, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=meta.record_dtype)
    if tuple(out.shape) != shape or out.dtype != meta.record_dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {shape} {meta.record_dtype}")
    return out


class FileEntryReader:
    """Reads an entry from an open file with ``os.preadv`` (no mmap: a file truncated or replaced
    by another process cannot crash the reader; it keeps reading the inode it opened)."""

    def __init__(self, path: os.PathLike | str, key: str) -> None:
        """Open and validate the header.

        Raises:
            FileNotFoundError: no such file (a miss).
            CorruptEntryError / ForeignEntryError: see :func:`parse_header`.
        """
        self.key = key
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self.stored_bytes = os.fstat(self._fd).st_size
            first = os.pread(self._fd, 8, 0)
            end = header_length(first, key)
            raw = first + self._pread_exact(end - 8, 8)
            self.meta, self._data_offset = parse_header(raw, key, self.stored_bytes)
        except BaseException:
            os.close(self._fd)
            raise

    def _pread_exact(self, n: int, offset: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise CorruptEntryError(self.key, f"short read at offset {offset} (truncated?)")
        return data

    def _read_into(self, t: torch.Tensor, offset: int) -> None:
        view = memoryview(byte_view(t))
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CorruptEntryError(self.key, f"short read at offset {offset + done} (truncated?)")
            done += got

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_layer_index(self.meta, layer)
        t = _out(self.meta, self.meta.record_shape, out)
        self._read_into(t, self._data_offset + layer * self.meta.layer_nbytes)
        verify_layer(self.key, self.meta, layer, t)
        return t

    def read_all(self) -> torch.Tensor:
        t = torch.empty(self.meta.kv_shape, dtype=self.meta.record_dtype)
        self._read_into(t, self._data_offset)
        for i in range(self.meta.num_layers):
            verify_layer(self.key, self.meta, i, t[i])
        return t

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # a reader dropped without close() must not leak its descriptor
        try:
            self.close()
        except Exception:
            pass


class BytesEntryReader:
    """Reads an entry held in memory as safetensors bytes (the remote tier's values)."""

    def __init__(self, data: bytes, key: str) -> None:
        """Validate the header.

        Raises:
            CorruptEntryError / ForeignEntryError: see :func:`parse_header`.
        """
        self.key = key
        self.stored_bytes = len(data)
        self._data = memoryview(data)
        self.meta, self._data_offset = parse_header(bytes(self._data[:header_length(data[:8], key)]),
                                                    key, len(data))

    def _copy_into(self, t: torch.Tensor, offset: int) -> None:
        dst = byte_view(t)
        src = self._data[offset:offset + dst.nbytes]
        if len(src) != dst.nbytes:
            raise CorruptEntryError(self.key, "value shorter than its header says")
        dst[:] = np.frombuffer(src, dtype=np.uint8)

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_layer_index(self.meta, layer)
        t = _out(self.meta, self.meta.record_shape, out)
        self._copy_into(t, self._data_offset + layer * self.meta.layer_nbytes)
        verify_layer(self.key, self.meta, layer, t)
        return t

    def read_all(self) -> torch.Tensor:
        t = torch.empty(self.meta.kv_shape, dtype=self.meta.record_dtype)
        self._copy_into(t, self._data_offset)
        for i in range(self.meta.num_layers):
            verify_layer(self.key, self.meta, i, t[i])
        return t

    def close(self) -> None:
        self._data = memoryview(b"")



def entry_nbytes(key: str, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int, compression: str,
                 dtype: str = "float32") -> int:
    """Bytes an entry of that shape takes on disk or in Redis under ``key``: header, values and
    scales, in form ``compression`` (``dtype``: the float dtype of ``none``; ignored by the quantised
    forms, whose scales are float16).

    Raises:
        ValueError: an unknown form or dtype, or int4 with an odd ``head_dim``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    meta = KVMeta("0" * 16, 1, dtype if compression == "none" else "float16", num_layers, num_tokens, num_kv_heads,
                  head_dim, 0, compression=compression)
    meta = KVMeta(**{**meta.__dict__, "checksums": (0,) * (len(meta.parts) * num_layers)})
    return len(encode_header(key, meta)) + meta.nbytes


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, compression: str, dtype: str = "float32",
                    tokens: int = 512) -> float:
    """Stored bytes per token of a ``tokens``-token chunk's entry (:func:`entry_nbytes` under a
    namespaced key) for a model of that KV shape: what a corpus costs is its tokens x this.

    Raises:
        ValueError: as :func:`entry_nbytes`.
    """
    return entry_nbytes("default:" + "0" * 32, num_layers, num_kv_heads, head_dim, tokens, compression, dtype) / tokens
