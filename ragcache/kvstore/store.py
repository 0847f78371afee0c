"""TieredStore: the policy over the tiers (device -> cpu -> disk -> remote).

Owns: where an entry goes on ``put`` (write-through), where ``get``/``open`` look and what they
promote, capacities and eviction (LRU/LFU), demotion of evicted entries, foreign/corrupt handling.
Built from: the tiers, plain media known only through the Tier protocol
(:mod:`~ragcache.kvstore.tier`; which ones a settings section asks for:
:mod:`~ragcache.kvstore.configure`); per tier a slot with its index, counters and single-tier
steps (:mod:`~ragcache.kvstore.slot`) and an availability guard (:mod:`~ragcache.kvstore.guard`:
back-off of an unreachable tier); the counters and hit-rate log (:mod:`~ragcache.kvstore.stats`,
:mod:`~ragcache.kvstore.ledger`); verification (:mod:`~ragcache.kvstore.verify`); the handles ``open`` returns
(:mod:`~ragcache.kvstore.handle`). Must not import vLLM, nor anything above kvstore.

Policy in one place:

- ``put`` writes the entry into the top memory tier (``device`` if present, else ``cpu``) and
  through to every persistent tier (``disk``, ``remote``).
- ``get``/``open`` search the tiers top-down; a hit below the top memory tier is promoted into it
  (memory tiers are exclusive: an entry promoted from ``cpu`` to ``device`` leaves ``cpu``;
  persistent tiers keep their copy).
- A tier over capacity evicts (``lru`` or ``lfu``); an evicted entry is demoted to the next tier
  down when it is not already there (``device`` -> ``cpu`` -> ``disk`` -> ``remote``).
- Damaged entries (bad header, truncated, checksum mismatch, a NaN or infinity among their
  scales or uncompressed K/V) are deleted, counted under ``corrupt`` (one warning each) and
  treated as misses. A persistent tier's entry is checked as it is read (its bytes can change
  outside this process); the memory tiers hold only what ``put`` accepted (it refuses non-finite
  K/V) or a checked read returned, and nothing changes them in place. Entries of another
  model/layout or stored form (``kv_compression``), or of a format this version does not read, are
  counted under ``foreign`` (one warning per tier and kind of difference), left in place and
  treated as misses. Neither is ever returned.
- Lookups are counted once each, as :mod:`~ragcache.kvstore.stats` defines them (the prompt
  head's apart; a handle whose layer turns out damaged turns its hit into a miss; keys in a
  private namespace, :func:`ragcache.chunks.is_private_key`, not at all), in a ledger
  whose totals across processes live in a counter file beside the disk tier
  (:mod:`~ragcache.kvstore.ledger`).
- Room: a tier's capacity is its setting, but for ``disk`` no more than the filesystem can hold
  (what the tier holds plus the free space; one warning at start when that is below the setting). An entry that cannot fit even with every other entry
  evicted is not stored (counted under ``not_stored``, one warning) and evicts nothing; one that
  fits after evictions evicts just enough first. A write that still fails with ENOSPC rescans,
  evicts if that can make room, and retries once. ``remote`` unreachable: the tier is marked down
  (one warning), skipped, and retried after a back-off that grows from ``remote_backoff_sec`` to
  ``remote_backoff_max_sec``. No storage failure raises out of
  ``get``/``put``/``contains``/``open``/``delete``.

Thread safety: one re-entrant lock, shared by the slots, guards the policy state, the memory tiers
and the counters (each guard has its own); disk and Redis I/O runs outside it. Several processes
may share the disk folder and Redis; the disk capacity is enforced by each process on the files it
knows (rescanned when it must evict), so with several writers it is approximate.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ragcache.chunks import is_private_key
from ragcache.config import StoreSettings
from ragcache.kvstore.configure import GB, tiers_from_settings
from ragcache.kvstore.entry import (
    DTYPES,
    CorruptEntryError,
    ForeignEntryError,
    KVEntry,
    KVMeta,
    KVSpec,
    StoredKV,
    TierError,
    check_key,
    dtype_name,
)
from ragcache.kvstore.codec import SCALE_DTYPE, all_finite, check_form, decode_all, encode, layer_parts
from ragcache.kvstore.format import EntryReader, checksums
from ragcache.kvstore.guard import TierDown, TierGuard
from ragcache.kvstore.handle import KVHandle
from ragcache.kvstore.ledger import COUNTER_FILE, CounterFile, Ledger
from ragcache.kvstore.policy import Victim
from ragcache.kvstore.slot import TierSlot
from ragcache.kvstore.stats import HitRateLog, hit_rate_line, stats_row
from ragcache.kvstore.tier import Tier
from ragcache.kvstore.verify import verify_tier

__all__ = ["GB", "TieredStore"]

_RESCAN_SEC = 30.0  # a bounded persistent tier over capacity rescans at most this often


class TieredStore:
    """Chunk KV entries across tiers, with write-through, promotion, eviction and demotion.

    Args:
        spec: the model/layout whose entries this store serves; None opens the store for
            administration only (``stats``, ``verify``, ``clear``, ``delete``, ``contains``
            without the model check); ``put``/``get``/``open`` then raise RuntimeError.
        tiers: ``(tier, capacity_bytes)`` top-down, memory tiers first; capacity None = unbounded.
        device: where ``get``/``open`` return tensors.
        eviction_policy: "lru" or "lfu".
        kv_dtype: storage dtype of uncompressed entries: "model" (= ``spec.dtype``), "float16" or
            "bfloat16".
        kv_compression: the stored form, "none", "int8" or "int4" (:mod:`ragcache.kvstore.codec`):
            what ``put`` stores and the only form ``get``/``open``/``contains`` serve (an entry in
            another form is foreign: a miss, recomputed by the caller).
        hit_rate_log_interval: seconds between hit-rate log lines; None = no logging thread.
        remote_backoff_sec: first wait (seconds) before retrying a tier that was unreachable.
        remote_backoff_max_sec: longest wait between retries (the wait doubles up to it).
        counter_file: where counts are summed across processes (``from_settings``: beside the
            disk tier); None = this process only.

    Prefer :meth:`from_settings`.
    """

    def __init__(
        self,
        spec: KVSpec | None,
        tiers: Sequence[tuple[Tier, int | None]],
        *,
        device: torch.device | str = "cpu",
        eviction_policy: str = "lru",
        kv_dtype: str = "model",
        kv_compression: str = "none",
        hit_rate_log_interval: float | None = None,
        remote_backoff_sec: float = 2.0,
        remote_backoff_max_sec: float = 10.0,
        counter_file: Path | str | None = None,
    ) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.eviction_policy = eviction_policy
        if kv_dtype != "model" and kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be 'model', 'float16' or 'bfloat16', got {kv_dtype!r}")
        self.kv_dtype = kv_dtype
        self.kv_compression = check_form(kv_compression)
        if spec is not None:
            layer_parts(kv_compression, spec.dtype, 1, spec.num_kv_heads, spec.head_dim)  # int4: even head_dim
        self._lock = threading.RLock()
        self._slots = [
            TierSlot(tier, None if capacity is None else int(capacity), eviction_policy,
                     TierGuard(tier.name, remote_backoff_sec, remote_backoff_max_sec), self._lock)
            for tier, capacity in tiers
        ]
        names = [s.name for s in self._slots]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self._top = next((i for i, s in enumerate(self._slots) if s.tier.memory), None)
        self._ledger = Ledger([(s.name, s.counters) for s in self._slots], self._lock,
                              CounterFile(counter_file) if counter_file is not None else None)
        for slot in self._slots:
            if not slot.tier.memory:
                slot.probe()  # an unreachable tier is marked down before the first lookup
                if slot.guard.up:
                    slot.rescan()  # a bounded one learns what it already holds
                    if spec is not None:  # a store that serves KV (not one opened to administer it)
                        slot.warn_if_capped()
        self._logger = HitRateLog(self.hit_rate_line, hit_rate_log_interval) if hit_rate_log_interval else None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_settings(
        cls, settings: StoreSettings, spec: KVSpec | None, device: torch.device | str = "cpu", **kwargs: Any
    ) -> "TieredStore":
        """Store configured by ``settings`` (``ragcache.config.StoreSettings``).

        Tiers as :func:`ragcache.kvstore.configure.tiers_from_settings` picks them: ``device``,
        ``cpu``, ``disk`` and ``remote`` by ``gpu_kv_pool_gb``, ``cpu_kv_pool_gb``,
        ``ssd_cache_max_gb`` (GB = 1e9 bytes) and ``remote_url``. With a disk tier, counts are
        summed across processes in ``ssd_cache_dir/.ragcache-counters.json``.

        Args:
            settings: the ``store`` section of :class:`ragcache.config.Settings`.
            spec: see :class:`TieredStore`.
            device: the engine's device.
            kwargs: passed to :class:`TieredStore` (e.g. ``remote_backoff_sec``).
        """
        device = torch.device(device)
        tiers = tiers_from_settings(settings, device)
        interval = settings.log_interval_sec if settings.enable_hit_rate_log else None
        kwargs.setdefault("hit_rate_log_interval", interval)
        disk = next((t for t, _ in tiers if t.name == "disk"), None)
        if disk is not None:
            kwargs.setdefault("counter_file", Path(disk.root) / COUNTER_FILE)
        return cls(spec, tiers, device=device, eviction_policy=settings.eviction_policy,
                   kv_dtype=settings.kv_dtype, kv_compression=settings.kv_compression, **kwargs)

    # ------------------------------------------------------------------ public API

    @property
    def tier_names(self) -> list[str]:
        """Names of the active tiers, top-down."""
        return [s.name for s in self._slots]

    @property
    def spec_dtype(self) -> torch.dtype:
        return self._spec().dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype uncompressed entries are stored in (``kv_dtype`` resolved against the spec)."""
        return self._spec().dtype if self.kv_dtype == "model" else DTYPES[self.kv_dtype]

    def mismatch(self, meta: KVMeta) -> str | None:
        """Why an entry with ``meta`` is not served here (another model, layout or stored form), or
        None when it is (:meth:`KVSpec.mismatch`); with no spec, every intact entry is served."""
        return None if self.spec is None else self.spec.mismatch(meta, self.kv_compression)

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor, start_position: int) -> tuple[str, ...]:
        """Store one chunk's KV: into the top memory tier and through to disk and remote.

        Args:
            key: ``str(ChunkKey)`` (1-160 characters from ``[A-Za-z0-9._:@+=/-]``).
            k: pre-RoPE keys ``[num_layers, num_tokens, num_kv_heads, head_dim]``, any float dtype
                (normally ``spec.dtype``), any device; quantised there when ``kv_compression`` asks.
            v: values, same shape.
            start_position: canonical position of the chunk's first token when its KV was computed.

        Storage failures (disk full, Redis down) are logged, counted and skipped; they never raise.

        Returns:
            the names of the tiers the entry was stored in, top-down (empty when none took it).

        Raises:
            ValueError: bad key, shapes that do not match the spec, a negative start_position, or
                non-finite K/V (whatever ``kv_compression``: no tier ever holds a NaN or infinity).
            RuntimeError: the store was opened without a spec.
        """
        spec = self._spec()
        check_key(key)
        num_tokens = spec.check_kv(k, v)
        if int(start_position) < 0:
            raise ValueError(f"start_position must be >= 0, got {start_position}")
        form = self.kv_compression
        kv, sdtype = self._encode(k, v)
        if form == "none" and not all_finite(kv):  # the quantised forms' encoder refuses them itself
            raise ValueError("KV holds non-finite values (NaN or infinity); not stored")
        meta = KVMeta(
            model_fingerprint=spec.model_fingerprint, layout_version=spec.layout_version,
            dtype=dtype_name(sdtype), num_layers=spec.num_layers, num_tokens=num_tokens,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            start_position=int(start_position), compression=form,
        )
        meta = replace(meta, checksums=checksums(meta, kv))
        item = StoredKV(key, meta, kv)
        stored = []
        if self._top is not None:
            with self._lock:  # memory tiers are exclusive: drop older copies below the top
                for slot in self._slots[self._top + 1:]:
                    if slot.tier.memory and slot.tier.delete(key):
                        slot.index.remove(key)
            if self._insert(self._top, item, freq=1):
                stored.append(self._slots[self._top].name)
        for pos, slot in enumerate(self._slots):
            if not slot.tier.memory and slot.guard.available() and self._insert(pos, item, freq=1):
                stored.append(slot.name)
        self._ledger.maybe_flush()
        return tuple(stored)

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as a read of them after :meth:`put` returns them: through the stored form
        (quantised and dequantised, or cast to ``kv_dtype``) into ``spec.dtype`` on the store's
        device; ``k``/``v`` themselves when the form keeps them as they are. So a chunk computed for
        a request is served exactly as its stored entry will be at the next hit.

        Args:
            k, v: ``[num_layers, T, num_kv_heads, head_dim]`` as handed to :meth:`put`.

        Raises:
            ValueError / RuntimeError: as :meth:`put`.
        """
        spec = self._spec()
        spec.check_kv(k, v)
        form = self.kv_compression
        if form == "none" and self.storage_dtype == spec.dtype == k.dtype == v.dtype \
                and k.device == v.device == self.device:
            return k, v
        kv, sdtype = self._encode(k, v)
        return decode_all(form, layer_parts(form, sdtype, *k.shape[1:]), kv, spec.dtype, self.device)

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """``(kv, dtype)``: K/V in this store's stored form (:func:`ragcache.kvstore.codec.encode`)
        and the float dtype its header names (the storage dtype uncompressed, the scales' quantised)."""
        sdtype = self.storage_dtype if self.kv_compression == "none" else SCALE_DTYPE
        return encode(k, v, self.kv_compression, sdtype), sdtype

    def get(self, key: str) -> tuple[KVEntry, str] | None:
        """The entry under ``key`` and the name of the tier that served it, or None (miss).

        One chunk lookup (see :mod:`~ragcache.kvstore.stats`). Searches the tiers top-down;
        promotes a hit below the top memory tier. Entries of another model/layout and damaged
        entries are never returned (counted, treated as misses; damaged ones are deleted and the
        search goes on in the lower tiers).

        Returns:
            ``(KVEntry, tier_name)``; the entry's ``k``/``v`` are
            ``[num_layers, num_tokens, num_kv_heads, head_dim]`` in ``spec.dtype`` on the store's
            device (dequantised when stored compressed), owned by the caller.

        Raises:
            ValueError: bad key.  RuntimeError: the store was opened without a spec.
        """
        for pos, reader in self._lookup(key):
            try:
                kv = reader.read_all()
            except CorruptEntryError as exc:
                self._slots[pos].discard_corrupt(key, exc)
                continue
            except OSError as exc:
                self._slots[pos].read_failed(key, exc)
                continue
            finally:
                reader.close()
            counted = _counted(key)
            self._slots[pos].record_hit(key, reader.stored_bytes, reader.meta.nbytes if counted else 0,
                                        chunk=counted)
            self._lookup_done(key, served=True)
            item = StoredKV(key, reader.meta, kv)
            meta = reader.meta
            entry = KVEntry(key, *decode_all(meta.compression, meta.parts, kv, self.spec_dtype, self.device), meta)
            if self.should_promote(pos, item.nbytes):
                self.promote(pos, item)
            return entry, self._slots[pos].name
        self._lookup_done(key, served=False)
        return None

    def open(self, key: str, *, head: bool = False) -> KVHandle | None:
        """A handle to read the entry layer by layer (for pipelined loading), or None (miss).

        One lookup: a chunk lookup, or with ``head`` the prompt head's (counted apart, see
        :mod:`~ragcache.kvstore.stats`). The header and metadata are checked here; each layer's
        checksum when it is read. The hit is counted now and turned into a miss if a layer cannot
        be read; the entry is promoted when the handle is closed after reading every layer.

        Raises:
            ValueError: bad key.  RuntimeError: the store was opened without a spec.
        """
        found = next(self._lookup(key, head), None)
        if found is None:
            self._lookup_done(key, served=False, head=head)
            return None
        pos, reader = found
        slot = self._slots[pos]
        slot.record_hit(key, reader.stored_bytes, 0, chunk=not head and _counted(key))
        self._lookup_done(key, served=True, head=head)
        return KVHandle(self, pos, reader, slot.name, slot.tier.memory, head=head)

    def contains(self, key: str) -> str | None:
        """Name of the highest tier holding a usable entry for ``key`` (header and model checked,
        tensors not read), or None. Counts no hit or miss; deletes an entry whose header is damaged.

        Raises:
            ValueError: bad key.
        """
        check_key(key)
        return next(self._holding(key), None)

    def holders(self, key: str) -> list[str]:
        """Names of every tier holding a usable entry for ``key`` now, top-down (checked as in
        :meth:`contains`; a tier that is down holds nothing). What an ingest really kept: an entry
        a tier took may have been evicted since by later ones.

        Raises:
            ValueError: bad key.
        """
        check_key(key)
        return list(self._holding(key))

    def _holding(self, key: str) -> Iterator[str]:
        for slot in self._slots:
            if not slot.guard.available():
                continue
            if slot.tier.memory:
                with self._lock:
                    if slot.tier.contains(key):
                        yield slot.name
                continue
            try:
                meta = slot.guard.call(slot.tier.head, key)
            except TierDown:
                continue
            except CorruptEntryError as exc:
                slot.discard_corrupt(key, exc)
                continue
            except (ForeignEntryError, TierError, OSError):
                continue
            if meta is not None and self.mismatch(meta) is None:
                yield slot.name

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier; True when any tier held it.

        Raises:
            ValueError: bad key.
        """
        check_key(key)
        removed = False
        for slot in self._slots:
            removed |= slot.delete(key)
        return removed

    def clear(self, namespace: str | None = None) -> None:
        """Remove every entry from every tier (the whole disk folder's entries and every Redis key
        under the tier's prefix, whichever model wrote them), or with ``namespace`` only the
        entries of that KV namespace and the namespaces below it (``ns:...`` and ``ns/...`` keys,
        see :func:`ragcache.chunks.kv_namespace`). Counters are kept."""
        prefixes = [""] if namespace is None else [f"{namespace}:", f"{namespace}/"]
        for slot in self._slots:
            if slot.tier.memory:
                with self._lock:
                    for prefix in prefixes:
                        slot.tier.clear(prefix)
                    slot.rescan()
                continue
            if not slot.guard.available():
                slot.guard.warn("clear", f"{slot.name} tier is down: not cleared")
                continue
            try:
                for prefix in prefixes:
                    slot.guard.call(slot.tier.clear, prefix)
            except TierDown:
                slot.guard.warn("clear", f"{slot.name} tier is down: not cleared")
            except (TierError, OSError) as exc:
                slot.guard.warn("clear", f"{slot.name} tier: clear failed ({exc})")
            slot.rescan()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier, top-down: ``{name: {hits, misses, lookups, hit_rate, unavailable, corrupt,
        foreign, read_errors, bytes_read, bytes_written, evictions, write_errors, not_stored,
        entries, occupancy_bytes, capacity_bytes, configured_capacity_bytes, free_bytes, up}}``.

        Counters are this process's since the store was created, as :mod:`~ragcache.kvstore.stats`
        defines them: ``lookups`` is the store's chunk lookups, ``hits + misses == lookups`` for
        every tier and ``hit_rate`` = hits / lookups, so the tiers' rates add up to the overall
        hit rate. ``entries`` and ``occupancy_bytes`` (bytes) describe what the tier holds now (for
        disk: the whole folder; for a down remote tier: 0); ``capacity_bytes`` is what it may hold
        now (for disk: no more than the filesystem allows), None for the unbounded remote tier;
        ``free_bytes`` is the medium's free space (None where it cannot tell).
        """
        out: dict[str, dict[str, Any]] = {}
        for slot in self._slots:
            usage = slot.usage()
            free = slot.free_bytes()
            capacity = slot.effective_capacity(usage.bytes)
            with self._lock:
                out[slot.name] = stats_row(slot.counters, self._ledger.lookups.lookups, usage, capacity,
                                           slot.guard.up, configured_capacity_bytes=slot.capacity, free_bytes=free)
        return out

    @property
    def ledger(self) -> Ledger:
        """The lookup counters: ``ledger.summary()`` (this process), ``ledger.cumulative()`` (every
        process that used the disk folder), ``ledger.reset()`` (see :mod:`~ragcache.kvstore.ledger`)."""
        return self._ledger

    def namespaces(self) -> dict[str, dict[str, int]]:
        """Entries per KV namespace in each persistent tier that is up: ``{tier: {namespace:
        entries}}`` (keys without a namespace under ""; see :class:`ragcache.chunks.ChunkKey`)."""
        out: dict[str, dict[str, int]] = {}
        for slot in self._slots:
            if slot.tier.memory or not slot.guard.available():
                continue
            try:
                keys = slot.guard.call(slot.tier.keys)
            except (TierDown, TierError, OSError):
                continue
            counts = out.setdefault(slot.name, {})
            for key in keys:
                ns = key.rsplit(":", 1)[0] if ":" in key else ""
                counts[ns] = counts.get(ns, 0) + 1
        return out

    def footprint(self, sample: int = 1000) -> dict[str, dict[str, Any]]:
        """What the entries of each tier that is up cost per token, from their headers.

        Reads the header (not the tensors) of at most ``sample`` entries per tier, spread evenly
        over the tier's listing (a memory tier: its entries as they are).

        Returns:
            ``{tier: {"entries", "bytes", "sampled", "tokens", "bytes_per_token", "forms"}}``:
            ``entries``/``bytes`` as the tier holds them now; ``sampled`` entries whose header could
            be read, with ``tokens`` in them and ``bytes_per_token`` = their bytes (header, values
            and scales) / their tokens (None without any); ``forms``: sampled entries per stored
            form (``{"int8": 70, "none": 7}``).
        """
        out: dict[str, dict[str, Any]] = {}
        for slot in self._slots:
            if not slot.guard.available():
                continue
            try:
                listed = slot.guard.call(slot.tier.scan) if not slot.tier.memory else slot.tier.scan()
            except (TierDown, TierError, OSError):
                continue
            picked = listed[:: max(1, -(-len(listed) // sample))] if sample > 0 else []
            sampled = tokens = nbytes = 0
            forms: dict[str, int] = {}
            for stat in picked:
                try:
                    meta = slot.guard.call(slot.tier.head, stat.key) if not slot.tier.memory \
                        else slot.tier.head(stat.key)
                except (TierDown, TierError, OSError):
                    continue
                if meta is None:
                    continue
                sampled, tokens, nbytes = sampled + 1, tokens + meta.num_tokens, nbytes + stat.size
                forms[meta.compression] = forms.get(meta.compression, 0) + 1
            out[slot.name] = {"entries": len(listed), "bytes": sum(s.size for s in listed), "sampled": sampled,
                              "tokens": tokens, "bytes_per_token": round(nbytes / tokens, 1) if tokens else None,
                              "forms": forms}
        return out

    def hit_rate_line(self) -> str:
        """One line of hit rates that add up, e.g.
        ``4 lookups: cpu 50.0% (2) | disk 25.0% (1) | miss 25.0% (1); head 2/2``."""
        with self._lock:
            return hit_rate_line(self._ledger.lookups, [(s.name, s.counters, s.guard.up) for s in self._slots])

    def verify(self) -> dict[str, dict[str, Any]]:
        """Check every entry in the persistent tiers (header, size and every checksum) and delete
        the damaged ones. Entries of another model/layout/stored form are checked too, and kept when
        intact.

        Returns:
            ``{tier: {"checked", "ok", "foreign", "corrupt", "removed": [keys], "damage": {key: what},
            "up"}}``, where
            ``ok`` counts intact entries of this store's spec and form (all intact ones without a
            spec) and ``foreign`` intact entries of another model, layout, stored form or format
            (see :func:`ragcache.kvstore.verify.verify_tier`).
        """
        return {
            slot.name: verify_tier(slot.tier, slot.guard, self.mismatch, slot.discard_corrupt)
            for slot in self._slots
            if not slot.tier.memory
        }

    def close(self) -> None:
        """Stop the hit-rate logger and release the tiers (memory tiers are emptied)."""
        if self._logger is not None:
            self._logger.stop()
            self._logger = None
        self._ledger.flush()
        for slot in self._slots:
            try:
                slot.tier.close()
            except Exception:  # closing must not fail the caller
                pass

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ what handles call back (HandleOwner)

    def should_promote(self, pos: int, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` (as stored) found in tier ``pos`` (top-down position)
        goes into the top memory tier: it is below that tier and fits its capacity."""
        top = self._top
        if top is None or pos == top:
            return False
        cap = self._slots[top].capacity
        return cap is None or nbytes <= cap

    def record_read(self, pos: int, key: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``key`` read from tier ``pos`` (a handle's layer)."""
        if _counted(key):
            self._slots[pos].count(bytes_read=nbytes)

    def read_failed(self, pos: int, key: str, exc: Exception, head: bool = False) -> None:
        """A layer of ``key`` read through a handle from tier ``pos`` failed: the lookup the handle
        served becomes a miss; a damaged entry (``CorruptEntryError``) is deleted and counted under
        ``corrupt``, an I/O error under ``read_errors``."""
        slot = self._slots[pos]
        if isinstance(exc, CorruptEntryError):
            slot.discard_corrupt(key, exc)
        else:
            slot.read_failed(key, exc)
        if _counted(key):
            self._ledger.retract_hit(slot.name, head)

    def promote(self, pos: int, item: StoredKV) -> None:
        """Copy (persistent source) or move (memory source) ``item``, found in tier ``pos``, into
        the top memory tier (evicting and demoting there as needed). Call only when
        :meth:`should_promote` said so."""
        src = self._slots[pos]
        with self._lock:
            freq = src.index.freq(item.key) if src.index is not None else 1
            if src.tier.memory:
                src.tier.delete(item.key)
                src.index.remove(item.key)
        self._insert(self._top, item, max(freq, 1))

    # ------------------------------------------------------------------ policy internals

    def _spec(self) -> KVSpec:
        if self.spec is None:
            raise RuntimeError("this TieredStore was opened without a KVSpec (administration only)")
        return self.spec

    def _lookup(self, key: str, head: bool = False) -> Iterator[tuple[int, EntryReader]]:
        """The lookup loop of ``get`` and ``open``: top-down, every available tier that holds a
        usable entry under ``key`` (header valid, this spec's model and layout, this stored form), as
        ``(tier position, open reader)``.

        Foreign and damaged entries found on the way are counted (and damaged ones deleted) here,
        and so is a counted chunk lookup (not ``head``) that reaches a tier while it is down
        (``unavailable``); the caller counts the lookup (:meth:`_lookup_done`) and the hit
        (``TierSlot.record_hit``) or the failure of its own read, closes the reader, and stops at
        the first entry it keeps.

        Raises (at the first ``next``):
            ValueError: bad key.  RuntimeError: the store was opened without a spec.
        """
        self._spec()
        check_key(key)
        for pos, slot in enumerate(self._slots):
            if slot.guard.available():
                reader = slot.open_checked(key, self.mismatch)
                if reader is not None:
                    yield pos, reader
                    continue
            if not slot.guard.up and not head and _counted(key):
                slot.count(unavailable=1)

    def _lookup_done(self, key: str, served: bool, head: bool = False) -> None:
        if _counted(key):
            self._ledger.lookup(served, head)
            self._ledger.maybe_flush()

    def _insert(self, pos: int, item: StoredKV, freq: int) -> bool:
        """Put ``item`` into tier ``pos``, evict over capacity, demote the victims. True if stored."""
        slot = self._slots[pos]
        if slot.tier.memory:
            if slot.capacity is not None and item.nbytes > slot.capacity:
                slot.not_stored(item.key, item.nbytes, f"(capacity {slot.capacity / 1e6:.1f} MB) is too small")
                return False  # can never fit this tier
            with self._lock:
                try:
                    written = slot.tier.put(item)
                except RuntimeError as exc:  # e.g. torch.OutOfMemoryError on the device
                    slot.counters.write_errors += 1
                    slot.guard.warn("write", f"{slot.name} tier: cannot keep {item.key!r} ({exc}); skipped")
                    return False
                slot.index.add(item.key, written, freq)
                slot.counters.bytes_written += written if _counted(item.key) else 0
                victims = (slot.index.pop_victims(slot.capacity, protect=item.key)
                           if slot.capacity is not None else [])
                evicted = [(slot.tier.pop(v.key), v) for v in victims]
                slot.counters.evictions += len(victims)
            for victim_item, victim in evicted:
                if victim_item is not None:
                    self._demote(pos, victim_item, victim.freq)
            return True
        written = slot.write(item, lambda victims: self._drop_persistent(pos, victims))
        if written is None:
            return False
        stale = False
        with self._lock:
            slot.counters.bytes_written += written if _counted(item.key) else 0
            if slot.index is not None and slot.capacity is not None:
                slot.index.add(item.key, written, freq)
                over = slot.index.used_bytes > slot.capacity
                stale = over and time.monotonic() - slot.last_scan > _RESCAN_SEC
        if stale:
            slot.rescan()  # other processes may have added or removed entries
        victims: list[Victim] = []
        with self._lock:
            if slot.index is not None and slot.capacity is not None:
                victims = slot.index.pop_victims(slot.capacity, protect=item.key)
        self._drop_persistent(pos, victims)
        return True

    def _demotion_target(self, pos: int, key: str) -> int | None:
        """Where ``key``, evicted from tier ``pos``, is demoted to: the next tier down when it is
        available and does not hold ``key`` already; else None."""
        below = pos + 1
        if below >= len(self._slots):
            return None
        slot = self._slots[below]
        if not slot.guard.available() or slot.holds(key):
            return None
        return below

    def _demote(self, pos: int, item: StoredKV, freq: int) -> None:
        """Move an entry evicted from tier ``pos`` into the next tier down unless already there."""
        below = self._demotion_target(pos, item.key)
        if below is not None:
            self._insert(below, item, freq)

    def _drop_persistent(self, pos: int, victims: list[Victim]) -> None:
        """Delete evicted files/values of tier ``pos``, demoting each first when needed."""
        slot = self._slots[pos]
        for victim in victims:
            below = self._demotion_target(pos, victim.key)
            if below is not None:
                try:
                    item = slot.tier.get(victim.key)
                except CorruptEntryError as exc:
                    slot.discard_corrupt(victim.key, exc)
                    continue
                except (ForeignEntryError, TierError, OSError):
                    item = None
                if item is not None:  # any intact entry, also another model's
                    self._insert(below, item, victim.freq)
            try:
                slot.tier.delete(victim.key)
            except (TierError, OSError) as exc:
                slot.guard.warn("delete", f"{slot.name} tier: evicting {victim.key!r} failed ({exc})")
            slot.count(evictions=1)


def _counted(key: str) -> bool:
    """Whether lookups, reads and writes of ``key`` count (not a private namespace's key: the
    start-up self-check's KV is ragcache's own traffic, not the users')."""
    return not is_private_key(key)
