"""Moving cached keys to new positions.

Owns: ``move_keys``. Chunk KV is stored with K *before* RoPE, so placing a chunk anywhere in a
prompt is one rotation at the new absolute positions, done with the engine's own rotary embedding
(``DecoderOps.rope``): Llama rotates the two halves of each head (rotate_half) with the configured
theta, and reusing the engine's module gets both right by construction. Because attention scores
depend only on relative positions, K computed at positions p and rotated to q equals K computed at
q up to float rounding (CacheBlend, Yao et al., EuroSys'25, §4: reusing a chunk's KV at a new
position).
Must not import vLLM, transformers, or anything above blend/ in ragcache.
"""

from __future__ import annotations

import torch

from ragcache.blend.ops import DecoderOps


def move_keys(ops: DecoderOps, layer: int, k_pre: torch.Tensor, positions: torch.LongTensor) -> torch.Tensor:
    """Apply RoPE at ``positions`` to pre-RoPE keys of one layer.

    Args:
        ops: the model's per-layer callables; its ``rope`` does the rotation.
        layer: layer index (passed to ``ops.rope``; Llama's rotary is the same for every layer).
        k_pre: ``[T, Hkv, D]`` keys before RoPE, on ``ops.device`` in ``ops.dtype``.
        positions: ``[T]`` int64 absolute positions the keys take in the prompt.

    Returns:
        ``[T, Hkv, D]`` post-RoPE keys, a new tensor (``k_pre`` is left untouched).

    Raises:
        ValueError: if ``k_pre`` is not 3-D or its length differs from ``positions``.
    """
    if k_pre.dim() != 3:
        raise ValueError(f"k_pre must be [T, Hkv, D], got shape {tuple(k_pre.shape)}")
    if positions.dim() != 1 or positions.shape[0] != k_pre.shape[0]:
        raise ValueError(f"positions {tuple(positions.shape)} do not match k_pre {tuple(k_pre.shape)}")
    _, k = ops.rope(layer, positions, None, k_pre)
    return k


def move_all_keys_(ops: DecoderOps, k_pre: torch.Tensor, positions: torch.LongTensor) -> torch.Tensor:
    """Every layer's pre-RoPE keys rotated to ``positions``, in place.

    One rotary call for all layers where the adapter can rotate keys in place with a rotary
    embedding every layer shares (an optional ``rotate_keys_(positions [n], k [n, Hkv, D])`` of the
    :class:`~ragcache.blend.ops.DecoderOps`): a constant number of operators, and no new memory, for
    a whole context. Otherwise :func:`move_keys` layer by layer, copied back.

    Args:
        ops: the model's per-layer callables.
        k_pre: ``[L, T, Hkv, D]`` keys before RoPE of the model's L layers, on ``ops.device`` in
            ``ops.dtype``; overwritten.
        positions: ``[T]`` int64 absolute positions the keys take.

    Returns:
        ``k_pre``, now post-RoPE.

    Raises:
        ValueError: if ``k_pre`` is not 4-D or its length differs from ``positions``.
    """
    if k_pre.dim() != 4 or positions.dim() != 1 or positions.shape[0] != k_pre.shape[1]:
        raise ValueError(f"k_pre {tuple(k_pre.shape)} is not [L, T, Hkv, D] for positions {tuple(positions.shape)}")
    rotate = getattr(ops, "rotate_keys_", None)
    if rotate is not None and k_pre.is_contiguous():
        rotate(positions.repeat(k_pre.shape[0]), k_pre.view(-1, *k_pre.shape[2:]))
        return k_pre
    for layer in range(k_pre.shape[0]):
        k_pre[layer].copy_(move_keys(ops, layer, k_pre[layer], positions))
    return k_pre
