"""DecoderOps over vLLM's Llama module tree, and the Mistral variant of it.

Owns: :class:`VLLMLlamaOps`, the adapter from vLLM's Llama-style module tree
(``model.model.embed_tokens``, ``layers[i]`` ``input_layernorm`` / ``self_attn.qkv_proj`` /
``rotary_emb`` / ``o_proj`` / ``post_attention_layernorm`` / ``mlp``) to
:class:`ragcache.blend.DecoderOps`, with two hooks the other families override (per-head q/k norms
before RoPE, refusals of configurations whose KV cannot be moved); and :class:`VLLMMistralOps`.
It never calls ``self_attn.attn`` (vLLM's attention layer); attention is computed by blend/ (torch
SDPA, or vLLM's kernel through the worker's attention callable, :mod:`ragcache.engine.paged_attention`). Checked against vLLM 0.32's ``vllm/model_executor/models/llama.py``
(``LlamaAttention.forward``, ``LlamaDecoderLayer.forward``) and ``mistral.py``
(``MistralAttention.forward``, ``MistralDecoderLayer.forward``).

RoPE is always the layer's own ``rotary_emb`` (built by vLLM's ``get_rope`` from the config's
``rope_parameters``), so rope scaling ("llama3", "linear", "dynamic", "yarn", partial rotary) is
exactly the engine's. Attention biases (``attention_bias``, Qwen2's q/k/v bias) live inside
``qkv_proj`` / ``o_proj`` and need nothing here. Must not import anything above ragcache.blend.
"""

from __future__ import annotations

import torch

#: attributes every decoder layer must have for this adapter (checked at construction)
_LAYER_MODULES = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTN_ATTRS = ("qkv_proj", "o_proj", "rotary_emb", "attn", "q_size", "kv_size", "num_heads", "num_kv_heads", "head_dim",
               "scaling")


