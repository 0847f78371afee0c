"""The run environment of a benchmark: its settings, and the context stamped on every result.

Owns: settings for a benchmark (KV in a scratch folder, no Redis), the machine description (CPU,
memory, library versions, load average), the engine description, the UTC time, the command
line, and :func:`stamp`, which puts all of that at the head of a result. Imports ragcache.config;
the engine only for type checking; never app/ or ui/.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ragcache.config import Settings
from ragcache.util.urls import redact

if TYPE_CHECKING:
    from ragcache.engine import BlendEngine


def bench_settings(settings_file: str | os.PathLike[str] | None = None, *, kv_dir: str | os.PathLike[str],
                   store: Mapping[str, Any] | None = None, engine: Mapping[str, Any] | None = None,
                   blend: Mapping[str, Any] | None = None) -> Settings:
    """Settings for a benchmark: the user's settings with the KV store in ``kv_dir`` and no Redis.

    The chunk KV of a benchmark (gigabytes for MuSiQue) never lands in the user's cache folder,
    and a configured shared Redis is left alone; ``store`` overrides win over both.
    """
    st = {"ssd_cache_dir": str(kv_dir), "remote_url": ""}
    st.update(store or {})
    overrides: dict[str, Any] = {"store": st}
    if engine:
        overrides["engine"] = dict(engine)
    if blend:
        overrides["blend"] = dict(blend)
    return Settings.load(settings_file, **overrides)


def machine_info() -> dict[str, Any]:
    """CPU, memory, library versions and the load average: the context every result needs."""
    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gb"] = round(int(line.split()[1]) / 1e6, 1)
                break
    except OSError:
        pass
    try:
        info["load_avg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    for mod in ("torch", "vllm", "transformers"):
        try:
            info[f"{mod}_version"] = __import__(mod).__version__
        except Exception:  # pragma: no cover - reporting only
            pass
    return info


def engine_info(engine: "BlendEngine") -> dict[str, Any]:
    """Model, device, start-up time and the engine/blend/store settings a result was measured with."""
    s = engine.settings
    choice = getattr(engine, "dtype", None)
    worker = getattr(engine, "worker", None)
    return {
        "model": s.models.model, "device": getattr(engine, "device", None),
        "startup_s": round(float(getattr(engine, "startup_s", 0.0)), 2),
        "dtype_setting": s.engine.dtype, "dtype": getattr(choice, "dtype", s.engine.dtype),
        "dtype_reason": getattr(choice, "reason", None), "cpu_flags": list(getattr(choice, "cpu_flags", ())),
        "in_process": s.engine.in_process,
        "recompute_ratio": s.blend.recompute_ratio, "check_layer": s.blend.check_layer,
        "check_layer_resolved": s.blend.resolved_check_layer,
        "min_recompute_tokens": s.blend.min_recompute_tokens, "recompute_depth": s.blend.recompute_depth,
        "budget": s.blend.budget, "mass_left": s.blend.mass_left, "max_recompute_ratio": s.blend.max_recompute_ratio,
        "max_recompute_tokens": s.blend.max_recompute_tokens,
        "granule": s.blend.granule, "candidates": s.blend.candidates,
        "refine_layer": s.blend.refine_layer, "propagate": s.blend.propagate,
        "propagate_temperature": s.blend.propagate_temperature, "propagate_scope": s.blend.propagate_scope,
        "propagate_from_depth": s.blend.propagate_from_depth,
        "deviation": s.blend.deviation, "selection": s.blend.selection, "pipeline_overlap": s.blend.pipeline_overlap,
        "attention_setting": s.blend.attention, "attention": getattr(worker, "attention", None),
        "attention_reason": getattr(worker, "attention_reason", None),
        "kv_context_tokens": s.prompt.kv_context_tokens,
        "store": {"cpu_kv_pool_gb": s.store.cpu_kv_pool_gb, "ssd_cache_max_gb": s.store.ssd_cache_max_gb,
                  "remote": bool(s.store.remote_url), "kv_dtype": s.store.kv_dtype,
                  "kv_compression": s.store.kv_compression},
    }


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def command_line() -> str:
    """The ``ragcache ...`` command that is running (for the result's ``command``), after the settings
    it overrides through the environment (``RAGCACHE_BLEND__BUDGET=fixed ragcache ...``: the
    ``RAGCACHE_<SECTION>__<NAME>`` variables of :class:`ragcache.config.Settings`), so the command
    reruns the measurement. Secrets stay out: an API key's value reads ``***``, and so does the
    password of a URL (``redis://:***@host:6379/0``)."""
    def shown(name: str, value: str) -> str:
        if name.endswith("API_KEY"):
            return "***"
        return redact(value) if "://" in value else value

    overrides = [f"{k}={shlex.quote(shown(k, v))}" for k, v in sorted(os.environ.items())
                 if k.startswith("RAGCACHE_") and "__" in k]
    return " ".join([*overrides, "ragcache", *sys.argv[1:]])


def stamp(result: dict[str, Any], *, command: str, engine: "BlendEngine | None" = None,
          dataset: str | None = None, started: str | None = None) -> dict[str, Any]:
    """Add the command line, time, machine and engine settings to a result (in place) and return it."""
    head = {"benchmark": result["benchmark"], "command": command, "started": started or utc_now(),
            "finished": utc_now(), "dataset": dataset, "machine": machine_info()}
    if engine is not None:
        head["engine"] = engine_info(engine)
    rest = {k: v for k, v in result.items() if k not in head}
    result.clear()
    result.update(head)
    result.update(rest)
    return result
