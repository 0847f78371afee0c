"""Worker-side runtime: the model's DecoderOps, the tiered KV store, chunk KV precompute and blending.

Owns everything that must run inside vLLM's worker process (where the model lives): the
:class:`WorkerRuntime` used by the connector's ``start_load_kv``, and the worker extension whose
methods the driver calls through ``LLM.collective_rpc`` (plain data in and out; tensors never
cross the process boundary). KV is computed and stored here, so it never travels to the driver.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from ragcache.blend import blend_kv, compute_kv, reuse_kv
from ragcache.config import StoreSettings
from ragcache.engine.ops import VLLMLlamaOps
from ragcache.kvstore import CorruptEntryError, KVSpec, TieredStore, TierError

log = logging.getLogger(__name__)

#: tier name recorded for a chunk whose KV was missing and computed during the request
COMPUTED = "computed"


class _MemoryHandle:
    """A just-computed entry served like a store handle (layer(i) -> (k, v))."""

    tier = COMPUTED

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def close(self) -> None:
        pass


class WorkerRuntime:
    """Chunk KV precompute and per-request context loading inside the vLLM worker.

    Args:
        model: the loaded vLLM model (``worker.model_runner.model``).
        store_settings: the ``[store]`` settings as a dict.
        model_fingerprint: from :func:`ragcache.models.resolve_llm`.
        layout_version: :data:`ragcache.chunks.KV_LAYOUT_VERSION`.
    """

    def __init__(self, model: torch.nn.Module, store_settings: dict[str, Any], model_fingerprint: str,
                 layout_version: int):
        self.ops = VLLMLlamaOps(model)
        self.attn_layers = [layer.self_attn.attn for layer in self.ops.layers]
        spec = KVSpec(model_fingerprint=model_fingerprint, layout_version=layout_version,
                      num_layers=self.ops.num_layers, num_kv_heads=self.ops.num_kv_heads,
                      head_dim=self.ops.head_dim, dtype=self.ops.dtype)
        self.store = TieredStore.from_settings(StoreSettings(**store_settings), spec=spec, device=self.ops.device)
        self.stats: "OrderedDict[str, dict[str, Any]]" = OrderedDict()
        self.lock = threading.Lock()

    # ---- chunk KV -------------------------------------------------------------------------

    def compute_unit(self, lead_in: list[int], unit: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of ``unit`` placed right after ``lead_in``: pre-RoPE K and V, [L, len(unit), Hkv, D]."""
        ids = torch.tensor(lead_in + unit, dtype=torch.long, device=self.ops.device)
        positions = torch.arange(len(ids), device=self.ops.device)
        return compute_kv(self.ops, ids, positions, keep_from=len(lead_in))

    def precompute(self, lead_in: list[int], items: list[list[Any]]) -> dict[str, Any]:
        """Compute and store the KV of every ``[key, unit_ids]`` not stored yet.

        ``lead_in`` is the canonical lead-in (the prompt head); an item whose unit *is* the head
        is passed with ``lead_in=[]``. Returns counts and seconds.
        """
        t0 = time.perf_counter()
        computed = skipped = tokens = 0
        with self.lock:
            for key, unit in items:
                if self.store.contains(key):
                    skipped += 1
                    continue
                k, v = self.compute_unit(lead_in, list(unit))
                self.store.put(key, k, v, start_position=len(lead_in))
                computed += 1
                tokens += len(unit)
        return {"computed": computed, "skipped": skipped, "tokens": tokens, "seconds": time.perf_counter() - t0}

    # ---- per request ----------------------------------------------------------------------

    def load_request(self, load: Any, block_size: int) -> None:
        """Write the final K/V of the context ``[0, ctx_len)`` of one request into vLLM's paged cache.

        Segments whose KV is missing (never ingested, evicted, corrupt) are computed now at their
        canonical place and stored, so the request succeeds and later requests hit.
        """
        p = load.params
        t0 = time.perf_counter()
        device = self.ops.device
        token_ids = load.token_ids
        lead_in = token_ids[: int(p["lead_in_len"])]
        handles, tiers = [], []
        computed_tokens = 0
        with self.lock:
            for key, start, length in p["segments"]:
                handle = self.store.open(key)
                if handle is None:
                    unit = token_ids[start:start + length]
                    lead = [] if start == 0 else lead_in
                    k, v = self.compute_unit(lead, unit)
                    self.store.put(key, k, v, start_position=len(lead))
                    handle = _MemoryHandle(k, v)
                    computed_tokens += length
                handles.append(handle)
                tiers.append(handle.tier)
        open_s = time.perf_counter() - t0

        n = int(p["ctx_len"])
        positions = torch.arange(n, device=device)
        blocks = torch.tensor(load.block_ids, dtype=torch.long)
        pos = torch.arange(n)
        slot_mapping = (blocks[pos // block_size] * block_size + pos % block_size).to(device)

        def layer_of(j: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            try:
                return handles[j].layer(i)
            except (CorruptEntryError, TierError, OSError) as exc:
                # the entry went bad (or its tier away) mid-read: compute it now, never serve it
                key, start, length = p["segments"][j]
                log.warning("chunk KV %s unreadable at layer %d (%s); recomputing it", key, i, exc)
                handles[j].close()
                k, v = self.compute_unit([] if start == 0 else lead_in, token_ids[start:start + length])
                self.store.put(key, k, v, start_position=0 if start == 0 else len(lead_in))
                handles[j], tiers[j] = _MemoryHandle(k, v), COMPUTED
                return handles[j].layer(i)

        loaded: set[int] = set()

        def load_layer(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            loaded.add(i)
            ks, vs = zip(*(layer_of(j, i) for j in range(len(handles))))
            return torch.cat(ks).to(device, self.ops.dtype), torch.cat(vs).to(device, self.ops.dtype)

        def write_layer(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            layer = self.attn_layers[i]
            layer.impl.do_kv_cache_update(layer, k.contiguous(), v.contiguous(), layer.kv_cache, slot_mapping)

        mode = p.get("mode", "blend")
        overlap = bool(p.get("pipeline_overlap", True))
        ids = torch.tensor(token_ids[:n], dtype=torch.long, device=device)
        if mode == "reuse":
            result = reuse_kv(self.ops, positions, load_layer, write_layer, prefetch=overlap)
        else:
            result = blend_kv(
                self.ops, ids, positions, load_layer,
                recompute_ratio=float(p.get("recompute_ratio", 0.15)),
                check_layer=int(p.get("check_layer", 1)),
                deviation=p.get("deviation", "value"),
                on_layer=write_layer, prefetch=overlap,
            )
        recomputed = int(result.num_recomputed)
        # blend does not load layers below the check layer; a handle promotes its entry to the top
        # memory tier only once every layer was read, so read the rest (one layer: cheap)
        for i in sorted(set(range(self.ops.num_layers)) - loaded):
            for j in range(len(handles)):
                layer_of(j, i)
        for h in handles:
            h.close()
        total_s = time.perf_counter() - t0
        load_s = open_s + result.load_s
        tier_counts: dict[str, int] = {}
        for t in tiers[1:]:  # the head is not a retrieved chunk
            tier_counts[t] = tier_counts.get(t, 0) + 1
        record = {
            "mode": mode,
            "ctx_len": n,
            "reused_tokens": n - recomputed,
            "recomputed_tokens": recomputed,
            "missing_computed_tokens": computed_tokens,
            "load_s": load_s,
            "blend_s": total_s,
            "chunk_tiers": tiers[1:],
            "tier_hits": tier_counts,
        }
        rid = p.get("rid") or load.req_id
        self.stats[rid] = record
        while len(self.stats) > 10000:
            self.stats.popitem(last=False)


class RagcacheWorkerExtension:
    """Methods added to vLLM's worker (``worker_extension_cls``); called via ``LLM.collective_rpc``.

    ``self`` is the vLLM worker: ``self.model_runner.model`` is the loaded model.
    """

    def ragcache_init(self, store_settings: dict[str, Any], model_fingerprint: str, layout_version: int) -> str:
        """Create the :class:`WorkerRuntime` and hand it to the worker-side connector. Returns the device."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        runtime = WorkerRuntime(self.model_runner.model, store_settings, model_fingerprint, layout_version)
        get_kv_transfer_group().runtime = runtime
        self._ragcache = runtime
        return str(runtime.ops.device)

    def ragcache_precompute(self, lead_in: list[int], items: list[list[Any]]) -> dict[str, Any]:
        return self._ragcache.precompute(lead_in, items)

    def ragcache_pop_stats(self, rid: str) -> dict[str, Any] | None:
        return self._ragcache.stats.pop(rid, None)

    def ragcache_store_stats(self) -> dict[str, Any]:
        return self._ragcache.store.stats()

    def ragcache_store_contains(self, keys: list[str]) -> list[str | None]:
        return [self._ragcache.store.contains(k) for k in keys]

    def ragcache_store_delete(self, keys: list[str]) -> int:
        return sum(bool(self._ragcache.store.delete(k)) for k in keys)

    def ragcache_store_clear(self) -> None:
        self._ragcache.store.clear()

    def ragcache_model_info(self) -> dict[str, Any]:
        ops = self._ragcache.ops
        return {"num_layers": ops.num_layers, "num_heads": ops.num_heads, "num_kv_heads": ops.num_kv_heads,
                "head_dim": ops.head_dim, "dtype": str(ops.dtype), "device": str(ops.device)}
