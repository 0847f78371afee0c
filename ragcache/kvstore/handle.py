"""An open KV entry read layer by layer (what ``TieredStore.open`` returns), and the small
interface it uses to report back to the store.

Owns: :class:`KVHandle` (per-layer reads, dequantised when the entry is stored compressed, into
the caller's dtype and device; the promotion buffer,
promotion on close) and :class:`HandleOwner` (the store's side: counting, turning a hit whose layer
cannot be read into a miss, discarding a damaged entry, promotion). The handle knows nothing of the
store's tiers, locks or counters. Reading layers ahead in a background thread is the blend's job
(``ragcache.blend.forward``), not the handle's.
Imports only the entry, codec and format modules; must not import vLLM, the store, nor anything
above kvstore.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from ragcache.kvstore.codec import StoredEntry, StoredLayer, decode_layer
from ragcache.kvstore.entry import CorruptEntryError, KVMeta, StoredKV, TierError
from ragcache.kvstore.format import EntryReader


class HandleOwner(Protocol):
    """What a :class:`KVHandle` needs from the store that opened it (``TieredStore`` implements it).

    A tier is named by its position ``pos`` in the store, top-down.

    Attributes:
        device: where the handle returns tensors.
        spec_dtype: dtype the handle returns tensors in.
    """

    device: torch.device

    @property
    def spec_dtype(self) -> torch.dtype: ...

    def should_promote(self, pos: int, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` (as stored) read from tier ``pos`` is to be promoted
        into the top memory tier once it was read completely."""
        ...

    def record_read(self, pos: int, key: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``key`` read from tier ``pos``."""
        ...

    def read_failed(self, pos: int, key: str, exc: Exception, head: bool = False) -> None:
        """A layer of ``key`` in tier ``pos`` could not be read: ``exc`` is a
        ``CorruptEntryError`` (failed its checksum: delete the entry and count it) or an
        ``OSError``. The lookup the handle served (the prompt head's when ``head``) is a miss
        after all: the hit counted when the handle was opened is taken back."""
        ...

    def promote(self, pos: int, item: StoredKV) -> None:
        """Put ``item``, read completely from tier ``pos``, into the top memory tier."""
        ...


class KVHandle:
    """An open entry for pipelined per-layer loading (``TieredStore.open``).

    Args:
        owner: the store that opened it.
        pos: position of the tier serving it in the store.
        reader: the tier's reader over the entry (header and metadata already validated).
        tier: name of that tier.
        from_memory: the tier is a memory tier (its layers are views of the stored tensor).
        head: the handle serves the prompt head's lookup (counted apart by the owner).

    Attributes:
        key: the entry's key.
        tier: name of the tier serving it.
        meta: its metadata (``meta.dtype`` and ``meta.compression`` say how it is stored).

    Read layers in any order with :meth:`layer`, then :meth:`close` (or use ``with``). When the
    handle came from a tier below the top memory tier and every layer was read, ``close``
    promotes the entry. Not thread-safe: one handle per consumer.
    """

    def __init__(self, owner: HandleOwner, pos: int, reader: EntryReader, tier: str, from_memory: bool,
                 head: bool = False) -> None:
        self._owner = owner
        self._pos = pos
        self._head = head
        self._reader: EntryReader | None = reader
        self._from_memory = from_memory
        self.key = reader.key
        self.meta: KVMeta = reader.meta
        self.tier = tier
        self._read = [False] * self.meta.num_layers
        self._parts = self.meta.parts
        self._promote = owner.should_promote(pos, self.meta.nbytes)
        # a persistent tier's layers are read straight into the buffer promotion will keep
        self._buf = (
            torch.empty(self.meta.kv_shape, dtype=self.meta.record_dtype)
            if self._promote and not from_memory
            else None
        )

    @property
    def num_layers(self) -> int:
        return self.meta.num_layers

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer ``i``, each ``[num_tokens, num_kv_heads, head_dim]`` in the spec's dtype
        on the store's device (the caller's own copies). A quantised entry's layer travels to the
        device compressed and is dequantised there (:func:`ragcache.kvstore.codec.decode_layer`):
        only this layer, so reading ahead layer by layer still overlaps with compute.

        Raises: as :meth:`stored_layer`.
        """
        stored = self.stored_layer(i)
        owned = self._buf is None and not self._from_memory
        return decode_layer(stored.form, stored.parts, stored.record, self._owner.spec_dtype, self._owner.device,
                            copy=not owned)

    def stored_layer(self, i: int) -> StoredLayer:
        """Layer ``i`` as stored, read and checked but not dequantised (for
        :func:`ragcache.kvstore.codec.decode_layers`, which decodes a layer of many entries at once):
        a view of a memory tier's entry or of the promotion buffer, never to be modified.

        Raises:
            CorruptEntryError: the layer failed its checksum; the entry has been deleted from
                the tier and counted, the lookup counts as a miss, and the handle cannot be used
                further (recompute the chunk).
            TierError: the tier failed while reading (e.g. an I/O error); counted likewise.
            IndexError: ``i`` out of range.
            RuntimeError: the handle is closed.
        """
        reader = self._open_reader()
        out = self._buf[i] if self._buf is not None else None
        t = self._reading(lambda: reader.read_layer(i, out), f"layer {i} of ")
        self._read[i] = True
        self._owner.record_read(self._pos, self.key, self.meta.layer_nbytes)
        return StoredLayer(self.meta.compression, self._parts, t)

    def stored_entry(self) -> StoredEntry:
        """Every layer as stored, read whole and checked but not dequantised (for
        :func:`ragcache.kvstore.codec.decode_entries`, which decodes many entries at once): a memory
        tier's entry itself, or the buffer promotion keeps; never to be modified. Counts as reading
        every layer (``close`` then promotes).

        Raises: as :meth:`stored_layer` (any layer's checksum).
        """
        reader = self._open_reader()
        t = self._reading(reader.read_all, "")
        if self._buf is not None:
            self._buf = t  # the entry as read is what promotion keeps
        self._read = [True] * self.meta.num_layers
        self._owner.record_read(self._pos, self.key, self.meta.layer_nbytes * self.meta.num_layers)
        return StoredEntry(self.meta.compression, self._parts, t)

    def _open_reader(self) -> EntryReader:
        if self._reader is None:
            raise RuntimeError("KVHandle is closed")
        return self._reader

    def _reading(self, read: Callable[[], torch.Tensor], what: str) -> torch.Tensor:
        """``read()``; a damaged entry or a failing tier is reported to the owner and closes the
        handle (CorruptEntryError as is, OSError as TierError naming ``what`` and the key)."""
        try:
            return read()
        except CorruptEntryError as exc:
            self._owner.read_failed(self._pos, self.key, exc, self._head)
            self.close()
            raise
        except OSError as exc:
            self._owner.read_failed(self._pos, self.key, exc, self._head)
            self.close()
            raise TierError(f"reading {what}{self.key!r} from {self.tier}: {exc}") from exc

    def close(self) -> None:
        """Release the reader; promote the entry if it was read completely. Idempotent."""
        reader, self._reader = self._reader, None
        if reader is None:
            return
        try:
            if self._promote and all(self._read):
                kv = self._buf if self._buf is not None else reader.read_all()
                self._owner.promote(self._pos, StoredKV(self.key, self.meta, kv))
        finally:
            reader.close()
            self._buf = None

    def __enter__(self) -> "KVHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
