"""The ragcache KV connector for vLLM 0.32 (``KVConnectorBase_V1``), loaded by module path.

Owns: telling vLLM's scheduler which prompt tokens are served from chunk KV, and, in the worker,
filling vLLM's paged KV cache with their final K/V (reused and moved, or CacheBlend-blended).
Modelled on vLLM's ``example_connector.py``. Two instances exist: the scheduler side (in the
engine core) and the worker side (with the model). Nothing here imports ragcache.pipeline, app/
or ui/.

A request opts in through ``SamplingParams(extra_args={"kv_transfer_params": {TRANSFER_KEY:
BlendParams.to_dict()}})`` (see :mod:`ragcache.engine.messages`); such a request carries a unique
``cache_salt`` so that its approximate KV never serves another request as an exact prefix.

The worker's :class:`~ragcache.engine.messages.ContextStats` travel back with the request: the
worker side hands them to the scheduler side in the step's worker metadata
(``build_connector_worker_meta`` -> ``update_connector_output``), and ``request_finished`` returns
them as the request's ``kv_transfer_params``, which vLLM puts on the ``RequestOutput``. A request
that finishes in the step that loaded it (e.g. ``max_tokens=1``) is finished *before* that step's
worker metadata is read (vLLM 0.32 ``Scheduler.update_from_output``): ``request_finished`` then
returns a dict that ``update_connector_output`` fills in later in the same call, before the
step's outputs leave the engine core.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from ragcache.engine.messages import TRANSFER_KEY, BlendParams, ContextStats, LoadRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class RagcacheConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step: the requests whose context KV the worker loads before the forward."""

    loads: list[LoadRequest] = field(default_factory=list)


