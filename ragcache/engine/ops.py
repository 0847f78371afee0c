"""DecoderOps over a loaded vLLM Llama-family model: the per-layer pieces blend/ composes.

Owns: the adapter from vLLM's module tree (``model.model.embed_tokens``, ``layers[i]``
``input_layernorm`` / ``self_attn.qkv_proj`` / ``rotary_emb`` / ``o_proj`` /
``post_attention_layernorm`` / ``mlp``) to :class:`ragcache.blend.DecoderOps`. It never calls
``self_attn.attn`` (vLLM's paged attention); attention is computed by blend/ with torch SDPA.
Checked against vLLM 0.32's ``vllm/model_executor/models/llama.py`` (LlamaDecoderLayer.forward).
"""

from __future__ import annotations

import torch


class VLLMLlamaOps:
    """:class:`ragcache.blend.DecoderOps` over a vLLM ``LlamaForCausalLM`` (tensor parallel size 1).

    Args:
        model: the model from ``worker.model_runner.model``.

    Raises:
        TypeError: the model does not have the Llama module layout.
    """

    def __init__(self, model: torch.nn.Module):
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
            raise TypeError(f"{type(model).__name__} is not a Llama-style vLLM model (model.layers, embed_tokens)")
        self.model = inner
        self.layers = list(inner.layers)
        attn0 = self.layers[0].self_attn
        self.num_layers = len(self.layers)
        self.num_heads = attn0.num_heads
        self.num_kv_heads = attn0.num_kv_heads
        self.head_dim = attn0.head_dim
        self.scaling = float(attn0.scaling)
        param = next(model.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[n] int64 -> [n, hidden]."""
        return self.model.embed_tokens(token_ids)

    def qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, hidden] -> q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D] (pre-RoPE), input norm included."""
        mod = self.layers[layer]
        attn = mod.self_attn
        x = mod.input_layernorm(hidden)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        n = hidden.shape[0]
        return (q.reshape(n, self.num_heads, self.head_dim),
                k.reshape(n, self.num_kv_heads, self.head_dim),
                v.reshape(n, self.num_kv_heads, self.head_dim))

    def rope(self, layer: int, positions: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rotate q [n, Hq, D] (optional) and k [n, Hkv, D] to ``positions`` [n]; out of place.

        vLLM's CPU rotary kernel works in place, so inputs are cloned first.
        """
        rotary = self.layers[layer].self_attn.rotary_emb
        n = k.shape[0]
        positions = positions.to(device=k.device, dtype=torch.long)
        k2 = k.reshape(n, -1).clone()
        if q is None:
            k_rot, _ = rotary(positions, k2, None)  # k in the query slot: rotary works per head_dim slice
            return None, k_rot.reshape(n, self.num_kv_heads, self.head_dim)
        q2 = q.reshape(n, -1).clone()
        q_rot, k_rot = rotary(positions, q2, k2)
        return (q_rot.reshape(n, self.num_heads, self.head_dim),
                k_rot.reshape(n, self.num_kv_heads, self.head_dim))

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden], attn_out [n, Hq, D] -> next hidden [n, hidden] (o_proj, residual, MLP)."""
        mod = self.layers[layer]
        o, _ = mod.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        hidden = hidden + o
        return hidden + mod.mlp(mod.post_attention_layernorm(hidden))
