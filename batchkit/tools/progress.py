"""A tiny progress bar on stderr, safe to update from many threads (no dependency)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    """``label [#######.......]  512/1024`` redrawn in place; silent unless ``enabled``.

    Redraws at most every 0.1 s so that updating it per request costs next to nothing.

    Args:
        label: The text before the bar.
        total: Units of work in all (at least 1 is assumed).
        enabled: Draw the bar; False makes every call a no-op on the stream.
        stream: Where to draw it; ``None``: ``sys.stderr``.
    """

    def __init__(
        self, label: str, total: int, *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.done = 0
        self._lock = threading.Lock()
        self._drawn_at = 0.0

    def advance(self, count: int = 1) -> None:
        """``count`` more units done.

        Args:
            count: Units finished since the last call.
        """
        with self._lock:
            self.done += count
            now = time.monotonic()
            if self.enabled and (now - self._drawn_at >= 0.1 or self.done >= self.total):
                self._drawn_at = now
                self._draw()

    def set(self, done: int) -> None:
        """Jump to ``done`` units (for callbacks that report totals).

        Args:
            done: Units finished so far, in all.
        """
        self.advance(done - self.done)

    def _draw(self) -> None:
        width = 30
        filled = width * min(self.done, self.total) // self.total
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r{self.label:<24} [{bar}] {self.done:>6}/{self.total}")
        self.stream.flush()

    def close(self) -> None:
        """End the line (only if something was drawn)."""
        if self.enabled and self._drawn_at:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