@dataclass
class RagcacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: ``{req_id: ContextStats.to_dict()}`` of the requests loaded."""

    stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, RagcacheWorkerMetadata):
            self.stats.update(other.stats)
        return self


def blend_params(request: "Request") -> BlendParams | None:
    """The request's :class:`BlendParams`, or None for a request that does not use the connector.

    Raises:
        ValueError: the request carries malformed ragcache params.
    """
    p = (request.kv_transfer_params or {}).get(TRANSFER_KEY)
    return BlendParams.from_dict(p) if isinstance(p, dict) and "mode" in p else None


class RagcacheConnector(KVConnectorBase_V1):
    """Serves chunk KV from ragcache's tiered store into vLLM (see module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        self.step_tokens = int(extra.get("step_tokens", 0))  # context tokens loaded per step (0 = no limit)
        # scheduler side
        self._admitted = 0  # context tokens of the loads admitted into the step being scheduled
        self._pending: dict[str, tuple["Request", BlendParams]] = {}
        self._loading: set[str] = set()  # loads sent to the worker, stats not back yet
        self._stats: dict[str, dict[str, Any]] = {}  # stats back, request not finished yet
        self._awaiting: dict[str, dict[str, Any]] = {}  # finished before its stats came back
        # worker side: set by the worker extension (ragcache.engine.worker) via ragcache_init
        self.runtime: Any = None
        self._done: dict[str, dict[str, Any]] = {}
        self._load_errors: set[int] = set()  # blocks of failed loads, for vLLM to recompute

    # ==============================
    # Worker-side methods
    # ==============================

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Fill the paged cache with the final context K/V of every request in this step's metadata.

        Runs synchronously before the step's forward (the claim is not asynchronous): the whole
        context is written (all layers), so ``wait_for_layer_load`` has nothing to wait for. The
        step's loads go to the worker together (:meth:`WorkerRuntime.load_step
        <ragcache.engine.worker.WorkerRuntime.load_step>`), which serves the blends that can share a
        pass in one.

        A load that raises is not re-raised (it would stop vLLM's engine with every request in it):
        vLLM recomputes that request's context instead (:meth:`_load_failed`).

        Raises:
            RuntimeError: a request asked for chunk KV before ``ragcache_init`` set up the worker.
        """
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagcacheConnectorMetadata) or not meta.loads:
            return
        if self.runtime is None:
            raise RuntimeError("ragcache connector used before ragcache_init; create engines with BlendEngine")
        try:
            done = self.runtime.load_step(meta.loads, self.block_size)
        except Exception as exc:  # a failure must not take the engine (and every request) down
            done = dict.fromkeys((load.req_id for load in meta.loads), exc)
        for load in meta.loads:
            got = done[load.req_id]
            self._done[load.req_id] = self._load_failed(load, got) if isinstance(got, Exception) else got.to_dict()

    def _load_failed(self, load: LoadRequest, exc: Exception) -> dict[str, Any]:
        """A load that raised: its context blocks are reported to vLLM as not loaded
        (:meth:`get_block_ids_with_load_errors`), and vLLM, under ``kv_load_failure_policy =
        "recompute"`` (set by the engine), prefills the whole prompt itself: the request is answered
        by full prefill, its stats say why (``ContextStats.load_error``), the log has the traceback."""
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        log.warning("ragcache could not serve the context of request %s (%s); vLLM prefills the whole prompt "
                    "instead", load.req_id, error, exc_info=exc)
        self._load_errors.update(load.block_ids[:-(-load.params.ctx_len // self.block_size)])
        return ContextStats(load_error=error).to_dict()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The paged-cache blocks of this step's loads that failed (see :meth:`_load_failed`), once."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # chunk KV is computed by ragcache itself (at ingest or on a miss), never read back

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        """vLLM shuts the worker down (``engine.close()``, the engine core's exit): the store's
        lookup counts go to its counter file now, in the sync and the async engine alike."""
        if self.runtime is not None:
            self.runtime.store.ledger.flush()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The stats of the requests loaded this step (None when there were none)."""
        if not self._done:
            return None
        done, self._done = self._done, {}
        return RagcacheWorkerMetadata(stats=done)

    # ==============================
    # Scheduler-side methods
    # ==============================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Claim the request's context tokens ``[num_computed_tokens, ctx_len)`` as externally computed.

        Side-effect free. Requests without ragcache params claim nothing. At least one prompt token
        (the tail) is always left for vLLM to prefill.

        Pacing: the worker loads (blends) a step's requests before the step's forward (in one pass
        where they can share it, :meth:`WorkerRuntime.load_step
        <ragcache.engine.worker.WorkerRuntime.load_step>`), so every request admitted into a step
        waits for all of them. Once the step holds
        ``step_tokens`` context tokens (``engine.connector_step_tokens``), another request is
        deferred to a later step (``None``: vLLM keeps it waiting and asks again); the first load
        of a step always goes. Under load this serves requests one by one as they arrive, as vLLM's
        chunked prefill does for full prefills, instead of making each wait for every other.
        """
        p = blend_params(request)
        if p is None:
            return 0, False
        ctx_len = min(p.ctx_len, request.num_prompt_tokens - 1)
        claim = max(0, ctx_len - num_computed_tokens)
        if claim and self.step_tokens and self._admitted and self._admitted + claim > self.step_tokens:
            return None, False
        return claim, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens > 0:
            self._pending[request.request_id] = (request, blend_params(request))
            self._admitted += num_external_tokens

    def _load(self, req_id: str, request: "Request", params: BlendParams, block_ids: list[int]) -> LoadRequest:
        self._loading.add(req_id)
        return LoadRequest(req_id=req_id, params=params, token_ids=list(request.prompt_token_ids),
                           block_ids=list(block_ids))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Turn this step's newly scheduled ragcache requests into :class:`LoadRequest` entries (the
        end of the step's scheduling: the pacing budget starts afresh)."""
        self._admitted = 0
        meta = RagcacheConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new_req.req_id, None)
            if pending is not None:
                meta.loads.append(self._load(new_req.req_id, *pending, new_req.block_ids[0]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: load again
            pending = self._pending.pop(req_id, None)
            if pending is not None and cached.new_block_ids[i] is not None:
                meta.loads.append(self._load(req_id, *pending, cached.new_block_ids[i][0]))
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Receive the worker's per-request stats (see the module docstring for the ordering)."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, RagcacheWorkerMetadata):
            return
        for req_id, stats in meta.stats.items():
            self._loading.discard(req_id)
            waiting = self._awaiting.pop(req_id, None)
            if waiting is not None:
                waiting.update(stats)
            else:
                self._stats[req_id] = stats

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Return the request's :class:`~ragcache.engine.messages.ContextStats` dict as its kv_transfer_params."""
        req_id = request.request_id
        self._pending.pop(req_id, None)
        stats = self._stats.pop(req_id, None)
        if stats is None:
            if req_id not in self._loading:
                return False, None  # never loaded (not a ragcache request, or aborted before its load)
            self._loading.discard(req_id)
            stats = self._awaiting[req_id] = {}  # filled by update_connector_output in this same step
        return False, {TRANSFER_KEY: stats}
