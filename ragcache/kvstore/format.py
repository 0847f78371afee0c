"""The on-disk / in-Redis format of a KV entry: a safetensors file with per-tensor checksums.

Owns: encoding an entry to safetensors bytes, parsing and validating the header, and readers that
load one layer (or all) from a file descriptor or from bytes, verifying checksums as they read.
Must not import vLLM.

Layout (plain safetensors, readable by ``safetensors.safe_open``)::

    8 bytes    little-endian header length N
    N bytes    JSON header, space-padded to a multiple of 8:
               "__metadata__": {"format": "ragcache-kv/1", "key", "model_fingerprint",
                                "layout_version", "dtype", "num_layers", "num_tokens",
                                "num_kv_heads", "head_dim", "start_position",
                                "crc32": "0a1b2c3d,..." (8 hex digits per tensor, file order)}
               "k.0", "v.0", "k.1", ... : {"dtype", "shape": [T, H, D], "data_offsets"}
    data       k.0 v.0 k.1 v.1 ... (each [T, H, D] in the storage dtype)

K and V of a layer are adjacent, so a per-layer read is one ``pread`` of ``2 * T * H * D * itemsize``
bytes, and the whole data area is exactly the store's ``kv`` tensor
``[num_layers, 2, T, H, D]``. Checksums are ``zlib.crc32`` of each tensor's bytes (~3 GB/s).
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

from ragcache.kvstore.entry import DTYPES, CorruptEntryError, ForeignEntryError, KVMeta

FORMAT = "ragcache-kv/1"
_ST_CODE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_MAX_HEADER = 16 * 1024 * 1024  # a real header is a few KB; more means garbage


def byte_view(t: torch.Tensor):
    """Flat writable uint8 numpy view over a contiguous CPU tensor's memory (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def checksums(kv: torch.Tensor) -> tuple[int, ...]:
    """crc32 of each ``[T, H, D]`` tensor of ``kv`` ``[L, 2, T, H, D]`` (CPU, contiguous), in file order."""
    raw = byte_view(kv)
    n = kv[0, 0].numel() * kv.element_size()
    return tuple(zlib.crc32(raw[i * n:(i + 1) * n]) for i in range(2 * kv.shape[0]))


def encode_header(key: str, meta: KVMeta) -> bytes:
    """The 8-byte length prefix plus the padded JSON header for an entry."""
    md = {
        "format": FORMAT,
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
    header: dict[str, object] = {"__metadata__": md}
    size, shape, code = meta.tensor_nbytes, list(meta.layer_shape), _ST_CODE[meta.dtype]
    for i in range(meta.num_layers):
        for j, name in enumerate(("k", "v")):
            start = (2 * i + j) * size
            header[f"{name}.{i}"] = {"dtype": code, "shape": shape, "data_offsets": [start, start + size]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


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
        ForeignEntryError: valid safetensors that is not a ragcache KV entry of this format.
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
    if not isinstance(md, dict) or md.get("format") != FORMAT:
        fmt = md.get("format") if isinstance(md, dict) else None
        raise ForeignEntryError(f"entry {key!r} has format {fmt!r}, not {FORMAT!r}")
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
        )
        stored_key = md["key"]
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptEntryError(key, f"bad metadata ({exc.__class__.__name__}: {exc})") from None
    if stored_key != key:
        raise CorruptEntryError(key, f"header names key {stored_key!r}")
    if meta.dtype not in DTYPES or min(meta.num_layers, meta.num_tokens, meta.num_kv_heads, meta.head_dim) < 1:
        raise CorruptEntryError(key, "bad dtype or shape in metadata")
    if len(meta.checksums) != 2 * meta.num_layers:
        raise CorruptEntryError(key, f"{len(meta.checksums)} checksums for {meta.num_layers} layers")
    size, shape, code = meta.tensor_nbytes, list(meta.layer_shape), _ST_CODE[meta.dtype]
    if len(header) != 2 * meta.num_layers + 1:
        raise CorruptEntryError(key, "unexpected tensors in header")
    for i in range(meta.num_layers):
        for j, name in enumerate(("k", "v")):
            start = (2 * i + j) * size
            info = header.get(f"{name}.{i}")
            if info != {"dtype": code, "shape": shape, "data_offsets": [start, start + size]}:
                raise CorruptEntryError(key, f"tensor {name}.{i} does not match the metadata")
    if total_size is not None and total_size != end + meta.nbytes:
        raise CorruptEntryError(key, f"size {total_size} bytes, expected {end + meta.nbytes} (truncated?)")
    return meta, end


def verify_layer(key: str, meta: KVMeta, layer: int, kv_layer: torch.Tensor) -> None:
    """Check one layer ``[2, T, H, D]`` (CPU, contiguous) against its two checksums.

    Raises:
        CorruptEntryError: a checksum differs.
    """
    raw = byte_view(kv_layer)
    n = meta.tensor_nbytes
    for j, name in enumerate(("k", "v")):
        if zlib.crc32(raw[j * n:(j + 1) * n]) != meta.checksums[2 * layer + j]:
            raise CorruptEntryError(key, f"checksum mismatch in {name}.{layer}")


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
        """Layer ``layer`` as ``[2, T, H, D]`` in the storage dtype (index 0 = K, 1 = V).

        ``out``, when given, is a contiguous CPU tensor of that shape and dtype to read into.

        Raises:
            CorruptEntryError: the layer's checksum does not match or its bytes are missing.
            IndexError: ``layer`` out of range.
        """
        ...

    def read_all(self) -> torch.Tensor:
        """All layers as ``[L, 2, T, H, D]`` in the storage dtype, checksums verified.

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
        return torch.empty(shape, dtype=meta.torch_dtype)
    if tuple(out.shape) != shape or out.dtype != meta.torch_dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {shape} {meta.dtype}")
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
        t = _out(self.meta, (2, *self.meta.layer_shape), out)
        self._read_into(t, self._data_offset + layer * 2 * self.meta.tensor_nbytes)
        verify_layer(self.key, self.meta, layer, t)
        return t

    def read_all(self) -> torch.Tensor:
        t = torch.empty(self.meta.kv_shape, dtype=self.meta.torch_dtype)
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
        t = _out(self.meta, (2, *self.meta.layer_shape), out)
        self._copy_into(t, self._data_offset + layer * 2 * self.meta.tensor_nbytes)
        verify_layer(self.key, self.meta, layer, t)
        return t

    def read_all(self) -> torch.Tensor:
        t = torch.empty(self.meta.kv_shape, dtype=self.meta.torch_dtype)
        self._copy_into(t, self._data_offset)
        for i in range(self.meta.num_layers):
            verify_layer(self.key, self.meta, i, t[i])
        return t

    def close(self) -> None:
        self._data = memoryview(b"")
