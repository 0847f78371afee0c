"""Spreading the recomputed tokens' KV corrections to the tokens a blend leaves reused.

Owns: :func:`spread_corrections` (the math) and :class:`Propagation` (one pass's requests: which
rows give and take corrections, and the writes into a layer's reused KV).

A reused token's KV is off because, when its chunk was precomputed, its attention did not see the
chunks now before it. In every selective layer the blend measures that error exactly for the
tokens it recomputes: their fresh K (before RoPE) and V minus their reused K/V. Tokens whose keys
look alike in a layer read alike from the context they missed, so each token left reused gets
``alpha`` times the mean of the recomputed tokens' corrections, weighted by
``softmax(cos(its reused pre-RoPE key, theirs) / tau)`` per KV head, before the recomputed queries
attend over the layer (and before the layer's KV is written for decode). With the chunk scope a
token takes corrections only from the recomputed tokens of its own chunk (they missed the same
chunks before them), and the weights are computed chunk by chunk: the cost falls from
``reused x recomputed`` key pairs per layer to the sum of each chunk's. ragcache's own method:
CacheBlend (Yao et al., EuroSys'25, §4.2) corrects only the recomputed tokens and leaves the rest
as cached; the screen that chose ``alpha = 0.5, tau = 0.05``, the runs that chose the deeper half
of the layers (``propagate_from_depth = 0.5``: the earlier layers are left as the blend makes them)
and the trade they measure are in docs/fidelity.md ("Propagating the recomputed tokens'
corrections").

The weights compare keys before RoPE (a key's position would otherwise dominate the similarity);
a correction to K is rotated to the target's position (RoPE is linear, so the rotated sum is the
sum of the rotated parts). Rows whose KV is exact (computed at their positions) or forced (no
cached KV at all) neither give nor take a correction; with every row recomputed (ratio 1) there is
nothing to correct and the blend is unchanged.
Must not import vLLM, transformers, or anything above blend/ in ragcache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

#: targets per block of :func:`spread_corrections` (bounds its ``[Hkv, block, s]`` weights)
BLOCK = 2048


def spread_corrections(keys_to: torch.Tensor, keys_from: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                       alpha: float, tau: float, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The corrections the tokens left reused take from the recomputed ones, in one layer.

    Args:
        keys_to: ``[u, Hkv, D]`` the reused tokens' K before RoPE (the tokens corrected).
        keys_from: ``[s, Hkv, D]`` the recomputed tokens' reused K before RoPE (s >= 1).
        dk: ``[s, Hkv, D]`` the recomputed tokens' fresh minus reused K, before RoPE.
        dv: ``[s, Hkv, D]`` their fresh minus reused V.
        alpha: the share of the weighted mean applied, in [0, 1].
        tau: the softmax temperature over cosine similarities, > 0.

    Returns:
        ``(ck [u, Hkv, D], cv [u, Hkv, D])`` in ``dk``'s dtype: ``alpha * sum_j w_ij d_j`` per KV head
        with ``w_i = softmax_j(cos(keys_to[i], keys_from[j]) / tau)``, computed in float32 (the
        similarity's steps in bfloat16 are as wide as the temperature's scale), ``block`` targets at
        a time.

    Raises:
        ValueError: shapes that do not match, or no recomputed token.
    """
    if keys_from.shape[0] == 0 or keys_from.shape != dk.shape or dk.shape != dv.shape \
            or keys_to.shape[1:] != keys_from.shape[1:]:
        raise ValueError(f"spread_corrections: keys_to {tuple(keys_to.shape)}, keys_from {tuple(keys_from.shape)}, "
                         f"dk {tuple(dk.shape)}, dv {tuple(dv.shape)}: expected [u, Hkv, D] and three [s >= 1, Hkv, D]")
    d = dk.shape[-1]
    sources = F.normalize(keys_from.float(), dim=-1).transpose(0, 1).div_(tau)  # [Hkv, s, D]
    delta = torch.cat([dk, dv], dim=-1).float().transpose(0, 1)  # [Hkv, s, 2D]
    out = torch.empty(keys_to.shape[0], keys_to.shape[1], 2 * d, dtype=torch.float32, device=keys_to.device)
    for lo in range(0, keys_to.shape[0], block):
        targets = F.normalize(keys_to[lo:lo + block].float(), dim=-1).transpose(0, 1)  # [Hkv, b, D]
        w = torch.softmax(targets @ sources.transpose(1, 2), dim=-1)  # [Hkv, b, s]
        out[lo:lo + block] = (w @ delta).transpose(0, 1)
    out.mul_(alpha)
    return out[..., :d].to(dk.dtype), out[..., d:].to(dv.dtype)


