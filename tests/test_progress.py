"""Progress that reads well in a log: no carriage-return frames off a terminal, a line at most every
few seconds, the last counts when it ends; a tqdm bar on a terminal."""

from __future__ import annotations

import io

from tqdm import tqdm

from ragcache.util.progress import LogProgress, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_progress_is_plain_lines_without_carriage_returns():
    out = io.StringIO()
    with progress(total=100, desc="KV precompute", unit="chunk", file=out) as bar:
        assert isinstance(bar, LogProgress)
        for _ in range(100):  # far faster than one line interval: no line in between
            bar.update(1)
            bar.set_postfix_str("3,000 tok/s")  # never forces a line out of turn
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0].startswith("KV precompute: 0/100 chunk (0%)")
    assert lines[-1].startswith("KV precompute: 100/100 chunk (100%)") and "3,000 tok/s" in lines[-1]
    assert len(lines) <= 3, lines


def test_on_a_terminal_progress_is_a_tqdm_bar_and_disabled_progress_prints_nothing():
    term = Terminal()
    with progress(total=3, desc="reading", unit="file", file=term) as bar:
        assert type(bar) is tqdm
        bar.update(3)
    assert "\r" in term.getvalue()
    quiet = io.StringIO()
    with progress(total=3, desc="reading", unit="file", file=quiet, disable=True) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""
