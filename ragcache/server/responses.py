"""The response bodies of ``ragcache serve``, as pydantic models: what the server sends and
:mod:`ragcache.server.client` reads back.

Owns: :class:`ChatCompletionResponse`, its stream's :class:`ChatCompletionChunk`, the ``ragcache``
object added to both (:class:`RagcacheResult`: index, sources, metrics, prompt), :class:`Usage`,
:class:`ErrorResponse`, the :class:`ModelList` of GET /v1/models, :class:`Health` (GET /health)
and :class:`CacheReport` (GET /v1/cache). Shapes follow OpenAI's API as the ``openai`` SDK parses
them (https://platform.openai.com/docs/api-reference/chat), in the manner of vLLM's OpenAI server
(``vllm/entrypoints/openai/protocol.py``): a key OpenAI leaves out rather than sending null is a
field left out of the JSON when None (:func:`_omitted_when_none`). Each model's ``of`` builds it
from the SDK's objects (:class:`~ragcache.pipeline.Answer`, :class:`~ragcache.pipeline.Source`).
The metrics of an answer travel as the one :class:`~ragcache.engine.messages.RequestMetrics`
record (``to_dict()`` here, ``from_dict()`` in the client). Imports pydantic and ragcache's
pipeline / engine.messages types only; no engine, no FastAPI.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from ragcache.engine.messages import TierStats
from ragcache.pipeline import Answer, Source

#: characters of a source's text returned as its ``snippet``
SNIPPET_CHARS = 240


def _none(value: Any) -> bool:
    return value is None


def _omitted_when_none() -> Any:
    """A field left out of the JSON when None (OpenAI omits such keys; a None elsewhere is sent as null)."""
    return Field(None, exclude_if=_none)


def completion_id() -> str:
    """A fresh ``chatcmpl-...`` id."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def cached_tokens(answer: Answer) -> int:
    """Prompt tokens whose KV was not computed for this request: the reused chunk KV in reuse/blend
    mode, vLLM's prefix-cache hits in prefix mode, 0 in full mode."""
    m = answer.metrics
    if m.mode in ("reuse", "blend"):
        return m.reused_tokens
    return m.num_cached_tokens if m.mode == "prefix" else 0


def finish_reason(answer: Answer) -> str:
    """OpenAI's finish reason: ``"length"`` when max_tokens (or the context) ended the answer, else ``"stop"``."""
    return "length" if answer.finish_reason == "length" else "stop"


