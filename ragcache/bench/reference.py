"""A plain-torch reference of what the engine computes, for diagnostics that need its insides.

Owns: :class:`HFDecoderOps` (:class:`ragcache.blend.DecoderOps` over a transformers Llama-family
model, plus its final norm and LM head), :func:`load_reference` (the configured model as an HF
folder, through :func:`ragcache.models.resolve_llm`), :func:`greedy_decode` (the question tail
prefilled and answer tokens decoded greedily over a given context KV, with the attention every
decode step gives the context) and :func:`token_relative_error` (how far a blend's K or V is from
full prefill's, per token).

Why a reference and not the vLLM worker: vLLM's paged cache has no op to read per-token K/V back
and its attention kernels return no attention weights, so a step's attention over the context and
the error of a token's reused KV are not observable there. The blend itself is the same code either
way (:func:`ragcache.blend.blend_kv` over ``DecoderOps``); only the model's per-layer callables and
the decode loop are transformers' and torch's here instead of vLLM's.

Unlike the other modules of ragcache.bench this one imports torch and transformers at import time:
it is imported only inside the runners that need it (``diverge``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

#: dtype names accepted by :func:`load_reference`
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFDecoderOps:
    """:class:`ragcache.blend.DecoderOps` over a transformers ``LlamaForCausalLM`` (or a model with the
    same module tree: ``model.embed_tokens``, ``model.layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj,
    post_attention_layernorm, mlp}``, ``model.norm``, ``model.rotary_emb``, ``lm_head``).

    The residual stream is ``[n, hidden]`` in the model's dtype. :meth:`logits` adds what DecoderOps
    leaves out: the final norm and the LM head.
    """

    def __init__(self, model: Any) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        config = model.config
        self.model = model
        self.layers = model.model.layers
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.layers[0].self_attn.scaling
        weight = model.model.embed_tokens.weight
        self.device = weight.device
        self.dtype = weight.dtype
        self._apply_rope = apply_rotary_pos_emb

    def embed(self, token_ids: torch.LongTensor) -> torch.Tensor:
        return self.model.model.embed_tokens(token_ids)  # [n, hidden]

    def qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self.layers[layer].self_attn
        x = self.layers[layer].input_layernorm(hidden)  # [n, hidden]
        n = hidden.shape[0]
        q = attn.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return q, k, v

    def rope(self, layer: int, positions: torch.LongTensor, q: torch.Tensor | None, k: torch.Tensor
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        cos, sin = self.model.model.rotary_emb(k, positions.unsqueeze(0))  # [1, n, D] each
        q_rot, k_rot = self._apply_rope(k if q is None else q, k, cos[0], sin[0], unsqueeze_dim=1)
        return (None if q is None else q_rot), k_rot

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        hidden = hidden + block.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` residual stream leaving the last layer -> ``[n, vocab]`` float32 logits."""
        return self.model.lm_head(self.model.model.norm(hidden)).float()


def load_reference(model: str, cache_dir: str | Path, dtype: str) -> tuple[Any, Any, HFDecoderOps]:
    """The ``models.model`` setting as a transformers model (eval, CPU, ``dtype``), its tokenizer and ops.

    Args:
        model: a packaged alias (converted to an HF folder once) or an HF model folder.
        cache_dir: ``models.cache_dir``.
        dtype: ``float32``, ``bfloat16`` or ``float16``.

    Raises:
        ragcache.models.ModelNotFoundError: the model cannot be provided.
        ValueError: an unknown dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragcache.models import resolve_llm

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = resolve_llm(model, Path(cache_dir)).path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa").eval()
    return hf, AutoTokenizer.from_pretrained(path), HFDecoderOps(hf)


@dataclass
class DecodeTrace:
    """One greedy decode over a context KV.

    Attributes:
        tokens: the generated token ids (up to and including an end-of-sequence id).
        margins: per step, the log-probability gap between the chosen token and the runner-up (nats).
        attention: per step, ``[L, N]`` float32: the attention the step's query gives each of the N
            context tokens, per layer, averaged over the query heads (the query of step 0 is the
            last tail token; of step s > 0, the token chosen at step s - 1).
        logprobs: per step, ``[vocab]`` float32 log-probabilities (kept only for ``keep_logprobs``).
    """

    tokens: list[int]
    margins: list[float]
    attention: list[torch.Tensor]
    logprobs: list[torch.Tensor] = field(default_factory=list)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            scaling: float, adjust: Callable[[torch.Tensor], torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention by position. ``q [n, Hq, D]``, ``k``/``v`` ``[m, Hkv, D]`` -> (``[n, Hq, D]`` in
    q's dtype, probabilities ``[Hq, n, m]`` float32). ``adjust``, when given, rewrites the scaled
    logits ``[Hq, n, m]`` (float32) before the causal mask (a screening hook: the engine has none)."""
    group = q.shape[1] // k.shape[1]
    kx = k.repeat_interleave(group, dim=1).float()  # [m, Hq, D]
    vx = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("nhd,mhd->hnm", q.float(), kx) * scaling  # [Hq, n, m]
    if adjust is not None:
        scores = adjust(scores)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hnm,mhd->nhd", probs, vx)
    return out.to(q.dtype), probs


