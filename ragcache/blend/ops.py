"""The per-layer pieces of a decoder-only transformer that the blend math calls.

Owns: the ``DecoderOps`` protocol, the only thing blend/ knows about a model. An engine adapter
(the vLLM worker connector, or transformers in the tests) implements it over the model's own
modules, so RoPE, norms and projections are exactly the engine's.
Must not import vLLM, transformers, or anything above blend/ in ragcache.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class DecoderOps(Protocol):
    """The per-layer pieces of a decoder-only transformer (Llama-style), as callables over its own modules.

    Shapes use ``n`` for the number of tokens passed in, ``Hq = num_heads``, ``Hkv = num_kv_heads``,
    ``D = head_dim``. Every tensor lives on ``device`` in ``dtype``; token ids and positions are int64.
    Callers run everything under ``torch.inference_mode()``.

    Contract the blend relies on: ``embed``, ``qkv`` and ``finish_layer`` act on each token
    independently (token-wise projections, norms and MLP), so they may be called on any subset of
    tokens; all mixing between tokens happens in the attention that blend/ computes itself. The
    residual stream ``hidden`` is ``[n, ...]``: tokens along dim 0, the rest the adapter's own
    (``[n, hidden]``, or e.g. vLLM's ``(hidden_states, residual)`` pair as ``[n, 2, hidden]``); the
    blend only selects, slices and concatenates its rows.

    Optional: ``qkv_rope(layer, hidden, positions [n]) -> (q, k, v)``, :meth:`qkv` with q and k then
    rotated to ``positions`` (the values of ``qkv`` followed by ``rope``, without the copies an
    out-of-place ``rope`` makes); the blend calls it wherever it rotates what ``qkv`` returned.
    ``rotate_keys_(positions [n], k [n, Hkv, D]) -> None``, rotating contiguous keys in
    place with the rotary embedding every layer shares (absent, or None, when the layers' rotaries
    differ): the blend then moves the cached K of every layer with one call
    (:func:`~ragcache.blend.rope.move_all_keys_`) instead of one ``rope`` per layer.

    Attributes:
        num_layers: number of decoder layers.
        num_heads: query heads per layer (Hq).
        num_kv_heads: key/value heads per layer (Hkv); Hq must be a multiple of Hkv (GQA).
        head_dim: dimensions per head (D).
        scaling: softmax scale of the attention scores, ``1 / sqrt(head_dim)`` for Llama.
        device: where the model's weights live.
        dtype: the model's compute dtype.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    device: torch.device
    dtype: torch.dtype

    def embed(self, token_ids: torch.LongTensor) -> torch.Tensor:
        """Token embeddings: ``[n]`` int64 -> the residual stream entering layer 0, ``[n, ...]``."""
        ...

    def qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input layernorm and Q/K/V projections of one layer.

        Args:
            layer: layer index in ``[0, num_layers)``.
            hidden: ``[n, ...]`` residual stream entering the layer.

        Returns:
            ``q [n, Hq, D]``, ``k [n, Hkv, D]``, ``v [n, Hkv, D]``; q and k before RoPE.
        """
        ...

    def rope(
        self,
        layer: int,
        positions: torch.LongTensor,
        q: torch.Tensor | None,
        k: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The model's own rotary embedding at absolute ``positions`` ``[n]``, out of place.

        Args:
            q: ``[n, Hq, D]`` pre-RoPE queries, or None to rotate keys only.
            k: ``[n, Hkv, D]`` pre-RoPE keys.

        Returns:
            ``(q_rotated or None, k_rotated)``, new tensors; the inputs are left untouched (an
            adapter over an in-place rotary clones first).
        """
        ...

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention: o_proj + residual + post-attention norm + MLP + residual.

        Args:
            hidden: ``[n, ...]`` residual stream that entered the layer.
            attn_out: ``[n, Hq, D]`` attention output of the same tokens.

        Returns:
            ``[n, ...]`` residual stream leaving the layer.
        """
        ...
