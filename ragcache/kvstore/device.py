"""The ``device`` tier: KV entries in accelerator memory (only when the engine runs on one).

Owns: :class:`DeviceTier`. Capacity (``gpu_kv_pool_gb``) and eviction are the store's. Must not
import vLLM.
"""

from __future__ import annotations

import torch

from ragcache.kvstore.memory import MemoryTier


class DeviceTier(MemoryTier):
    """Accelerator-memory tier; tensors ``[L, 2, T, H, D]`` in the storage dtype on ``device``.

    The store creates it only when its device is not the CPU; constructing it with a CPU device is
    allowed (tests use that to exercise a two-level memory hierarchy on CPU-only machines).
    """

    def __init__(self, device: torch.device | str) -> None:
        super().__init__("device", torch.device(device))
