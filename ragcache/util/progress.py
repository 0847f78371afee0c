"""Progress displays that read well on a terminal and in a log file.

Owns :func:`progress`: a tqdm bar on a terminal; where the output is not a terminal (a log file, a
pipe, CI), :class:`LogProgress` instead: a plain line at most every :data:`LINE_INTERVAL_S`
seconds and a last one at the end, never tqdm's carriage-return frames (which turn a log into one
long line per bar). Imports tqdm only; every layer may use it.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm

#: seconds between two progress lines in a log
LINE_INTERVAL_S = 5.0

#: what a log line shows: "KV precompute: 24/64 chunk (38%) [00:10<00:16, 2.4 chunk/s, 3,100 tok/s]"
LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class LogProgress(tqdm):
    """tqdm for output that is not a terminal: whole lines, at most every ``mininterval`` seconds
    (:data:`LINE_INTERVAL_S` by default), the last one when it closes; no ``\\r``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("mininterval", LINE_INTERVAL_S)
        kwargs.setdefault("bar_format", LINE_FORMAT)
        kwargs["leave"] = False  # the last line is written by close() itself; nothing to clear
        kwargs["dynamic_ncols"] = False
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """Write the status as one line (tqdm's "clear the bar", ``msg=""``, writes nothing)."""
        if msg == "":
            return False
        self.fp.write((self.__str__() if msg is None else msg).strip() + "\n")
        self.fp.flush()
        return True

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        """As tqdm's, but never forces a line out of turn (``refresh`` is ignored)."""
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """As tqdm's, but never forces a line out of turn (``refresh`` is ignored)."""
        super().set_postfix_str(s, refresh=False)

    def close(self) -> None:
        """Write the final line (the counts at the end), then release the bar."""
        if not self.disable and hasattr(self, "last_print_t") and self.last_print_n != self.n:
            self.display()
        super().close()


def progress(*, total: int | None, desc: str, unit: str, disable: bool = False,
             file: TextIO | None = None, **kwargs: Any) -> tqdm:
    """A progress display over ``total`` items (``update(n)``, ``set_postfix_str``, context manager).

    Args:
        total: items expected (None: unknown).
        desc, unit: what is counted, e.g. ``desc="KV precompute", unit="chunk"``.
        disable: no display at all.
        file: where it writes (default ``sys.stderr``): a terminal gets a tqdm bar, anything else
            :class:`LogProgress` lines.
        kwargs: more tqdm arguments.
    """
    out = file if file is not None else sys.stderr
    is_tty = bool(getattr(out, "isatty", lambda: False)())
    cls = tqdm if is_tty else LogProgress
    return cls(total=total, desc=desc, unit=unit, disable=disable, file=out, **kwargs)
