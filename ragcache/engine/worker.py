"""Worker-side runtime: the model's DecoderOps, the tiered KV store, chunk KV precompute and blending.

Owns everything that must run inside vLLM's worker process (where the model lives): the
:class:`WorkerRuntime` used by the connector's ``start_load_kv``, and the worker extension whose
methods the driver calls through ``LLM.collective_rpc`` (plain data in and out; tensors never
cross the process boundary). KV is computed and stored here, so it never travels to the driver.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from ragcache.blend import (
    BlendRequest, BlendResult, CachedKV, LeadIns, LoadLayer, LoadOnCaller, blend_batch, compute_kv, reuse_kv,
)
from ragcache.blend.opcount import count_ops
from ragcache.chunks import is_private_key
from ragcache.config import StoreSettings
from ragcache.engine.messages import (
    ContextStats, LoadRequest, OpsProbe, PrecomputeItem, PrecomputeReport, WorkerReady,
)
from ragcache.engine.ops import UnsupportedArchitectureError, adapter_for, exercise, kv_layout, sliding_window
from ragcache.engine.paged_attention import (
    AttentionChoice, KernelCaches, PagedContexts, PagedWriter, ScratchKernelAttention, choose_attention,
    engine_attention, kernel_available,
)
from ragcache.kvstore import CorruptEntryError, KVSpec, TieredStore, TierError
from ragcache.kvstore.codec import StoredEntry, StoredLayer, decode_entries, decode_layers, layer_parts
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

    def stored_entry(self) -> StoredEntry:
        return StoredEntry("none", self._parts, torch.stack([self.k, self.v], dim=1))

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
        self._stage: torch.Tensor | None = None  # the staging buffer of a pass's chunk KV (_staging)
        self._count_steps = 0  # load steps still to count the operators of (count_ops)
        self._op_counts: list[dict[str, Any]] = []
        self.attention = AttentionChoice("torch", "no DecoderOps adapter")
        self._scratch_attention: ScratchKernelAttention | None = None  # chunk KV precompute on the kernel
        # vLLM's CPU backend: its caches split once, written and read by its kernels directly
        self._caches = KernelCaches(self.attn_layers) if self.ops and kernel_available(self.attn_layers) is None \
            else None
        if self.ops is not None:
            self.attention = choose_attention(attention, self.attn_layers, num_heads=ops.num_heads,
                                              num_kv_heads=ops.num_kv_heads, head_dim=ops.head_dim,
                                              dtype=ops.dtype, scaling=ops.scaling)
            if self.attention.path == "kernel" and kernel_available(self.attn_layers) is None:
                self._scratch_attention = ScratchKernelAttention(
                    self.attn_layers, num_heads=ops.num_heads, num_kv_heads=ops.num_kv_heads, head_dim=ops.head_dim,
                    dtype=ops.dtype)
            self._lead_ins = LeadIns(ops, attention=self._scratch_attention)  # chunk KV's lead-ins, computed once

    def ready(self) -> WorkerReady:
        """The reply to ``Rpc.INIT``: the device and the blend's attention path."""
        return WorkerReady(str(self.device), self.attention.path, self.attention.reason)

    # ---- chunk KV -------------------------------------------------------------------------

    def compute_segment(self, head_ids: list[int], start: int, unit: list[int],
                        context_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of ``unit`` computed where the placement rule puts it (:func:`ragcache.prompt.lead_in_for`:
        after the head and the KV context ``context_ids``, for a chunk).

        Returns pre-RoPE K and V, each ``[L, len(unit), Hkv, D]`` in the model's dtype on its device.

        Raises:
            UnsupportedArchitectureError: no adapter serves this model.
        """
        if self.ops is None:
            raise self.ops_error
        lead_in = lead_in_for(start, head_ids, context_ids)
        ids = torch.tensor(list(unit), dtype=torch.long, device=self.ops.device)
        positions = torch.arange(len(lead_in), len(lead_in) + len(ids), device=self.ops.device)
        return compute_kv(self.ops, ids, positions, attention=self._scratch_attention,
                          lead_in=self._lead_ins.get(lead_in) if lead_in else None)

    def _compute_and_store(self, key: str, head_ids: list[int], start: int, unit: list[int],
                           stored: dict[str, int] | None = None,
                           context_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute a segment's KV and store it; returns the computed K and V (:meth:`compute_segment`)."""
        k, v = self.compute_segment(head_ids, start, unit, context_ids)
        tiers = self.store.put(key, k, v, start_position=len(lead_in_for(start, head_ids, context_ids)))
        if stored is not None:
            for tier in tiers:
                stored[tier] += 1
        return k, v

    def _compute_for_request(self, key: str, head_ids: list[int], start: int, unit: list[int],
                             context_ids: Sequence[int] = ()) -> _MemoryHandle:
        """A missing segment computed and stored now, served as its stored entry will be served
        (``store.as_stored``: through ``store.kv_compression``), so an answer does not depend on
        whether its chunks were hits. The start-up self-check's private segments are served as
        computed: the check measures the adapter against vLLM, not the compression."""
        k, v = self._compute_and_store(key, head_ids, start, unit, context_ids=context_ids)
        return _MemoryHandle(*((k, v) if is_private_key(key) else self.store.as_stored(k, v)))

    def precompute(self, head_ids: list[int], items: list[PrecomputeItem],
                   context_ids: Sequence[int] = ()) -> PrecomputeReport:
        """Compute and store the KV of every item not stored yet, chunks after the head and the KV
        context ``context_ids`` (see :class:`~ragcache.engine.messages.PrecomputeReport` for what
        the report counts)."""
        t0 = time.perf_counter()
        report = PrecomputeReport(stored=dict.fromkeys(self.store.tier_names, 0))
        with self.lock:
            for item in items:
                if self.store.contains(item.key):
                    report.skipped += 1
                    continue
                self._compute_and_store(item.key, head_ids, item.start, list(item.unit_ids), report.stored,
                                        context_ids)
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

    # ---- per engine step ------------------------------------------------------------------

    def load_step(self, loads: Sequence[LoadRequest], block_size: int) -> dict[str, ContextStats | Exception]:
        """Write the final K/V of the contexts of every request of one engine step into vLLM's paged cache.

        Requests whose blends can share a pass (:meth:`BlendRequest.pass_key
        <ragcache.blend.BlendRequest.pass_key>`; reuse requests alike) are served by one pass
        (:func:`ragcache.blend.blend_batch`): their chunk KV staged once into the worker's staging
        buffer, their selected tokens computed together, their attention one kernel call per layer. A
        pass that raises is retried request by request, so one bad request does not fail the others.
        Segments whose KV is missing (never ingested, evicted, corrupt) are computed now at their
        canonical place and stored, so the request succeeds and later requests hit.

        Returns ``{req_id: ContextStats}``, or the exception a request's load raised in its place
        (the connector has vLLM prefill that request instead). When armed by :meth:`count_ops`, the
        operators the step dispatched are counted (:func:`ragcache.blend.opcount.count_ops`).
        """
        counting = self._count_steps > 0
        with count_ops() if counting else nullcontext() as counted:
            done = self._load_step(loads, block_size)
        if counting:
            self._count_steps -= 1
            self._op_counts.append({
                "requests": len(loads), "modes": [load.params.mode for load in loads],
                "ctx_tokens": [load.params.ctx_len for load in loads],
                "layers": self.ops.num_layers if self.ops is not None else 0, "ops": counted.to_dict()})
        return done

    def _load_step(self, loads: Sequence[LoadRequest], block_size: int) -> dict[str, ContextStats | Exception]:
        t0 = time.perf_counter()
        done: dict[str, ContextStats | Exception] = {}
        passes: dict[tuple, list[_Opened]] = {}
        for load in loads:
            try:
                opened = self._open(load)
            except Exception as exc:  # one request's failure must not take the step's others down
                done[load.req_id] = exc
                continue
            passes.setdefault(opened.key, []).append(opened)
        for group in passes.values():
            try:
                served = self._serve(group, block_size, t0)
            except Exception as exc:
                if len(group) == 1:
                    served = [exc]
                else:  # find the request that fails: the others are served alone
                    log.warning("a batched context load of %d requests failed (%s: %s); serving them one by one",
                                len(group), type(exc).__name__, exc)
                    served = []
                    for opened in group:
                        try:
                            served.extend(self._serve([opened], block_size, t0))
                        except Exception as alone:
                            served.append(alone)
            finally:
                for opened in group:
                    opened.close()
            done.update((o.load.req_id, s) for o, s in zip(group, served))
        return done

    def count_ops(self, steps: int) -> list[dict[str, Any]]:
        """Count the operators of the next ``steps`` load steps (0: stop counting); returns the counts
        recorded since the previous call, oldest first: per step ``requests``, ``modes``,
        ``ctx_tokens`` (per request), ``layers`` and ``ops`` (:meth:`OpCount.to_dict
        <ragcache.blend.opcount.OpCount.to_dict>`)."""
        recorded, self._op_counts = self._op_counts, []
        self._count_steps = max(0, int(steps))
        return recorded

    # ---- one request's chunks, one pass ----------------------------------------------------

    def _open(self, load: LoadRequest) -> "_Opened":
        """Open every segment's stored KV (computing the missing ones now) and build the blend request."""
        p = load.params
        t0 = time.perf_counter()
        token_ids = load.token_ids
        head_ids = token_ids[: p.lead_in_len]
        opened = _Opened(load)
        with self.lock:
            for j, seg in enumerate(p.segments):
                handle = self.store.open(seg.key, head=j == 0)  # the head's lookup is counted apart
                if handle is None:
                    t_miss = time.perf_counter()
                    handle = self._compute_for_request(seg.key, head_ids, seg.start,
                                                       token_ids[seg.start:seg.start + seg.length], p.kv_context)
                    opened.missing_s += time.perf_counter() - t_miss
                    opened.missing_tokens += seg.length
                opened.handles.append(handle)
                opened.tiers.append(handle.tier)
        opened.open_s = time.perf_counter() - t0 - opened.missing_s
        # one staging copy makes the loads cheap and upfront; a network tier (or an explicit setting)
        # is read layer by layer in a background thread instead, behind the compute
        knobs = p.blend
        opened.streamed = prefetch_layers(knobs.pipeline_overlap, self.ops.device, opened.tiers) and (
            knobs.pipeline_overlap is True or any(tier in SLOW_TIERS for tier in opened.tiers))
        n = p.ctx_len
        if p.mode == "reuse":
            opened.key = ("reuse", opened.streamed)
            return opened
        canonical = [is_canonical(seg.start, head_ids, p.kv_context) for seg in p.segments]
        exact = torch.repeat_interleave(torch.tensor(canonical), torch.tensor([seg.length for seg in p.segments]))
        tail = token_ids[n:p.question_end or None] if knobs.token_selection.needs_question else None
        opened.request = BlendRequest(
            token_ids=torch.tensor(token_ids[:n], dtype=torch.long), positions=torch.arange(n), knobs=knobs,
            tail_ids=None if tail is None else torch.tensor(tail, dtype=torch.long),
            segment_starts=[seg.start for seg in p.segments], exact=exact)
        opened.key = ("blend", opened.streamed, opened.request.pass_key(self.ops.num_layers))
        return opened

    def _staging(self, rows: int) -> torch.Tensor:
        """``[2, L, rows, Hkv, D]`` of the worker's staging buffer (K of every layer, then V), grown
        when a step needs more and kept: the same memory serves every request (no fresh pages)."""
        ops = self.ops
        shape = (2, ops.num_layers, rows, ops.num_kv_heads, ops.head_dim)
        need = math.prod(shape)
        if self._stage is None or self._stage.numel() < need:
            self._stage = None  # free the old buffer first
            self._stage = torch.empty(need, dtype=ops.dtype, device=ops.device)
        return self._stage[:need].view(shape)

    def _stage_kv(self, group: list["_Opened"]) -> CachedKV:
        """Every layer of every segment of the pass's requests, in row order, decoded into the staging
        buffer by :func:`~ragcache.kvstore.codec.decode_entries` (a fixed number of kernels per layer
        however many chunks and requests)."""
        ops = self.ops
        staged = self._staging(sum(o.load.params.ctx_len for o in group))
        # on a CPU layer by layer (the float32 temporaries stay in cache), elsewhere all layers at once
        per_call = 1 if torch.device(ops.device).type == "cpu" else None
        decode_entries([e for o in group for e in o.stored_entries(self)], ops.dtype, ops.device,
                       out=(staged[0], staged[1]), layers_per_call=per_call)
        return CachedKV(k_pre=staged[0], v=staged[1])

    def _serve(self, group: list["_Opened"], block_size: int, t_step: float) -> list[ContextStats]:
        """One pass over the requests of ``group`` (equal keys); their stats, in order."""
        ops, device = self.ops, self.ops.device
        sizes = [o.load.params.ctx_len for o in group]
        contexts = PagedContexts.of([o.load.block_ids for o in group], sizes, block_size)
        writer = PagedWriter(self.attn_layers, contexts.slots(device), self._caches)
        t_load = time.perf_counter()
        streamed = group[0].streamed
        missing_s = sum(o.missing_s for o in group)
        load = _streamed_loader(group, self) if streamed else self._stage_kv(group)
        # a segment recomputed while staging (its entry went bad) is compute, not load
        stage_s = time.perf_counter() - t_load - (sum(o.missing_s for o in group) - missing_s)
        if group[0].request is None:
            positions = torch.cat([torch.arange(n) for n in sizes]).to(device)
            results = [reuse_kv(ops, positions, load, writer.layer, prefetch=streamed)] * len(group)
        else:
            attention = None  # torch SDPA inside the blend
            if self.attention.path == "kernel":
                attention = engine_attention(self.attn_layers, [o.load.block_ids for o in group], block_size,
                                             starts=contexts.starts.tolist(), caches=self._caches,
                                             num_heads=ops.num_heads, num_kv_heads=ops.num_kv_heads,
                                             head_dim=ops.head_dim, dtype=ops.dtype)
            # with the kernel (it reads the paged cache) a probed layer is written once, then only its
            # recomputed rows; blend_batch uses write_rows only with an attention of the engine's own
            results = blend_batch(ops, [o.request for o in group], load, on_layer=writer.layer, attention=attention,
                                  write_rows=writer.rows, prefetch=streamed)
        t_rest = time.perf_counter()
        for o in group:
            o.read_rest(self)  # a handle promotes its entry only once every layer was read
        promote_s = time.perf_counter() - t_rest
        return [o.stats(result, stage_s, promote_s, time.perf_counter() - t_step, ops.num_layers)
                for o, result in zip(group, results)]


class _Opened:
    """One request of a step with its segments' stored KV open (see :meth:`WorkerRuntime._open`)."""

    def __init__(self, load: LoadRequest) -> None:
        self.load = load
        self.handles: list[Any] = []
        self.tiers: list[str] = []
        self.open_s = self.missing_s = 0.0
        self.missing_tokens = 0
        self.streamed = False
        self.request: BlendRequest | None = None  # None for reuse
        self.key: tuple = ()
        self.read: set[int] = set()  # layers read through the streamed loader
        self.failed: dict[int, tuple[Exception, str]] = {}  # segments found damaged off the caller's thread

    def _recompute(self, j: int, runtime: "WorkerRuntime", exc: Exception, what: str) -> None:
        """Segment j's entry went bad (or its tier away) mid-read: compute it now, never serve it."""
        p, token_ids = self.load.params, self.load.token_ids
        seg = p.segments[j]
        # the store has logged the damage (or, rate-limited, the failing tier) once already
        log.debug("chunk KV %s unreadable %s (%s); recomputing it", seg.key, what, exc)
        self.handles[j].close()
        t0 = time.perf_counter()
        self.handles[j] = runtime._compute_for_request(seg.key, token_ids[: p.lead_in_len], seg.start,
                                                       token_ids[seg.start:seg.start + seg.length], p.kv_context)
        self.missing_s += time.perf_counter() - t0  # a missing segment like one missed at open
        self.missing_tokens += seg.length
        self.tiers[j] = COMPUTED

    def _guarded(self, j: int, runtime: "WorkerRuntime", read: Callable[[Any], Any], what: str,
                 compute: bool = True) -> Any:
        """``read(handle)`` of segment j; when its entry turns out damaged or its tier went away, the
        segment is recomputed and read from that. Without ``compute`` (the prefetch thread: a model
        forward there would run beside the blend's) the damage is kept for the caller's thread and
        :class:`~ragcache.blend.LoadOnCaller` raised."""
        if j in self.failed:  # found damaged by the prefetch thread
            if not compute:
                raise LoadOnCaller(f"segment {j} needs recomputing {self.failed[j][1]}")
            self._recompute(j, runtime, *self.failed.pop(j))
            return read(self.handles[j])
        try:
            return read(self.handles[j])
        except (CorruptEntryError, TierError, OSError) as exc:
            if not compute:
                self.failed[j] = (exc, what)
                raise LoadOnCaller(f"segment {j} needs recomputing {what}") from exc
            self._recompute(j, runtime, exc, what)
            return read(self.handles[j])

    def stored_layer(self, j: int, i: int, runtime: "WorkerRuntime", compute: bool = True) -> StoredLayer:
        """Layer i of segment j as stored (:class:`~ragcache.kvstore.codec.StoredLayer`); ``compute``
        as in :meth:`_guarded`."""
        self.read.add(i)
        return self._guarded(j, runtime, lambda h: h.stored_layer(i), f"at layer {i}", compute)

    def stored_entries(self, runtime: "WorkerRuntime") -> list[StoredEntry]:
        """Every segment's whole entry, in row order."""
        return [self._guarded(j, runtime, lambda h: h.stored_entry(), "when read whole")
                for j in range(len(self.handles))]

    def read_rest(self, runtime: "WorkerRuntime") -> None:
        """After a streamed load: read the layers the blend did not (below the check layer), so that a
        handle promotes its entry (it does once every layer was read). Staged loads read them all."""
        if not self.streamed:
            return
        for i in sorted(set(range(runtime.ops.num_layers)) - self.read):
            for j in range(len(self.handles)):
                self.stored_layer(j, i, runtime)  # read, not decoded

    def close(self) -> None:
        for handle in self.handles:
            handle.close()

    def stats(self, result: BlendResult, stage_s: float, promote_s: float, worker_s: float,
              num_layers: int) -> ContextStats:
        n = self.load.params.ctx_len
        recomputed = int(result.num_recomputed)
        stages = {"open_s": self.open_s, "missing_compute_s": self.missing_s, **result.stages,
                  "promote_s": promote_s}
        stages["load_wait_s"] = stages.get("load_wait_s", 0.0) + stage_s  # the staging copy is the load
        return ContextStats(
            ctx_tokens=n, reused_tokens=n - recomputed, recomputed_tokens=recomputed,
            missing_computed_tokens=self.missing_tokens, chunk_tiers=self.tiers[1:], head_tier=self.tiers[0],
            load_s=self.open_s + stage_s + result.load_s, compute_s=self.missing_s + result.compute_s,
            write_s=result.on_layer_s, worker_s=worker_s, stages=stages,
            recomputed_layers=result.recomputed_layers, model_layers=num_layers,
            attention_pairs=result.attention_pairs, recompute_budget=result.budget.tokens if result.budget is not None else 0,
            budget_reason=result.budget.reason if result.budget is not None else "",
        )


def _streamed_loader(group: list[_Opened], runtime: WorkerRuntime) -> LoadLayer:
    """``load_layer`` over a pass's requests: one layer of every segment, in row order, decoded on the
    engine's device in its dtype.

    Called from another thread (the blend's prefetch), a segment found damaged is not recomputed
    there: that is a model forward beside the blend's own, and vLLM's CPU GEMM shares one scratch
    buffer per process (two threads in it corrupt each other's results). The loader raises
    :class:`~ragcache.blend.LoadOnCaller` instead, and the recompute runs when the caller's thread
    loads the layer again; the segments read before the damaged one are kept for that load, not read
    a second time. The prefetch and the caller's load of a layer never overlap (the caller loads it
    again only once the prefetch has raised)."""
    device, dtype = runtime.ops.device, runtime.ops.dtype
    caller = threading.get_ident()
    read_before: dict[int, dict[tuple[int, int], StoredLayer]] = {}  # layer -> (request, segment) read

    def load_layer(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        here = threading.get_ident() == caller
        done = read_before.setdefault(i, {})
        layers = []
        for r, opened in enumerate(group):
            for j in range(len(opened.handles)):
                if (r, j) not in done:
                    done[(r, j)] = opened.stored_layer(j, i, runtime, here)  # may raise LoadOnCaller
                layers.append(done[(r, j)])
        del read_before[i]
        return decode_layers(layers, dtype, device)

    return load_layer


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

    def ragcache_precompute(self, head_ids: list[int], items: list[list[Any]],
                            context_ids: list[int] | None = None) -> dict[str, Any]:
        """See :meth:`WorkerRuntime.precompute`: ``PrecomputeItem.to_list()`` rows in,
        ``PrecomputeReport.to_dict()`` out."""
        return self._ragcache.precompute(head_ids, [PrecomputeItem.from_list(i) for i in items],
                                         context_ids or ()).to_dict()

    def ragcache_op_counts(self, steps: int = 0) -> list[dict[str, Any]]:
        """See :meth:`WorkerRuntime.count_ops`: arm the count of the next ``steps`` load steps and
        return the counts recorded since the previous call."""
        return self._ragcache.count_ops(steps)

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