class VLLMLlamaOps:
    """:class:`ragcache.blend.DecoderOps` over a vLLM ``LlamaForCausalLM`` (tensor parallel size 1).

    Serves every checkpoint vLLM loads as ``LlamaForCausalLM``: Llama 2, Llama 3.x (rope_scaling
    "llama3"), SmolLM2, Yi, and other Llama-layout models. Subclasses change :meth:`_qk_norm` and
    :meth:`_refuse`.

    Args:
        model: the model from ``worker.model_runner.model``.

    Attributes:
        family: short family name for messages ("llama").
        layers: the decoder layers (``model.model.layers``).
        num_layers, num_heads, num_kv_heads, head_dim, scaling, device, dtype: see DecoderOps.

    Raises:
        TypeError: the model lacks a module this adapter reads (the message names it), or its
            configuration is one the adapter refuses (see :meth:`_refuse`).
    """

    family = "llama"

    def __init__(self, model: torch.nn.Module):
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
            raise TypeError(f"{type(model).__name__} has no model.layers / model.embed_tokens "
                            f"(the module layout {type(self).__name__} reads)")
        self.model = inner
        self.layers = list(inner.layers)
        if not self.layers:
            raise TypeError(f"{type(model).__name__} has no decoder layers")
        for i, layer in enumerate(self.layers):
            missing = [n for n in _LAYER_MODULES if not hasattr(layer, n)]
            missing += [f"self_attn.{n}" for n in _ATTN_ATTRS if hasattr(layer, "self_attn")
                        and not hasattr(layer.self_attn, n)]
            if missing:
                raise TypeError(f"{type(model).__name__} layer {i} lacks {', '.join(missing)} "
                                f"(the module layout {type(self).__name__} reads)")
        attn0 = self.layers[0].self_attn
        self.num_layers = len(self.layers)
        self.num_heads = attn0.num_heads
        self.num_kv_heads = attn0.num_kv_heads
        self.head_dim = attn0.head_dim
        self.scaling = float(attn0.scaling)
        param = next(model.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype
        reason = self._refuse(model)
        if reason:
            raise TypeError(f"{type(model).__name__}: {reason}")
        rotary = attn0.rotary_emb
        # every layer rotates with the same module (vLLM's get_rope caches it): keys of all layers move in one call
        self.rotate_keys_ = self._rotate_keys_ if all(layer.self_attn.rotary_emb is rotary
                                                      for layer in self.layers) else None
        self._residual: tuple[torch.Tensor, torch.Tensor] | None = None  # (stream, its residual), see qkv

    # ---- family hooks ----------------------------------------------------------------------

    def _refuse(self, model: torch.nn.Module) -> str | None:
        """Why this model's configuration cannot be served (None: it can). Llama: bidirectional
        (``is_causal = false``) models, whose attention is not causal."""
        if any(getattr(layer.self_attn.attn, "attn_type", "decoder") != "decoder" for layer in self.layers):
            return "non-causal (encoder-only) attention; chunk KV reuse needs a causal decoder"
        return None

    def _qk_norm(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head norms of q ``[n, Hq, D]`` and k ``[n, Hkv, D]`` before RoPE; none in Llama."""
        return q, k

    # ---- DecoderOps ------------------------------------------------------------------------
    #
    # The residual stream is carried as vLLM carries it between decoder layers: a pair
    # ``(hidden_states, residual)`` stacked as ``[n, 2, hidden]``. vLLM's norms add the pair in float32
    # and normalise the unrounded sum (``fused_add_rms_norm``); adding first in the model's dtype and
    # normalising the rounded sum differs by an ulp of bfloat16 here and there, which 30 layers turn
    # into a visible drift from vLLM's own prefill. Carrying the pair keeps the arithmetic vLLM's.

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[n] int64 -> the residual stream ``[n, 2, hidden]``: (zeros, embeddings), which the first
        layer's fused norm turns into exactly vLLM's ``residual = embeddings``."""
        emb = self.model.embed_tokens(token_ids)  # [n, hidden]
        return torch.stack([torch.zeros_like(emb), emb], dim=1)

    def qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual stream ``[n, 2, hidden]`` -> q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D] (pre-RoPE),
        input norm included.

        Q and K are returned after the family's per-head norms (:meth:`_qk_norm`), i.e. exactly what
        vLLM feeds its ``rotary_emb``: the stored pre-RoPE K. All three may be views of one projection
        output (read them, do not write into them).
        """
        mod = self.layers[layer]
        x, residual = mod.input_layernorm(*hidden.unbind(1))
        self._residual = (hidden, residual)  # finish_layer of the same stream reads it instead of adding again
        qkv, _ = mod.self_attn.qkv_proj(x)
        q, k, v = qkv.view(hidden.shape[0], -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)  # [n, H, D] views
        q, k = self._qk_norm(layer, q, k)
        return q, k, v

    def qkv_rope(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`qkv`, then q and k rotated to ``positions`` ``[n]`` with the layer's rotary in place in
        the projection's own output, as ``LlamaAttention.forward`` does (no copies): the same values
        as :meth:`qkv` followed by :meth:`rope` (``qkv_rope`` of :class:`ragcache.blend.DecoderOps`)."""
        q, k, v = self.qkv(layer, hidden)
        n = q.shape[0]
        if positions.device != q.device or positions.dtype != torch.long:
            positions = positions.to(device=q.device, dtype=torch.long)
        q2, k2 = self.layers[layer].self_attn.rotary_emb(positions, q.view(n, -1), k.view(n, -1))
        return q2.view(n, self.num_heads, self.head_dim), k2.view(n, self.num_kv_heads, self.head_dim), v

    def rope(self, layer: int, positions: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rotate q [n, Hq, D] (optional) and k [n, Hkv, D] to ``positions`` [n]; out of place.

        Uses the layer's own ``rotary_emb`` (it carries any rope scaling). vLLM's CPU rotary kernel
        works in place, so inputs are cloned first.
        """
        rotary = self.layers[layer].self_attn.rotary_emb
        n = k.shape[0]
        if positions.device != k.device or positions.dtype != torch.long:
            positions = positions.to(device=k.device, dtype=torch.long)
        k2 = k.reshape(n, -1).clone()
        if q is None:
            k_rot, _ = rotary(positions, k2, None)  # k in the query slot: rotary works per head_dim slice
            return None, k_rot.reshape(n, self.num_kv_heads, self.head_dim)
        q2 = q.reshape(n, -1).clone()
        q_rot, k_rot = rotary(positions, q2, k2)
        return (q_rot.reshape(n, self.num_heads, self.head_dim),
                k_rot.reshape(n, self.num_kv_heads, self.head_dim))

    def _rotate_keys_(self, positions: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate k ``[n, Hkv, D]`` (contiguous) to ``positions`` ``[n]`` in place with the rotary every
        layer shares (``rotate_keys_`` of :class:`ragcache.blend.DecoderOps`, when they share one)."""
        flat = k.view(k.shape[0], -1)
        out, _ = self.layers[0].self_attn.rotary_emb(positions, flat, None)
        if out.data_ptr() != flat.data_ptr():  # a rotary that works out of place (vLLM's native path)
            flat.copy_(out)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual stream ``[n, 2, hidden]``, attn_out [n, Hq, D] -> the next layer's residual stream
        ``[n, 2, hidden]`` (o_proj, the fused residual add and norm, MLP), as ``LlamaDecoderLayer.forward``."""
        mod = self.layers[layer]
        known = self._residual
        if known is not None and known[0] is hidden:
            residual = known[1]  # what the layer's input norm left as residual (qkv of this stream)
        else:
            residual = hidden[:, 0] + hidden[:, 1]  # the same sum, in the same rounding
        self._residual = None
        o, _ = mod.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        x, residual = mod.post_attention_layernorm(o, residual)
        return torch.stack([mod.mlp(x), residual], dim=1)


class VLLMMistralOps(VLLMLlamaOps):
    """:class:`ragcache.blend.DecoderOps` over a vLLM ``MistralForCausalLM`` (HF-format Mistral 7B,
    Mistral NeMo, Ministral): the Llama layout, plus two refusals (``mistral.py``).

    Refused configurations (``TypeError`` at construction, so reuse/blend are disabled and full and
    prefix keep working):
      - ``llama_4_scaling``: ``MistralAttention`` multiplies q after RoPE by a factor of the
        *absolute* position, so a chunk's KV computed at one place differs from its KV at another
        beyond a moved rotation;
      - ``ada_rms_norm_t_cond``: the MLP input depends on a time condition the blend does not have.

    Sliding-window attention (Mistral 7B v0.1: 4096) is handled above the adapter: reuse/blend are
    exact while the context fits in the window and refused beyond it (see
    :mod:`ragcache.engine.selfcheck`).
    """

    family = "mistral"

    def _refuse(self, model: torch.nn.Module) -> str | None:
        attn0 = self.layers[0].self_attn
        if getattr(attn0, "do_llama_4_scaling", False):
            return ("llama_4_scaling scales queries by their absolute position, so moved chunk KV is not "
                    "exact; reuse/blend are not supported for it")
        if getattr(self.layers[0], "ada_rms_norm_t_cond", None) is not None:
            return "ada_rms_norm_t_cond (time-conditioned MLP) is not supported by reuse/blend"
        return super()._refuse(model)
