"""The ragcache KV connector for vLLM 0.32 (``KVConnectorBase_V1``), loaded by module path.

Owns: telling vLLM's scheduler which prompt tokens are served from chunk KV, and, in the worker,
filling vLLM's paged KV cache with their final K/V (reused and moved, or CacheBlend-blended).
Modelled on vLLM's ``example_connector.py``. Two instances exist: the scheduler side (in the
engine core) and the worker side (with the model). Nothing here imports ragcache.pipeline, app/
or ui/.

A request opts in through ``SamplingParams(extra_args={"kv_transfer_params": {"ragcache": {...}}})``
with the dict of :meth:`ragcache.prompt.AssembledPrompt.transfer_params` plus ``rid`` (ragcache's
request id), ``mode`` ("reuse" or "blend") and the blend knobs. Such a request carries a unique
``cache_salt`` so that its approximate KV never serves another request as an exact prefix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PARAMS_KEY = "ragcache"


@dataclass
class LoadRequest:
    """What the worker needs to fill one request's context KV (plain data, sent between processes).

    Attributes:
        req_id: vLLM's request id.
        params: the request's ``kv_transfer_params["ragcache"]`` dict (rid, mode, segments, ...).
        token_ids: the context tokens ``[0, ctx_len)`` of the prompt.
        block_ids: the request's paged-cache block ids (first KV cache group), in order.
    """

    req_id: str
    params: dict[str, Any]
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class RagcacheConnectorMetadata(KVConnectorMetadata):
    """Per-step metadata: the requests whose context KV the worker loads before this step's forward."""

    loads: list[LoadRequest] = field(default_factory=list)


def _ragcache_params(request: "Request") -> dict[str, Any] | None:
    params = request.kv_transfer_params or {}
    p = params.get(PARAMS_KEY)
    return p if isinstance(p, dict) else None


class RagcacheConnector(KVConnectorBase_V1):
    """Serves chunk KV from ragcache's tiered store into vLLM (see module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._pending: dict[str, tuple["Request", list[int]]] = {}
        # worker side: set by the worker extension (ragcache.engine.worker) via ragcache_init
        self.runtime: Any = None

    # ==============================
    # Worker-side methods
    # ==============================

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Fill the paged cache with the final context K/V of every request in this step's metadata.

        Runs synchronously before the step's forward: the whole context is written (all layers),
        so ``wait_for_layer_load`` has nothing to wait for.

        Raises:
            RuntimeError: a request asked for chunk KV before ``ragcache_init`` set up the worker.
        """
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagcacheConnectorMetadata) or not meta.loads:
            return
        if self.runtime is None:
            raise RuntimeError("ragcache connector used before ragcache_init; create engines with BlendEngine")
        for load in meta.loads:
            self.runtime.load_request(load, self.block_size)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # chunk KV is computed by ragcache itself (at ingest or on a miss), never read back

    def wait_for_save(self) -> None:
        return

    # ==============================
    # Scheduler-side methods
    # ==============================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Claim the request's context tokens ``[num_computed_tokens, ctx_len)`` as externally computed.

        Side-effect free. Requests without ragcache params claim nothing. At least one prompt token
        (the tail) is always left for vLLM to prefill.
        """
        p = _ragcache_params(request)
        if p is None:
            return 0, False
        ctx_len = min(int(p["ctx_len"]), request.num_prompt_tokens - 1)
        return max(0, ctx_len - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens > 0:
            self._pending[request.request_id] = (request, list(blocks.get_block_ids()[0]))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Turn this step's newly scheduled ragcache requests into :class:`LoadRequest` entries."""
        meta = RagcacheConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new_req.req_id, None)
            if pending is None:
                continue
            request, _ = pending
            p = _ragcache_params(request)
            ctx_len = int(p["ctx_len"])
            meta.loads.append(LoadRequest(
                req_id=new_req.req_id,
                params=p,
                token_ids=list(request.prompt_token_ids[:ctx_len]),
                block_ids=list(new_req.block_ids[0]),
            ))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: load again
            pending = self._pending.pop(req_id, None)
            if pending is None or cached.new_block_ids[i] is None:
                continue
            request, _ = pending
            p = _ragcache_params(request)
            meta.loads.append(LoadRequest(
                req_id=req_id,
                params=p,
                token_ids=list(request.prompt_token_ids[: int(p["ctx_len"])]),
                block_ids=list(cached.new_block_ids[i][0]),
            ))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        p = _ragcache_params(request)
        return False, ({"ragcache_rid": p.get("rid")} if p else None)
