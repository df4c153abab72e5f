"""Progress through a long prompt's prefill on stderr, as the verifier reports it after each chunk: one line
rewritten in place on a terminal, else a line at most every LOG_EVERY_S seconds (logs stay short)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

LOG_EVERY_S = 2.0


class PrefillProgress:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self._last_line = float("-inf")
        self.shown = False

    def __call__(self, computed: int, total: int) -> None:
        now = time.monotonic()
        line = f"prefill: {computed:,} of {total:,} prompt tokens ({computed / total:.0%}), {now - self.started:.1f} s"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        elif now - self._last_line >= LOG_EVERY_S:
            self.stream.write(line + "\n")
            self._last_line = now
        else:
            return
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        """End the in-place line (call once the generation is over)."""
        if self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()
