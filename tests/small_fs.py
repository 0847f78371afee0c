"""A real, small filesystem for disk-full tests: a size-limited tmpfs mounted on a temporary folder.

Writes beyond its size fail with a real ENOSPC from the kernel (no mocks). Mounting needs the right
to mount (root, or CAP_SYS_ADMIN); where the machine does not allow it the test is skipped with the
reason. ``fill`` takes free space away with a plain file, as another program filling the disk would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


def mount(folder: Path, size_bytes: int) -> str | None:
    """Mount a tmpfs of ``size_bytes`` (rounded up to whole pages) on ``folder`` (created when
    missing); None on success, else why not."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return "no mount command"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited with {r.returncode}")


def unmount(folder: Path) -> None:
    """Unmount what :func:`mount` mounted (lazily: a file still open cannot keep it mounted)."""
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def skip_reason(size_bytes: int, why: str) -> str:
    return (f"cannot mount a {size_bytes}-byte tmpfs for a real disk-full test ({why}); "
            "run the tests as root (or with CAP_SYS_ADMIN) to include it")


@contextmanager
def small_fs(folder: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted on ``folder`` for the ``with`` block, then unmounted.
    Skips the test when it cannot be mounted here."""
    why = mount(folder, size_bytes)
    if why is not None:
        pytest.skip(skip_reason(size_bytes, why))
    try:
        yield folder
    finally:
        unmount(folder)


def free_bytes(folder: Path) -> int:
    """Bytes free for an unprivileged writer in ``folder``'s filesystem."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def fill(folder: Path, leave_bytes: int, name: str = "filler.bin") -> Path:
    """Write a file into ``folder`` that leaves about ``leave_bytes`` free on its filesystem."""
    path = folder / name
    n = max(0, free_bytes(folder) - leave_bytes)
    with open(path, "wb") as f:
        f.write(b"\0" * n)
    return path
