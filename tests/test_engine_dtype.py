"""engine.dtype = "auto" resolves per host from the CPU's flags and, where they name bf16, a bf16
matmul measured once per host (ragcache.engine.dtype)."""

from __future__ import annotations

import json

from ragcache.engine import dtype as dtype_mod
from ragcache.engine.dtype import BF16_MIN_SPEEDUP, cpu_flags, measure_bf16_speedup, recorded_bf16_speedup, resolve_dtype

SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
ZEN4 = {"avx2", "avx512f", "avx512_bf16"}
EPYC_ZEN3 = {"avx2", "fma", "f16c"}
OLD_XEON = {"avx2", "avx512f"}


def test_cpus_with_fast_bf16_matmul_get_bfloat16():
    spr = resolve_dtype("auto", cuda=False, flags=SAPPHIRE_RAPIDS, bf16_speedup=2.5)
    assert spr.dtype == "bfloat16" and "amx_bf16" in spr.reason and "2.50x float32's speed" in spr.reason
    assert set(spr.cpu_flags) == {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert resolve_dtype("auto", cuda=False, flags=ZEN4, bf16_speedup=BF16_MIN_SPEEDUP).dtype == "bfloat16"


def test_bf16_flags_with_a_slow_bf16_matmul_get_float32():
    # a Xeon under KVM that exposes avx512_bf16 without AMX: bf16 matmuls measured slower than float32
    choice = resolve_dtype("auto", cuda=False, flags=ZEN4, bf16_speedup=0.55)
    assert choice.dtype == "float32" and "avx512_bf16 but a bf16 matmul runs at 0.55x" in choice.reason
    assert resolve_dtype("auto", cuda=False, flags=ZEN4, bf16_speedup=BF16_MIN_SPEEDUP - 0.01).dtype == "float32"
    # the measurement is not read where the flags decide, nor where the setting does
    assert resolve_dtype("auto", cuda=False, flags=OLD_XEON, bf16_speedup=3.0).dtype == "float32"
    assert resolve_dtype("bfloat16", cuda=False, flags=ZEN4, bf16_speedup=0.5).dtype == "bfloat16"


def test_the_measurement_is_made_once_per_host_and_recorded(tmp_path, monkeypatch):
    record = tmp_path / "host" / "dtype.json"
    calls = []

    def measure():
        calls.append(1)
        return 0.6

    flags = ("avx512_bf16", "avx512f")
    assert recorded_bf16_speedup(flags, record, measure) == 0.6
    assert recorded_bf16_speedup(flags, record, measure) == 0.6 and len(calls) == 1  # read, not measured
    assert json.loads(record.read_text())["bf16_speedup"] == 0.6
    # another host (here: other flags) measures again; so does an unreadable record
    assert recorded_bf16_speedup(("amx_bf16",), record, lambda: 2.0) == 2.0
    record.write_text("{not json")
    assert recorded_bf16_speedup(flags, record, measure) == 0.6 and len(calls) == 2
    # resolve_dtype reads the host's record
    monkeypatch.setattr(dtype_mod, "DTYPE_RECORD", record)
    assert resolve_dtype("auto", cuda=False, flags={"avx512_bf16", "avx512f"}).dtype == "float32"


def test_an_unwritable_record_still_gives_the_measurement(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert recorded_bf16_speedup(("avx512_bf16",), blocker / "dtype.json", lambda: 1.7) == 1.7


def test_the_real_measurement_times_both_dtypes():
    speedup = measure_bf16_speedup(shape=(64, 128, 256), repeats=2)
    assert 0.01 < speedup < 100


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
