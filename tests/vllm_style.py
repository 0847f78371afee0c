"""Test and benchmark helper: a Llama laid out as vLLM lays it out, in plain torch, for the real adapter.

``ragcache.engine.ops.VLLMLlamaOps`` reads vLLM's module tree (``model.model.embed_tokens``,
``layers[i].input_layernorm(x, residual) -> (x, residual)``, ``self_attn.qkv_proj(x) -> (qkv, bias)``,
an in-place ``rotary_emb(positions, q, k)``, ``o_proj``, ``post_attention_layernorm``, ``mlp``). Where
vLLM is absent (a GPU host with torch only) :func:`vllm_style_llama` builds that tree from a
transformers Llama's weights, so the adapter the engine runs can be run, timed and counted there.
Each module is what vLLM's GPU build runs as one fused kernel, written with torch's closest fused
operators (``F.rms_norm``) or registered as one operator of its own (the rotary embedding and
SiLU-and-multiply, as vLLM registers ``_C.rotary_embedding`` and ``_C.silu_and_mul``), so an operator
count is the one vLLM's engine would see; the arithmetic is transformers', not vLLM's kernels'.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("ragcache_vllm_style::rotary_embedding_", mutates_args=("query", "key"))
def rotary_embedding_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                      head_dim: int) -> None:
    """Neox-style RoPE of ``query`` / ``key`` ``[n, H * D]`` (any row stride) at ``positions``, in place."""
    cos, sin = cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)  # [n, D/2] each
    cos, sin = cos[:, None], sin[:, None]
    half = head_dim // 2
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_dim)
        x1, x2 = heads[..., :half], heads[..., half:]
        x1_new, x2_new = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        x1.copy_(x1_new)
        x2.copy_(x2_new)


@torch.library.custom_op("ragcache_vllm_style::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` (vLLM's ``SiluAndMul``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """vLLM's ``RMSNorm`` interface: ``norm(x)``, or ``norm(x, residual) -> (norm(x + residual), x + residual)``."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, (x.shape[-1],), self.weight, self.eps), residual


class Linear(nn.Module):
    """vLLM's linear layers' interface: ``linear(x) -> (x @ W.T + b, None)``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor):
        return F.linear(x, self.weight, self.bias), None


class Rotary(nn.Module):
    """vLLM's neox-style ``RotaryEmbedding`` interface: ``rotary(positions [n], q [n, Hq*D], k [n, Hkv*D] or
    None) -> (q, k)`` rotated in place (any row stride), from a cos/sin cache indexed by position."""

    def __init__(self, head_dim: int, base: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        rotary_embedding_(positions, query, query[:, :0] if key is None else key, self.cos_sin_cache, self.head_dim)
        return query, key


class MLP(nn.Module):
    """vLLM's ``LlamaMLP``: one gate-up projection, SiLU-and-multiply, the down projection."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = Linear(gate_up), Linear(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(silu_and_mul(gate_up))
        return out


def vllm_style_llama(hf_model: nn.Module) -> nn.Module:
    """A module tree with vLLM's Llama layout over ``hf_model``'s weights (copies, same device and dtype).

    Supports the default rotary (``rope_type = "default"``) and no attention bias, as the tiny test
    model and the benchmark shapes use.
    """
    config = hf_model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(config, "rope_theta", 1e4)
    rotary = Rotary(head_dim, theta, config.max_position_embeddings).to(hf_model.device)
    layers = nn.ModuleList()
    for hf in hf_model.model.layers:
        a, m = hf.self_attn, hf.mlp
        layer = nn.Module()
        layer.input_layernorm = RMSNorm(hf.input_layernorm.weight, hf.input_layernorm.variance_epsilon)
        layer.post_attention_layernorm = RMSNorm(hf.post_attention_layernorm.weight,
                                                 hf.post_attention_layernorm.variance_epsilon)
        layer.mlp = MLP(torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight)
        attn = nn.Module()
        attn.qkv_proj = Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        attn.o_proj = Linear(a.o_proj.weight)
        attn.rotary_emb = rotary  # one module for every layer, as vLLM's get_rope caches it
        attn.attn = SimpleNamespace(attn_type="decoder")
        attn.num_heads, attn.num_kv_heads, attn.head_dim = heads, kv_heads, head_dim
        attn.q_size, attn.kv_size, attn.scaling = heads * head_dim, kv_heads * head_dim, head_dim ** -0.5
        layer.self_attn = attn
        layers.append(layer)
    inner = nn.Module()
    inner.embed_tokens = hf_model.model.embed_tokens
    inner.layers = layers
    model = nn.Module()
    model.model = inner
    return model
