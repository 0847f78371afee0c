"""Which compute dtype the engine runs in: ``engine.dtype = "auto"`` resolved per host.

Owns: :func:`resolve_dtype` and the CPU feature probe it uses. The fastest dtype whose quality is
fine depends on the hardware, not only on "CPU or GPU":

- CUDA: bfloat16 (float16 where the GPU has no bf16).
- CPU with AMX-BF16 or AVX512-BF16 (Intel Sapphire Rapids and later, Cooper Lake, AMD Zen 4+):
  bfloat16, which these CPUs compute natively.
- Any other CPU: float32. Without bf16 dot-product instructions bf16 is emulated, and slower than
  float32 (docs/benchmarks.md measures both on such a host).

The choice is made from the CPU's flags (``/proc/cpuinfo``; torch's own probe where that file is
missing), which costs nothing at start-up and is the same on every start. An explicit
``engine.dtype`` always wins. Must not import vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: CPU flags (as /proc/cpuinfo spells them) whose presence makes bf16 matmul fast
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
#: flags recorded with every choice (benchmarks print them beside the dtype)
REPORTED_CPU_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


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
                  flags: set[str] | None = None) -> DtypeChoice:
    """The dtype to run the model in for the ``engine.dtype`` setting on this host.

    Args:
        setting: ``"auto"`` or an explicit ``"float32"`` / ``"float16"`` / ``"bfloat16"``.
        cuda: whether a CUDA device will run the model (default: ``torch.cuda.is_available()``).
        cuda_bf16: whether that device computes in bf16 (default: ``torch.cuda.is_bf16_supported()``).
        flags: the CPU's flags (default: :func:`cpu_flags`).

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
    if fast:
        return DtypeChoice("bfloat16", f"auto: CPU has {fast[0]} (fast bf16 matmul)", reported)
    return DtypeChoice("float32", "auto: CPU has no AMX-BF16/AVX512-BF16 (bf16 would be emulated, slower)",
                       reported)
