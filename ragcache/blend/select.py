"""Selecting the HKVD (high-KV-deviation) tokens to recompute.

Owns: ``select_hkvd`` and ``hkvd_budget``. At the check layer the blend has, for every context
token, both the reused KV (computed per chunk, without the other chunks in view) and the freshly
computed KV (with full cross-chunk attention). The tokens whose reused KV deviates most are the
ones whose recompute restores cross-chunk attention best (CacheBlend, Yao et al., EuroSys'25,
§4.3 "Selecting which tokens to recompute"; the deviation is the squared L2 distance, on V by
default).
Must not import vLLM, transformers, or anything above blend/ in ragcache.
"""

from __future__ import annotations

import math

import torch


def hkvd_budget(ratio: float, num_tokens: int) -> int:
    """``ceil(ratio * num_tokens)``, robust to float noise (0.15 * 100 gives 15, not 16).

    Raises:
        ValueError: if ``ratio`` is outside ``[0, 1]``.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute ratio must be in [0, 1], got {ratio}")
    return min(num_tokens, math.ceil(round(ratio * num_tokens, 9)))


def check_forced(forced: torch.Tensor | None, num_tokens: int) -> None:
    """Raise ValueError unless ``forced`` is None or a bool tensor of shape ``[num_tokens]``."""
    if forced is not None and (forced.shape != (num_tokens,) or forced.dtype != torch.bool):
        raise ValueError(
            f"forced must be a bool tensor of shape ({num_tokens},), got {forced.dtype} {tuple(forced.shape)}"
        )


def select_hkvd(
    reused: torch.Tensor,
    fresh: torch.Tensor,
    ratio: float,
    forced: torch.Tensor | None = None,
) -> torch.LongTensor:
    """Indices of the tokens to recompute: the largest KV deviations plus every forced token.

    The deviation of token t is ``sum((fresh[t] - reused[t]) ** 2)`` over heads and dims, in float32.
    The ``ceil(ratio * N)`` tokens with the largest deviation are taken among the tokens that are
    not forced (a forced token has no cached KV, so its "reused" row is a placeholder and must not
    use up the budget); then all forced tokens are added. Ties are broken by ``torch.topk``.

    Args:
        reused: ``[N, Hkv, D]`` K or V of the context tokens as loaded from the cache (K rotated to
            the same positions as ``fresh`` when comparing keys).
        fresh: ``[N, Hkv, D]`` the same layer's K or V computed with full attention.
        ratio: recompute ratio in ``[0, 1]``; 0 selects only the forced tokens, 1 selects all.
        forced: ``[N]`` bool, True for tokens that must be recomputed (no cached KV), or None.

    Returns:
        ``[n]`` int64 token indices, sorted ascending, on ``fresh``'s device;
        ``n = min(ceil(ratio * N), N - num_forced) + num_forced``.

    Raises:
        ValueError: if the shapes of ``reused``, ``fresh`` and ``forced`` disagree or ``ratio`` is
            outside ``[0, 1]``.
    """
    if reused.shape != fresh.shape or fresh.dim() < 1:
        raise ValueError(f"reused {tuple(reused.shape)} and fresh {tuple(fresh.shape)} differ in shape")
    num_tokens = fresh.shape[0]
    budget = hkvd_budget(ratio, num_tokens)
    check_forced(forced, num_tokens)

    reused = reused.to(fresh.device)
    deviation = (fresh.float() - reused.float()).pow(2).flatten(1).sum(dim=1)  # [N]
    chosen = torch.zeros(num_tokens, dtype=torch.bool, device=fresh.device)  # [N]
    if forced is not None:
        forced = forced.to(fresh.device)
        deviation = deviation.masked_fill(forced, float("-inf"))
        budget = min(budget, num_tokens - int(forced.sum()))
        chosen |= forced
    if budget > 0:
        chosen[torch.topk(deviation, budget, sorted=False).indices] = True
    return chosen.nonzero().squeeze(1)  # [n], ascending
