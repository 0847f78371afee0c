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
from typing import Any

import torch

from ragcache.blend import BudgetRule, Selection, blend_kv, compute_kv, reuse_kv
from ragcache.chunks import is_private_key
from ragcache.config import StoreSettings
from ragcache.engine.messages import (
    ContextStats, LoadRequest, OpsProbe, PrecomputeItem, PrecomputeReport, WorkerReady,
)
from ragcache.engine.ops import UnsupportedArchitectureError, adapter_for, exercise, kv_layout, sliding_window
from ragcache.engine.paged_attention import (
    AttentionChoice, PagedKernelAttention, ScratchKernelAttention, choose_attention,
)
from ragcache.kvstore import CorruptEntryError, KVSpec, TieredStore, TierError
from ragcache.kvstore.codec import StoredLayer, decode_layers, layer_parts
from ragcache.prompt import is_canonical, lead_in_for

log = logging.getLogger(__name__)

#: tier name recorded for a chunk whose KV was missing and computed during the request
COMPUTED = "computed"


#: rows of the log-probability matrix counted at once by :func:`eager_logprob_ranks`
RANK_ROWS = 256


def eager_logprob_ranks(logprobs: torch.Tensor, values: torch.Tensor, rows: int = RANK_ROWS) -> torch.Tensor:
    """Each row's rank count ``(logprobs >= values).sum(-1)``, evaluated eagerly ``rows`` rows at a time.

    The same expression as vLLM 0.32's ``vllm.v1.sample.ops.logprobs.batched_count_greater_than``
    (the rank vLLM reports with every logprob), which vLLM wraps in ``torch.compile``: on CPU the
    first request with logprobs then compiles it with inductor, 2.5-3 s on a 2-core EPYC, and the
    engine's start-up self-check is such a request. Row blocks keep the temporary bool matrix at
    ``rows x vocab`` (the copies the compiled kernel was introduced to avoid).

    Args:
        logprobs: ``[B, V]`` float log-probabilities.
        values: ``[B, 1]`` the logprob whose rank is counted, per row.

    Returns:
        ``[B]`` int64 counts.
    """
    out = torch.empty(logprobs.shape[0], dtype=torch.long, device=logprobs.device)
    for start in range(0, logprobs.shape[0], rows):
        out[start:start + rows] = (logprobs[start:start + rows] >= values[start:start + rows]).sum(-1)
    return out


def use_eager_logprob_ranks(device: torch.device) -> bool:
    """On CPU, make vLLM's sampler count logprob ranks with :func:`eager_logprob_ranks` instead of
    its ``torch.compile``d function (no compile on the first logprobs request). Accelerators keep
    vLLM's kernel. Returns whether the sampler was changed (False on another device, or when this
    vLLM has no such function)."""
    if torch.device(device).type != "cpu":
        return False
    try:
        from vllm.v1.sample import sampler
    except ImportError:
        return False
    if not hasattr(sampler, "batched_count_greater_than"):
        return False
    sampler.batched_count_greater_than = eager_logprob_ranks
    return True


#: tiers whose layer reads wait on a network: worth a background loader even when the blend computes on CPU
SLOW_TIERS = frozenset({"remote"})


def prefetch_layers(setting: bool | str, device: torch.device, tiers: list[str]) -> bool:
    """Whether the blend loads layer i+1 in a background thread while it computes layer i.

    ``setting`` is ``blend.pipeline_overlap``: True or False as given; ``"auto"`` is on when the
    blend computes on an accelerator (the thread's copies do not compete with its kernels) or when
    a chunk's KV comes from a slow tier (:data:`SLOW_TIERS`), and off for CPU compute over KV in RAM
    or on local disk. There the thread's tensor copies run their own OpenMP team on the cores the
    compute uses, and every stage of the blend slows down: on a 2-core Zen 4 (bf16) TTFT was
    12% (MuSiQue, ~6k tokens, cpu tier) and 22-24% (HotpotQA, ~1.5k tokens, cpu and disk tiers)
    lower without the thread (docs/benchmarks.md).
    """
    if setting != "auto":
        return bool(setting)
    return torch.device(device).type != "cpu" or any(tier in SLOW_TIERS for tier in tiers)


