"""A status line rewritten in place on a terminal, plain lines otherwise:
the live display of ``shmeval selfplay`` and the progress bar of
``shmeval bench``; and rates and durations as the tables and live views
show them."""
from __future__ import annotations

import math
import sys
import time
from typing import Optional, TextIO

#: Without a terminal, a status line is printed at most this often (seconds).
PLAIN_EVERY_S = 5.0


def fmt_rate(x: float) -> str:
    """A rate as the tables show it: whole from 100 on, one decimal below."""
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def format_duration(seconds: float) -> str:
    """``42s``, ``3m07s`` or ``2h05m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Display:
    """The live status: one line rewritten in place on a terminal, plain
    lines every few seconds otherwise."""

    def __init__(self, stream: TextIO = sys.stdout, tty: Optional[bool] = None,
                 plain_every: float = PLAIN_EVERY_S) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.plain_every = plain_every
        self._open = False  # a status line is showing (TTY)
        self._last_plain = -math.inf
        self._last_text = ""

    def status(self, text: str, force: bool = False) -> None:
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K")
            self.stream.flush()
            self._open = True
        else:
            now = time.monotonic()
            if force or now - self._last_plain >= self.plain_every:
                if text != self._last_text:
                    self.stream.write(text + "\n")
                    self.stream.flush()
                    self._last_text = text
                self._last_plain = now

    def line(self, text: str = "") -> None:
        if self._open:
            self.stream.write("\r\x1b[K")
            self._open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def end_status(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
