"""Which compute dtype the engine runs in: ``engine.dtype = "auto"`` resolved per host.

Owns: :func:`resolve_dtype`, the CPU feature probe and the bf16 matmul measurement it uses. The
fastest dtype whose quality is fine depends on the hardware, not only on "CPU or GPU":

- CUDA: bfloat16 (float16 where the GPU has no bf16).
- CPU with AMX-BF16 or AVX512-BF16 (Intel Sapphire Rapids and later, Cooper Lake, AMD Zen 4+):
  bfloat16 where a prefill-sized bf16 matmul is measured at least :data:`BF16_MIN_SPEEDUP` times
  faster than float32 on this host, else float32. The flags alone do not say it: a Xeon under
  KVM that exposes ``avx512_bf16`` but not AMX ran bf16 matmuls 1.6-2.0x *slower* than float32, and
  its full prefill of ~1.2k tokens took 1.95 s in bfloat16 against 1.27 s by plain vLLM in float32
  (docs/fidelity.md). The measurement (a few hundred milliseconds) is made once per host and
  recorded (:data:`DTYPE_RECORD`, keyed by CPU model, flags and torch version), so every
  start, KV actor and benchmark on the host resolves the same dtype, and chunk keys (which carry it)
  stay valid.
- Any other CPU: float32. Without bf16 dot-product instructions bf16 is emulated, and slower than
  float32 (docs/benchmarks.md measures both on such a host).

An explicit ``engine.dtype`` always wins. Must not import vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: CPU flags (as /proc/cpuinfo spells them) whose presence makes bf16 matmul fast
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
#: flags recorded with every choice (benchmarks print them beside the dtype)
REPORTED_CPU_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
#: a CPU with bf16 flags runs bfloat16 when its bf16 matmul is at least this many times float32's
#: speed: below it, float32 is (nearly) as fast and computes more exactly (quality first)
BF16_MIN_SPEEDUP = 1.2
#: where the per-host measurement is kept (``$XDG_CACHE_HOME/ragcache/host/dtype.json``); delete it
#: to measure again
DTYPE_RECORD = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ragcache" / "host" / "dtype.json"
#: the matmul measured: ``[tokens, hidden] x [hidden, out]``, a prefill's projection
PROBE_SHAPE = (512, 1024, 2816)


@dataclass(frozen=True)
class DtypeChoice:
    """The resolved compute dtype and why.

    Attributes:
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (what vLLM is given).
        reason: one line for logs and reports, e.g. ``"auto: CPU has amx_bf16"``.
        cpu_flags: the :data:`REPORTED_CPU_FLAGS` this host has.
    """

    dtype: str
    reason: str
    cpu_flags: tuple[str, ...] = ()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (lower case), from ``/proc/cpuinfo`` or, failing that, torch's probe."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return {f.lower() for f in line.split(":", 1)[1].split()}
    except OSError:
        pass
    flags: set[str] = set()
    try:
        import torch

        cpu = torch._C._cpu  # private but stable across 2.x: the same probe oneDNN dispatch uses
        if cpu._is_amx_tile_supported():
            flags |= {"amx_tile", "amx_bf16"}
        if cpu._is_avx512_bf16_supported():
            flags.add("avx512_bf16")
    except Exception:  # pragma: no cover - any failure means "no known bf16 support"
        pass
    return flags


def resolve_dtype(setting: str, *, cuda: bool | None = None, cuda_bf16: bool | None = None,
                  flags: set[str] | None = None, bf16_speedup: float | None = None) -> DtypeChoice:
    """The dtype to run the model in for the ``engine.dtype`` setting on this host.

    Args:
        setting: ``"auto"`` or an explicit ``"float32"`` / ``"float16"`` / ``"bfloat16"``.
        cuda: whether a CUDA device will run the model (default: ``torch.cuda.is_available()``).
        cuda_bf16: whether that device computes in bf16 (default: ``torch.cuda.is_bf16_supported()``).
        flags: the CPU's flags (default: :func:`cpu_flags`).
        bf16_speedup: float32 seconds over bfloat16 seconds of a prefill-sized matmul on this CPU
            (default: :func:`recorded_bf16_speedup`; read only for a CPU with bf16 flags).

    Returns:
        the choice, with the reason and the relevant CPU flags.
    """
    flags = cpu_flags() if flags is None else flags
    reported = tuple(f for f in REPORTED_CPU_FLAGS if f in flags)
    if setting != "auto":
        return DtypeChoice(setting, "set in engine.dtype", reported)
    if cuda is None:
        try:
            import torch

            cuda = torch.cuda.is_available()
        except Exception:  # pragma: no cover - torch is always importable beside vLLM
            cuda = False
    if cuda:
        if cuda_bf16 is None:
            import torch

            cuda_bf16 = torch.cuda.is_bf16_supported()
        if cuda_bf16:
            return DtypeChoice("bfloat16", "auto: CUDA device with bf16", reported)
        return DtypeChoice("float16", "auto: CUDA device without bf16", reported)
    fast = [f for f in BF16_CPU_FLAGS if f in flags]
    if not fast:
        return DtypeChoice("float32", "auto: CPU has no AMX-BF16/AVX512-BF16 (bf16 would be emulated, slower)",
                           reported)
    speedup = recorded_bf16_speedup(reported) if bf16_speedup is None else bf16_speedup
    measured = f"a bf16 matmul runs at {speedup:.2f}x float32's speed here"
    if speedup >= BF16_MIN_SPEEDUP:
        return DtypeChoice("bfloat16", f"auto: CPU has {fast[0]} and {measured}", reported)
    return DtypeChoice("float32", f"auto: CPU has {fast[0]} but {measured}, below the {BF16_MIN_SPEEDUP}x bfloat16 "
                       f"needs, measured once per host", reported)


def measure_bf16_speedup(shape: tuple[int, int, int] = PROBE_SHAPE, repeats: int = 5) -> float:
    """float32 seconds over bfloat16 seconds of one ``torch.nn.functional.linear`` of ``shape``
    (``[tokens, hidden] x [hidden, out]``) on this CPU, each the best of ``repeats`` after a warm-up
    call; above 1 bf16 is faster. Takes a few hundred milliseconds on 2 cores."""
    import torch

    m, k, n = shape
    seconds = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).to(dtype)
            w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(dtype)
            torch.nn.functional.linear(x, w)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                best = min(best, time.perf_counter() - t0)
            seconds[dtype] = best
    return seconds[torch.float32] / max(seconds[torch.bfloat16], 1e-9)


def host_key(flags: tuple[str, ...]) -> str:
    """What a recorded measurement is valid for: CPU model, the reported flags and torch's version
    (not the thread count: every process on the host, KV actors included, reads one record)."""
    import torch

    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model}|{','.join(flags)}|torch {torch.__version__}"


def recorded_bf16_speedup(flags: tuple[str, ...], record: Path | None = None,
                          measure: Callable[[], float] = measure_bf16_speedup) -> float:
    """This host's bf16 matmul speedup (:func:`measure_bf16_speedup`), measured once and kept in
    ``record`` (default :data:`DTYPE_RECORD`) under :func:`host_key`; measured again when the key
    differs or the file is unreadable. A record that cannot be written is only logged: the
    measurement is then made at every start."""
    path = DTYPE_RECORD if record is None else record
    key = host_key(flags)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") == key and float(data["bf16_speedup"]) > 0:
            return float(data["bf16_speedup"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    speedup = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "bf16_speedup": round(speedup, 3)}) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not record the bf16 matmul measurement in %s (%s): it is measured at every start",
                    path, exc)
    return speedup