class _MemoryHandle:
    """A just-computed entry served like a store handle (layer(i) -> (k, v), or as a stored layer)."""

    tier = COMPUTED

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self._parts = layer_parts("none", k.dtype, *k.shape[1:])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def stored_layer(self, i: int) -> StoredLayer:
        return StoredLayer("none", self._parts, torch.stack([self.k[i], self.v[i]]))

    def close(self) -> None:
        pass


class WorkerRuntime:
    """Chunk KV precompute and per-request context loading inside the vLLM worker.

    Args:
        model: the loaded vLLM model (``worker.model_runner.model``).
        store_settings: the ``[store]`` settings as a dict.
        model_fingerprint: from :func:`ragcache.models.resolve_llm`.
        layout_version: :data:`ragcache.chunks.KV_LAYOUT_VERSION`.
        hf_architectures: the checkpoint's ``config.architectures`` (for messages).
        attention: the ``blend.attention`` setting (auto, kernel, torch).

    Attributes:
        ops: the model's DecoderOps adapter (:func:`ragcache.engine.ops.adapter_for`), or None when
            no adapter serves the model (then only full and prefix requests reach the engine;
            ``ops_error`` says why).
        attention: the blend's attention path on this host (:func:`ragcache.engine.paged_attention.
            choose_attention`); resolved when the first blend needs it, or by :meth:`ready`.
    """

    def __init__(self, model: torch.nn.Module, store_settings: dict[str, Any], model_fingerprint: str,
                 layout_version: int, hf_architectures: tuple[str, ...] = (), attention: str = "auto"):
        self.architecture, self.hf_architectures = type(model).__name__, tuple(hf_architectures)
        self.ops_error: UnsupportedArchitectureError | None = None
        try:
            self.ops = adapter_for(model, hf_architectures)
        except UnsupportedArchitectureError as exc:
            self.ops, self.ops_error = None, exc
            log.warning("%s", exc)
        self.sliding_window = sliding_window(model)
        self.attn_layers = [layer.self_attn.attn for layer in self.ops.layers] if self.ops else []
        ops = self.ops
        num_layers, num_kv_heads, head_dim, dtype = (ops.num_layers, ops.num_kv_heads, ops.head_dim, ops.dtype) if ops \
            else kv_layout(model)  # no adapter: size the store from vLLM's attention layers
        spec = KVSpec(model_fingerprint=model_fingerprint, layout_version=layout_version, num_layers=num_layers,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        self.device = next(model.parameters()).device
        use_eager_logprob_ranks(self.device)
        self.store = TieredStore.from_settings(StoreSettings(**store_settings), spec=spec, device=self.device)
        self.lock = threading.Lock()
        self.attention = AttentionChoice("torch", "no DecoderOps adapter")
        self._scratch_attention: ScratchKernelAttention | None = None  # chunk KV precompute on the kernel
        if self.ops is not None:
            self.attention = choose_attention(attention, self.attn_layers, num_heads=ops.num_heads,
                                              num_kv_heads=ops.num_kv_heads, head_dim=ops.head_dim,
                                              dtype=ops.dtype, scaling=ops.scaling)
            if self.attention.path == "kernel":
                self._scratch_attention = ScratchKernelAttention(
                    self.attn_layers, num_heads=ops.num_heads, num_kv_heads=ops.num_kv_heads, head_dim=ops.head_dim,
                    dtype=ops.dtype)

    def ready(self) -> WorkerReady:
        """The reply to ``Rpc.INIT``: the device and the blend's attention path."""
        return WorkerReady(str(self.device), self.attention.path, self.attention.reason)

    # ---- chunk KV -------------------------------------------------------------------------

    def compute_segment(self, head_ids: list[int], start: int, unit: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of ``unit`` computed where the placement rule puts it (:func:`ragcache.prompt.lead_in_for`).

        Returns pre-RoPE K and V, each ``[L, len(unit), Hkv, D]`` in the model's dtype on its device.

        Raises:
            UnsupportedArchitectureError: no adapter serves this model.
        """
        if self.ops is None:
            raise self.ops_error
        lead_in = lead_in_for(start, head_ids)
        ids = torch.tensor(lead_in + list(unit), dtype=torch.long, device=self.ops.device)
        positions = torch.arange(len(ids), device=self.ops.device)
        return compute_kv(self.ops, ids, positions, keep_from=len(lead_in), attention=self._scratch_attention)

    def _compute_and_store(self, key: str, head_ids: list[int], start: int, unit: list[int],
                           stored: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute a segment's KV and store it; returns the computed K and V (:meth:`compute_segment`)."""
        k, v = self.compute_segment(head_ids, start, unit)
        tiers = self.store.put(key, k, v, start_position=len(lead_in_for(start, head_ids)))
        if stored is not None:
            for tier in tiers:
                stored[tier] += 1
        return k, v

    def _compute_for_request(self, key: str, head_ids: list[int], start: int, unit: list[int]) -> _MemoryHandle:
        """A missing segment computed and stored now, served as its stored entry will be served
        (``store.as_stored``: through ``store.kv_compression``), so an answer does not depend on
        whether its chunks were hits. The start-up self-check's private segments are served as
        computed: the check measures the adapter against vLLM, not the compression."""
        k, v = self._compute_and_store(key, head_ids, start, unit)
        return _MemoryHandle(*((k, v) if is_private_key(key) else self.store.as_stored(k, v)))

    def precompute(self, head_ids: list[int], items: list[PrecomputeItem]) -> PrecomputeReport:
        """Compute and store the KV of every item not stored yet (see
        :class:`~ragcache.engine.messages.PrecomputeReport` for what the report counts)."""
        t0 = time.perf_counter()
        report = PrecomputeReport(stored=dict.fromkeys(self.store.tier_names, 0))
        with self.lock:
            for item in items:
                if self.store.contains(item.key):
                    report.skipped += 1
                    continue
                self._compute_and_store(item.key, head_ids, item.start, list(item.unit_ids), report.stored)
                report.computed += 1
                report.computed_keys.append(item.key)
                report.tokens += len(item.unit_ids)
        report.seconds = time.perf_counter() - t0
        return report

    def probe(self, token_ids: list[int]) -> OpsProbe:
        """Report the adapter and exercise it on ``token_ids`` (:func:`ragcache.engine.ops.exercise`):
        an adapter that raises on this model becomes ``OpsProbe.error`` here, instead of an
        exception inside vLLM's engine loop during the self-check's reuse request."""
        adapter = type(self.ops).__name__ if self.ops is not None else None
        error = str(self.ops_error) if self.ops_error else None
        t0 = time.perf_counter()
        if self.ops is not None and token_ids:
            try:
                with self.lock:
                    exercise(self.ops, torch.tensor(token_ids, dtype=torch.long, device=self.ops.device))
            except Exception as exc:  # any failure means "this adapter cannot serve this model"
                error = f"the {adapter} adapter failed on it ({type(exc).__name__}: {exc})"
        return OpsProbe(self.architecture, self.hf_architectures, adapter, error, self.sliding_window,
                        time.perf_counter() - t0)

    # ---- per request ----------------------------------------------------------------------

    def load_request(self, load: LoadRequest, block_size: int) -> ContextStats:
        """Write the final K/V of the context ``[0, ctx_len)`` of one request into vLLM's paged cache.

        Segments whose KV is missing (never ingested, evicted, corrupt) are computed now at their
        canonical place and stored, so the request succeeds and later requests hit.

        Returns:
            what was done, with timings (see :class:`ragcache.engine.messages.ContextStats`).
        """
        p = load.params
        t0 = time.perf_counter()
        device = self.ops.device
        token_ids = load.token_ids
        head_ids = token_ids[: p.lead_in_len]
        segments = p.segments
        handles, tiers = [], []
        missing_tokens = 0
        missing_s = 0.0
        with self.lock:
            for j, seg in enumerate(segments):
                handle = self.store.open(seg.key, head=j == 0)  # the head's lookup is counted apart
                if handle is None:
                    t_miss = time.perf_counter()
                    handle = self._compute_for_request(seg.key, head_ids, seg.start,
                                                       token_ids[seg.start:seg.start + seg.length])
                    missing_s += time.perf_counter() - t_miss
                    missing_tokens += seg.length
                handles.append(handle)
                tiers.append(handle.tier)
        open_s = time.perf_counter() - t0 - missing_s

        n = p.ctx_len
        positions = torch.arange(n, device=device)
        blocks = torch.tensor(load.block_ids, dtype=torch.long)
        pos = torch.arange(n)
        slot_mapping = (blocks[pos // block_size] * block_size + pos % block_size).to(device)

        def layer_of(j: int, i: int) -> StoredLayer:
            try:
                return handles[j].stored_layer(i)
            except (CorruptEntryError, TierError, OSError) as exc:
                # the entry went bad (or its tier away) mid-read: compute it now, never serve it
                seg = segments[j]
                log.warning("chunk KV %s unreadable at layer %d (%s); recomputing it", seg.key, i, exc)
                handles[j].close()
                handles[j] = self._compute_for_request(seg.key, head_ids, seg.start,
                                                       token_ids[seg.start:seg.start + seg.length])
                tiers[j] = COMPUTED
                return handles[j].stored_layer(i)

        loaded: set[int] = set()

        def load_layer(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            loaded.add(i)  # one layer of every chunk, decoded together (a few kernels however many chunks)
            return decode_layers([layer_of(j, i) for j in range(len(handles))], self.ops.dtype, device)

        def write_slots(i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            layer = self.attn_layers[i]
            layer.impl.do_kv_cache_update(layer, k.contiguous(), v.contiguous(), layer.kv_cache, slots)

        def write_layer(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            write_slots(i, slot_mapping, k, v)

        def write_rows(i: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            write_slots(i, slot_mapping[index], k, v)

        ids = torch.tensor(token_ids[:n], dtype=torch.long, device=device)
        attention = None  # torch SDPA inside the blend
        if self.attention.path == "kernel":
            ops = self.ops
            attention = PagedKernelAttention(self.attn_layers, load.block_ids, block_size, num_heads=ops.num_heads,
                                             num_kv_heads=ops.num_kv_heads, head_dim=ops.head_dim, dtype=ops.dtype)
        prefetch = prefetch_layers(p.pipeline_overlap, device, tiers)
        if p.mode == "reuse":
            result = reuse_kv(self.ops, positions, load_layer, write_layer, prefetch=prefetch)
        else:
            selection = Selection(p.selection, p.chunk_head_tokens, p.question_weight, p.max_chunk_share, p.granule,
                                  None if p.probe_layers < 0 else p.probe_layers, p.question_heads, p.candidates,
                                  p.refine_layer)
            exact = torch.zeros(n, dtype=torch.bool, device=device)
            for seg in segments:
                if is_canonical(seg.start, head_ids):
                    exact[seg.start:seg.start + seg.length] = True
            tail = token_ids[n:p.question_end or None] if selection.needs_question else None
            result = blend_kv(
                self.ops, ids, positions, load_layer,
                recompute_ratio=p.recompute_ratio, min_recompute_tokens=p.min_recompute_tokens,
                recompute_depth=p.recompute_depth,
                check_layer=p.check_layer, deviation=p.deviation,
                selection=selection, segment_starts=[seg.start for seg in segments], exact=exact,
                tail_ids=None if tail is None else torch.tensor(tail, dtype=torch.long, device=device),
                # with the kernel (it reads the paged cache) a probed layer is written once, then only its
                # recomputed rows; blend_kv uses write_rows only with an attention of the engine's own
                on_layer=write_layer, attention=attention, write_rows=write_rows, prefetch=prefetch,
                budget_rule=BudgetRule(p.mass_left, p.max_recompute_ratio, max_tokens=p.max_recompute_tokens)
                if p.budget == "adaptive" else None,
            )
        recomputed = int(result.num_recomputed)
        # blend does not load layers below the check layer; a handle promotes its entry to the top
        # memory tier only once every layer was read, so read the rest (one layer: cheap)
        t_rest = time.perf_counter()
        for i in sorted(set(range(self.ops.num_layers)) - loaded):
            for j in range(len(handles)):
                layer_of(j, i)
        for h in handles:
            h.close()
        promote_s = time.perf_counter() - t_rest
        return ContextStats(
            ctx_tokens=n, reused_tokens=n - recomputed, recomputed_tokens=recomputed,
            missing_computed_tokens=missing_tokens, chunk_tiers=tiers[1:], head_tier=tiers[0],
            load_s=open_s + result.load_s, compute_s=missing_s + result.compute_s, write_s=result.on_layer_s,
            worker_s=time.perf_counter() - t0,
            stages={"open_s": open_s, "missing_compute_s": missing_s, **result.stages, "promote_s": promote_s},
            recomputed_layers=result.recomputed_layers, model_layers=self.ops.num_layers,
            recompute_budget=result.budget.tokens if result.budget is not None else 0,
            budget_reason=result.budget.reason if result.budget is not None else "",
        )


class RagcacheWorkerExtension:
    """Methods added to vLLM's worker (``worker_extension_cls``); called via ``LLM.collective_rpc``
    with the names in :class:`ragcache.engine.messages.Rpc`.

    ``self`` is the vLLM worker: ``self.model_runner.model`` is the loaded model.
    """

    def ragcache_init(self, store_settings: dict[str, Any], model_fingerprint: str, layout_version: int,
                      attention: str = "auto") -> dict[str, Any]:
        """Create the :class:`WorkerRuntime` and hand it to the worker-side connector.
        Returns :meth:`WorkerRuntime.ready` as plain data (``WorkerReady.to_dict()``)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        hf_architectures = tuple(getattr(self.model_runner.model_config, "architectures", None) or ())
        runtime = WorkerRuntime(self.model_runner.model, store_settings, model_fingerprint, layout_version,
                                hf_architectures, attention)
        get_kv_transfer_group().runtime = runtime
        self._ragcache = runtime
        return runtime.ready().to_dict()

    def ragcache_ops_probe(self, token_ids: list[int]) -> dict[str, Any]:
        """See :meth:`WorkerRuntime.probe`; returns ``OpsProbe.to_dict()``."""
        return self._ragcache.probe(token_ids).to_dict()

    def ragcache_precompute(self, head_ids: list[int], items: list[list[Any]]) -> dict[str, Any]:
        """See :meth:`WorkerRuntime.precompute`: ``PrecomputeItem.to_list()`` rows in,
        ``PrecomputeReport.to_dict()`` out."""
        return self._ragcache.precompute(head_ids, [PrecomputeItem.from_list(i) for i in items]).to_dict()

    def ragcache_store_stats(self) -> dict[str, Any]:
        """Per-tier stats of the worker's store (``TieredStore.stats``)."""
        return self._ragcache.store.stats()

    def ragcache_store_contains(self, keys: list[str]) -> list[str | None]:
        """For each key, the highest tier holding it, or None."""
        return [self._ragcache.store.contains(k) for k in keys]

    def ragcache_store_holders(self, keys: list[str]) -> list[list[str]]:
        """For each key, every tier holding it now, top-down (``TieredStore.holders``)."""
        return [self._ragcache.store.holders(k) for k in keys]

    def ragcache_store_delete(self, keys: list[str]) -> int:
        """Delete the keys from every tier; returns how many were present."""
        return sum(bool(self._ragcache.store.delete(k)) for k in keys)

    def ragcache_store_flush(self) -> None:
        """Write the store's lookup counts to its counter file now (before the worker goes away)."""
        self._ragcache.store.ledger.flush()
