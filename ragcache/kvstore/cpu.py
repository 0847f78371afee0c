"""The ``cpu`` tier: KV entries in host RAM, pinned when an accelerator will read them.

Owns: :class:`CpuTier`. Capacity (``cpu_kv_pool_gb``) and eviction are the store's. Must not import
vLLM.
"""

from __future__ import annotations

import torch

from ragcache.kvstore.memory import MemoryTier


class CpuTier(MemoryTier):
    """Host-RAM tier; tensors ``[L, 2, T, H, D]`` in the storage dtype on the CPU.

    Args:
        pin_memory: page-lock the tensors (set when the store's device is an accelerator) so
            per-layer copies to the device can be asynchronous. Falls back to pageable memory
            when pinning is not possible.
    """

    def __init__(self, pin_memory: bool = False) -> None:
        super().__init__("cpu", torch.device("cpu"), pin_memory=pin_memory)
