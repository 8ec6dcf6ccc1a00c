"""What the bench holds of one engine across its servers, visits and budgets: its clock, its server now, its
crashes and down time (`EngineRun`), and at each KV budget its knee search and points (`Searched`). The bench's
collaborators share these records; none of them holds the bench."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from harness.analysis.knee import Judged, KneeSearch
from harness.run.servers import ServerProcess
from harness.run.stats_poller import StatsPoller
from harness.units import KvBudget


@dataclass
class EngineRun:
    """One engine of the run: its clock, its server now, what happened to it, what its searches found."""

    engine: str
    t0: float  # wall clock: the origin of this engine's samples, events and request times
    port: int
    server: ServerProcess | None = None
    crashes: int = 0
    down: list[tuple[float, float]] = field(default_factory=list)  # (crash, back up), engine time
    budget: KvBudget | None = None  # the KV budget its server runs at now
    oom_seen: int = 0
    checked_s: float = -1e9  # a target: when it was last asked whether it answers, engine time
    down_since: float | None = None  # a target that stopped answering: since when
    searched: dict[KvBudget, Searched] = field(default_factory=dict)  # by KV budget (its bytes)
    sampler: StatsPoller | None = None  # the latest one (a revisit resumes it)
    setup_s: float = 0.0  # server start, debugging pass and calibration, as measured


@dataclass
class Searched:
    """One engine's points at one KV budget: its knee search, run.json's point records (the same objects),
    what each point judged so far (provisional verdicts, for the decision phase), and where it stands in each
    stream (a point continued later goes on from there)."""

    points: list[dict]
    search: KneeSearch | None = None
    judged: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # point -> (met, index)
    cursors: dict[str, int] = field(default_factory=dict)
    warmup_s: float = 3.0  # the last point's warm-up: the next one's plan

    def of_key(self, key: str) -> int | None:
        """The point that judged stream `key` (a rate and its replication: workloads/streams.key_of)."""
        return next((i for i, p in enumerate(self.points) if p["key"] == key), None)

    def of_rate(self, rate: float) -> list[int]:
        """Every point at `rate`: its replications."""
        return [i for i, p in enumerate(self.points) if p["offered_rps"] == rate]

    def judged_points(self) -> list[Judged]:
        return [Judged(p["offered_rps"], p["key"], *self.judged[i]) for i, p in enumerate(self.points)
                if i in self.judged]
