"""BlendEngine: the embedded vLLM engine with ragcache's KV connector and worker extension.

Owns: creating ``vllm.LLM`` with the connector (by module path) and the worker extension, the
four query modes, KV precompute calls, and per-request metrics. Streaming and batches go through
the same engine (``LLMEngine.add_request`` / ``step`` with DELTA outputs), so one engine serves
``generate``, ``generate_many`` and ``stream``; a lock keeps callers from stepping it concurrently.

Modes (one prompt, four ways):
  ``full``   normal prefill, no reuse (a unique ``cache_salt`` defeats prefix caching);
  ``prefix`` vLLM's own prefix caching only (exact prefixes of earlier prompts);
  ``reuse``  every chunk's KV moved to its new position, nothing recomputed;
  ``blend``  CacheBlend: reuse plus recompute of the HKVD tokens (default).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

from ragcache.chunks import KV_LAYOUT_VERSION, Chunk
from ragcache.config import MODES, Settings
from ragcache.models import LLMInfo, resolve_llm
from ragcache.prompt import AssembledPrompt, PromptBuilder

log = logging.getLogger(__name__)

# vLLM lowers torch to one thread per worker unless OMP_NUM_THREADS is set (10x slower on CPU).
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))


@dataclass
class GenerationMetrics:
    """Per-request numbers. Times in seconds, sizes in tokens.

    ttft_s is vLLM's ``first_token_latency`` (queueing + connector load/blend + prefill of the tail).
    """

    mode: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    ctx_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    missing_computed_tokens: int = 0
    num_cached_tokens: int = 0
    load_s: float = 0.0
    blend_s: float = 0.0
    output_tokens: int = 0
    chunk_tiers: list[str] = field(default_factory=list)
    tier_hits: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Generation:
    """An answer: text, token ids and metrics."""

    text: str
    token_ids: list[int]
    metrics: GenerationMetrics
    first_token_logprobs: dict[int, float] | None = None


def _default_dtype(setting: str) -> str:
    if setting != "auto":
        return setting
    try:
        import torch

        return "bfloat16" if torch.cuda.is_available() else "float32"
    except Exception:  # pragma: no cover - torch always importable beside vLLM
        return "float32"


class BlendEngine:
    """Embedded vLLM with chunk-KV reuse and CacheBlend.

    Args:
        settings: ragcache settings (engine, blend, store, prompt sections are used).
        llm: an already provisioned model; resolved from ``settings.models`` when None.

    Raises:
        ModelNotFoundError: the configured model cannot be found (see ragcache.models).
    """

    def __init__(self, settings: Settings, llm: LLMInfo | None = None):
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.settings = settings
        self._lock = threading.RLock()
        self.llm_info = llm or resolve_llm(settings.models.model, settings.models.cache_dir)
        t0 = time.perf_counter()
        # read by vLLM when the engine is created (vllm.envs is evaluated lazily)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if settings.engine.in_process else "1"
        kv_config = KVTransferConfig(
            kv_connector="RagcacheConnector",
            kv_connector_module_path="ragcache.engine.connector",
            kv_role="kv_both",
        )
        eng = settings.engine
        self.llm = LLM(
            model=str(self.llm_info.path),
            dtype=_default_dtype(eng.dtype),
            max_model_len=eng.max_model_len,
            kv_cache_memory_bytes=eng.kv_cache_memory_bytes,
            enforce_eager=eng.enforce_eager,
            enable_prefix_caching=True,
            disable_log_stats=False,
            max_logprobs=-1,  # full first-token distributions for quality checks (KL)
            kv_transfer_config=kv_config,
            worker_extension_cls="ragcache.engine.worker.RagcacheWorkerExtension",
            seed=0,
        )
        self.device = self.llm.collective_rpc(
            "ragcache_init",
            args=(settings.store.model_dump(mode="json"), self.llm_info.fingerprint, KV_LAYOUT_VERSION),
        )[0]
        self.tokenizer = self.llm.get_tokenizer()
        self.prompts = PromptBuilder(self.tokenizer, settings.prompt, self.llm_info.fingerprint)
        # one tiny blend request: the first one pays for lazy kernel and allocator set-up
        self.generate(self.prompts.build("warm up", []), "blend", max_tokens=1)
        self.startup_s = time.perf_counter() - t0
        log.info("BlendEngine ready on %s in %.1f s", self.device, self.startup_s)

    # ---- KV precompute ---------------------------------------------------------------------

    def precompute(self, chunks: Sequence[Chunk], *, show_progress: bool = False,
                   batch_size: int = 8) -> dict[str, Any]:
        """Compute and store the KV of the head and of each chunk's unit not stored yet.

        Blocks the engine while it runs: call it at ingest time, not beside live requests.
        Chunks go to the worker ``batch_size`` at a time (a tqdm bar on stderr when
        ``show_progress``). Returns ``{"computed", "skipped", "tokens", "seconds"}`` (seconds of
        worker compute, tokens of the computed units).
        """
        from tqdm import tqdm

        total = {"computed": 0, "skipped": 0, "tokens": 0, "seconds": 0.0}
        bar = tqdm(total=len(chunks), unit="chunk", desc="KV precompute", disable=not show_progress)
        with self._lock, bar:
            batches = [(list(), [[self.prompts.head_key, self.prompts.head_ids]])]
            items = [[self.prompts.key(c), self.prompts.unit_ids(c)] for c in chunks]
            batches += [(self.prompts.head_ids, items[i:i + batch_size]) for i in range(0, len(items), batch_size)]
            for n, (lead_in, batch) in enumerate(batches):
                out = self.llm.collective_rpc("ragcache_precompute", args=(lead_in, batch))[0]
                for k in total:
                    total[k] += out[k]
                if n:  # the head is not one of the user's chunks
                    bar.update(len(batch))
                    bar.set_postfix_str(f"{total['tokens'] / max(total['seconds'], 1e-9):,.0f} tok/s")
        return total

    # ---- generation ------------------------------------------------------------------------

    def build_prompt(self, question: str, chunks: Sequence[Chunk]) -> AssembledPrompt:
        """The prompt for ``question`` over ``chunks`` (in the given order). See ragcache.prompt."""
        return self.prompts.build(question, chunks, max_len=self.settings.engine.max_model_len)

    def _request(self, prompt: AssembledPrompt, mode: str, max_tokens: int | None, recompute_ratio: float | None,
                 logprobs: int | None, delta: bool) -> tuple[str, dict[str, Any], Any]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        rid = uuid.uuid4().hex
        extra = None
        if mode in ("reuse", "blend"):
            b = self.settings.blend
            params = prompt.transfer_params()
            params.update(rid=rid, mode=mode,
                          recompute_ratio=b.recompute_ratio if recompute_ratio is None else recompute_ratio,
                          check_layer=b.check_layer, deviation=b.deviation, pipeline_overlap=b.pipeline_overlap)
            extra = {"kv_transfer_params": {"ragcache": params}}
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens or self.settings.engine.max_tokens,
            logprobs=logprobs,
            extra_args=extra,
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
        )
        inputs: dict[str, Any] = {"prompt_token_ids": list(prompt.token_ids)}
        if mode != "prefix":
            inputs["cache_salt"] = rid  # never share (or reuse) exact-prefix blocks with others
        return rid, inputs, sp

    def _metrics(self, rid: str, mode: str, prompt: AssembledPrompt, out: Any, total_s: float,
                 output_tokens: int) -> GenerationMetrics:
        m = out.metrics
        ttft = float(getattr(m, "first_token_latency", 0.0) or 0.0) if m is not None else 0.0
        stats = self.llm.collective_rpc("ragcache_pop_stats", args=(rid,))[0] or {}
        return GenerationMetrics(
            mode=mode, ttft_s=ttft, total_s=total_s, prompt_tokens=len(prompt.token_ids),
            ctx_tokens=prompt.ctx_len,
            reused_tokens=int(stats.get("reused_tokens", 0)),
            recomputed_tokens=int(stats.get("recomputed_tokens", 0)),
            missing_computed_tokens=int(stats.get("missing_computed_tokens", 0)),
            num_cached_tokens=int(out.num_cached_tokens or 0),
            load_s=float(stats.get("load_s", 0.0)), blend_s=float(stats.get("blend_s", 0.0)),
            output_tokens=output_tokens,
            chunk_tiers=list(stats.get("chunk_tiers", [])), tier_hits=dict(stats.get("tier_hits", {})),
        )

    def generate_many(self, prompts: Sequence[AssembledPrompt], mode: str | None = None, *,
                      max_tokens: int | None = None, recompute_ratio: float | None = None,
                      logprobs: int | None = None) -> list[Generation]:
        """Run several prompts as one batch (concurrent in vLLM); greedy decoding.

        Args:
            mode: full, prefix, reuse or blend (default ``engine.mode``).
            logprobs: when set, the first generated token's top-``logprobs`` log-probabilities are
                returned (-1 = the whole vocabulary), for quality measurements.

        Raises:
            ValueError: unknown mode.
        """
        mode = mode or self.settings.engine.mode
        t0 = time.perf_counter()
        reqs = [self._request(p, mode, max_tokens, recompute_ratio, logprobs, delta=False) for p in prompts]
        with self._lock:
            outs = self.llm.generate([inp for _, inp, _ in reqs], [sp for _, _, sp in reqs], use_tqdm=False)
            total = time.perf_counter() - t0
            results = []
            for (rid, _, _), prompt, out in zip(reqs, prompts, outs):
                comp = out.outputs[0]
                first_lp = None
                if logprobs is not None and comp.logprobs:
                    first_lp = {tok: lp.logprob for tok, lp in comp.logprobs[0].items()}
                results.append(Generation(comp.text, list(comp.token_ids),
                                          self._metrics(rid, mode, prompt, out, total, len(comp.token_ids)),
                                          first_lp))
        return results

    def generate(self, prompt: AssembledPrompt, mode: str | None = None, **kwargs: Any) -> Generation:
        """One prompt; see :meth:`generate_many`."""
        return self.generate_many([prompt], mode, **kwargs)[0]

    def stream(self, prompt: AssembledPrompt, mode: str | None = None, *, max_tokens: int | None = None,
               recompute_ratio: float | None = None) -> Iterator[str | Generation]:
        """Yield text pieces as they are decoded, then the final :class:`Generation`."""
        mode = mode or self.settings.engine.mode
        rid, inputs, sp = self._request(prompt, mode, max_tokens, recompute_ratio, None, delta=True)
        engine = self.llm.llm_engine
        t0 = time.perf_counter()
        text, token_ids, last = [], [], None
        with self._lock:
            req_id = engine.add_request(rid, inputs, sp)  # internal id = rid + random suffix
            finished = False
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.request_id not in (rid, req_id):
                            continue
                        piece = out.outputs[0].text
                        token_ids.extend(out.outputs[0].token_ids)
                        last = out
                        if piece:
                            text.append(piece)
                            yield piece
                finished = True
            finally:
                if not finished:  # the reader stopped early: free the request's slots in vLLM
                    engine.abort_request([req_id], internal=True)
                    self.llm.collective_rpc("ragcache_pop_stats", args=(rid,))
            metrics = self._metrics(rid, mode, prompt, last, time.perf_counter() - t0, len(token_ids))
        yield Generation("".join(text), token_ids, metrics)

    # ---- store -----------------------------------------------------------------------------

    def store_stats(self) -> dict[str, Any]:
        """Per-tier stats of the worker's KV store (see ragcache.kvstore.TieredStore.stats)."""
        with self._lock:
            return self.llm.collective_rpc("ragcache_store_stats")[0]

    def stored_tiers(self, chunks: Sequence[Chunk]) -> list[str | None]:
        """For each chunk, the highest tier holding its KV, or None."""
        with self._lock:
            return self.llm.collective_rpc("ragcache_store_contains",
                                           args=([self.prompts.key(c) for c in chunks],))[0]

    def forget(self, chunks: Sequence[Chunk]) -> int:
        """Delete the stored KV of ``chunks`` from every tier; returns how many entries were removed."""
        with self._lock:
            return self.llm.collective_rpc("ragcache_store_delete", args=([self.prompts.key(c) for c in chunks],))[0]

    def clear_store(self) -> None:
        with self._lock:
            self.llm.collective_rpc("ragcache_store_clear")

    def close(self) -> None:
        """Shut the engine core (and its worker processes) down; the engine is unusable afterwards."""
        with self._lock:
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache (for fair side-by-side measurements)."""
        with self._lock:
            self.llm.reset_prefix_cache()
