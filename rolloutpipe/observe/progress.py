"""Console progress of long work (a step's samples, groups dispatched, trainer lag) that never floods a log.

On a terminal the status line is rewritten in place, at most ``tty_interval_s`` apart. Anywhere else (a
Slurm log, a pipe) it is printed as a plain line, at most one every ``interval_s``, and only for work
that has already taken ``interval_s``: a run whose steps are short prints nothing here and keeps its one
summary line per step (trainer/node.py), while a step that takes ten minutes reports every ``interval_s``.

Usage, from the thread that waits (``update`` costs a clock read when nothing is due):

    progress = Progress(label="rollout")
    progress.start()                                     # new unit of work (e.g. a step)
    progress.update(lambda: f"step 3: 96/128 samples")   # as often as you like; the text is built when shown
    progress.done()                                      # ends the in-place line on a terminal
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    def __init__(self, *, label: str, stream: TextIO | None = None, interval_s: float = 60.0,
                 tty_interval_s: float = 0.5, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s = tty_interval_s if self.tty else interval_s
        self.clock = clock
        self._started = self._last = clock()
        self._shown = False

    def start(self) -> None:
        self._started = self._last = self.clock()

    def update(self, text: Callable[[], str]) -> None:
        now = self.clock()
        if now - self._last < self.interval_s:
            return
        self._last = now
        line = f"[{self.label}] {text()}  ({now - self._started:.0f} s)"
        if self.tty:
            self.stream.write("\r\033[K" + line)
            self._shown = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False
