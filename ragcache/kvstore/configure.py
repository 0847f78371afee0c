"""Which tiers a ``store`` settings section asks for (``TieredStore.from_settings``).

Owns: :func:`tiers_from_settings` and :data:`GB`; the only place that picks concrete media
(device, cpu, disk, remote), so the store itself knows only the Tier protocol. Imports
:mod:`ragcache.config` and the tier modules; must not import vLLM, the store, nor anything above
kvstore.
"""

from __future__ import annotations

import logging

import torch

from ragcache.config import ConfigError, StoreSettings
from ragcache.kvstore.cpu import CpuTier
from ragcache.kvstore.device import DeviceTier
from ragcache.kvstore.disk import DiskTier
from ragcache.kvstore.remote import RedisTier
from ragcache.kvstore.tier import Tier
from ragcache.util.urls import redact

log = logging.getLogger("ragcache.kvstore")

GB = 10**9  # settings sizes are decimal gigabytes


def tiers_from_settings(settings: StoreSettings, device: torch.device) -> list[tuple[Tier, int | None]]:
    """``(tier, capacity_bytes)`` top-down for ``settings`` and the engine's ``device``.

    ``device`` when ``device`` is not the CPU and ``gpu_kv_pool_gb`` > 0; ``cpu`` when
    ``cpu_kv_pool_gb`` > 0 (pinned when ``device`` is CUDA); ``disk`` at ``ssd_cache_dir`` when
    ``ssd_cache_max_gb`` > 0; ``remote`` (unbounded: None) when ``remote_url`` is set (a Redis
    Cluster with ``remote_cluster``). Sizes are
    GB = 1e9 bytes. A disk folder that cannot be created turns the disk tier off with a warning.

    Raises:
        ConfigError: several ``remote_url`` nodes without ``remote_cluster``.
    """
    if "," in settings.remote_url and not settings.remote_cluster:
        raise ConfigError(f"store.remote_url lists several nodes ({redact(settings.remote_url)}): set "
                          "store.remote_cluster = true for a Redis Cluster, or name one server")
    tiers: list[tuple[Tier, int | None]] = []
    if device.type != "cpu" and settings.gpu_kv_pool_gb > 0:
        tiers.append((DeviceTier(device), int(settings.gpu_kv_pool_gb * GB)))
    if settings.cpu_kv_pool_gb > 0:
        tiers.append((CpuTier(pin_memory=device.type == "cuda"), int(settings.cpu_kv_pool_gb * GB)))
    if settings.ssd_cache_max_gb > 0:
        try:
            tiers.append((DiskTier(settings.ssd_cache_dir), int(settings.ssd_cache_max_gb * GB)))
        except OSError as exc:
            log.warning("disk tier off: cannot use %s (%s); set store.ssd_cache_dir", settings.ssd_cache_dir, exc)
    if settings.remote_url:
        tiers.append((RedisTier(settings.remote_url, cluster=settings.remote_cluster,
                                connect_timeout=settings.remote_timeout_s, timeout=settings.remote_timeout_s), None))
    return tiers
