"""Stored forms of chunk KV: uncompressed, or quantised to int8 / int4 with per-group scales.

Owns: the forms (:data:`FORMS`), the byte layout of one layer in each (:func:`layer_parts`),
quantising an entry when it is stored (:func:`encode`) and dequantising one layer (or all) when it
is read (:func:`decode_layer`, :func:`decode_all`; one layer of many entries at once:
:func:`decode_layers`), and each form's error bound
(:data:`ERROR_BOUNDS`). Plain torch; imports nothing from ragcache; must not import vLLM.

Forms (``store.kv_compression``):

- ``none``: K and V as floats in the storage dtype (``store.kv_dtype``), ``[2, T, H, D]`` per layer.
- ``int8``: symmetric round-to-nearest int8, K grouped per channel (one scale per head and
  dimension over the chunk's T tokens: K's outliers sit in fixed channels, and ragcache stores K
  before RoPE, where they are not yet rotated into neighbouring dimensions) and V per token (one
  scale per token and head over its D dimensions), as KIVI does (Liu et al., "KIVI: A Tuning-Free
  Asymmetric 2bit Quantization for KV Cache", ICML 2024). Scales are float16.
- ``int4``: the same grouping with 4-bit values in [-7, 7], two per byte (low nibble = even
  dimension), each stored as value + 8.

Layer layout of the quantised forms (each part a safetensors tensor; all sizes even, so the
float16 scales stay 2-byte aligned): ``k`` (int8 ``[T, H, D]`` or uint8 ``[T, H, D/2]``), ``k_scale``
(float16 ``[H, D]``), ``v`` (as ``k``), ``v_scale`` (float16 ``[T, H]``). Bytes per token and layer:
``2*H*D*b + 2*H`` plus ``2*H*D/T`` for K's scales, b = 1 (int8) or 1/2 (int4); against
``8*H*D`` in float32.

Each scale is ``max|x| / qmax`` of its group rounded *up* to float16 (never below 2**-14, float16's
smallest normal), and values are quantised with that stored scale, so decoding is exactly
``q * scale`` and every element is within half a scale of the value stored:
``|x - x_hat| <= scale / 2`` with ``scale <= max(max|group| / qmax, 2**-14) * (1 + 2**-9)``
(:data:`ERROR_BOUNDS` gives the bound relative to the group's largest magnitude).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the stored forms, by their ``store.kv_compression`` name
FORMS = ("none", "int8", "int4")
#: largest quantised magnitude per quantised form (symmetric: values in [-qmax, qmax])
QMAX = {"int8": 127, "int4": 7}
#: worst-case ``|x - x_hat| / max|group of x|`` per quantised form (round to nearest: half a step,
#: the step being the group's largest magnitude over qmax, times the float16 rounding-up of the
#: scale), for groups whose largest magnitude is at least ``qmax * 2**-14``
ERROR_BOUNDS = {form: (1 + 2**-9) / (2 * qmax) for form, qmax in QMAX.items()}
#: smallest scale stored (float16's smallest normal number)
MIN_SCALE = 2.0**-14
SCALE_DTYPE = torch.float16

_ST_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
             torch.uint8: "U8"}


@dataclass(frozen=True)
class Part:
    """One tensor of a stored layer.

    Attributes:
        name: ``k``, ``k_scale``, ``v`` or ``v_scale`` (the safetensors name is ``<name>.<layer>``).
        dtype: its torch dtype.
        shape: its shape.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def code(self) -> str:
        """The safetensors dtype code (``F32``, ``F16``, ``BF16``, ``I8``, ``U8``)."""
        return _ST_CODES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def check_form(form: str) -> str:
    """Return ``form`` if it is a stored form.

    Raises:
        ValueError: not one of :data:`FORMS`.
    """
    if form not in FORMS:
        raise ValueError(f"unknown KV compression {form!r}; use one of {', '.join(FORMS)}")
    return form


