"""The progress display: which row and compiler is running, in which phase, for how long.

On a terminal one status line is redrawn four times a second
(``[2/4] gpt2 infer · torch.compile · compiling + first call  12.3 s``); into a log or a pipe,
each phase prints once when it starts and each measurement once when it ends, so a CI log
stays readable.
"""

from __future__ import annotations

import threading
import time
from typing import TextIO


class Progress:
    """Thread-safe status reporting for one bench run (written to ``stream``)."""

    def __init__(self, stream: TextIO, live: bool | None = None, enabled: bool = True) -> None:
        self.stream = stream
        self.live = stream.isatty() if live is None else live
        self.enabled = enabled
        self.label = ""
        self.phase_name = ""
        self.phase_start = time.perf_counter()
        self.task_start = self.phase_start
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def start(self, label: str) -> None:
        """A new measurement (one compiler of one row) begins."""
        with self._lock:
            self.label = label
            self.task_start = time.perf_counter()
        self.phase("starting")
        if self.live and self.enabled and self._ticker is None:
            self._stop.clear()
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()

    def phase(self, name: str) -> None:
        with self._lock:
            self.phase_name = name
            self.phase_start = time.perf_counter()
        if self.enabled and not self.live and name != "starting":
            self._write(f"{self.label} · {name}\n")

    def done(self, summary: str) -> None:
        """The measurement ended; ``summary`` is its one-line outcome."""
        elapsed = time.perf_counter() - self.task_start
        self._stop_ticker()
        if self.enabled:
            prefix = "\r\033[K" if self.live else ""
            self._write(f"{prefix}{self.label} · {summary} ({elapsed:.1f} s)\n")

    def note(self, text: str) -> None:
        """A line outside any measurement (a skipped model, a warning)."""
        if self.enabled:
            self._write(("\r\033[K" if self.live else "") + text + "\n")

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                elapsed = time.perf_counter() - self.phase_start
                line = f"{self.label} · {self.phase_name}  {elapsed:.1f} s"
            self._write(f"\r\033[K{line}")

    def _stop_ticker(self) -> None:
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
            self._ticker = None

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
