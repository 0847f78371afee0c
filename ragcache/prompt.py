"""Token-level prompt assembly: ``[head][chunk 1]...[chunk k][question + tail]`` with recorded spans.

Owns: the prompt template (system prompt, chunk framing, question), the placement rule of cached
KV (:func:`lead_in_for`) and the KV keys of the cached segments. Imports only ragcache.chunks,
ragcache.config, ragcache.conversation and ragcache.models' :func:`~ragcache.models.encode` (no
vLLM), so the same prompt is built for every mode and the pieces can be tested with a plain tokenizer.

The prompt is the model's chat template rendered around a placeholder and split there::

    head = <system prompt> <user turn opening> "Documents:\\n"       (the canonical lead-in)
    unit_i = chunk_i.token_ids + separator ids                       (one cached KV entry each)
    tail = [history] "Question: <q>" <end of user turn> <assistant turn opening>

Multi-turn: the earlier turns of a conversation (:class:`ragcache.conversation.Turn`) go into the
tail, after the chunks, as plain text inside the same user turn (:func:`format_history`)::

    Conversation so far:
    User: <earlier question>
    Assistant: <earlier answer>
    <blank line>
    Question: <q>

so the head and every chunk unit are the same tokens, at the same positions, with or without a
history: the chunk KV reuse is unchanged, and only the tail (prefilled by vLLM) grows.

Token ids are concatenated, never re-tokenized, so a chunk's tokens are identical in every prompt
and its KV can be reused. Where cached KV is computed is one rule, :func:`lead_in_for` (the
*placement rule*): the head is a cached segment computed at position 0 with no lead-in (exact),
and every chunk's KV is computed right after the head and the *KV context* (``prompt.kv_context_tokens``
tokens of a neutral text shipped with ragcache, :func:`kv_context_ids`; never part of a prompt), i.e.
at canonical start position ``len(head) + len(context)``. The KV of every chunk saw the same lead-in,
one that, like a prompt's, holds a few passages before the chunk: its tokens share their attention
with earlier text as they do in a prompt, so the reused KV is much closer to a full prefill's than
KV computed after the head alone. With ``kv_context_tokens = 0`` chunks are computed right after the
head and the first chunk of a prompt sits exactly where its KV was computed (:func:`is_canonical`);
with a KV context only the head does. The key of a unit hashes (model fingerprint, layout
version, compute dtype, KV namespace, unit token ids, its lead-in), so changing the system prompt,
the KV context, the model or the engine's dtype changes every key (KV computed in another precision
is never served: it is computed again). The KV namespace is the builder's store namespace (``store.namespace``) joined with the
index's own namespace, which callers pass per call (``namespace=``, from the index manifest; see
:func:`ragcache.chunks.kv_namespace`): one builder serves every index, and two namespaces never
share a key.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ragcache.chunks import Chunk, ChunkKey, kv_namespace
from ragcache.config import PromptSettings
from ragcache.conversation import EmptyQuestionError, Question, Turn, check_question  # noqa: F401 (re-exported)
from ragcache.models import encode

_CTX = "\u2063RAGCACHE_CONTEXT\u2063"
_QUESTION = "\u2063RAGCACHE_QUESTION\u2063"
_HISTORY = "\u2063RAGCACHE_HISTORY\u2063"

#: how each role of an earlier turn is labelled in the history block
HISTORY_LABELS = {"user": "User", "assistant": "Assistant", "system": "Instructions"}


def format_history(history: Sequence[Turn]) -> str:
    """The history block of the tail: ``"Conversation so far:\\n"``, one ``"<Label>: <text>\\n"``
    line per turn (labels in :data:`HISTORY_LABELS`), then a blank line; ``""`` for no turns."""
    if not history:
        return ""
    lines = [f"{HISTORY_LABELS.get(t.role, t.role.title())}: {t.content.strip()}" for t in history]
    return "Conversation so far:\n" + "\n".join(lines) + "\n\n"


def lead_in_for(start: int, head_ids: Sequence[int], context_ids: Sequence[int] = ()) -> list[int]:
    """The placement rule: the tokens a cached segment's KV is computed after.

    The head (the segment starting at position 0) is computed with no lead-in; every chunk is
    computed right after the head and the KV context (``context_ids``: the builder's
    :attr:`PromptBuilder.context_ids`, empty when ``prompt.kv_context_tokens`` is 0), whatever its
    position in a prompt. Used to key, precompute and (when missing) compute every segment.

    Args:
        start: the segment's first position in its prompt (0 only for the head).
        head_ids: token ids of the prompt head.
        context_ids: token ids of the KV context chunk KV is computed after (never part of a prompt).
    """
    return [] if start == 0 else list(head_ids) + list(context_ids)


def is_canonical(start: int, head_ids: Sequence[int], context_ids: Sequence[int] = ()) -> bool:
    """Whether a segment starting at ``start`` sits where its KV was computed, after the same
    tokens: the head at 0, or (with no KV context) the chunk right after the head. Its cached KV is
    then exactly what a full prefill computes. With a KV context no chunk is: in a prompt the
    tokens before a chunk are the head and other chunks, never the context."""
    return start == 0 or (not context_ids and start == len(head_ids))


#: the KV context's text, shipped with ragcache (five short encyclopedia-style passages written for it)
KV_CONTEXT_FILE = Path(__file__).parent / "data" / "kv_context.txt"


def kv_context_ids(tokenizer: Any, tokens: int) -> tuple[int, ...]:
    """The KV context: the first ``tokens`` token ids of :data:`KV_CONTEXT_FILE` (``()`` for 0).

    Chunk KV computed right after the head alone has seen a context no prompt has: its tokens
    attend to a short system prompt and nothing else, where in a prompt they share their attention
    with the passages before them. Computed after a few passages of neutral text (never shown to
    the model in a prompt), the reused KV is closer to a full prefill's: on held-out HotpotQA
    questions blend's first-token KL against full prefill fell 2-3x and reuse's ~3x (bfloat16,
    docs/fidelity.md). The same idea with each chunk's most similar chunks as its context
    (FusionRAG, arXiv 2601.12904) needs a neighbour lookup at ingest and on every miss; this fixed
    text needs none, so a chunk's key and KV depend on its own tokens alone.

    Raises:
        ValueError: ``tokens`` is more than the file holds.
    """
    if tokens <= 0:
        return ()
    ids = encode(tokenizer, KV_CONTEXT_FILE.read_text(encoding="utf-8"))
    if tokens > len(ids):
        raise ValueError(f"prompt.kv_context_tokens is {tokens} but the KV context text has {len(ids)} tokens "
                         f"for this tokenizer: set it to {len(ids)} or less")
    return tuple(ids[:tokens])


class PromptTooLongError(ValueError):
    """The assembled prompt does not fit the model's context (max_model_len)."""


