"""The requests of ``ragcache serve``: OpenAI-shaped chat requests, their validation and errors.

Owns: the request models (:class:`ChatCompletionRequest` with its :class:`RagcacheOptions`),
:class:`APIError` (an error answered in OpenAI's shape, :class:`~ragcache.server.responses.ErrorResponse`)
and the mapping of validation errors to it. Shapes follow OpenAI's Chat Completions API
(https://platform.openai.com/docs/api-reference/chat), as the ``openai`` SDK sends them; the
``ragcache`` object is a top-level field the SDK merges in from ``extra_body``. The response bodies
are in :mod:`ragcache.server.responses`. Imports pydantic and ragcache.config / conversation /
options types only; no engine, no FastAPI.

The request's options are validated once, while FastAPI parses the body: the ``ragcache`` object
is a :class:`~ragcache.options.RequestOptions` (the fields :class:`~ragcache.options.QueryOptions`
shares, with the settings' range types), and :meth:`ChatCompletionRequest.query_options`
assembles the ``QueryOptions`` the pipeline and the engine get, without checking anything again.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ragcache.conversation import Question, Turn, split_messages
from ragcache.options import (
    Choices, MinTokens, QueryOptions, RequestMaxTokens, RequestOptions, SamplingOptions, Seed, Temperature, TopP,
    check_min_tokens, check_stop,
)
from ragcache.server.responses import ErrorInfo, ErrorResponse

#: ``model`` values that mean "the server's default index" (``serve.index`` / ``--index``)
DEFAULT_MODEL_ALIASES = ("", "ragcache", "default")


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: HTTP status (400 bad request, 401 key, 403 index not allowed, 404 unknown
            model/index, 413 body too large, 429 too many in flight, 431 request line and headers
            too large, 500 server error, 503 not ready).
        message: what is wrong and how to fix it.
        param: the request field at fault (``"temperature"``, ``"messages[1].role"``), if any.
        code: a stable machine-readable code (``"model_not_found"``, ``"context_length_exceeded"``...).
    """

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
             404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             431: "invalid_request_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> ErrorResponse:
        """The body of the error response (also sent as an SSE ``data:`` line mid-stream)."""
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.TYPES.get(self.status, "server_error"),
                                             param=self.param, code=self.code))


#: characters of an invalid value repeated in its error message
GOT_CHARS = 80


def validation_error(exc: ValidationError | Any) -> APIError:
    """A 400 naming the first invalid field of a pydantic / FastAPI validation error, its value and the rule."""
    errors = exc.errors()
    err = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    loc = [p for p in err.get("loc", ()) if p != "body"]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({err.get('msg')}); send a JSON object")
    if err.get("type") == "missing":
        if param is None:  # the body itself
            return APIError(400, "the request body is empty; send a JSON object with at least model and messages "
                            "(an OpenAI chat completion request)")
        return APIError(400, f"{param} is required", param=param)
    got = ""
    if "input" in err and not isinstance(err["input"], (dict, list)):
        shown = repr(err["input"])
        got = f" (got {shown[:GOT_CHARS] + '...' if len(shown) > GOT_CHARS else shown})"
    more = f"; {len(errors) - 1} more error(s)" if len(errors) > 1 else ""
    msg = str(err.get("msg")).removeprefix("Value error, ")
    return APIError(400, f"{param or 'body'}: {msg}{got}{more}", param=param)


# ---- request ------------------------------------------------------------------------------------


