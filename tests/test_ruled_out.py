"""Ruled out means out (issue 79, part 0): one rule (analysis/ruled_out.py) for the screen, the rival's choice and
the summary's roles, its words agreeing with its interval, and a recorded run's points under it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from harness.analysis.headline import headline, rival_of, roles, rulings_of
from harness.analysis.knee import Judged
from harness.analysis.kneefit import fit
from harness.analysis.ruled_out import Evidence, evidence, evidence_of, leader_of, rulings
from workloads.streams import key_of

FIXTURE = Path(__file__).parent / "fixtures" / "rival_hf" / "points.json"


def judged(rate: float, met: int, n: int) -> Judged:
    return Judged(rate, key_of(rate), (np.arange(n) < met).astype(float), np.arange(n))


def test_a_wilson_interval_wholly_under_the_target_at_or_under_the_leaders_knee_rules_the_engine_out():
    """A fresh-clone run printed "hf: not ruled out: 12 of 63 judged met at 1.09051 req/s (Wilson 90 % [0.07, 0.43]
    at the effective size, target 0.9)": an interval wholly under the target beside "not ruled out"."""
    knees = {"static-oracle": (1.93, 2.43, True), "hf": (0.9, 2.2, False)}
    ruling = rulings(knees, {"hf": evidence([judged(1.09051, 12, 63)], 0.9)})
    hf = ruling["hf"]
    assert hf.out and hf.leader == "static-oracle" and hf.point.clear_miss
    assert hf.words().startswith("hf: ruled out: 12 of 63 judged met at 1.09051 req/s (Wilson 90 % [")
    assert "under the target 0.9" in hf.words() and "not ruled out" not in hf.words()
    assert not ruling["static-oracle"].out  # the leader is never ruled out
    # the fit's reach (2.2, above the leader's 1.93) does not bring it back: the rival stays the leader
    assert rival_of(knees) == "hf" and rival_of(knees, {"hf": evidence([judged(1.09051, 12, 63)], 0.9)}) == \
        "static-oracle"


def test_what_is_not_ruled_out_says_why_in_words_that_agree_with_its_interval():
    knees = {"static-oracle": (1.0, 1.2, True), "hf": (0.9, 2.2, False)}
    above = rulings(knees, {"hf": evidence([judged(1.5, 5, 40)], 0.9)})["hf"]  # a clear miss above the knee
    assert not above.out and "under the target" in above.words() and "above static-oracle's knee" in above.words()
    knees = {"static-oracle": (2.0, 2.4, True), "hf": (1.5, 2.2, False)}
    near = rulings(knees, {"hf": evidence([judged(1.5, 33, 40)], 0.9)})["hf"]  # 82 %: its interval holds 0.9
    assert not near.out and "not wholly under the target 0.9" in near.words()
    # brought back by evidence the rule reads: measured later at a higher rate, it meets
    back = rulings(knees, {"hf": evidence([judged(1.5, 5, 40), judged(1.8, 40, 40)], 0.9)})["hf"]
    assert not back.out and back.met_above_rps == 1.8 and "met the target at 1.8 req/s" in back.words()
    assert rulings(knees, {})["hf"].words() == "hf: not ruled out: no judged point"
    edge = Evidence(2.0, 57, 68, (0.7521, 0.8985), 0.9)  # an upper end of 0.8985: said as such, not as 0.90
    assert edge.clear_miss and "[0.752, 0.898]" in edge.words()


def test_the_leader_is_the_highest_bracketed_knee_else_the_highest_knee():
    assert leader_of({"a": (3.0, 5.0, False), "b": (2.0, 2.5, True)}) == "b"
    assert leader_of({"a": (3.0, 5.0, False), "b": (2.0, 2.5, False)}) == "a"
    assert leader_of({}) is None
    assert not rulings({"a": (1.0, 1.0, False)}, {"a": evidence([judged(0.5, 0, 40)], 0.9)})["a"].out  # alone


def recorded() -> tuple[list[tuple[float, str, Judged]], dict]:
    """The points of a fresh-clone run of be5c217 (its summary's judged verdicts per point, in the order they were
    started), and what it recorded of its screens and its headline."""
    d = json.loads(FIXTURE.read_text())
    rows = sorted((p["started_s"], e, Judged(p["offered_rps"], p["key"], np.array([float(c) for c in p["met"]]),
                                              np.array(p["index"]), p["use"], p["log_load"]))
                  for e, ps in d["points"].items() for p in ps)
    return rows, d


def test_a_recorded_run_whose_screens_ruled_hf_and_static_max_out_never_takes_either_for_the_rival():
    """In the recorded run hf (5 of 40 met at 1.76 req/s) and static-max (20 of 34) were ruled out by their screens
    under static-oracle's interval; then the headline took static-max for its rival and later hf (each one's
    one-point fit reaching above static-oracle's falling knee) and the run ended undecided against hf. Replayed
    in the order its points were started, from the screens on, the rival is static-oracle at every look that
    switched in the run, and at its end."""
    rows, d = recorded()
    assert d["screens"]["hf"]["ruled_out"] and d["headline_then"]["against"] == "hf"  # the run as it went
    target = d["target"]
    for n in (8, 13, 17, len(rows)):  # after both screens, then the looks at which the run switched, then its end
        pts: dict[str, list[Judged]] = {}
        for _, e, p in rows[:n]:
            pts.setdefault(e, []).append(p)
        f = fit(pts, target)
        h = headline(f, None, 1.5, pts, target)
        assert h.against == "static-oracle", n
        ev = evidence_of(pts, target)
        assert roles(f, ev) == {"paged": "headline", "static-oracle": "rival", "hf": "screened",
                                "static-max": "screened"}
        ruled = rulings_of(f, ev)
        # the screens sat at the old (median-stream) knee's lower end; the long-run knee the rulings now read is
        # lower (1.74 req/s at the end), so a miss at 1.76 no longer proves a knee under it: each screened engine
        # is then searched, never taken for the rival on that point alone
        assert not ruled["static-oracle"].out
        for engine in ("hf", "static-max"):
            assert ruled[engine].out == (ruled[engine].point.offered_rps <= ruled[engine].leader_rps), n
        assert ruled["hf"].point.offered_rps == ruled["static-max"].point.offered_rps == 1.756252