def layer_parts(form: str, dtype: torch.dtype, tokens: int, heads: int, head_dim: int) -> tuple[Part, ...]:
    """The tensors of one stored layer, in file order.

    Args:
        form: a stored form.
        dtype: the storage dtype of ``none`` (ignored by the quantised forms).
        tokens, heads, head_dim: T, H, D.

    Raises:
        ValueError: an unknown form, or ``int4`` with an odd ``head_dim``.
    """
    check_form(form)
    T, H, D = tokens, heads, head_dim
    if form == "none":
        return (Part("k", dtype, (T, H, D)), Part("v", dtype, (T, H, D)))
    if form == "int4":
        if D % 2:
            raise ValueError(f"kv_compression int4 packs two dimensions per byte; head_dim {D} is odd "
                             "(use int8)")
        payload = Part("", torch.uint8, (T, H, D // 2))
    else:
        payload = Part("", torch.int8, (T, H, D))
    return (Part("k", payload.dtype, payload.shape), Part("k_scale", SCALE_DTYPE, (H, D)),
            Part("v", payload.dtype, payload.shape), Part("v_scale", SCALE_DTYPE, (T, H)))


def record_nbytes(parts: tuple[Part, ...]) -> int:
    """Bytes of one stored layer."""
    return sum(p.nbytes for p in parts)


def _scales(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """float16 scales ``>= absmax / qmax`` (rounded up, at least :data:`MIN_SCALE`).

    Raises:
        ValueError: a group holds a non-finite value, or one too large for a float16 scale.
    """
    s = (absmax.float() / qmax).clamp_min(MIN_SCALE)
    s16 = (s * (1 + 2.0**-10)).to(SCALE_DTYPE)  # float16 rounds to nearest (rel. error <= 2**-11): now >= s
    if not bool(torch.isfinite(s16).all()):
        raise ValueError("KV holds non-finite values or magnitudes beyond float16 scales (above "
                         f"{65504 * qmax:.3g}); store it with store.kv_compression = \"none\"")
    return s16


def _quantise(x: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    return torch.round(x.float() / scale.float()).clamp_(-qmax, qmax).to(torch.int8)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-7, 7], ``[..., D]`` -> uint8 ``[..., D/2]`` (low nibble = even dimension)."""
    u = (q + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def encode(k: torch.Tensor, v: torch.Tensor, form: str, dtype: torch.dtype) -> torch.Tensor:
    """An entry's K and V in stored form: one record per layer, on the CPU, contiguous.

    Quantisation runs on the tensors' own device (an accelerator's, where the KV was computed).

    Args:
        k: pre-RoPE keys ``[L, T, H, D]``, any float dtype, any device.
        v: values, same shape.
        form: a stored form.
        dtype: storage dtype of ``none``.

    Returns:
        ``none``: ``[L, 2, T, H, D]`` in ``dtype``; ``int8``/``int4``: uint8 ``[L, record bytes]``
        holding each layer's parts (:func:`layer_parts`) back to back.

    Raises:
        ValueError: an unknown form; ``int4`` with an odd head_dim; non-finite KV (quantised forms).
    """
    check_form(form)
    if form == "none":
        return torch.stack([k.detach(), v.detach()], dim=1).to(device="cpu", dtype=dtype).contiguous()
    L, T, H, D = k.shape
    layer_parts(form, dtype, T, H, D)  # validates int4's even head_dim
    qmax = QMAX[form]
    k, v = k.detach(), v.detach()
    k_scale = _scales(k.abs().amax(dim=1), qmax)  # [L, H, D]: per channel, over the chunk's tokens
    v_scale = _scales(v.abs().amax(dim=3), qmax)  # [L, T, H]: per token and head
    qk = _quantise(k, k_scale[:, None], qmax)
    qv = _quantise(v, v_scale[..., None], qmax)
    if form == "int4":
        qk, qv = _pack4(qk), _pack4(qv)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8).reshape(L, -1)

    out = torch.cat([flat(qk), flat(k_scale), flat(qv), flat(v_scale)], dim=1)
    return out.to("cpu").contiguous()


def split_layer(parts: tuple[Part, ...], record: torch.Tensor) -> list[torch.Tensor]:
    """Views of one stored layer's parts (``record``: uint8 ``[record bytes]``, contiguous)."""
    views, offset = [], 0
    for p in parts:
        views.append(record[offset:offset + p.nbytes].view(p.dtype).view(p.shape))
        offset += p.nbytes
    return views


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of the float tensor ``t`` is finite (no NaN, no infinity).

    One float32 sum over ``t`` decides in the usual case (a NaN or an infinity makes the sum
    non-finite, so a finite sum clears every element); only a sum that overflows from finite
    values is looked at element by element.
    """
    if t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def non_finite_part(form: str, parts: tuple[Part, ...], record: torch.Tensor) -> str | None:
    """The name of the first float part of one stored layer holding a NaN or an infinity, or None
    when every one is finite: the scales of a quantised form (its integer values cannot be
    non-finite), K and V of ``none``. :func:`encode` never writes such a layer, so a reader refuses
    one as damaged.

    Args:
        form, parts: the entry's stored form and layer layout (:func:`layer_parts`).
        record: the stored layer, ``[2, T, H, D]`` floats (``none``) or uint8 ``[record bytes]``.
    """
    if form == "none":
        tensors = [record[0], record[1]]
    else:
        tensors = split_layer(parts, record)
    for part, t in zip(parts, tensors):
        if t.is_floating_point() and not all_finite(t):
            return part.name
    return None


def decode_layer(form: str, parts: tuple[Part, ...], record: torch.Tensor, dtype: torch.dtype,
                 device: torch.device, copy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one stored layer, each ``[T, H, D]`` in ``dtype`` on ``device``.

    Args:
        form: the entry's stored form.
        parts: its layer layout (:func:`layer_parts`).
        record: the stored layer: ``[2, T, H, D]`` floats (``none``) or uint8 ``[record bytes]``;
            on the CPU or on ``device``. Never modified.
        dtype, device: what to return.
        copy: ``none`` only: copy even where ``record`` already is in ``dtype`` on ``device`` (False:
            the caller owns ``record``). The quantised forms always return new tensors.

    Dequantisation (``q * scale`` in float32, cast once to ``dtype``) runs on ``device``: the
    record travels in its compressed size.
    """
    non_blocking = device.type != "cpu"
    if form == "none":
        kv = record.to(device=device, dtype=dtype, copy=copy, non_blocking=non_blocking)
        return kv[0], kv[1]
    record = record.to(device=device, non_blocking=non_blocking)
    qk, k_scale, qv, v_scale = split_layer(parts, record)
    return _dequantise(form, qk, k_scale, dtype), _dequantise(form, qv, v_scale[..., None], dtype)


def _dequantise(form: str, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``q * scale`` in float32, cast once to ``dtype`` (into ``out`` when given). Plain same-dtype
    kernels (a cast, an in-place multiply, a cast): a mixed int8 x float multiply into a 16-bit
    output takes torch's slow casting path (~4x slower on a CPU)."""
    if form == "int4":  # nibbles 1..15 stand for -7..7: unpack (low nibble = even dimension), then shift
        x = torch.stack((q & 15, q >> 4), dim=-1).flatten(-2).to(torch.float32).sub_(8)
    else:
        x = q.to(torch.float32)
    x.mul_(scale.to(torch.float32))
    if out is not None:
        return out.copy_(x)
    return x if dtype == torch.float32 else x.to(dtype)


@dataclass(frozen=True)
class _Stored:
    form: str
    parts: tuple[Part, ...]
    record: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.parts[0].shape[0]


@dataclass(frozen=True)
class StoredLayer(_Stored):
    """One layer of one entry as it was stored and read, not yet dequantised (what
    :meth:`ragcache.kvstore.handle.KVHandle.stored_layer` returns, :func:`decode_layers` decodes).

    Attributes:
        form: the entry's stored form.
        parts: its layer layout (:func:`layer_parts`).
        record: ``[2, T, H, D]`` floats (``none``) or uint8 ``[record bytes]``, on the CPU or the
            compute device; a view of a memory tier's entry, or the caller's own tensor. Never modified.
    """


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (asynchronously from the CPU to an accelerator)."""
    return t if t.device == device else t.to(device=device, non_blocking=device.type != "cpu")


def decode_layers(layers: "list[StoredLayer]", dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer of several entries, concatenated along their tokens in the given order:
    each ``[sum T, H, D]`` in ``dtype`` on ``device`` (new tensors).

    Entries of one stored form are decoded together, in a number of kernels that does not grow with
    the number of entries: the payloads and the scales are concatenated (K's per-channel scales
    repeated over each entry's tokens), then dequantised once (:func:`decode_layer` per entry costs
    a handful of kernels each, which for a context of many chunks adds up to more than the
    dequantisation itself). Entries of different forms (a chunk computed during a request among
    stored ones) are decoded one by one.

    Raises:
        ValueError: no layers.
    """
    if not layers:
        raise ValueError("decode_layers needs at least one layer")

    form = layers[0].form
    if any(layer.form != form for layer in layers):
        ks, vs = zip(*(decode_layer(layer.form, layer.parts, layer.record, dtype, device) for layer in layers))
        return torch.cat(ks), torch.cat(vs)
    if form == "none":
        kv = torch.cat([_on_device(layer.record, device) for layer in layers], dim=1)  # [2, N, H, D], a new tensor
        kv = kv.to(dtype=dtype)
        return kv[0], kv[1]
    split = [split_layer(layer.parts, _on_device(layer.record, device)) for layer in layers]
    qk = torch.cat([p[0] for p in split])  # [N, H, D] (int4: D/2 bytes)
    qv = torch.cat([p[2] for p in split])
    counts = torch.tensor([layer.num_tokens for layer in layers], device=device)
    k_scale = torch.repeat_interleave(torch.stack([p[1] for p in split]), counts, dim=0)  # [N, H, D]
    v_scale = torch.cat([p[3] for p in split])  # [N, H]
    return _dequantise(form, qk, k_scale, dtype), _dequantise(form, qv, v_scale[..., None], dtype)


@dataclass(frozen=True)
class StoredEntry(_Stored):
    """Every layer of one entry as it was stored and read, not yet dequantised (what
    :meth:`ragcache.kvstore.handle.KVHandle.stored_entry` returns, :func:`decode_entries` decodes).

    Attributes:
        form: the entry's stored form.
        parts: its layer layout (:func:`layer_parts`).
        record: ``[L, 2, T, H, D]`` floats (``none``) or uint8 ``[L, record bytes]``, on the CPU or the
            compute device; a memory tier's entry itself, or the caller's own tensor. Never modified.
    """


def decode_entries(entries: "list[StoredEntry]", dtype: torch.dtype, device: torch.device,
                   out: "tuple[torch.Tensor, torch.Tensor] | None" = None,
                   layers_per_call: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every layer of several entries, concatenated along their tokens in the given order:
    each ``[L, sum T, H, D]`` in ``dtype`` on ``device``.

    Entries of one stored form are decoded together: each entry's record is split into its parts
    once for all its layers (one operator per entry), each part of every entry is concatenated once
    (``[L, bytes]``), then every round of layers is dequantised in a fixed number of kernels (K's
    per-channel scales spread over each entry's tokens by one index). Entries of different forms (a
    chunk computed during a request among stored ones) are decoded one by one.

    Args:
        out: ``(k, v)`` tensors of the result's shape and dtype to write into (then returned), or None
            for new tensors.
        layers_per_call: decode this many layers per round of kernels (None: all at once, the fewest
            launches, for an accelerator; 1 on a CPU keeps each round's float32 temporaries in cache,
            where one round over every layer streams several times the entries' size through memory).

    Raises:
        ValueError: no entries, or ``layers_per_call`` below 1.
    """
    if not entries:
        raise ValueError("decode_entries needs at least one entry")
    if layers_per_call is not None and layers_per_call < 1:
        raise ValueError(f"layers_per_call must be at least 1, got {layers_per_call}")

    def written(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if out is None:
            return k, v
        out[0].copy_(k)
        out[1].copy_(v)
        return out

    form = entries[0].form
    if any(e.form != form for e in entries):
        ks, vs = zip(*(decode_entries([e], dtype, device) for e in entries))
        return written(torch.cat(ks, dim=1), torch.cat(vs, dim=1))
    if form == "none":
        kv = torch.cat([_on_device(e.record, device) for e in entries], dim=2).to(dtype=dtype)  # [L, 2, N, H, D], new
        return written(kv[:, 0], kv[:, 1])
    num_layers = entries[0].record.shape[0]
    n = sum(e.num_tokens for e in entries)
    qk_part, _, _, vs_part = entries[0].parts
    heads, qdim = qk_part.shape[1], qk_part.shape[2]
    # each entry's record split into its parts (one operator per entry, whatever the layers), then each
    # part of every entry concatenated along the bytes: [L, bytes] per part, in token order
    split = [_on_device(e.record, device).split([p.nbytes for p in e.parts], dim=1) for e in entries]
    qk_all, ks_all, qv_all, vs_all = (torch.cat([parts[i] for parts in split], dim=1) for i in range(4))
    qk_all = qk_all.view(qk_part.dtype).view(num_layers, n, heads, qdim)
    qv_all = qv_all.view(qk_part.dtype).view(num_layers, n, heads, qdim)
    ks_all = ks_all.view(SCALE_DTYPE).view(num_layers, len(entries), heads, -1)  # per entry and channel
    vs_all = vs_all.view(vs_part.dtype).view(num_layers, n, heads, 1)  # per token and head
    counts = torch.tensor([e.num_tokens for e in entries], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(entries)), counts, output_size=n)  # [N]: each token's entry
    owner = _on_device(owner, device)
    if out is None:
        shape = (num_layers, n, heads, qdim * (2 if form == "int4" else 1))
        out = (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
    step = num_layers if layers_per_call is None else layers_per_call
    for first in range(0, num_layers, step):
        layers = slice(first, first + step)
        _dequantise(form, qk_all[layers], ks_all[layers].index_select(1, owner), dtype, out=out[0][layers])
        _dequantise(form, qv_all[layers], vs_all[layers], dtype, out=out[1][layers])
    return out


def decode_all(form: str, parts: tuple[Part, ...], kv: torch.Tensor, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every layer, each ``[L, T, H, D]`` in ``dtype`` on ``device`` (new tensors);
    ``kv`` as :func:`encode` returns it."""
    if form == "none":
        return (kv[:, 0].to(device=device, dtype=dtype, copy=True).contiguous(),
                kv[:, 1].to(device=device, dtype=dtype, copy=True).contiguous())
    layers = [decode_layer(form, parts, kv[i], dtype, device) for i in range(kv.shape[0])]
    return torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])
