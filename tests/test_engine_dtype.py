"""engine.dtype = "auto" resolves per host from the CPU's flags (ragcache.engine.dtype)."""

from __future__ import annotations

from ragcache.engine.dtype import cpu_flags, resolve_dtype

SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
ZEN4 = {"avx2", "avx512f", "avx512_bf16"}
EPYC_ZEN3 = {"avx2", "fma", "f16c"}
OLD_XEON = {"avx2", "avx512f"}


def test_cpus_with_fast_bf16_matmul_get_bfloat16():
    spr = resolve_dtype("auto", cuda=False, flags=SAPPHIRE_RAPIDS)
    assert spr.dtype == "bfloat16" and "amx_bf16" in spr.reason
    assert set(spr.cpu_flags) == {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert resolve_dtype("auto", cuda=False, flags=ZEN4).dtype == "bfloat16"


def test_cpus_without_bf16_instructions_stay_in_float32():
    for flags in (EPYC_ZEN3, OLD_XEON, set()):
        choice = resolve_dtype("auto", cuda=False, flags=flags)
        assert choice.dtype == "float32" and "no AMX-BF16/AVX512-BF16" in choice.reason


def test_cuda_gets_bfloat16_or_float16_without_bf16():
    assert resolve_dtype("auto", cuda=True, cuda_bf16=True, flags=EPYC_ZEN3).dtype == "bfloat16"
    assert resolve_dtype("auto", cuda=True, cuda_bf16=False, flags=EPYC_ZEN3).dtype == "float16"


def test_an_explicit_setting_wins_everywhere():
    for setting in ("float32", "bfloat16", "float16"):
        for flags in (SAPPHIRE_RAPIDS, EPYC_ZEN3):
            choice = resolve_dtype(setting, cuda=False, flags=flags)
            assert choice.dtype == setting and choice.reason == "set in engine.dtype"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 AMX_BF16 amx_bf16\n\n")
    assert {"avx2", "amx_bf16"} <= cpu_flags(info)
    assert isinstance(cpu_flags(tmp_path / "missing"), set)  # falls back to torch's probe