def greedy_decode(ops: HFDecoderOps, ctx_k: Sequence[torch.Tensor], ctx_v: Sequence[torch.Tensor],
                  tail_ids: Sequence[int], max_tokens: int, stop_ids: Sequence[int] = (),
                  keep_logprobs: bool = False) -> DecodeTrace:
    """Prefill ``tail_ids`` over a context KV and decode ``max_tokens`` greedily, in plain torch.

    Args:
        ops: the reference model's ops.
        ctx_k: per layer ``[N, Hkv, D]`` post-RoPE K of the context at positions ``0..N-1``.
        ctx_v: per layer ``[N, Hkv, D]`` V of the context.
        tail_ids: the question tail, at positions ``N..``.
        max_tokens: tokens to decode at most (>= 1).
        stop_ids: end-of-sequence ids: decoding stops after one of them.
        keep_logprobs: keep each step's log-probabilities in the trace.

    Returns:
        a :class:`DecodeTrace`; the attention of the tail's last token and of every decode step.
    """
    if max_tokens < 1 or not tail_ids:
        raise ValueError("greedy_decode needs a non-empty tail and max_tokens >= 1")
    n_ctx = ctx_k[0].shape[0]
    stop = set(stop_ids)
    trace = DecodeTrace([], [], [])
    with torch.inference_mode():
        ks = [k for k in ctx_k]
        vs = [v for v in ctx_v]
        ids = torch.tensor(list(tail_ids), device=ops.device)
        start = n_ctx
        for _ in range(max_tokens):
            n = ids.shape[0]
            positions = torch.arange(start, start + n, device=ops.device)
            hidden = ops.embed(ids)
            rows = []
            for layer in range(ops.num_layers):
                q, k, v = ops.qkv(layer, hidden)
                q, k = ops.rope(layer, positions, q, k)
                ks[layer] = torch.cat([ks[layer], k])
                vs[layer] = torch.cat([vs[layer], v])
                k_pos = torch.arange(ks[layer].shape[0], device=ops.device)
                out, probs = _attend(q, ks[layer], vs[layer], positions, k_pos, ops.scaling)
                rows.append(probs[:, -1, :n_ctx].mean(dim=0))  # [N]: the last query, mean over heads
                hidden = ops.finish_layer(layer, hidden, out)
            logprobs = torch.log_softmax(ops.logits(hidden[-1:])[0], dim=-1)
            top = torch.topk(logprobs, 2)
            token = int(top.indices[0])
            trace.tokens.append(token)
            trace.margins.append(float(top.values[0] - top.values[1]))
            trace.attention.append(torch.stack(rows))  # [L, N]
            if keep_logprobs:
                trace.logprobs.append(logprobs)
            if token in stop:
                break
            start += n
            ids = torch.tensor([token], device=ops.device)
    return trace


def token_relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per token, the relative L2 error of ``got`` against ``want``, averaged over the layers.

    Args:
        got, want: ``[L, N, Hkv, D]`` K or V of every layer (any float dtype).

    Returns:
        ``[N]`` float32: ``mean_l ||got[l, i] - want[l, i]|| / ||want[l, i]||`` (norms over the heads
        and the head dimension; a zero ``want`` row counts as 1e-12).
    """
    got, want = got.float(), want.float()
    return ((got - want).norm(dim=-1).norm(dim=-1) / want.norm(dim=-1).norm(dim=-1).clamp_min(1e-12)).mean(dim=0)
