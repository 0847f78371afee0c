"""DecoderOps over vLLM's Qwen2 / Qwen2.5 and Qwen3 module trees.

Owns: :class:`VLLMQwen2Ops` and :class:`VLLMQwen3Ops`. Both families keep the Llama layout (one
fused ``qkv_proj``, ``rotary_emb``, ``o_proj``, pre-norm residual blocks), so they reuse
:class:`~ragcache.engine.ops.llama.VLLMLlamaOps` and override one hook:

- Qwen2 / Qwen2.5 (``vllm/model_executor/models/qwen2.py``, ``Qwen2Attention``): the q/k/v biases
  are inside ``qkv_proj`` (``bias=True``), so its output already carries them; ``head_dim`` is
  ``hidden_size // num_attention_heads`` (vLLM ignores ``config.head_dim`` here) and is read from
  the module. Configs with ``qk_norm = true`` (BAGEL and a few others) get the per-head norms
  before RoPE, as ``Qwen2Attention.forward`` applies them.
- Qwen3 (``vllm/model_executor/models/qwen3.py``, ``Qwen3Attention.forward``): per-head RMSNorm
  ``q_norm`` / ``k_norm`` on q and k *before* RoPE, always. The stored pre-RoPE K is the normed K.

Must not import anything above ragcache.blend.
"""

from __future__ import annotations

import torch

from ragcache.engine.ops.llama import VLLMLlamaOps


def _apply_head_norms(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn.q_norm`` / ``attn.k_norm`` (RMSNorm over ``head_dim``) on q ``[n, Hq, D]`` and k ``[n, Hkv, D]``."""
    return attn.q_norm(q), attn.k_norm(k)


class VLLMQwen2Ops(VLLMLlamaOps):
    """:class:`ragcache.blend.DecoderOps` over a vLLM ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5, QwQ).

    Raises:
        TypeError: as :class:`~ragcache.engine.ops.llama.VLLMLlamaOps`; also for dual-chunk
            attention (``dual_chunk_attention_config``, Qwen2.5-1M), whose rotary and attention are
            not the plain causal ones.
    """

    family = "qwen2"

    def _refuse(self, model: torch.nn.Module) -> str | None:
        if getattr(self.layers[0].self_attn, "dual_chunk_attention_config", None):
            return "dual-chunk attention (dual_chunk_attention_config) is not supported by reuse/blend"
        return super()._refuse(model)

    def _qk_norm(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.layers[layer].self_attn
        if getattr(attn, "qk_norm", False):
            return _apply_head_norms(attn, q, k)
        return q, k


class VLLMQwen3Ops(VLLMQwen2Ops):
    """:class:`ragcache.blend.DecoderOps` over a vLLM ``Qwen3ForCausalLM``: per-head ``q_norm`` /
    ``k_norm`` before RoPE in every layer.

    Raises:
        TypeError: as :class:`VLLMQwen2Ops`, or when a layer lacks ``q_norm`` / ``k_norm``.
    """

    family = "qwen3"

    def _refuse(self, model: torch.nn.Module) -> str | None:
        if not all(hasattr(layer.self_attn, "q_norm") and hasattr(layer.self_attn, "k_norm") for layer in self.layers):
            return "a Qwen3 attention layer lacks q_norm / k_norm"
        return super()._refuse(model)

    def _qk_norm(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _apply_head_norms(self.layers[layer].self_attn, q, k)
