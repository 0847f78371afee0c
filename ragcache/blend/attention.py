"""Causal attention by absolute position, for any subset of queries over a full set of keys.

Owns: ``causal_attention`` and the head expansion it uses, and the blend's attention seam:
:data:`Attention` (the callable an engine hands the layer-wise forwards to run the context's
attention on its own kernel and KV cache) with :func:`torch_attention`, the reference
implementation on ``causal_attention``. The blend's selective layers run n
selected queries over all N context keys; torch SDPA's ``is_causal=True`` aligns its mask top-left
when n < N, which is wrong there, so visibility is decided by absolute position: key j is visible to
a query iff ``k_positions[j] <= query position`` (CacheBlend, Yao et al., EuroSys'25, §4: selective
KV recompute of the HKVD tokens attends over the whole fused KV cache).

Speed on CPU: 4-D SDPA inputs ``[1, H, T, D]`` with the KV heads expanded to the query heads run
faster than 3-D inputs with ``enable_gqa``; a dense ``[n, N]`` mask skips no work and masked SDPA
costs more than the ``is_causal`` kernel. So a contiguous run of queries that
starts where the keys start uses ``is_causal``; anything else is processed in blocks of sorted
queries, each block attending only to the keys up to its last query's position, with a mask only
inside that window.
Must not import vLLM, transformers, or anything above blend/ in ragcache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUERY_BLOCK = 256  # sorted queries per SDPA call in the masked path

Attention = Callable[[int, torch.Tensor, torch.LongTensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attention(layer, q [n, Hq, D], index [n], k [N, Hkv, D], v [N, Hkv, D]) -> [n, Hq, D]``.

Causal attention of the queries of the context tokens at ``index`` (int64, strictly ascending
indices into the context, whose positions ascend) over the context's final K (post-RoPE) and V of
``layer``: the query of token ``index[i]`` sees the context tokens ``0 .. index[i]``. The layer-wise
forwards call it right after ``on_layer(layer, k, v)`` with the same ``k`` and ``v``, so an engine
may read them back from where ``on_layer`` wrote them (its paged KV cache) and run its own
attention kernel instead of using the tensors (CacheBlend's selective layers attend over the whole
fused KV cache, §4.2). A blend given ``write_rows`` (:func:`~ragcache.blend.forward.blend_kv`)
calls it right after ``write_rows`` instead, with ``k = v = None``: such an attention must read the
engine's cache. :func:`torch_attention` is the reference (it needs the tensors)."""


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[N, Hkv, D]`` -> ``[1, Hq, N, D]``, each KV head repeated for its group of query heads."""
    num_kv_heads = x.shape[1]
    x = x.transpose(0, 1)  # [Hkv, N, D]
    if num_heads != num_kv_heads:
        x = x.repeat_interleave(num_heads // num_kv_heads, dim=0)  # [Hq, N, D]
    return x.unsqueeze(0)  # [1, Hq, N, D]


def is_contiguous_range(positions: torch.LongTensor) -> bool:
    """True if ``positions`` is ``p0, p0 + 1, ..., p0 + n - 1`` (an empty tensor counts)."""
    if positions.numel() == 0:
        return True
    expected = torch.arange(positions.shape[0], device=positions.device) + positions[0]
    return bool(torch.equal(positions, expected))


@dataclass(frozen=True)
class CausalPlan:
    """How :func:`causal_attention` runs one set of query positions over one set of key positions.

    Making it reads positions on the host (on an accelerator each read waits for the device);
    running it does not. The blend's selective layers attend with the same queries over the same
    keys in every layer, so :func:`torch_attention` makes one plan per query set and reuses it:
    on an NVIDIA H200 this took a blend of SmolLM2's 30 layers from 309 host waits to 65 (the rest
    are the selection's, once per request).

    Attributes:
        num_queries: ``n``, the queries it was made for.
        num_keys: ``N``, the keys it was made for.
        prefill: the queries are the first ``n`` keys at the same positions (one ``is_causal`` SDPA call).
        order: ``[n]`` int64 argsort of the query positions when they do not ascend, else None.
        q_positions: ``[n]`` int64 query positions, ascending (in ``order`` when it is set).
        k_positions: ``[N]`` int64 key positions.
        blocks: per block of sorted queries ``(start, stop, end, masked)``: queries ``start:stop``
            read keys ``:end``, with a position mask unless each of them sees every one of those keys.
    """

    num_queries: int
    num_keys: int
    prefill: bool
    order: torch.LongTensor | None
    q_positions: torch.LongTensor
    k_positions: torch.LongTensor
    blocks: tuple[tuple[int, int, int, bool], ...]


def causal_plan(q_positions: torch.LongTensor, k_positions: torch.LongTensor,
                block_size: int = QUERY_BLOCK) -> CausalPlan:
    """The :class:`CausalPlan` of queries at ``q_positions`` ``[n]`` over keys at ``k_positions`` ``[N]`` (int64).

    Raises:
        ValueError: positions that are not 1-D, no keys while there are queries, or a query that sees
            no key (its position precedes every key's), whose softmax would be undefined.
    """
    if q_positions.dim() != 1 or k_positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got {tuple(q_positions.shape)} and {tuple(k_positions.shape)}")
    n, num_keys = q_positions.shape[0], k_positions.shape[0]
    if n == 0:
        return CausalPlan(0, num_keys, False, None, q_positions, k_positions, ())
    if num_keys == 0 or bool(q_positions.min() < k_positions.min()):
        raise ValueError("a query precedes every key: its attention row would be empty")
    # Fast path: the queries are the first n keys (a full prefill, possibly at an offset).
    if (
        n <= num_keys
        and is_contiguous_range(k_positions)
        and is_contiguous_range(q_positions)
        and bool(q_positions[0] == k_positions[0])
    ):
        return CausalPlan(n, num_keys, True, None, q_positions, k_positions, ())
    # Masked path: sorted queries in blocks; with sorted keys a block only reads the keys up to
    # its last query's position, and needs no mask when its first query already sees them all.
    order = None
    if n > 1 and not bool((q_positions[1:] >= q_positions[:-1]).all()):
        order = torch.argsort(q_positions, stable=True)
        q_positions = q_positions[order]
    keys_sorted = num_keys == 1 or bool((k_positions[1:] >= k_positions[:-1]).all())
    starts = list(range(0, n, block_size))
    stops = [min(start + block_size, n) for start in starts]
    if keys_sorted:
        block_last = q_positions[torch.tensor([stop - 1 for stop in stops], device=q_positions.device)]
        ends_t = torch.searchsorted(k_positions, block_last, right=True)  # [num_blocks], each >= 1
        first = q_positions[torch.tensor(starts, device=q_positions.device)]
        no_mask = (first >= k_positions[ends_t - 1]).tolist()
        ends = ends_t.tolist()
    else:
        ends = [num_keys] * len(starts)
        no_mask = [False] * len(starts)
    blocks = tuple((start, stop, end, not free) for start, stop, end, free in zip(starts, stops, ends, no_mask))
    return CausalPlan(n, num_keys, False, order, q_positions, k_positions, blocks)


def causal_attention(
    q: torch.Tensor,
    q_positions: torch.LongTensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_positions: torch.LongTensor | None = None,
    scaling: float | None = None,
    block_size: int = QUERY_BLOCK,
    plan: CausalPlan | None = None,
) -> torch.Tensor:
    """Softmax attention of queries over keys with an exact causal mask by absolute position.

    Key j is visible to query i iff ``k_positions[j] <= q_positions[i]``. Queries need not be
    contiguous or sorted (they are sorted internally and returned in the input order).

    Args:
        q: ``[n, Hq, D]`` post-RoPE queries.
        q_positions: ``[n]`` int64 absolute positions of the queries.
        k: ``[N, Hkv, D]`` post-RoPE keys; ``Hq`` must be a multiple of ``Hkv``.
        v: ``[N, Hkv, D]`` values.
        k_positions: ``[N]`` int64 absolute positions of the keys; default ``arange(N)``.
        scaling: softmax scale; default ``1 / sqrt(D)``.
        block_size: queries per SDPA call when a mask is needed (speed only, not results).
        plan: :func:`causal_plan` of these positions, made once for calls that repeat them (no host
            reads of device tensors then); made here when None.

    Returns:
        ``[n, Hq, D]`` attention output in ``q``'s dtype and device, rows in the order of ``q``.

    Raises:
        ValueError: on mismatched shapes or lengths, ``Hq`` not a multiple of ``Hkv``, a plan made
            for other sizes, or a query that sees no key (its position precedes every key's), whose
            softmax would be undefined.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be 3-D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    if v.shape != k.shape or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if q_positions.shape != (n,):
        raise ValueError(f"q_positions {tuple(q_positions.shape)} does not match q {tuple(q.shape)}")
    if k_positions is None:
        k_positions = torch.arange(num_keys, device=k.device)
    elif k_positions.shape != (num_keys,):
        raise ValueError(f"k_positions {tuple(k_positions.shape)} does not match k {tuple(k.shape)}")
    if plan is None:
        plan = causal_plan(q_positions, k_positions, block_size)
    elif (plan.num_queries, plan.num_keys) != (n, num_keys):
        raise ValueError(f"the plan is for {plan.num_queries} queries over {plan.num_keys} keys, "
                         f"got {n} over {num_keys}")
    if n == 0:
        return q.new_empty(0, num_heads, head_dim)

    query = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    key = expand_kv_heads(k, num_heads)  # [1, Hq, N, D]
    value = expand_kv_heads(v, num_heads)  # [1, Hq, N, D]
    if plan.prefill:
        out = F.scaled_dot_product_attention(
            query, key[:, :, :n], value[:, :, :n], is_causal=True, scale=scaling
        )  # [1, Hq, n, D]
        return out[0].transpose(0, 1).contiguous()  # [n, Hq, D]

    if plan.order is not None:
        query = query[:, :, plan.order]
    outs = []
    for start, stop, end, masked in plan.blocks:
        mask = None
        if masked:
            mask = plan.k_positions[:end].unsqueeze(0) <= plan.q_positions[start:stop].unsqueeze(1)  # [b, end]
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:stop], key[:, :, :end], value[:, :, :end], attn_mask=mask, scale=scaling
            )  # [1, Hq, b, D]
        )
    out = torch.cat(outs, dim=2)[0].transpose(0, 1)  # [n, Hq, D]
    if plan.order is not None:
        out = torch.empty_like(out).index_copy_(0, plan.order, out)
    return out.contiguous()


