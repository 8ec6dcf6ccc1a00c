"""Ruled out means out: the one rule by which a contiguous engine's knee is known to lie under the leading one's,
so that it is never the headline's rival. The screen (harness/run/search.py) prints it as it decides, the rival's
choice (headline.rival_of) and the summary's roles (headline.roles, summary.json's `capacity.ENGINE.ruling`) read
it, all from the same evidence: the engine's judged points and the leader's knee.

The rule: an engine is ruled out when it clearly missed the SLO at a rate at or under the leader's knee, and met
it at no rate above that one. A clear miss is a rate whose judged requests (its replications pooled, the points a
knee rests on: knee.knee_points) have a Wilson 90 % interval at the effective size (the engine's design effect)
wholly under the target: the point's own early stop, and the screen's. Its knee then lies under that rate, so
under the leader's. The leader is the contiguous engine with the highest knee among those whose knee is bracketed
(among all of them where none is); it is never ruled out. The fit's interval does not enter: a one-point fit
under a heavy-tailed stream effect reaches far past the rate it clearly missed (a fresh-clone run of be5c217 took
hf, 5 of 40 met at 1.76 req/s, for the rival on its fit's upper end 2.18 over static-oracle's knee 1.93, after
its screen had ruled it out). What brings an engine back is evidence the rule reads: a rate above its clear miss
that meets, or the leader's knee falling under the rate it missed.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.analysis.knee import Judged, design_effect, knee_points, pooled
from harness.analysis.steady import wilson


@dataclass(frozen=True)
class Evidence:
    """One rate's judged requests (its replications pooled) and their Wilson 90 % interval at the effective
    size, against the SLO's attainment target."""

    offered_rps: float
    met: int
    judged: int
    wilson_90: tuple[float, float]
    target: float

    @property
    def clear_miss(self) -> bool:
        return self.wilson_90[1] < self.target

    def words(self) -> str:
        lo, hi = self.wilson_90
        side = "under" if self.clear_miss else "not wholly under"
        # a third decimal where two would round an upper end under the target onto it
        places = 3 if round(hi, 2) >= self.target > hi else 2
        return (f"{self.met} of {self.judged} judged met at {self.offered_rps:g} req/s (Wilson 90 % [{lo:.{places}f}, "
                f"{hi:.{places}f}] at the effective size, {side} the target {self.target:g})")


def evidence(points: list[Judged], target: float) -> tuple[Evidence | None, float | None]:
    """What the rule reads of one engine: its lowest clear miss above every rate that met, with None; else its
    highest clear miss with the highest rate that met (above it: what keeps the engine in); else its highest
    rate (the one nearest a miss), with None."""
    rows = pooled(knee_points(points))
    if not rows:
        return None, None
    d = design_effect(points)

    def at(p: Judged) -> Evidence:
        met = int(p.met.sum())
        lo, hi = wilson(met / d, len(p.met) / d)
        return Evidence(p.offered_rps, met, len(p.met), (lo, hi), target)

    met_rates = [p.offered_rps for p in rows if len(p.met) and p.attainment >= target]
    top_met = max(met_rates, default=0.0)
    misses = [e for p in rows if (e := at(p)).clear_miss]
    above = [e for e in misses if e.offered_rps > top_met]
    if above:
        return above[0], None
    if misses:  # every clear miss lies under a rate that met: the miss nearest it, and that rate
        return misses[-1], top_met
    return at(rows[-1]), None


def evidence_of(points: dict[str, list[Judged]], target: float) -> dict[str, tuple[Evidence | None, float | None]]:
    """`evidence` for every engine."""
    return {e: evidence(p, target) for e, p in points.items()}


@dataclass(frozen=True)
class Ruling:
    """Whether one contiguous engine is ruled out, against which leader, on what evidence."""

    engine: str
    out: bool
    leader: str | None
    leader_rps: float | None
    point: Evidence | None  # its clear miss where it has one, else the rate nearest one
    met_above_rps: float | None = None  # a rate above its clear miss that met (what keeps it in)

    def words(self) -> str:
        """The ruling as the console prints it and the report reads it: ruled out or not, and why."""
        head = f"{self.engine}: {'ruled out' if self.out else 'not ruled out'}"
        if self.point is None:
            return f"{head}: no judged point"
        said = f"{head}: {self.point.words()}"
        if self.out:
            return (f"{said}, at or under {self.leader}'s knee {self.leader_rps:.3g} req/s: its knee is a bound under "
                    f"{self.point.offered_rps:g} req/s")
        if self.leader is None:
            return f"{said}; no other contiguous engine's knee to rule it out against"
        if self.leader == self.engine:
            return f"{said}; its knee leads the contiguous engines"
        if self.met_above_rps is not None:
            return f"{said}, but it met the target at {self.met_above_rps:g} req/s, above it"
        if self.point.clear_miss:
            return f"{said}, but above {self.leader}'s knee {self.leader_rps:.3g} req/s: its knee may lie above it"
        return f"{said}: its knee may lie above {self.leader}'s {self.leader_rps:.3g} req/s"

    def written(self) -> dict:
        """summary.json's `capacity.ENGINE.ruling`."""
        p = self.point
        return {"ruled_out": self.out, "leader": self.leader, "leader_rps": self.leader_rps,
                "offered_rps": p.offered_rps if p else None, "met": p.met if p else None,
                "judged": p.judged if p else None, "wilson_90": [round(x, 4) for x in p.wilson_90] if p else None,
                "target": p.target if p else None, "met_above_rps": self.met_above_rps, "words": self.words()}


def leader_of(knees: dict[str, tuple[float, float, bool]]) -> str | None:
    """The contiguous engine the others are ruled out against (`knees`: engine -> its knee, its interval's upper
    end, whether it is bracketed): the highest knee among the bracketed ones, else among all."""
    closed = [e for e, (_, _, bracketed) in knees.items() if bracketed]
    return max(closed or list(knees), key=lambda e: knees[e][0], default=None)


def rulings(knees: dict[str, tuple[float, float, bool]],
            evidence_by: dict[str, tuple[Evidence | None, float | None]]) -> dict[str, Ruling]:
    """The rule (module docstring) for every contiguous engine in `knees`, reading each one's evidence (an engine
    without any is not ruled out)."""
    leader = leader_of(knees)
    bar = knees[leader][0] if leader is not None else None
    out = {}
    for e in knees:
        point, met_above = evidence_by.get(e, (None, None))
        ruled = (leader is not None and e != leader and point is not None and point.clear_miss
                 and met_above is None and point.offered_rps <= bar)
        out[e] = Ruling(e, ruled, leader, None if bar is None else round(bar, 4), point, met_above)
    return out
