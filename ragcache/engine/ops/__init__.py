"""DecoderOps adapters over vLLM's model modules, and the one registry that picks them.

Owns: :data:`ADAPTERS` (loaded vLLM model class name -> adapter class), :func:`adapter_for`,
:func:`supported_architectures`, :class:`UnsupportedArchitectureError`, :func:`exercise` (an
adapter's crash test) and, for any vLLM model with or without an adapter, :func:`kv_layout` and
:func:`sliding_window`. An adapter implements
:class:`ragcache.blend.DecoderOps` over the loaded model's own modules; its RoPE is always the
model's own ``rotary_emb``, so rope scaling is the engine's by construction.

The key is the class vLLM instantiated (``type(worker.model_runner.model).__name__``), which fixes
the module layout the adapter reads: HF architectures that vLLM loads as the same class share its
adapter (vLLM's ``models/registry.py`` maps e.g. ``LLaMAForCausalLM`` and ``InternLM3ForCausalLM``
to ``LlamaForCausalLM``). Whatever the registry says, the start-up self-check
(:mod:`ragcache.engine.selfcheck`) verifies the adapter numerically against vLLM's own prefill
before reuse/blend are allowed.

Adding a family: write a subclass of :class:`~ragcache.engine.ops.llama.VLLMLlamaOps` (override
``_qk_norm`` for norms before RoPE, ``_refuse`` for configurations it cannot serve, or the
DecoderOps methods themselves) following vLLM's ``vllm/model_executor/models/<family>.py``, add
``ADAPTERS["<vLLM class name>"] = YourOps``, and add a tiny-model test to
``tests/test_engine_families.py``. Must not import vLLM (adapters only read module attributes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragcache.engine.ops.llama import VLLMLlamaOps, VLLMMistralOps
from ragcache.engine.ops.qwen import VLLMQwen2Ops, VLLMQwen3Ops

#: loaded vLLM model class name -> DecoderOps adapter class
ADAPTERS: dict[str, type[VLLMLlamaOps]] = {
    "LlamaForCausalLM": VLLMLlamaOps,
    "MistralForCausalLM": VLLMMistralOps,
    "Qwen2ForCausalLM": VLLMQwen2Ops,
    "Qwen3ForCausalLM": VLLMQwen3Ops,
}

#: the checkpoints each registered class serves, for messages and docs/model-families.md's support matrix
FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "Llama 2, Llama 3.x (rope_scaling llama3/linear/dynamic), SmolLM2, Yi",
    "MistralForCausalLM": "Mistral 7B, Mistral NeMo (HF format)",
    "Qwen2ForCausalLM": "Qwen2, Qwen2.5, QwQ",
    "Qwen3ForCausalLM": "Qwen3 (dense)",
}

HOW_TO_ADD = ("to add an adapter, subclass VLLMLlamaOps in ragcache/engine/ops/ following vLLM's "
              "model file and register it in ragcache.engine.ops.ADAPTERS (see that module's docstring)")


class UnsupportedArchitectureError(TypeError):
    """No adapter serves the loaded model: its class is not in :data:`ADAPTERS`, or its adapter
    refused it (a missing module, a configuration whose KV cannot be moved).

    Attributes:
        architecture: the loaded vLLM model class name.
        hf_architectures: ``config.architectures`` of the checkpoint.
        reason: why (one sentence).
    """

    def __init__(self, architecture: str, hf_architectures: Sequence[str], reason: str):
        self.architecture = architecture
        self.hf_architectures = tuple(hf_architectures)
        self.reason = reason
        super().__init__(f"{describe(architecture, hf_architectures)}: {reason}")


def describe(architecture: str, hf_architectures: Sequence[str] = ()) -> str:
    """``"Qwen2ForCausalLM"``, or ``"InternLM3ForCausalLM (loaded by vLLM as LlamaForCausalLM)"``."""
    others = [a for a in hf_architectures if a != architecture]
    return f"{others[0]} (loaded by vLLM as {architecture})" if others else architecture


def supported_architectures() -> str:
    """One line listing the registered classes and the checkpoints they serve."""
    return "; ".join(f"{name} ({FAMILIES.get(name, adapter.__name__)})" for name, adapter in ADAPTERS.items())


def adapter_for(model: torch.nn.Module, hf_architectures: Sequence[str] = ()) -> VLLMLlamaOps:
    """The registered DecoderOps adapter built over ``model``.

    Args:
        model: the loaded vLLM model (``worker.model_runner.model``).
        hf_architectures: the checkpoint's ``config.architectures`` (for messages only).

    Returns:
        an adapter instance (a :class:`ragcache.blend.DecoderOps`).

    Raises:
        UnsupportedArchitectureError: the class is not registered (the message lists the supported
            ones), or the adapter refused the model (the message says why).
    """
    architecture = type(model).__name__
    adapter = ADAPTERS.get(architecture)
    if adapter is None:
        raise UnsupportedArchitectureError(
            architecture, hf_architectures, f"no DecoderOps adapter is registered for it (supported: "
            f"{supported_architectures()})")
    try:
        return adapter(model)
    except TypeError as exc:
        raise UnsupportedArchitectureError(architecture, hf_architectures,
                                           f"the {adapter.__name__} adapter refused it: {exc}") from exc


def exercise(ops: VLLMLlamaOps, token_ids: torch.Tensor) -> None:
    """Call every DecoderOps method of ``ops`` once on the first and the last layer.

    A cheap crash test (two layers of a few tokens) run in the worker before the self-check's first
    blend request, so that an adapter which raises on this model is reported instead of failing
    inside vLLM's engine loop. It does not check values: the self-check does.

    Args:
        ops: the adapter.
        token_ids: ``[n]`` int64 token ids on ``ops.device``.

    Raises:
        Exception: whatever the adapter raises; FloatingPointError on non-finite outputs.
    """
    from ragcache.blend import causal_attention

    positions = torch.arange(token_ids.shape[0], device=ops.device)
    with torch.inference_mode():
        hidden = ops.embed(token_ids)  # [n, hidden]
        for layer in sorted({0, ops.num_layers - 1}):
            q, k, v = ops.qkv(layer, hidden)
            q, k = ops.rope(layer, positions, q, k)
            _, moved = ops.rope(layer, positions + 7, None, k)
            out = ops.finish_layer(layer, hidden, causal_attention(q, positions, k, v, positions, ops.scaling))
            if not all(torch.isfinite(t).all() for t in (q, k, v, moved, out)):
                raise FloatingPointError(f"non-finite values in layer {layer}")


def kv_layout(model: torch.nn.Module) -> tuple[int, int, int, torch.dtype]:
    """``(num_layers, num_kv_heads, head_dim, dtype)`` of any vLLM model, from its attention layers.

    Counts the modules that own a paged KV cache (vLLM's ``Attention``: they have ``impl`` and
    ``num_kv_heads`` and ``head_size``), so it needs no adapter; used to size the KV store when
    there is none.

    Raises:
        TypeError: the model has no such attention layer.
    """
    layers = [m for m in model.modules() if hasattr(m, "impl") and hasattr(m, "num_kv_heads")
              and hasattr(m, "head_size")]
    if not layers:
        raise TypeError(f"{type(model).__name__} has no vLLM attention layers")
    param = next(model.parameters())
    return len(layers), int(layers[0].num_kv_heads), int(layers[0].head_size), param.dtype


def sliding_window(model: torch.nn.Module) -> int | None:
    """The smallest attention window (tokens) any layer of ``model`` uses, None when all are global.

    Read from the layers vLLM built (``Attention.sliding_window``), so it is what the engine applies
    (vLLM sets it from ``config.sliding_window`` / ``layer_types``; ``use_sliding_window = false``
    and ``disable_sliding_window`` leave it None).
    """
    windows = [int(m.sliding_window) for m in model.modules()
               if hasattr(m, "impl") and hasattr(m, "num_kv_heads") and getattr(m, "sliding_window", None)]
    return min(windows) if windows else None


__all__ = [
    "ADAPTERS", "FAMILIES", "HOW_TO_ADD", "UnsupportedArchitectureError", "VLLMLlamaOps", "VLLMMistralOps",
    "VLLMQwen2Ops", "VLLMQwen3Ops", "adapter_for", "describe", "exercise", "kv_layout", "sliding_window",
    "supported_architectures",
]
