"""The machine's speed, engine-independent, as run.json records it (`speed_probe`): a fixed compute (a float32
matrix product, numpy's BLAS) and a fixed interpreter loop (pure Python), each timed a few times at the run's start,
middle and end (harness/run/speed_probes.py measures them, between engines, with no server running). Two runs
of one commit on one quiet machine read the same; a slow night, another tenant or another machine reads slower in
the probe as in every engine, so `compare` can tell the machine from the code.

The rule `agreement` states: the two runs' machines agree when each run was steady (its probes moved less than
STEADY x between its fastest and slowest moment: a hog from the middle on, a neighbour's job, shows as drift) and,
for both probes, NEW's median over BASE's lies within the wider of their spreads, never tighter than FLOOR. A
moment's value is its fastest repetition (what the machine gave when nothing else took it: on this shared 2-core
machine single repetitions of the compute ranged 12-235 ms within one moment, their minimum 9-21 ms)"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engines.json_record import Num, Record

PROBES = ("compute_s", "interpreter_s")
FLOOR = 1.10  # the narrowest spread allowed (x or /): quiet runs of one machine differ by a few % in each probe
STEADY = 1.25  # a run whose probe moved more than this between its moments ran on a drifting machine


class ProbeReading(Record):
    """One moment's probe: each probe's repetitions, seconds each."""

    at: str  # start, middle or end
    compute_s: list[Num]
    interpreter_s: list[Num]


class SpeedProbe(Record):
    """run.json's `speed_probe`: what was timed, and the readings in the order taken."""

    compute: str = ""
    interpreter: str = ""
    readings: list[ProbeReading] = []

    def moments(self, probe: str) -> list[float]:
        """The probe's value at each moment: its fastest repetition there (a slower one met another process)."""
        return [float(min(getattr(r, probe))) for r in self.readings if getattr(r, probe)]

    def median(self, probe: str) -> float | None:
        values = self.moments(probe)
        return float(np.median(values)) if values else None

    def spread(self, probe: str) -> float:
        """The slowest moment over the fastest (1 with one moment)."""
        values = self.moments(probe)
        return max(values) / min(values) if values and min(values) > 0 else 1.0


@dataclass(frozen=True)
class ProbeChange:
    probe: str
    base_s: float
    new_s: float
    allowed: float  # the spread within which the two agree (x or /)

    @property
    def ratio(self) -> float:
        return self.new_s / self.base_s

    @property
    def agrees(self) -> bool:
        return abs(math.log(self.ratio)) <= math.log(self.allowed)

    def text(self) -> str:
        return (f"{self.probe} {1e3 * self.base_s:.1f} -> {1e3 * self.new_s:.1f} ms ({100 * (self.ratio - 1):+.0f} %, "
                f"{'within' if self.agrees else 'outside'} the runs' spread x{self.allowed:.2f})")


@dataclass(frozen=True)
class Agreement:
    """Whether two runs' machines ran alike, and the sentence that says so."""

    same: bool
    changes: list[ProbeChange]
    why: str = ""  # where a run has no probe

    def sentence(self) -> str:
        if self.why:
            return f"the machine differed or cannot be told ({self.why}): absolute figures shown, not gated"
        head = "the machine agreed" if self.same else "the machine differed"
        tail = "" if self.same else ": absolute figures shown, not gated (not a regression)"
        return f"{head} ({'; '.join(c.text() for c in self.changes)}){tail}"


def agreement(base: SpeedProbe | None, new: SpeedProbe | None) -> Agreement:
    """The rule in the module's docstring; a run without a probe (recorded before it existed) cannot agree."""
    missing = [name for name, p in (("BASE", base), ("NEW", new)) if p is None or not p.readings]
    if missing:
        return Agreement(False, [], f"{' and '.join(missing)} recorded no speed probe")
    drifted = [f"{name}'s {probe} moved x{p.spread(probe):.2f} within the run" for name, p in (("BASE", base),
               ("NEW", new)) for probe in PROBES if p.spread(probe) > STEADY]
    if drifted:
        return Agreement(False, [], "; ".join(drifted))
    changes = []
    for probe in PROBES:
        b, n = base.median(probe), new.median(probe)
        if not b or not n:
            return Agreement(False, [], f"a run's {probe} is empty")
        changes.append(ProbeChange(probe, b, n, max(base.spread(probe), new.spread(probe), FLOOR)))
    return Agreement(all(c.agrees for c in changes), changes)
