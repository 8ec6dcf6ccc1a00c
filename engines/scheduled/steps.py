"""What one engine step computed and how long it took: the rows a step-time model is fitted on
(`harness/sim/stepfit.py`). Written as CSV lines, flushed about once a second, so a killed server leaves
all but its last second; the header names the columns once."""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, fields
from pathlib import Path

FLUSH_S = 1.0


@dataclass(frozen=True)
class StepRow:
    """One step. `context_tokens` is every key its attention read (a decode reads its whole context, a
    prefill chunk the context up to its end); `tokens` is every position it computed."""

    t_wall: float  # when the step ended, wall clock (bench places it in a point's window by this)
    duration_s: float  # schedule, forward, sampling and emitting its tokens
    decodes: int
    prefills: int
    tokens: int
    context_tokens: int
    buckets: int  # decode length buckets: each costs its own attention kernels
    running: int  # after the step
    waiting: int

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class StepRecorder:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        self._f = open(path, "a", buffering=1 << 16)
        if new:
            self._f.write(",".join(StepRow.columns()) + "\n")
        self._flushed = time.monotonic()

    def record(self, row: StepRow) -> None:
        self._f.write(",".join(f"{v:.6f}" if isinstance(v, float) else str(v) for v in astuple(row)) + "\n")
        if time.monotonic() - self._flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self._f.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        self._f.close()