def check_text(value: str) -> str:
    """Return ``value`` when it is text that can be sent on as UTF-8 (tokenizer, embedder, logs).

    JSON may carry a lone UTF-16 surrogate (``"\\ud800"``), which Python decodes into a string
    that no UTF-8 encoder accepts.

    Raises:
        ValueError: a lone surrogate; the message gives its position.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"holds a lone UTF-16 surrogate ({ascii(value[exc.start])} at character {exc.start}), "
                         "which is not text: send valid Unicode (a surrogate pair, or the character itself)") from None
    return value


def _check_texts(value: Any) -> Any:
    """:func:`check_text` over a str, or the strings of a list (stop sequences)."""
    if isinstance(value, str):
        return check_text(value)
    if isinstance(value, list):
        for j, item in enumerate(value):
            if isinstance(item, str):
                try:
                    check_text(item)
                except ValueError as exc:
                    raise ValueError(f"[{j}] {exc}") from None
    return value


class RagcacheOptions(RequestOptions):
    """The ``ragcache`` object of a request (the openai SDK's ``extra_body={"ragcache": {...}}``):
    the :class:`~ragcache.options.RequestOptions` (mode, top_k, recompute_ratio, selection, budget,
    mass_left), the index to answer from and what to return.

    Every field is optional; unset ones take the server's settings.
    """

    index: str | None = Field(None, description="index to answer from (overrides model)")
    return_sources: bool = Field(True, description="include the retrieved chunks in the response")
    return_prompt: bool = Field(False, description="include the prompt text the model was given")

    @field_validator("index")
    @classmethod
    def _check_index(cls, v: str | None) -> str | None:
        return v if v is None else check_text(v)


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds the usage chunk before ``[DONE]``."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatMessage(BaseModel):
    """One message; ``content`` is a string or a list of ``{"type": "text", "text"}`` parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _check_content(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(v, str):
            return check_text(v)
        for j, part in enumerate(v or ()):
            if isinstance(part.get("text"), str):
                try:
                    check_text(part["text"])
                except ValueError as exc:
                    raise ValueError(f"[{j}].text {exc}") from None
        return v

    def text(self) -> str:
        """The message text; text parts are joined with newlines.

        Raises:
            ValueError: a part that is not text.
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content[{j}] has type {part.get('type')!r}; only text parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. OpenAI's fields that ragcache honours, vLLM's ``ignore_eos`` /
    ``min_tokens``, and ``ragcache``; other OpenAI fields are accepted and ignored.

    ``temperature`` defaults to 0 (greedy), unlike OpenAI's 1: answers are reproducible and the
    modes comparable token for token. Numbers are strict: a boolean
    or a string where a number is taken is a 400 (``"top_k": true`` is not 1, ``"0.1"`` not 0.1).
    """

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    max_tokens: RequestMaxTokens | None = None
    max_completion_tokens: RequestMaxTokens | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    n: Choices = 1
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    stream_options: StreamOptions | None = None
    ragcache: RagcacheOptions | None = None

    @field_validator("model")
    @classmethod
    def _check_model(cls, v: str) -> str:
        return check_text(v)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        check_stop(v)
        return _check_texts(v)

    @model_validator(mode="after")
    def _check_min_tokens(self) -> "ChatCompletionRequest":
        check_min_tokens(self.min_tokens, self.answer_tokens)
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk (``stream_options.include_usage``; ignored
        without ``stream``, where the usage is always in the response)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def answer_tokens(self) -> int | None:
        """``max_completion_tokens`` or ``max_tokens``; None = the server's ``engine.max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def options(self) -> RagcacheOptions:
        return self.ragcache or RagcacheOptions()

    def conversation(self) -> tuple[Question, list[Turn]]:
        """The question (the last user message) and the earlier turns.

        Raises:
            APIError: 400 naming the message at fault.
        """
        msgs = []
        for i, m in enumerate(self.messages):
            try:
                msgs.append({"role": m.role, "content": m.text()})
            except ValueError as exc:
                raise APIError(400, f"messages[{i}].{exc}", param=f"messages[{i}].content") from None
        try:
            return split_messages(msgs)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None

    def sampling(self) -> SamplingOptions:
        """temperature, top_p, stop, seed, ignore_eos and min_tokens as engine options (validated
        with the body: assembled, not checked again)."""
        return SamplingOptions.model_construct(
            temperature=self.temperature, top_p=self.top_p, stop=check_stop(self.stop), seed=self.seed,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens)

    def query_options(self, history: list[Turn]) -> QueryOptions:
        """The request's :class:`~ragcache.options.QueryOptions` (with the conversation's earlier
        turns): its fields were validated with the body, by the same types, so they are assembled
        here and not checked again."""
        o = self.options
        return QueryOptions.model_construct(
            **{name: getattr(o, name) for name in RequestOptions.model_fields}, max_tokens=self.answer_tokens,
            sampling=self.sampling(), history=tuple(history))
