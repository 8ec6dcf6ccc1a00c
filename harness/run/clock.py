"""The bench's clock: when the run started and the time `--time` gave it (set-up, every search, the decision)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Clock:
    time_s: float  # the whole run's time
    started: float = field(default_factory=time.time)  # wall clock
    reserved_s: float = 0.0  # held back for a phase after the decision (the saturation sets), until it begins

    @property
    def left_s(self) -> float:
        """Seconds of the run's time still to spend (negative once it is spent)."""
        return self.started + self.time_s - self.reserved_s - time.time()

    @property
    def spent_s(self) -> float:
        return self.time_s - self.left_s
