"""Wall time and peak resident memory of a block of code (sampled in a thread)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import psutil

SAMPLE_SECONDS = 0.02


@dataclass
class Measurement:
    seconds: float = 0.0
    peak_rss_mib: float = 0.0  # peak resident memory of the process during the block
    extra_rss_mib: float = 0.0  # peak minus resident memory at the start of the block


class measure:
    """``with measure() as m: ...`` then read ``m.result``."""

    def __enter__(self) -> "measure":
        self._proc = psutil.Process()
        self._start_rss = self._peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        dt = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._proc.memory_info().rss)
        mib = 1024 * 1024
        self.result = Measurement(dt, self._peak / mib, (self._peak - self._start_rss) / mib)
