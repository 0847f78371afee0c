"""ragcache.blend.opcount: counting a block's operators says nothing on the console."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COUNT_TWICE = """
import torch
from ragcache.blend.opcount import count_ops
for _ in range(2):
    with count_ops() as counted:
        torch.ones(3) + 1
print(counted.total)
"""


def test_counting_operators_prints_no_profiler_lines():
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COUNT_TWICE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120, check=True)
    assert int(done.stdout.split()[-1]) >= 1
    assert "profiler_start" not in done.stderr and "profiler_stop" not in done.stderr, done.stderr


def test_operators_are_put_down_to_ragcaches_own_code_or_the_libraries_it_calls():
    import torch
    import torch.nn.functional as F

    from ragcache.blend.opcount import count_ops
    from ragcache.kvstore.codec import _dequantise

    q = torch.randint(-127, 128, (4, 2, 8), dtype=torch.int8)
    scale = torch.rand(2, 8)
    with count_ops() as alone:
        _dequantise("int8", q, scale, torch.bfloat16)
    with count_ops() as mixed:
        x = torch.ones(3) + 1  # two operators this test calls
        F.silu(x)  # one through torch's own Python (skipped): still this test's, not ragcache's
        _dequantise("int8", q, scale, torch.bfloat16)
    assert alone.total >= 3 and alone.own == alone.total
    assert mixed.own == alone.total
    assert mixed.total == alone.total + 3
    assert mixed.to_dict()["own"] == mixed.own
