"""A client of a running ``ragcache serve`` that answers with the SDK's objects.

Owns: :class:`RemotePipeline`, which has the query side of :class:`~ragcache.pipeline.RAGPipeline`
(``query``, ``stream``, ``cache_stats``) but sends each question to the server's
/v1/chat/completions and rebuilds the :class:`~ragcache.pipeline.Answer` (sources, metrics) from
the ``ragcache`` object of the response; and :func:`server_indexes` (GET /v1/models). So an app
(the Streamlit UI with ``ui.server_url``) can talk to one shared, batched engine instead of
embedding its own. Sources carry the server's ``snippet`` as their text. Uses httpx; no vLLM.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from ragcache.engine.messages import RequestMetrics, StoreStats
from ragcache.options import QueryOptions, options_from
from ragcache.pipeline import Answer, Source


class ServerError(RuntimeError):
    """The server answered with an error (its OpenAI-shaped message, which says what to fix)."""


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _raise_for(resp: Any) -> None:
    if resp.status_code >= 400:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:300]
        raise ServerError(f"{resp.status_code} from {resp.request.url}: {message}")


def server_indexes(base_url: str, api_key: str = "", timeout_s: float = 10.0) -> list[str]:
    """The indexes a server offers (GET /v1/models).

    Raises:
        ServerError: an error answer. httpx.HTTPError: the server cannot be reached.
    """
    import httpx

    resp = httpx.get(f"{base_url}/v1/models", headers=_headers(api_key), timeout=timeout_s)
    _raise_for(resp)
    return [m["id"] for m in resp.json()["data"]]


def answer_from(question: str, text: str, finish: str | None, extra: dict[str, Any]) -> Answer:
    """An :class:`Answer` from a response's text, finish reason and ``ragcache`` object, whose
    ``metrics`` is the server's :class:`~ragcache.engine.messages.RequestMetrics` record, read back
    whole (``ratio_source``, ``chunk_tiers``, the worker's stages...).

    Raises:
        ServerError: the response carries no metrics (not a ragcache server's answer).
    """
    if not isinstance(extra.get("metrics"), dict):
        raise ServerError("the response has no ragcache.metrics object; is this a ragcache server?")
    sources = [Source(s["doc_id"], s["title"], s.get("snippet", ""), s["score"], s["chunk_id"], s.get("tier") or "")
               for s in extra.get("sources") or []]
    return Answer(question, text.strip(), sources, RequestMetrics.from_dict(extra["metrics"]), finish)


class RemotePipeline:
    """The query side of RAGPipeline, answered by a ``ragcache serve`` at ``base_url``.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        index: the index to ask (the request's ``model``).
        api_key: the server's ``serve.api_key``, if it has one.
        timeout_s: seconds to wait for an answer (full prefill of long prompts takes tens of seconds on CPU).
    """

    def __init__(self, base_url: str, index: str, *, api_key: str = "", timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.index_name = index
        self.api_key = api_key
        self.timeout_s = timeout_s

    def _body(self, question: str, o: QueryOptions, stream: bool) -> dict[str, Any]:
        """The request body carrying ``o`` (the server validates it again at its own edge)."""
        opts = {k: v for k, v in (("mode", o.mode), ("top_k", o.top_k), ("recompute_ratio", o.recompute_ratio),
                                  ("selection", None if o.selection is None else str(o.selection)),
                                  ("budget", o.budget), ("mass_left", o.mass_left)) if v is not None}
        s = o.sampling
        body: dict[str, Any] = {
            "model": self.index_name, "stream": stream, "ragcache": opts,
            "messages": [{"role": t.role, "content": t.content} for t in o.history]
            + [{"role": "user", "content": question}],
            "temperature": s.temperature, "top_p": s.top_p, "ignore_eos": s.ignore_eos, "min_tokens": s.min_tokens}
        for key, value in (("max_tokens", o.max_tokens), ("seed", s.seed), ("stop", list(s.stop) or None)):
            if value is not None:
                body[key] = value
        return body

    def stream(self, question: str, options: QueryOptions | None = None, **fields: Any) -> Iterator[str | Answer]:
        """Yield the answer's text pieces as the server streams them, then the :class:`Answer`
        (options as :meth:`RAGPipeline.query <ragcache.pipeline.RAGPipeline.query>`).

        Raises:
            ServerError: the server refused the question or failed while answering.
            QueryOptionsError: an option out of range (checked here, before sending).
        """
        import httpx

        body = self._body(question, options_from(options, fields), stream=True)
        text: list[str] = []
        finish, extra = None, {}
        with httpx.stream("POST", f"{self.base_url}/v1/chat/completions", json=body,
                          headers=_headers(self.api_key), timeout=self.timeout_s) as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for(resp)
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise ServerError(chunk["error"].get("message", "the server failed while answering"))
                if "metrics" in (chunk.get("ragcache") or {}):  # the finish chunk: the whole ragcache object
                    extra = chunk["ragcache"]
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    finish = choice.get("finish_reason") or finish
                    piece = choice["delta"].get("content")
                    if piece:
                        text.append(piece)
                        yield piece
        yield answer_from(question, "".join(text), finish, extra)

    def query(self, question: str, options: QueryOptions | None = None, **fields: Any) -> Answer:
        """The whole :class:`Answer` in one response (options as :meth:`RAGPipeline.query
        <ragcache.pipeline.RAGPipeline.query>`).

        Raises:
            ServerError: the server refused the question or failed while answering.
            QueryOptionsError: an option out of range (checked here, before sending).
        """
        import httpx

        body = self._body(question, options_from(options, fields), stream=False)
        resp = httpx.post(f"{self.base_url}/v1/chat/completions", json=body, headers=_headers(self.api_key),
                          timeout=self.timeout_s)
        _raise_for(resp)
        data = resp.json()
        choice = data["choices"][0]
        return answer_from(question, choice["message"]["content"], choice.get("finish_reason"),
                           data.get("ragcache") or {})

    def cache_stats(self) -> StoreStats:
        """The server's per-tier KV store stats (GET /v1/cache)."""
        import httpx

        resp = httpx.get(f"{self.base_url}/v1/cache", headers=_headers(self.api_key), timeout=30)
        _raise_for(resp)
        return StoreStats.from_dict(resp.json()["tiers"])
