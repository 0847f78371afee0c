"""Quiet by default from the SDK too: `RAGPipeline.open(...)` in a plain Python program (no CLI)
prints none of vLLM's, torch's or transformers' notices, warnings or loading bars, in its own
process or the engine's; `engine.verbose = true` (RAGCACHE_ENGINE__VERBOSE=1) shows them. Real
subprocesses, each starting a real engine."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.test_demo import NOISE

pytestmark = pytest.mark.integration

PROGRAM = """
from ragcache import RAGPipeline, Settings

rag = RAGPipeline.open(Settings.load(), index="none-yet")
print("program: engine ready on", rag.engine.device)
rag.engine.close()
"""


def run_program(tmp_path, **env_extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAGCACHE_", "VLLM_", "PYTHONWARNINGS"))}
    env.update(PYTHONPATH=str(REPO), RAGCACHE_STORE__SSD_CACHE_DIR=str(tmp_path / "kv"),
               RAGCACHE_STORE__REMOTE_URL="", RAGCACHE_ENGINE__MAX_MODEL_LEN="2048",
               RAGCACHE_ENGINE__KV_CACHE_MEMORY_BYTES=str(256 << 20), **env_extra)
    out = subprocess.run([sys.executable, "-c", PROGRAM], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "program: engine ready on" in out.stdout
    return out.stdout


def test_an_sdk_program_is_quiet_by_default_and_verbose_when_asked(tmp_path):
    quiet = run_program(tmp_path)
    assert "\r" not in quiet
    noisy = [line for line in quiet.splitlines() if any(word in line for word in NOISE)]
    assert noisy == [], quiet[-4000:]

    verbose = run_program(tmp_path, RAGCACHE_ENGINE__VERBOSE="1")
    assert re.search(r"^(\(\w+ pid=\d+\) )?(INFO|WARNING) \d\d-\d\d ", verbose, re.M), verbose[-4000:]  # vLLM's own log lines