class Propagation:
    """Correction propagation over one pass's rows (request after request, as the pass lays them out).

    Args:
        starts: ``[R + 1]`` the first row of each request, then the pass's rows S.
        shares: each request's ``alpha`` (0: that request's rows are left as the blend makes them).
        temperatures: each request's ``tau``.
        fixed: ``[S]`` bool, rows whose KV is exact or forced (they neither give nor take), or None.
        segments: per request, None (corrections flow within the whole request) or its chunks'
            first rows, ascending from 0 (within each chunk only).
        first_layers: per request, the first layer its rows take corrections in (None: every layer).
    """

    def __init__(self, starts: Sequence[int], shares: Sequence[float], temperatures: Sequence[float],
                 fixed: torch.Tensor | None, segments: Sequence[Sequence[int] | None] | None = None,
                 first_layers: Sequence[int] | None = None) -> None:
        self.spans = []  # (first row, end, alpha, tau, first layer)
        for r, (lo, hi, a, t) in enumerate(zip(starts[:-1], starts[1:], shares, temperatures)):
            if a <= 0:
                continue
            cuts = [lo] if segments is None or segments[r] is None else [lo + c for c in segments[r]]
            first = 0 if first_layers is None else first_layers[r]
            self.spans += [(x, y, a, t, first) for x, y in zip(cuts, [*cuts[1:], hi]) if y > x]
        self.start_layer = min((span[4] for span in self.spans), default=0)
        self.num_rows = starts[-1]
        self.fixed = fixed
        self.corrected = 0  # targets corrected, summed over layers
        self._per_pass: tuple[torch.Tensor, torch.Tensor] | None = None  # built on the first layer's device

    def _prepare(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(eligible [S] bool: rows inside a span (a propagating request's) and neither exact nor
        forced, edges [2 * spans] int64: each span's first row and end)``, once per pass."""
        if self._per_pass is None:
            inside = [False] * self.num_rows
            for lo, hi, *_ in self.spans:
                inside[lo:hi] = [True] * (hi - lo)
            eligible = torch.tensor(inside, dtype=torch.bool, device=device)
            if self.fixed is not None:
                eligible &= ~self.fixed.to(device)
            self._per_pass = eligible, torch.tensor([x for lo, hi, *_ in self.spans for x in (lo, hi)], device=device)
        return self._per_pass

    def active(self, layer: int) -> bool:
        """Some request of the pass propagates in ``layer`` (its first propagating layer,
        ``propagate_from_depth`` x the model's layers, is at or below it)."""
        return layer >= self.start_layer

    @classmethod
    def of(cls, starts: Sequence[int], knobs: Sequence, exact: torch.Tensor | None,
           forced: torch.Tensor | None, segment_starts: Sequence[Sequence[int]] | None = None, *,
           num_layers: int) -> "Propagation | None":
        """The propagation of a pass whose requests carry ``knobs`` (``propagate``,
        ``propagate_temperature``, ``propagate_scope`` and ``propagate_from_depth`` of
        :class:`ragcache.config.BlendSettings`), or None when none of them propagates.
        ``segment_starts``: each request's chunk starts (for ``propagate_scope = "chunk"``);
        ``num_layers``: the model's, for ``propagate_from_depth`` (its share of them, rounded).

        Raises:
            ValueError: ``num_layers`` below 1 (every depth would start at layer 0).
        """
        if num_layers < 1:
            raise ValueError(f"num_layers must be the model's layer count (>= 1), got {num_layers}")
        shares = [float(getattr(k, "propagate", 0.0)) for k in knobs]
        if not any(a > 0 for a in shares):
            return None
        fixed = None
        for mask in (exact, forced):
            if mask is not None:
                fixed = mask.clone() if fixed is None else fixed | mask
        segments = [list(seg) if segment_starts is not None and getattr(k, "propagate_scope", "chunk") == "chunk"
                    else None for k, seg in zip(knobs, segment_starts or [None] * len(knobs))]
        first_layers = [round(float(getattr(k, "propagate_from_depth", 0.0)) * num_layers) for k in knobs]
        return cls(starts, shares, [float(getattr(k, "propagate_temperature", 0.05)) for k in knobs], fixed, segments,
                   first_layers)

    def apply_(self, rows: torch.Tensor, fresh_k_pre: torch.Tensor, fresh_v: torch.Tensor, reused_k_pre: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], layer: int = 0) -> None:
        """Correct one layer's reused KV in place from its recomputed rows.

        Args:
            layer: the layer (the spans whose first layer is above it are left as they are).
            rows: ``[n]`` ascending, the rows recomputed in this layer.
            fresh_k_pre: ``[n, Hkv, D]`` their fresh K before RoPE; ``fresh_v`` ``[n, Hkv, D]`` their V.
            reused_k_pre: ``[S, Hkv, D]`` every row's reused K before RoPE.
            k: ``[S, Hkv, D]`` every row's reused K at its position (post-RoPE), corrected in place.
            v: ``[S, Hkv, D]`` every row's reused V, corrected in place.
            positions: ``[S]`` int64, every row's position.
            rotate: ``(x [u, Hkv, D], positions [u]) -> x`` rotated to ``positions`` (the model's RoPE).

        The recomputed rows themselves are left for the caller to overwrite with their fresh KV.
        """
        device = k.device
        eligible, edges = self._prepare(device)  # the rows of non-propagating requests neither give nor take
        chosen = torch.zeros(k.shape[0], dtype=torch.bool, device=device)
        chosen[rows] = True
        given = (chosen & eligible)[rows]  # [n]: which recomputed rows give
        src, to = rows[given], (eligible & ~chosen).nonzero().flatten()  # ascending rows
        cuts = torch.stack([torch.searchsorted(src, edges), torch.searchsorted(to, edges)]).tolist()  # one sync
        keys_from, keys_to = reused_k_pre[src], reused_k_pre[to]
        dk, dv = fresh_k_pre[given] - keys_from, fresh_v[given] - v[src]
        ck, cv = torch.zeros_like(keys_to), torch.zeros_like(keys_to)
        for i, (_, _, alpha, tau, first) in enumerate(self.spans):
            s0, s1, t0, t1 = cuts[0][2 * i], cuts[0][2 * i + 1], cuts[1][2 * i], cuts[1][2 * i + 1]
            if s1 > s0 and t1 > t0 and layer >= first:  # a span with no recomputed row gives nothing
                ck[t0:t1], cv[t0:t1] = spread_corrections(keys_to[t0:t1], keys_from[s0:s1], dk[s0:s1], dv[s0:s1],
                                                          alpha, tau)
                self.corrected += t1 - t0
        if to.numel() > 0:
            k.index_add_(0, to, rotate(ck, positions[to]))
            v.index_add_(0, to, cv)
