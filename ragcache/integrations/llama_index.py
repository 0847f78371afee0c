"""llama-index integration: a query engine answering through the blend engine, and an LLM class.

Owns: :class:`RagcacheQueryEngine` (``query`` / streaming, returning llama-index ``Response`` /
``StreamingResponse`` with ``source_nodes`` and ragcache's metrics in ``metadata``) and
:class:`RagcacheLLM` (so ``Settings.llm`` can use the embedded engine for plain completions).
Modelled on llama-index's ``CustomLLM`` and ``CustomQueryEngine``: implement the few required
methods, inherit the rest. Must not import app/ or ui/.
"""

from __future__ import annotations

from typing import Any, Iterator

from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode
from pydantic import ConfigDict, Field, PrivateAttr

from ragcache.models import encode
from ragcache.options import QueryOptions
from ragcache.pipeline import Answer, RAGPipeline
from ragcache.prompt import AssembledPrompt


def _source_nodes(answer: Answer) -> list[NodeWithScore]:
    return [
        NodeWithScore(
            node=TextNode(id_=s.chunk_id, text=s.text,
                          metadata={"doc_id": s.doc_id, "title": s.title, "chunk_id": s.chunk_id, "kv_tier": s.tier}),
            score=s.score,
        )
        for s in answer.sources
    ]


class RagcacheQueryEngine(CustomQueryEngine):
    """Retrieves with the ragcache index (stable order kept) and answers through the blend engine.

    Attributes:
        pipeline: an open :class:`ragcache.pipeline.RAGPipeline`.
        mode: query mode (None = ``engine.mode``). top_k: chunks per question (None = setting).
        streaming: return a ``StreamingResponse`` whose ``response_gen`` yields text pieces.

    ``Response.metadata`` holds ragcache's RequestMetrics as a dict (ttft_s, reused_tokens, ...).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    pipeline: Any = Field(description="ragcache.pipeline.RAGPipeline")
    mode: str | None = None
    top_k: int | None = None
    streaming: bool = False

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        rag: RAGPipeline = self.pipeline
        if not self.streaming:
            answer = rag.query(query_str, mode=self.mode, top_k=self.top_k)
            return Response(response=answer.text, source_nodes=_source_nodes(answer),
                            metadata=answer.metrics.to_dict())
        items = rag.stream(query_str, mode=self.mode, top_k=self.top_k)
        response = StreamingResponse(response_gen=iter(()), source_nodes=[], metadata={})

        def gen() -> Iterator[str]:
            for item in items:
                if isinstance(item, str):
                    yield item
                else:  # the final Answer: fill in sources and metrics
                    response.source_nodes = _source_nodes(item)
                    response.metadata = item.metrics.to_dict()

        response.response_gen = gen()
        return response


class RagcacheLLM(CustomLLM):
    """The embedded vLLM engine as a llama-index LLM (plain completions, greedy, streaming).

    Completions use vLLM's own prefix caching (mode ``prefix``); no chunk KV is involved.
    """

    max_tokens: int = 64
    _engine: Any = PrivateAttr()

    def __init__(self, engine: Any, max_tokens: int = 64, **kwargs: Any):
        super().__init__(max_tokens=max_tokens, **kwargs)
        self._engine = engine

    @property
    def metadata(self) -> LLMMetadata:
        eng = self._engine
        return LLMMetadata(context_window=eng.settings.engine.max_model_len, num_output=self.max_tokens,
                           model_name=str(eng.llm_info.path.name), is_chat_model=False)

    def _options(self) -> QueryOptions:
        return QueryOptions(mode="prefix", max_tokens=self.max_tokens)

    def _prompt(self, prompt: str) -> AssembledPrompt:
        ids = encode(self._engine.tokenizer, prompt)
        return AssembledPrompt(token_ids=ids, segments=[], ctx_len=0, lead_in_len=0)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        gen = self._engine.generate(self._prompt(prompt), self._options())
        return CompletionResponse(text=gen.text, additional_kwargs={"metrics": gen.metrics.to_dict()})

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        text = ""
        for item in self._engine.stream(self._prompt(prompt), self._options()):
            if isinstance(item, str):
                text += item
                yield CompletionResponse(text=text, delta=item)
