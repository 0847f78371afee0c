"""The demo's note on a shared CPU (no model): its TTFTs are only comparable on a quiet machine."""

from __future__ import annotations

from app.demo_cmd import busy_note


def test_the_demo_says_when_other_processes_shared_the_cpu():
    assert busy_note(load=2.1, cores=2) == ""  # the demo's own threads: a quiet machine
    assert busy_note(load=3.0, cores=2) == ""
    note = busy_note(load=4.6, cores=2)
    assert note.startswith("note: load average 4.6 on 2 cores") and "run it again alone" in note
    assert isinstance(busy_note(), str)  # this machine's own load average and cores
