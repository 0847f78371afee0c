"""What vLLM 0.32 will refuse at start-up, checked before it starts, with the numbers.

Owns: :func:`check_engine_limits` (``engine.max_model_len`` against the model's ``config.json``,
``engine.kv_cache_memory_bytes`` against what one request of ``max_model_len`` tokens needs) and
:func:`kv_bytes_per_request`. vLLM raises these after loading the model (seconds to a minute) with a
multi-line traceback; here they are one :class:`~ragcache.config.ConfigError` naming the setting,
the numbers and the fix. Reads only ``config.json``; must not import vLLM or torch.

The rules mirror vLLM 0.32:

- ``max_model_len`` may not exceed the smallest of the config's length keys
  (``max_position_embeddings``, ``n_positions``, ``max_seq_len``, ``seq_length``,
  ``max_sequence_length``, ``max_seq_length``, ``seq_len``; ``model_max_length`` when present),
  times a RoPE scaling ``factor`` for the RoPE types vLLM scales by, unless
  ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set (``vllm/config/model.py:_get_and_verify_max_len``).
- The paged KV cache must hold one request of ``max_model_len`` tokens in whole blocks, plus the
  one block vLLM keeps back (the null block): ``layers x (ceil(max_model_len / block) + 1) x
  block x 2 (K and V) x kv_heads x head_dim x dtype bytes`` (``vllm/v1/core/kv_cache_utils.py:
  check_enough_kv_cache_memory``). The block is 128 tokens on the CPU backend, 16 on CUDA.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragcache.config import ConfigError, EngineSettings

#: keys vLLM reads the model's maximum length from (the smallest wins)
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
               "max_seq_length", "seq_len")
#: RoPE types whose ``factor`` vLLM does not apply to the maximum length (already scaled)
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CPU_BLOCK_SIZE = 128
CUDA_BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVShape:
    """What one token's KV takes in the model (from config.json).

    Attributes:
        num_layers, num_kv_heads, head_dim: the attention layout.
        max_len: the longest context vLLM accepts (tokens), None when the config does not say.
        max_len_key: the config key ``max_len`` came from.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_len: int | None
    max_len_key: str | None


def read_kv_shape(model_dir: Path) -> KVShape:
    """The KV layout and maximum length of the HF model in ``model_dir``.

    Raises:
        ConfigError: config.json is missing or lacks the layer/head counts.
    """
    path = Path(model_dir) / "config.json"
    try:
        cfg: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the model's {path} ({exc}); check models.model") from None
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    try:
        heads = int(cfg["num_attention_heads"])
        shape = (int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads") or heads),
                 int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"the model's {path} lacks {exc}; models.model must name a causal LM folder") from None
    found = [(int(cfg[k]), k) for k in LENGTH_KEYS if isinstance(cfg.get(k), (int, float))]
    max_len, key = min(found) if found else (None, None)
    if isinstance(cfg.get("model_max_length"), (int, float)):
        max_len, key = int(cfg["model_max_length"]), "model_max_length"
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if max_len is not None and factor and rope.get("rope_type", rope.get("type")) not in _PRESCALED_ROPE:
        max_len = int(max_len * float(factor))
    return KVShape(*shape, max_len, key)


def kv_bytes_per_request(shape: KVShape, max_model_len: int, dtype: str, block_size: int) -> int:
    """Bytes of paged KV cache vLLM requires for one request of ``max_model_len`` tokens (whole
    blocks of ``block_size`` tokens, plus the null block it keeps back)."""
    page = block_size * 2 * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[dtype]
    return shape.num_layers * page * (math.ceil(max_model_len / block_size) + 1)


def default_block_size() -> int:
    """vLLM's KV block size here: 16 tokens on CUDA, 128 on the CPU backend."""
    try:
        import torch

        return CUDA_BLOCK_SIZE if torch.cuda.is_available() else CPU_BLOCK_SIZE
    except Exception:  # pragma: no cover - torch is always importable beside vLLM
        return CPU_BLOCK_SIZE


def check_engine_limits(engine: EngineSettings, model_dir: Path, dtype: str, block_size: int | None = None) -> KVShape:
    """Refuse engine settings vLLM would refuse for the model in ``model_dir``; return the model's
    :class:`KVShape` (read once, for the caller's other checks).

    Args:
        engine: the ``[engine]`` settings.
        model_dir: the resolved HF model folder (``LLMInfo.path``).
        dtype: the KV cache dtype (the resolved compute dtype, e.g. ``"float32"``).
        block_size: vLLM's KV block in tokens (default: :func:`default_block_size`).

    Raises:
        ConfigError: ``max_model_len`` above the model's maximum, or ``kv_cache_memory_bytes`` too
            small for one ``max_model_len`` request; the message gives the numbers and the fix.
    """
    shape = read_kv_shape(model_dir)
    n = engine.max_model_len
    if (shape.max_len is not None and n > shape.max_len and not os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN")):
        raise ConfigError(
            f"engine.max_model_len = {n} is above the model's maximum of {shape.max_len} tokens "
            f"({shape.max_len_key} in {Path(model_dir) / 'config.json'}); set engine.max_model_len <= "
            f"{shape.max_len} (e.g. RAGCACHE_ENGINE__MAX_MODEL_LEN={shape.max_len})")
    block = block_size or default_block_size()
    need = kv_bytes_per_request(shape, n, dtype, block)
    have = engine.kv_cache_memory_bytes
    if have < need:
        per_block = kv_bytes_per_request(shape, block, dtype, block) // 2  # one block of every layer
        fits = (have // per_block - 1) * block
        longest = f"engine.max_model_len <= {fits}" if fits >= 128 else "a smaller engine.max_model_len"
        raise ConfigError(
            f"engine.kv_cache_memory_bytes = {have} ({have / 2**20:.1f} MiB) cannot hold one request of "
            f"engine.max_model_len = {n} tokens: vLLM needs {need} bytes ({need / 2**20:.1f} MiB = {shape.num_layers} "
            f"layers x 2 (K, V) x {shape.num_kv_heads} KV heads x {shape.head_dim} x {DTYPE_BYTES[dtype]} bytes "
            f"({dtype}) x {math.ceil(n / block) + 1} blocks of {block} tokens); set engine.kv_cache_memory_bytes "
            f">= {need} or {longest}")
    return shape