def torch_attention(positions: torch.LongTensor, scaling: float, starts: Sequence[int] | None = None) -> Attention:
    """The reference :data:`Attention` of a context at ``positions`` ``[N]``: :func:`causal_attention`
    over the ``k``/``v`` it is handed (the engine's cache is not read).

    With ``starts`` (``[0, N_0, N_0 + N_1, ..., N]``) the context is several requests' contexts one
    after another (a batched blend): each request's queries attend over its own rows only, one
    :func:`causal_attention` per request (the reference path; an engine's varlen kernel serves a
    batch in one call).

    The :class:`CausalPlan` of the last query set is kept while the same ``index`` tensor comes
    back (the blend's selective layers pass one per request), so only the first layer reads
    positions on the host. An ``index`` is therefore read once: do not change one in place between
    calls (pass a new tensor).

    Args:
        positions: ``[N]`` int64 absolute positions of the context tokens (ascending within a request).
        scaling: softmax scale.
        starts: the first row of every request and N, or None for one request.
    """
    bounds = [0, positions.numel()] if starts is None else list(starts)
    last: list = [None, None]  # [index the plans are for (kept alive, so `is` is safe), per request plans]

    def plans(index: torch.LongTensor) -> list:
        """Per request with queries: (query slice a:b, key slice lo:hi, query positions, plan)."""
        index = index.to(positions.device)
        if len(bounds) == 2:  # one request: no slicing
            q_positions = positions if index.numel() == positions.numel() else positions[index]
            return [(None, None, None, None, q_positions, causal_plan(q_positions, positions))]
        cuts = torch.searchsorted(index, torch.tensor(bounds, device=index.device)).tolist()
        out = []
        for lo, hi, a, b in zip(bounds[:-1], bounds[1:], cuts[:-1], cuts[1:]):
            if a < b:
                keys = positions[lo:hi]
                q_positions = keys if b - a == hi - lo else keys[index[a:b] - lo]
                out.append((a, b, lo, hi, q_positions, causal_plan(q_positions, keys)))
        return out

    def attend(layer: int, q: torch.Tensor, index: torch.LongTensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if last[0] is not index:
            last[:] = [index, plans(index)]
        if len(bounds) == 2:
            q_positions, plan = last[1][0][4:]
            return causal_attention(q, q_positions, k, v, positions, scaling, plan=plan)
        outs = [causal_attention(q[a:b], q_positions, k[lo:hi], v[lo:hi], positions[lo:hi], scaling, plan=plan)
                for a, b, lo, hi, q_positions, plan in last[1]]
        return outs[0] if len(outs) == 1 else torch.cat(outs) if outs else q.new_empty(0, *q.shape[1:])

    return attend


def masked_attention(positions: torch.LongTensor, scaling: float, starts: Sequence[int] | None = None) -> Attention:
    """An :data:`Attention` in one SDPA call per layer whatever the number of requests and runs: every
    query over every row, with a mask that keeps a query to its own request's rows at positions up to
    its own (``starts`` as :func:`torch_attention`'s; None for one request).

    For an accelerator where no engine kernel is available: one kernel launch per layer instead of
    one per request and block of queries, at the cost of computing the masked-out scores (the mask
    is made once per query set). On a CPU :func:`torch_attention` is faster: it skips the keys past
    each block of queries.

    Args:
        positions: ``[N]`` int64 absolute positions of the rows (ascending within a request).
        scaling: softmax scale.
        starts: the first row of every request and N, or None for one request.
    """
    bounds = torch.tensor([0, positions.numel()] if starts is None else list(starts), device=positions.device)
    request = torch.searchsorted(bounds[1:], torch.arange(positions.numel(), device=positions.device), right=True)
    last: list = [None, None]  # [index the mask is for, mask [1, 1, n, N]]

    def attend(layer: int, q: torch.Tensor, index: torch.LongTensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if last[0] is not index:
            rows = index.to(positions.device)
            visible = (request[None, :] == request[rows, None]) & (positions[None, :] <= positions[rows, None])
            last[:] = [index, visible[None, None]]
        num_heads = q.shape[1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], expand_kv_heads(k, num_heads),
                                             expand_kv_heads(v, num_heads), attn_mask=last[1], scale=scaling)
        return out[0].transpose(0, 1)  # [n, Hq, D]

    return attend

