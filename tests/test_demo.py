"""`make demo > log 2>&1` as a new user runs it: `python -m app.cli demo` as a real subprocess, stdout
and stderr into one file. The log reads line by line (no carriage-return progress frames), holds
ragcache's own lines only (no third-party notices or warnings from any process it starts), and the
KV store's hit rate is 100% when every lookup hit (the start-up self-check's own lookups are not
counted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

#: what third-party output looks like (vLLM's and torch's notices, Python warnings, tqdm bars)
NOISE = ("Warning", "warnings.warn", "resource_tracker", "Triton", "set_num_threads", "Loading weights",
         "it/s]", "INFO vllm", "WARNING vllm", "FutureWarning", "DeprecationWarning")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) ([\w.]+): ")


def test_the_demo_log_is_readable_and_says_100_percent_when_every_lookup_hit(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
    env.update(PYTHONPATH=str(REPO), RAGCACHE_INGEST__INDEX_DIR=str(tmp_path / "indexes"),
               RAGCACHE_STORE__SSD_CACHE_DIR=str(tmp_path / "kv"), RAGCACHE_STORE__REMOTE_URL="")
    log = tmp_path / "log"
    with open(log, "wb") as out:  # make demo > log 2>&1
        proc = subprocess.run([sys.executable, "-m", "app.cli", "demo", "--questions", "2"], cwd=tmp_path, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    text = log.read_text(encoding="utf-8")
    assert proc.returncode == 0, text[-4000:]
    assert "\r" not in text, "carriage-return frames in the log"
    for line in text.splitlines():
        assert not any(word in line for word in NOISE), line
        m = LOG_LINE.match(line)
        assert m is None or m.group(2).startswith(("ragcache", "app")), line  # log lines are ragcache's
    assert re.search(r"^KV precompute: \d+/\d+ chunk \(100%\)", text, re.M), text[-4000:]  # progress, as lines
    store = next(line for line in text.splitlines() if line.startswith("KV store: "))
    # every lookup (the questions', and calibration's probes') hit: no self-check miss in the count
    assert re.search(r"^KV store: (\d+) chunk lookups this run \(the calibration.s included\), hit rate 100% "
                     r"\(served by \w+ \1; 0 computed\)", store), store