class ErrorInfo(BaseModel):
    """OpenAI's error object: what is wrong and how to fix it, its type, the field at fault, a stable code."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """An error answer: ``{"error": {"message", "type", "param", "code"}}`` (raised as
    :class:`ragcache.server.schemas.APIError`)."""

    error: ErrorInfo


class SourceInfo(BaseModel):
    """One retrieved chunk in ``ragcache.sources``: its document, score (cosine, 4 decimals), the KV
    tier that served it (None: not known yet, in a stream's first chunk) and the first
    :data:`SNIPPET_CHARS` characters of its text, whitespace collapsed."""

    doc_id: str
    title: str
    chunk_id: str
    score: float
    tier: str | None
    snippet: str

    @classmethod
    def of(cls, s: Source, tier: str | None) -> "SourceInfo":
        return cls(doc_id=s.doc_id, title=s.title, chunk_id=s.chunk_id, score=round(float(s.score), 4), tier=tier,
                   snippet=" ".join(s.text.split())[:SNIPPET_CHARS])


class RagcacheResult(BaseModel):
    """The ``ragcache`` object of a response: the index, the sources (unless the request set
    ``return_sources`` false), the metrics once answered and the prompt text when asked for
    (``return_prompt``); absent keys are left out, not null.

    ``metrics`` is the answer's :class:`~ragcache.engine.messages.RequestMetrics` as ``to_dict()``
    writes it (every field, seconds as measured, plus the derived ``tier_hits``);
    ``RequestMetrics.from_dict`` reads it back whole (:func:`ragcache.server.client.answer_from`).
    """

    index: str
    sources: list[SourceInfo] | None = _omitted_when_none()
    metrics: dict[str, Any] | None = _omitted_when_none()
    prompt: str | None = _omitted_when_none()

    @classmethod
    def of(cls, index: str, *, sources: list[Source] | None = None, answer: Answer | None = None,
           prompt: str | None = None, with_sources: bool = True) -> "RagcacheResult":
        """Before the answer (``sources``: their tiers not known yet) or with it (``answer``);
        ``with_sources``: the request's ``return_sources``; ``prompt``: given when it asked for it."""
        listed = None
        if with_sources:
            srcs = answer.sources if answer is not None else sources or []
            listed = [SourceInfo.of(s, (s.tier or None) if answer is not None else None) for s in srcs]
        return cls(index=index, sources=listed, metrics=None if answer is None else answer.metrics.to_dict(),
                   prompt=prompt)


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    """OpenAI usage with ``prompt_tokens_details.cached_tokens`` (see :func:`cached_tokens`)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, answer: Answer) -> "Usage":
        m = answer.metrics
        return cls(prompt_tokens=m.prompt_tokens, completion_tokens=m.output_tokens,
                   total_tokens=m.prompt_tokens + m.output_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens(answer)))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    """A ``chat.completion`` object with usage and the ``ragcache`` object."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    ragcache: RagcacheResult

    @classmethod
    def of(cls, cid: str, model: str, answer: Answer, extra: RagcacheResult) -> "ChatCompletionResponse":
        return cls(id=cid, created=int(time.time()), model=model,
                   choices=[Choice(message=AssistantMessage(content=answer.text), finish_reason=finish_reason(answer))],
                   usage=Usage.of(answer), ragcache=extra)


class Delta(BaseModel):
    """A stream chunk's piece of the message: the role (first chunk), text, or neither (the finish chunk)."""

    role: Literal["assistant"] | None = _omitted_when_none()
    content: str | None = _omitted_when_none()


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """A ``chat.completion.chunk``: one choice with a delta (and a finish reason), or, with ``usage``,
    the final usage chunk whose ``choices`` is empty; ``ragcache`` on the first chunk (the sources)
    and on the last (sources with tiers, metrics)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = _omitted_when_none()
    ragcache: RagcacheResult | None = _omitted_when_none()

    @classmethod
    def of(cls, cid: str, model: str, created: int, *, delta: Delta | None = None, finish: str | None = None,
           usage: Usage | None = None, extra: RagcacheResult | None = None) -> "ChatCompletionChunk":
        choices = [] if usage is not None else [ChunkChoice(delta=delta or Delta(), finish_reason=finish)]
        return cls(id=cid, created=created, model=model, choices=choices, usage=usage, ragcache=extra)


class ModelCard(BaseModel):
    """One index, offered as a model: its name is the ``model`` to send; ``created`` when it was last
    written (seconds since the epoch, 0 when unknown)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ragcache"


class ModelList(BaseModel):
    """GET /v1/models: one :class:`ModelCard` per index the caller may read."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class BlendAvailability(BaseModel):
    """Whether reuse/blend can run (the engine's start-up self-check), and why not."""

    available: bool
    reason: str | None


class KeysFileHealth(BaseModel):
    """The state of ``serve.keys_file`` (:class:`~ragcache.server.keys.KeysFileStatus`): ``ok``,
    ``empty`` (every scoped key refused), ``missing`` or ``invalid`` (every key refused with 503,
    unless ``serve.keys_invalid = "keep"`` keeps the keys read before an invalid file), since when
    (unix seconds). /health is open to everyone: it says nothing about the keys themselves."""

    state: Literal["ok", "empty", "missing", "invalid"]
    since: float


class Health(BaseModel):
    """GET /health: the engine (device, seconds it took to start, dtype), the mode requests get by
    default and whether reuse/blend is available, requests in flight here and unfinished in vLLM,
    the default index, the model and the keys file's state (null without one)."""

    status: Literal["ok"] = "ok"
    device: str
    startup_s: float
    mode: str
    blend: BlendAvailability
    dtype: str
    in_flight: int
    engine_unfinished_requests: int
    default_index: str
    model: str
    keys_file: KeysFileHealth | None = None


class CacheReport(BaseModel):
    """GET /v1/cache: the KV store's stats per tier, top-down (:class:`~ragcache.engine.messages.TierStats`:
    hits, misses, hit_rate, entries, occupancy_bytes, capacity_bytes...)."""

    object: Literal["ragcache.cache"] = "ragcache.cache"
    tiers: dict[str, TierStats]
