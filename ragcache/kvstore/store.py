"""TieredStore: the policy over the tiers (device -> cpu -> disk -> remote) and its statistics.

Owns: where an entry goes on ``put`` (write-through), where ``get``/``open`` look and what they
promote, capacities and eviction (LRU/LFU), demotion of evicted entries, foreign/corrupt handling,
the Redis back-off, per-tier statistics and the periodic hit-rate log line. The tiers themselves
are plain media (see :mod:`ragcache.kvstore.tier`). Must not import vLLM.

Policy in one place:

- ``put`` writes the entry into the top memory tier (``device`` if present, else ``cpu``) and
  through to every persistent tier (``disk``, ``remote``).
- ``get``/``open`` search the tiers top-down; a hit below the top memory tier is promoted into it
  (memory tiers are exclusive: an entry promoted from ``cpu`` to ``device`` leaves ``cpu``;
  persistent tiers keep their copy).
- A tier over capacity evicts (``lru`` or ``lfu``); an evicted entry is demoted to the next tier
  down when it is not already there (``device`` -> ``cpu`` -> ``disk`` -> ``remote``).
- Damaged entries (bad header, truncated, checksum mismatch) are deleted, counted under
  ``corrupt`` and treated as misses; entries of another model/layout are counted under
  ``foreign``, left in place and treated as misses. Neither is ever returned.
- ``disk`` full (ENOSPC): evict, retry once, else skip the write with a warning. ``remote``
  unreachable: the tier is marked down (one warning), skipped, and retried after a back-off that
  grows from ``remote_backoff_sec`` to ``remote_backoff_max_sec``. No storage failure raises out
  of ``get``/``put``/``contains``/``open``/``delete``.

Thread safety: one re-entrant lock guards the policy state, the memory tiers and the counters;
disk and Redis I/O runs outside it. Several processes may share the disk folder and Redis; the
disk capacity is enforced by each process on the files it knows (rescanned when it must evict),
so with several writers it is approximate.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch

from ragcache.config import StoreSettings
from ragcache.kvstore.cpu import CpuTier
from ragcache.kvstore.device import DeviceTier
from ragcache.kvstore.disk import DiskTier
from ragcache.kvstore.entry import (
    DTYPES,
    CorruptEntryError,
    ForeignEntryError,
    KVEntry,
    KVMeta,
    KVSpec,
    StoredKV,
    TierError,
    TierUnavailableError,
    check_key,
    dtype_name,
)
from ragcache.kvstore.format import EntryReader, checksums
from ragcache.kvstore.policy import EvictionIndex, Victim
from ragcache.kvstore.remote import RedisTier
from ragcache.kvstore.tier import Tier, TierUsage

log = logging.getLogger("ragcache.kvstore")

GB = 10**9  # settings sizes are decimal gigabytes
T = TypeVar("T")
_WARN_EVERY_SEC = 60.0
_RESCAN_SEC = 30.0  # a bounded persistent tier over capacity rescans at most this often


class _Down(Exception):
    """Internal: the tier is unavailable (already marked down)."""


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    corrupt: int = 0
    foreign: int = 0
    write_errors: int = 0


@dataclass
class _Slot:
    tier: Tier
    capacity: int | None  # bytes; None = unbounded (remote: sized by Redis itself)
    index: EvictionIndex | None
    counters: _Counters = field(default_factory=_Counters)
    up: bool = True
    retry_at: float = 0.0
    backoff: float = 0.0
    last_scan: float = 0.0
    last_warn: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.tier.name


class KVHandle:
    """An open entry for pipelined per-layer loading (``TieredStore.open``).

    Attributes:
        key: the entry's key.
        tier: name of the tier serving it.
        meta: its metadata (``meta.dtype`` is the storage dtype).

    Read layers in any order with :meth:`layer`, or in order with read-ahead with
    :meth:`iter_layers`; then :meth:`close` (or use ``with``). When the
    handle came from a tier below the top memory tier and every layer was read, ``close``
    promotes the entry. Not thread-safe: one handle per consumer.
    """

    def __init__(self, store: "TieredStore", pos: int, reader: EntryReader) -> None:
        self._store = store
        self._pos = pos
        self._reader: EntryReader | None = reader
        self.key = reader.key
        self.meta: KVMeta = reader.meta
        self.tier: str = store._slots[pos].name
        self._read = [False] * self.meta.num_layers
        self._promote = store._should_promote(pos, self.meta.nbytes)
        # a persistent tier's layers are read straight into the buffer promotion will keep
        self._buf = (
            torch.empty(self.meta.kv_shape, dtype=self.meta.torch_dtype)
            if self._promote and not store._slots[pos].tier.memory
            else None
        )

    @property
    def num_layers(self) -> int:
        return self.meta.num_layers

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer ``i``, each ``[num_tokens, num_kv_heads, head_dim]`` in the spec's dtype
        on the store's device (the caller's own copies).

        Raises:
            CorruptEntryError: the layer failed its checksum; the entry has been deleted from
                the tier and counted, and the handle cannot be used further (recompute the chunk).
            TierError: the tier failed while reading (e.g. an I/O error).
            IndexError: ``i`` out of range.
            RuntimeError: the handle is closed.
        """
        if self._reader is None:
            raise RuntimeError("KVHandle is closed")
        store = self._store
        out = self._buf[i] if self._buf is not None else None
        try:
            t = self._reader.read_layer(i, out)
        except CorruptEntryError as exc:
            store._on_corrupt(self._pos, self.key, exc, count_miss=False)
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise TierError(f"reading layer {i} of {self.key!r} from {self.tier}: {exc}") from exc
        self._read[i] = True
        store._count(self._pos, bytes_read=2 * self.meta.tensor_nbytes)
        # a memory tier's layer is a view of the stored entry, the promotion buffer is kept: copy those;
        # a layer read into a fresh tensor is already the caller's own
        owned = self._buf is None and not store._slots[self._pos].tier.memory
        kv = t.to(device=store.device, dtype=store.spec_dtype, copy=not owned, non_blocking=store._async_copy)
        return kv[0], kv[1]

    def iter_layers(self, prefetch: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(k, v)`` of layers 0, 1, ... in order (shapes as :meth:`layer`), reading up to
        ``prefetch`` layers ahead on a background thread, so loading layer i+1 overlaps the
        caller's work on layer i (file reads, checksums and copies release the GIL).
        ``prefetch=0`` reads in the caller's thread.

        Raises:
            CorruptEntryError, TierError, RuntimeError: as :meth:`layer`, when the layer is reached.
        """
        n = self.meta.num_layers
        if prefetch <= 0:
            for i in range(n):
                yield self.layer(i)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragcache-kv-prefetch") as pool:
            pending: deque[Future] = deque()
            for i in range(n):
                while len(pending) <= prefetch and i + len(pending) < n:
                    pending.append(pool.submit(self.layer, i + len(pending)))
                yield pending.popleft().result()

    def close(self) -> None:
        """Release the reader; promote the entry if it was read completely. Idempotent."""
        reader, self._reader = self._reader, None
        if reader is None:
            return
        try:
            if self._promote and all(self._read):
                kv = self._buf if self._buf is not None else reader.read_all()
                self._store._promote(self._pos, StoredKV(self.key, self.meta, kv))
        finally:
            reader.close()
            self._buf = None

    def __enter__(self) -> "KVHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TieredStore:
    """Chunk KV entries across tiers, with write-through, promotion, eviction and demotion.

    Args:
        spec: the model/layout whose entries this store serves; None opens the store for
            administration only (``stats``, ``verify``, ``clear``, ``delete``, ``contains``
            without the model check); ``put``/``get``/``open`` then raise RuntimeError.
        tiers: ``(tier, capacity_bytes)`` top-down, memory tiers first; capacity None = unbounded.
        device: where ``get``/``open`` return tensors.
        eviction_policy: "lru" or "lfu".
        kv_dtype: storage dtype: "model" (= ``spec.dtype``), "float16" or "bfloat16".
        hit_rate_log_interval: seconds between hit-rate log lines; None = no logging thread.
        remote_backoff_sec: first wait (seconds) before retrying a tier that was unreachable.
        remote_backoff_max_sec: longest wait between retries (the wait doubles up to it).

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
        hit_rate_log_interval: float | None = None,
        remote_backoff_sec: float = 2.0,
        remote_backoff_max_sec: float = 10.0,
    ) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.eviction_policy = eviction_policy
        if kv_dtype != "model" and kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be 'model', 'float16' or 'bfloat16', got {kv_dtype!r}")
        self.kv_dtype = kv_dtype
        self._backoff = (float(remote_backoff_sec), float(remote_backoff_max_sec))
        self._lock = threading.RLock()
        self._slots: list[_Slot] = []
        for tier, capacity in tiers:
            bounded = capacity is not None
            self._slots.append(_Slot(tier, int(capacity) if bounded else None,
                                     EvictionIndex(eviction_policy) if bounded or tier.memory else None,
                                     backoff=self._backoff[0]))
        names = [s.name for s in self._slots]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self._top = next((i for i, s in enumerate(self._slots) if s.tier.memory), None)
        self._async_copy = self.device.type != "cpu"
        for pos, slot in enumerate(self._slots):
            if not slot.tier.memory:
                self._probe(pos)  # an unreachable tier is marked down before the first lookup
                if slot.up:
                    self._rescan(pos)  # a bounded one learns what it already holds
        self._stop = threading.Event()
        self._logger: threading.Thread | None = None
        if hit_rate_log_interval:
            self._logger = threading.Thread(
                target=self._log_loop, args=(float(hit_rate_log_interval),),
                name="ragcache-kvstore-hit-rates", daemon=True,
            )
            self._logger.start()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_settings(
        cls, settings: StoreSettings, spec: KVSpec | None, device: torch.device | str = "cpu", **kwargs: Any
    ) -> "TieredStore":
        """Store configured by ``settings`` (``ragcache.config.StoreSettings``).

        Tiers: ``device`` when ``device`` is not the CPU and ``gpu_kv_pool_gb`` > 0; ``cpu`` when
        ``cpu_kv_pool_gb`` > 0 (pinned when ``device`` is CUDA); ``disk`` at ``ssd_cache_dir``
        when ``ssd_cache_max_gb`` > 0; ``remote`` when ``remote_url`` is set. Sizes are GB = 1e9
        bytes. A disk folder that cannot be created turns the disk tier off with a warning.

        Args:
            settings: the ``store`` section of :class:`ragcache.config.Settings`.
            spec: see :class:`TieredStore`.
            device: the engine's device.
            kwargs: passed to :class:`TieredStore` (e.g. ``remote_backoff_sec``).
        """
        device = torch.device(device)
        tiers: list[tuple[Tier, int | None]] = []
        if device.type != "cpu" and settings.gpu_kv_pool_gb > 0:
            tiers.append((DeviceTier(device), int(settings.gpu_kv_pool_gb * GB)))
        if settings.cpu_kv_pool_gb > 0:
            tiers.append((CpuTier(pin_memory=device.type == "cuda"), int(settings.cpu_kv_pool_gb * GB)))
        if settings.ssd_cache_max_gb > 0:
            try:
                tiers.append((DiskTier(settings.ssd_cache_dir), int(settings.ssd_cache_max_gb * GB)))
            except OSError as exc:
                log.warning("disk tier off: cannot use %s (%s); set store.ssd_cache_dir", settings.ssd_cache_dir, exc)
        if settings.remote_url:
            tiers.append((RedisTier(settings.remote_url), None))
        interval = settings.log_interval_sec if settings.enable_hit_rate_log else None
        kwargs.setdefault("hit_rate_log_interval", interval)
        return cls(spec, tiers, device=device, eviction_policy=settings.eviction_policy,
                   kv_dtype=settings.kv_dtype, **kwargs)

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
        """dtype entries are stored in (``kv_dtype`` resolved against the spec)."""
        return self._spec().dtype if self.kv_dtype == "model" else DTYPES[self.kv_dtype]

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor, start_position: int) -> None:
        """Store one chunk's KV: into the top memory tier and through to disk and remote.

        Args:
            key: ``str(ChunkKey)`` (1-80 characters from ``[A-Za-z0-9._:@+=/-]``).
            k: pre-RoPE keys ``[num_layers, num_tokens, num_kv_heads, head_dim]``, any float dtype
                (normally ``spec.dtype``), any device.
            v: values, same shape.
            start_position: canonical position of the chunk's first token when its KV was computed.

        Storage failures (disk full, Redis down) are logged, counted and skipped; they never raise.

        Raises:
            ValueError: bad key, shapes that do not match the spec, or a negative start_position.
            RuntimeError: the store was opened without a spec.
        """
        spec = self._spec()
        check_key(key)
        num_tokens = spec.check_kv(k, v)
        if int(start_position) < 0:
            raise ValueError(f"start_position must be >= 0, got {start_position}")
        sdtype = self.storage_dtype
        kv = torch.stack([k.detach(), v.detach()], dim=1).to(device="cpu", dtype=sdtype).contiguous()
        meta = KVMeta(
            model_fingerprint=spec.model_fingerprint, layout_version=spec.layout_version,
            dtype=dtype_name(sdtype), num_layers=spec.num_layers, num_tokens=num_tokens,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            start_position=int(start_position), checksums=checksums(kv),
        )
        item = StoredKV(key, meta, kv)
        if self._top is not None:
            with self._lock:  # memory tiers are exclusive: drop older copies below the top
                for slot in self._slots[self._top + 1:]:
                    if slot.tier.memory and slot.tier.delete(key):
                        slot.index.remove(key)
            self._insert(self._top, item, freq=1)
        for pos, slot in enumerate(self._slots):
            if not slot.tier.memory and self._available(slot):
                self._insert(pos, item, freq=1)

    def get(self, key: str) -> tuple[KVEntry, str] | None:
        """The entry under ``key`` and the name of the tier that served it, or None (miss).

        Searches the tiers top-down; promotes a hit below the top memory tier. Entries of another
        model/layout and damaged entries are never returned (counted, treated as misses; damaged
        ones are deleted and the search goes on in the lower tiers).

        Returns:
            ``(KVEntry, tier_name)``; the entry's ``k``/``v`` are
            ``[num_layers, num_tokens, num_kv_heads, head_dim]`` in ``spec.dtype`` on the store's
            device, owned by the caller.

        Raises:
            ValueError: bad key.  RuntimeError: the store was opened without a spec.
        """
        spec = self._spec()
        check_key(key)
        for pos, slot in enumerate(self._slots):
            if not self._available(slot):
                continue
            reader = self._open_checked(pos, key, spec)
            if reader is None:
                continue
            try:
                kv = reader.read_all()
            except CorruptEntryError as exc:
                self._on_corrupt(pos, key, exc)
                continue
            except OSError as exc:
                self._warn(slot, "read", f"{slot.name} tier: reading {key!r} failed ({exc}); treated as a miss")
                self._count(pos, misses=1)
                continue
            finally:
                reader.close()
            self._on_hit(pos, key, reader.stored_bytes, reader.meta.nbytes)
            item = StoredKV(key, reader.meta, kv)
            entry = KVEntry(
                key,
                kv[:, 0].to(device=self.device, dtype=spec.dtype, copy=True).contiguous(),
                kv[:, 1].to(device=self.device, dtype=spec.dtype, copy=True).contiguous(),
                reader.meta,
            )
            if self._should_promote(pos, item.nbytes):
                self._promote(pos, item)
            return entry, slot.name
        return None

    def open(self, key: str) -> KVHandle | None:
        """A handle to read the entry layer by layer (for pipelined loading), or None (miss).

        The header and metadata are checked here; each layer's checksum when it is read. The hit
        is counted now; the entry is promoted when the handle is closed after reading every layer.

        Raises:
            ValueError: bad key.  RuntimeError: the store was opened without a spec.
        """
        spec = self._spec()
        check_key(key)
        for pos, slot in enumerate(self._slots):
            if not self._available(slot):
                continue
            reader = self._open_checked(pos, key, spec)
            if reader is None:
                continue
            self._on_hit(pos, key, reader.stored_bytes, 0)
            return KVHandle(self, pos, reader)
        return None

    def contains(self, key: str) -> str | None:
        """Name of the highest tier holding a usable entry for ``key`` (header and model checked,
        tensors not read), or None. Counts no hit or miss; deletes an entry whose header is damaged.

        Raises:
            ValueError: bad key.
        """
        check_key(key)
        for pos, slot in enumerate(self._slots):
            if not self._available(slot):
                continue
            if slot.tier.memory:
                with self._lock:
                    if slot.tier.contains(key):
                        return slot.name
                continue
            try:
                meta = self._call(slot, slot.tier.head, key)
            except _Down:
                continue
            except CorruptEntryError as exc:
                self._on_corrupt(pos, key, exc, count_miss=False)
                continue
            except (ForeignEntryError, TierError, OSError):
                continue
            if meta is not None and (self.spec is None or self.spec.mismatch(meta) is None):
                return slot.name
        return None

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier; True when any tier held it.

        Raises:
            ValueError: bad key.
        """
        check_key(key)
        removed = False
        for slot in self._slots:
            removed |= self._delete_from(slot, key)
        return removed

    def clear(self) -> None:
        """Remove every entry from every tier (the whole disk folder's entries and every Redis key
        under the tier's prefix, whichever model wrote them). Counters are kept."""
        for slot in self._slots:
            if slot.tier.memory:
                with self._lock:
                    slot.tier.clear()
                    slot.index.clear()
                continue
            if not self._available(slot):
                self._warn(slot, "clear", f"{slot.name} tier is down: not cleared")
                continue
            try:
                self._call(slot, slot.tier.clear)
            except _Down:
                self._warn(slot, "clear", f"{slot.name} tier is down: not cleared")
            except (TierError, OSError) as exc:
                self._warn(slot, "clear", f"{slot.name} tier: clear failed ({exc})")
            with self._lock:
                if slot.index is not None:
                    slot.index.clear()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier, top-down: ``{name: {hits, misses, hit_rate, bytes_read, bytes_written,
        evictions, corrupt, foreign, write_errors, entries, occupancy_bytes, capacity_bytes, up}}``.

        Counters are this process's since the store was created; ``hit_rate`` = hits / (hits +
        misses) of lookups that reached the tier (0.0 before any); ``entries`` and
        ``occupancy_bytes`` (bytes) describe what the tier holds now (for disk: the whole folder;
        for a down remote tier: 0); ``capacity_bytes`` is None for the unbounded remote tier.
        """
        out: dict[str, dict[str, Any]] = {}
        for slot in self._slots:
            usage = TierUsage(0, 0)
            if slot.tier.memory:
                with self._lock:
                    usage = slot.tier.usage()
            elif slot.up or self._available(slot):
                try:
                    usage = self._call(slot, slot.tier.usage)
                except (_Down, TierError, OSError):
                    pass
            with self._lock:
                c = slot.counters
                lookups = c.hits + c.misses
                out[slot.name] = {
                    "hits": c.hits, "misses": c.misses,
                    "hit_rate": c.hits / lookups if lookups else 0.0,
                    "bytes_read": c.bytes_read, "bytes_written": c.bytes_written,
                    "evictions": c.evictions, "corrupt": c.corrupt, "foreign": c.foreign,
                    "write_errors": c.write_errors,
                    "entries": usage.entries, "occupancy_bytes": usage.bytes,
                    "capacity_bytes": slot.capacity, "up": slot.up,
                }
        return out

    def hit_rate_line(self) -> str:
        """One line of per-tier hit rates, e.g. ``cpu 75.0% (3/4) | disk 100.0% (1/1)``."""
        parts = []
        with self._lock:
            for slot in self._slots:
                c = slot.counters
                n = c.hits + c.misses
                rate = f"{100.0 * c.hits / n:.1f}%" if n else "-"
                parts.append(f"{slot.name} {rate} ({c.hits}/{n})" + ("" if slot.up else " DOWN"))
        return " | ".join(parts)

    def verify(self) -> dict[str, dict[str, Any]]:
        """Check every entry in the persistent tiers (header, size and every checksum) and delete
        the damaged ones. Entries of another model/layout are checked too, and kept when intact.

        Returns:
            ``{tier: {"checked", "ok", "foreign", "corrupt", "removed": [keys], "up"}}``, where
            ``ok`` counts intact entries of this store's spec (all intact ones without a spec) and
            ``foreign`` intact entries of another model, layout or format.
        """
        report: dict[str, dict[str, Any]] = {}
        for pos, slot in enumerate(self._slots):
            if slot.tier.memory:
                continue
            rep: dict[str, Any] = {"checked": 0, "ok": 0, "foreign": 0, "corrupt": 0, "removed": [], "up": True}
            report[slot.name] = rep
            try:
                keys = list(self._call(slot, slot.tier.keys)) if self._available(slot) else None
            except (_Down, TierError, OSError):
                keys = None
            if keys is None:
                rep["up"] = False
                continue
            for key in keys:
                outcome = self._verify_one(pos, key)
                if outcome == "down":
                    rep["up"] = False
                    break
                if outcome in ("ok", "foreign", "corrupt"):
                    rep["checked"] += 1
                    rep[outcome] += 1
                    if outcome == "corrupt":
                        rep["removed"].append(key)
        return report

    def _verify_one(self, pos: int, key: str) -> str:
        """Check one stored entry: "ok", "foreign", "corrupt" (deleted), "gone", "error" or "down"."""
        slot = self._slots[pos]
        try:
            reader = self._call(slot, slot.tier.open, key)
            if reader is None:
                return "gone"  # deleted meanwhile
            try:
                reader.read_all()
            finally:
                reader.close()
        except _Down:
            return "down"
        except ForeignEntryError:
            return "foreign"
        except CorruptEntryError as exc:
            self._on_corrupt(pos, key, exc, count_miss=False)
            return "corrupt"
        except (TierError, OSError) as exc:
            self._warn(slot, "verify", f"{slot.name} tier: cannot check {key!r} ({exc})")
            return "error"
        if self.spec is not None and self.spec.mismatch(reader.meta) is not None:
            return "foreign"
        return "ok"

    def close(self) -> None:
        """Stop the hit-rate logger and release the tiers (memory tiers are emptied)."""
        self._stop.set()
        if self._logger is not None:
            self._logger.join(timeout=5)
            self._logger = None
        for slot in self._slots:
            try:
                slot.tier.close()
            except Exception:  # closing must not fail the caller
                pass

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ policy internals

    def _spec(self) -> KVSpec:
        if self.spec is None:
            raise RuntimeError("this TieredStore was opened without a KVSpec (administration only)")
        return self.spec

    def _count(self, pos: int, **deltas: int) -> None:
        with self._lock:
            c = self._slots[pos].counters
            for name, d in deltas.items():
                setattr(c, name, getattr(c, name) + d)

    def _warn(self, slot: _Slot, kind: str, message: str) -> None:
        """Log a warning at most once a minute per tier and kind."""
        now = time.monotonic()
        with self._lock:
            last = slot.last_warn.get(kind)
            if last is not None and now - last < _WARN_EVERY_SEC:
                return
            slot.last_warn[kind] = now
        log.warning(message)

    def _available(self, slot: _Slot) -> bool:
        """True when the tier is up, or down but due for a retry (then one caller probes it)."""
        if slot.up:
            return True
        now = time.monotonic()
        with self._lock:
            if now >= slot.retry_at:
                slot.retry_at = now + slot.backoff  # others keep skipping while this one probes
                return True
        return False

    def _call(self, slot: _Slot, fn: Callable[..., T], *args: Any) -> T:
        try:
            result = fn(*args)
        except TierUnavailableError as exc:
            self._mark_down(slot, exc)
            raise _Down from None
        if not slot.up:
            self._mark_up(slot)
        return result

    def _mark_down(self, slot: _Slot, exc: Exception) -> None:
        with self._lock:
            if slot.up:
                slot.up = False
                slot.backoff = self._backoff[0]
                log.warning("%s tier unavailable (%s); continuing with the other tiers, retrying every "
                            "%.0f-%.0f s", slot.name, exc, *self._backoff)
            else:
                slot.backoff = min(slot.backoff * 2, self._backoff[1])
            slot.retry_at = time.monotonic() + slot.backoff

    def _mark_up(self, slot: _Slot) -> None:
        with self._lock:
            if not slot.up:
                slot.up = True
                slot.backoff = self._backoff[0]
                log.warning("%s tier reachable again", slot.name)

    def _probe(self, pos: int) -> None:
        slot = self._slots[pos]
        try:
            self._call(slot, slot.tier.ping)
        except (_Down, TierError, OSError):
            pass

    def _rescan(self, pos: int) -> None:
        """Rebuild a bounded persistent tier's index from ``scan`` (disk: LRU order = file mtime),
        keeping the recorded access counts of entries still present. Other processes may have
        added or removed entries since the last scan."""
        slot = self._slots[pos]
        if slot.index is None:
            return
        try:
            files = self._call(slot, slot.tier.scan)
        except _Down:
            return
        except (TierError, OSError) as exc:
            self._warn(slot, "scan", f"{slot.name} tier: cannot scan ({exc})")
            return
        with self._lock:
            old = slot.index
            fresh = EvictionIndex(self.eviction_policy)
            for f in files:
                fresh.add(f.key, f.size, max(1, old.freq(f.key)))
            slot.index = fresh
            slot.last_scan = time.monotonic()

    def _open_checked(self, pos: int, key: str, spec: KVSpec) -> EntryReader | None:
        """Open ``key`` in tier ``pos``; count and return None for absent, foreign or damaged."""
        slot = self._slots[pos]
        try:
            if slot.tier.memory:
                with self._lock:
                    reader = slot.tier.open(key)
            else:
                reader = self._call(slot, slot.tier.open, key)
        except _Down:
            return None
        except CorruptEntryError as exc:
            self._on_corrupt(pos, key, exc)
            return None
        except ForeignEntryError:
            self._count(pos, misses=1, foreign=1)
            return None
        except (TierError, OSError) as exc:
            self._warn(slot, "read", f"{slot.name} tier: reading {key!r} failed ({exc}); treated as a miss")
            self._count(pos, misses=1)
            return None
        if reader is None:
            self._count(pos, misses=1)
            return None
        reason = spec.mismatch(reader.meta)
        if reason is not None:
            reader.close()
            log.debug("%s tier: entry %r is foreign (%s)", slot.name, key, reason)
            self._count(pos, misses=1, foreign=1)
            return None
        return reader

    def _on_hit(self, pos: int, key: str, stored_bytes: int, nbytes_read: int) -> None:
        slot = self._slots[pos]
        with self._lock:
            slot.counters.hits += 1
            slot.counters.bytes_read += nbytes_read
            if slot.index is not None:
                if key in slot.index:
                    slot.index.touch(key)
                elif not slot.tier.memory:
                    slot.index.add(key, stored_bytes, 1)  # written by another process
        if not slot.tier.memory:
            slot.tier.touch(key)

    def _on_corrupt(self, pos: int, key: str, exc: CorruptEntryError, count_miss: bool = True) -> None:
        slot = self._slots[pos]
        log.warning("%s tier: %s; deleted, treated as a miss", slot.name, exc)
        self._count(pos, corrupt=1, misses=1 if count_miss else 0)
        self._delete_from(slot, key)

    def _delete_from(self, slot: _Slot, key: str) -> bool:
        if slot.tier.memory:
            with self._lock:
                if slot.index is not None:
                    slot.index.remove(key)
                return slot.tier.delete(key)
        with self._lock:
            if slot.index is not None:
                slot.index.remove(key)
        if not self._available(slot):
            return False
        try:
            return bool(self._call(slot, slot.tier.delete, key))
        except (_Down, TierError, OSError) as exc:
            if not isinstance(exc, _Down):
                self._warn(slot, "delete", f"{slot.name} tier: deleting {key!r} failed ({exc})")
            return False

    def _should_promote(self, pos: int, nbytes: int) -> bool:
        top = self._top
        if top is None or pos == top:
            return False
        cap = self._slots[top].capacity
        return cap is None or nbytes <= cap

    def _promote(self, pos: int, item: StoredKV) -> None:
        """Copy (persistent source) or move (memory source) ``item`` into the top memory tier."""
        src = self._slots[pos]
        with self._lock:
            freq = src.index.freq(item.key) if src.index is not None else 1
            if src.tier.memory:
                src.tier.delete(item.key)
                src.index.remove(item.key)
        self._insert(self._top, item, max(freq, 1))

    def _insert(self, pos: int, item: StoredKV, freq: int) -> bool:
        """Put ``item`` into tier ``pos``, evict over capacity, demote the victims. True if stored."""
        slot = self._slots[pos]
        if slot.capacity is not None and item.nbytes > slot.capacity:
            return False  # can never fit this tier
        if slot.tier.memory:
            with self._lock:
                try:
                    written = slot.tier.put(item)
                except RuntimeError as exc:  # e.g. torch.OutOfMemoryError on the device
                    slot.counters.write_errors += 1
                    self._warn(slot, "write", f"{slot.name} tier: cannot keep {item.key!r} ({exc}); skipped")
                    return False
                slot.index.add(item.key, written, freq)
                slot.counters.bytes_written += written
                victims = (slot.index.pop_victims(slot.capacity, protect=item.key)
                           if slot.capacity is not None else [])
                evicted = [(slot.tier.pop(v.key), v) for v in victims]
                slot.counters.evictions += len(victims)
            for victim_item, victim in evicted:
                if victim_item is not None:
                    self._demote(pos, victim_item, victim.freq)
            return True
        written = self._write_persistent(pos, item)
        if written is None:
            return False
        stale = False
        with self._lock:
            slot.counters.bytes_written += written
            if slot.index is not None and slot.capacity is not None:
                slot.index.add(item.key, written, freq)
                over = slot.index.used_bytes > slot.capacity
                stale = over and time.monotonic() - slot.last_scan > _RESCAN_SEC
        if stale:
            self._rescan(pos)  # other processes may have added or removed entries
        victims: list[Victim] = []
        with self._lock:
            if slot.index is not None and slot.capacity is not None:
                victims = slot.index.pop_victims(slot.capacity, protect=item.key)
        self._drop_persistent(pos, victims)
        return True

    def _write_persistent(self, pos: int, item: StoredKV) -> int | None:
        slot = self._slots[pos]
        try:
            return self._call(slot, slot.tier.put, item)
        except _Down:
            return None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) and slot.index is not None:
                with self._lock:
                    victims = slot.index.pop_bytes(item.nbytes, protect=item.key)
                self._drop_persistent(pos, victims)
                if victims:
                    try:
                        return self._call(slot, slot.tier.put, item)
                    except (_Down, TierError):
                        return None
                    except OSError as again:
                        exc = again
                self._count(pos, write_errors=1)
                self._warn(slot, "full", f"{slot.name} tier full ({exc}); evicted {len(victims)} "
                           f"entries, write of {item.key!r} skipped")
                return None
            self._count(pos, write_errors=1)
            self._warn(slot, "write", f"{slot.name} tier: write of {item.key!r} failed ({exc}); skipped")
            return None
        except TierError as exc:
            self._count(pos, write_errors=1)
            self._warn(slot, "write", f"{slot.name} tier: write of {item.key!r} failed ({exc}); skipped")
            return None

    def _next_below(self, pos: int) -> int | None:
        return pos + 1 if pos + 1 < len(self._slots) else None

    def _already_in(self, pos: int, key: str) -> bool:
        slot = self._slots[pos]
        if slot.tier.memory:
            with self._lock:
                return slot.tier.contains(key)
        try:
            return bool(self._call(slot, slot.tier.contains, key))
        except (_Down, TierError, OSError):
            return True  # cannot tell: do not write

    def _demote(self, pos: int, item: StoredKV, freq: int) -> None:
        """Move an entry evicted from tier ``pos`` into the next tier down unless already there."""
        below = self._next_below(pos)
        if below is None or not self._available(self._slots[below]) or self._already_in(below, item.key):
            return
        self._insert(below, item, freq)

    def _drop_persistent(self, pos: int, victims: list[Victim]) -> None:
        """Delete evicted files/values of tier ``pos``, demoting each first when needed."""
        if not victims:
            return
        slot = self._slots[pos]
        below = self._next_below(pos)
        for victim in victims:
            if below is not None and self._available(self._slots[below]) and not self._already_in(below, victim.key):
                try:
                    item = slot.tier.get(victim.key)
                except CorruptEntryError as exc:
                    self._on_corrupt(pos, victim.key, exc, count_miss=False)
                    continue
                except (ForeignEntryError, TierError, OSError):
                    item = None
                if item is not None:  # any intact entry, also another model's
                    self._insert(below, item, victim.freq)
            try:
                slot.tier.delete(victim.key)
            except (TierError, OSError) as exc:
                self._warn(slot, "delete", f"{slot.name} tier: evicting {victim.key!r} failed ({exc})")
            self._count(pos, evictions=1)

    def _log_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                log.info("kv hit rates: %s", self.hit_rate_line())
            except Exception:  # the logger thread must never die of a formatting problem
                log.debug("hit-rate logging failed", exc_info=True)