@dataclass(frozen=True)
class Segment:
    """One cached span of the context.

    Attributes:
        key: KV store key (ChunkKey digest) of this span's KV entry.
        start: position of the first token in the prompt.
        length: number of tokens.
        chunk_id: the chunk's content id; None for the head (lead-in).
    """

    key: str
    start: int
    length: int
    chunk_id: str | None


@dataclass(frozen=True)
class AssembledPrompt:
    """A prompt as token ids with the cached context spans recorded.

    Attributes:
        token_ids: the whole prompt, head + units + tail.
        segments: contiguous spans covering ``[0, ctx_len)``; segments[0] is the head.
        ctx_len: tokens served from cached KV (reuse/blend); the rest (the tail) is prefilled.
        lead_in_len: tokens of the head; chunk KV is computed after these tokens and ``kv_context``.
        kv_context: token ids of the KV context (:attr:`PromptBuilder.context_ids`); not in the prompt.
    """

    token_ids: list[int]
    segments: list[Segment]
    ctx_len: int
    lead_in_len: int
    kv_context: tuple[int, ...] = ()

    @property
    def tail_len(self) -> int:
        """Tokens after the cached context (the question and the assistant-turn opening)."""
        return len(self.token_ids) - self.ctx_len


class PromptBuilder:
    """Builds :class:`AssembledPrompt` objects for one tokenizer, template and model.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (or none: a plain fallback is used).
        settings: the ``[prompt]`` settings.
        model_fingerprint: from :func:`ragcache.models.resolve_llm`; part of every key.
        max_len: the model's context in tokens (``engine.max_model_len``); longer prompts are
            refused by :meth:`build`. None: no limit.
        store_namespace: ``store.namespace``; part of every key. Methods that make keys take the
            index's own namespace (``namespace=``, "" = none) on top of it.
        compute_dtype: the engine's compute dtype (``"float32"``, ``"bfloat16"``, ``"float16"``);
            part of every key, so KV computed in one precision is never served to an engine running
            in another (see :meth:`ragcache.chunks.ChunkKey.of`).
        kv_compression: ``store.kv_compression``, the form chunk KV is stored in; part of every key.
    """

    def __init__(self, tokenizer: Any, settings: PromptSettings, model_fingerprint: str,
                 max_len: int | None = None, store_namespace: str = "default", compute_dtype: str = "",
                 kv_compression: str = "none"):
        self.tokenizer = tokenizer
        self.settings = settings
        self.model_fingerprint = model_fingerprint
        self.compute_dtype = compute_dtype
        self.kv_compression = kv_compression
        self.max_len = max_len
        self.store_namespace = store_namespace
        head_text, self._tail_template = self._split_template()
        self.head_ids: list[int] = self._encode(head_text)
        self.separator_ids: list[int] = self._encode(settings.chunk_separator)
        self.context_ids: tuple[int, ...] = kv_context_ids(tokenizer, settings.kv_context_tokens)
        self.head = self.head_segment()

    def _encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def _split_template(self) -> tuple[str, str]:
        user = f"Documents:\n{_CTX}{_HISTORY}Question: {_QUESTION}"
        messages = [{"role": "system", "content": self.settings.system_prompt},
                    {"role": "user", "content": user}]
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            rendered = f"{self.settings.system_prompt}\n\n{user}\nAnswer:"
        head, rest = rendered.split(_CTX)
        return head, rest

    def _key(self, unit: Sequence[int], start: int, namespace: str = "") -> str:
        lead_in = lead_in_for(start, self.head_ids, self.context_ids)
        context = hashlib.sha256(("lead-in:" + ",".join(map(str, lead_in))).encode()).hexdigest()[:16]
        ns = kv_namespace(self.store_namespace, namespace)
        return str(ChunkKey.of(unit, self.model_fingerprint, namespace=ns, context=context,
                               compute_dtype=self.compute_dtype, kv_compression=self.kv_compression))

    def without_kv_context(self) -> "PromptBuilder":
        """This builder with no KV context (chunk KV keyed and computed right after the head): the
        start-up self-check's, whose chunk must sit exactly where its KV was computed."""
        plain = copy.copy(self)
        plain.context_ids = ()
        return plain

    @property
    def head_key(self) -> str:
        """KV store key of the prompt head (in the store namespace)."""
        return self.head.key

    def head_segment(self, namespace: str = "") -> Segment:
        """The prompt head as a cached segment, keyed in the index namespace ``namespace``."""
        return Segment(self._key(self.head_ids, 0, namespace), 0, len(self.head_ids), None)

    def unit_ids(self, chunk: Chunk) -> list[int]:
        """Token ids of a chunk's cached unit: its token ids followed by the separator."""
        return list(chunk.token_ids) + self.separator_ids

    def key(self, chunk: Chunk, namespace: str = "") -> str:
        """KV store key of a chunk's unit under this model and lead-in, in the index namespace
        ``namespace`` ("" = the store namespace alone)."""
        return self._key(self.unit_ids(chunk), len(self.head_ids), namespace)

    def canonical_segment(self, chunk: Chunk, namespace: str = "") -> Segment:
        """The chunk's unit where its KV is computed: right after the head and the KV context (see
        :func:`lead_in_for`)."""
        unit = self.unit_ids(chunk)
        return Segment(self.key(chunk, namespace), len(self.head_ids) + len(self.context_ids), len(unit),
                       chunk.chunk_id)

    def tail_ids(self, question: str, history: Sequence[Turn] = ()) -> list[int]:
        """Token ids of the tail: the history block (:func:`format_history`), the question, the
        end of the user turn and the opening of the assistant turn."""
        before, after = self._tail_template.split(_QUESTION)  # user text is inserted once, never searched
        return self._encode(before.replace(_HISTORY, format_history(history)) + question.strip() + after)

    def build(self, question: str, chunks: Sequence[Chunk], max_len: int | None = None, *,
              namespace: str = "", history: Sequence[Turn] = ()) -> AssembledPrompt:
        """Assemble the prompt for ``question`` over ``chunks`` (already in stable order).

        ``max_len`` overrides the builder's limit for this call; ``namespace`` is the index's own
        KV namespace ("" = the store namespace alone), see :meth:`key`. ``history``: earlier turns
        of the conversation, oldest first; they go into the tail (see the module docstring).

        Raises:
            EmptyQuestionError: empty question.
            PromptTooLongError: more than ``max_len`` tokens (retrieve fewer chunks or shorten the question).
        """
        check_question(question)
        ids = list(self.head_ids)
        segments = [self.head_segment(namespace)]
        for chunk in chunks:
            unit = self.unit_ids(chunk)
            segments.append(Segment(self.key(chunk, namespace), len(ids), len(unit), chunk.chunk_id))
            ids.extend(unit)
        ctx_len = len(ids)
        ids.extend(self.tail_ids(question, history))
        max_len = self.max_len if max_len is None else max_len
        if max_len is not None and len(ids) + 1 > max_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens but the model's context is {max_len} "
                f"(engine.max_model_len): use a smaller top_k or chunk_size, or a shorter question"
                + (" or conversation" if history else "")
            )
        return AssembledPrompt(ids, segments, ctx_len, len(self.head_ids), self.context_ids)
