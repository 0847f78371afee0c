"""Multi-turn conversations: turns, and which text a follow-up question retrieves with.

Owns: :class:`Turn` (one earlier message), :class:`Question` and :func:`check_question` (the one
check that there is something to answer), :func:`split_messages` (a chat message list -> the
question and the earlier turns) and the *retrieval-query rule* (:func:`retrieval_query`). How the
turns enter the prompt is :mod:`ragcache.prompt`'s template (after the retrieved chunks, so the
chunk KV reuse is unchanged). Pure Python: imports nothing else from ragcache, no vLLM, no app/ or ui/.

The retrieval-query rule. A follow-up such as "and what does it return?" retrieves nothing
useful on its own, while the conversation as a whole would drag old topics into every search.
So retrieval uses the last user message, plus the previous user message when the last one

* is short: fewer than :data:`SHORT_QUESTION_WORDS` words, or
* refers back: it contains a referring word (:data:`REFERRING_WORDS`: it, they, this, that, he,
  she, there, ...) or starts with a continuation (:data:`CONTINUATIONS`: "and", "also", "what
  about", ...).

Only one earlier user message is ever added (never assistant text), so a conversation that
changes topic retrieves for the new topic from the next full question on. Examples::

    ["What is the capital of Zorbia?"]                      -> "What is the capital of Zorbia?"
    ["What is the capital of Zorbia?", "Who founded it?"]   -> "What is the capital of Zorbia? Who founded it?"
    ["What is kelmet?", "Where does the parliament meet?"]  -> "Where does the parliament meet?"
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

#: roles a turn may have (OpenAI's chat roles; "developer" is read as "system")
ROLES = ("system", "user", "assistant")

#: a question with fewer words than this is taken as a follow-up
SHORT_QUESTION_WORDS = 4

#: words that point back to something said earlier
REFERRING_WORDS = frozenset(
    "it its it's they them their theirs this that these those he him his she her hers there then "
    "former latter above same such".split()
)

#: openings of a follow-up question
CONTINUATIONS = ("and ", "also ", "but ", "so ", "what about ", "how about ")

_WORD = re.compile(r"[a-z']+")


class EmptyQuestionError(ValueError):
    """The question is empty or only white space."""


class Question(str):
    """A question :func:`check_question` accepted: the check is not run again on it (the CLI checks
    before its engine starts, the pipeline where a request enters the SDK; each passes on this)."""


def check_question(question: str) -> Question:
    """``question`` as a :class:`Question` when there is something to answer (a Question is
    returned as is: it was checked when it was made).

    Raises:
        EmptyQuestionError: ``question`` is empty or only white space.
    """
    if isinstance(question, Question):
        return question
    if not question or not question.strip():
        raise EmptyQuestionError("the question is empty; ask something")
    return Question(question)


@dataclass(frozen=True)
class Turn:
    """One earlier message of a conversation.

    Attributes:
        role: ``"user"``, ``"assistant"`` or ``"system"`` (instructions from the client).
        content: the message text.
    """

    role: str
    content: str


def split_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[Question, list[Turn]]:
    """A chat message list (``[{"role", "content"}, ...]``, oldest first) as ``(question, history)``.

    The last message must be the user's: it is the question; every message before it is the
    history, in order. ``"developer"`` is read as ``"system"``.

    Raises:
        ValueError: no messages, an unknown role, a non-text content, or a last message that is
            not a non-empty user message (the message names the index and the fix).
    """
    if not messages:
        raise ValueError("messages is empty: send at least one user message")
    turns = []
    for i, m in enumerate(messages):
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role is {m.get('role')!r}; use one of system, user, assistant")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        turns.append(Turn(role, content))
    last = turns[-1]
    try:
        if last.role != "user":
            raise EmptyQuestionError(last.role)
        question = check_question(last.content)
    except EmptyQuestionError:
        raise ValueError(f"messages[{len(turns) - 1}] must be a non-empty user message: the last message is the "
                         "question") from None
    return question, turns[:-1]


def refers_back(question: str) -> bool:
    """Whether ``question`` is a follow-up: short, a referring word, or a continuation opening."""
    text = question.strip().lower()
    words = _WORD.findall(text)
    return (len(words) < SHORT_QUESTION_WORDS or any(w in REFERRING_WORDS for w in words)
            or text.startswith(CONTINUATIONS))


def retrieval_query(question: str, history: Iterable[Turn] = ()) -> str:
    """The text to retrieve chunks with for ``question`` after ``history`` (see the module docstring).

    Returns ``question`` alone, or ``"<previous user message> <question>"`` for a follow-up.
    """
    previous = next((t.content.strip() for t in reversed(list(history)) if t.role == "user" and t.content.strip()),
                    None)
    if previous is None or not refers_back(question):
        return question
    return f"{previous} {question.strip()}"
