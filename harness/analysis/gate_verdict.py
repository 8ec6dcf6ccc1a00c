"""The gates' one verdict vocabulary and one rule for combining verdicts (docs/method.md, Nightly): `fragbench ab`,
`memory-gate`, `check` and `compare` each decide their own figures, and each combines them here.

- PASS: every figure decided, none worse past its rule.
- FAIL: a figure (or NEW's build) failed its rule: exit 1.
- INCONCLUSIVE: no figure failed, at least one undecided (time spent, nothing measured): exit 3 where a gate has it.
- ERROR: the gate could not judge NEW (BASE's build failed, a tree could not be set up): exit 2.

`worst` is the one "worst verdict wins" rule: FAIL over ERROR (a regression found is news whatever else failed to
run), ERROR over INCONCLUSIVE, INCONCLUSIVE over PASS; nothing to combine is INCONCLUSIVE, never a PASS."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class GateVerdict(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"
    ERROR = "ERROR"


SEVERITY = (GateVerdict.FAIL, GateVerdict.ERROR, GateVerdict.INCONCLUSIVE, GateVerdict.PASS)  # worst first
EXIT = {GateVerdict.PASS: 0, GateVerdict.FAIL: 1, GateVerdict.ERROR: 2, GateVerdict.INCONCLUSIVE: 3}


def worst(verdicts: Iterable[str]) -> GateVerdict:
    """The worst of the verdicts (SEVERITY); INCONCLUSIVE where there are none."""
    found = {GateVerdict(v) for v in verdicts}
    return next((v for v in SEVERITY if v in found), GateVerdict.INCONCLUSIVE) if found else GateVerdict.INCONCLUSIVE


def passed_or_failed(failed: bool) -> GateVerdict:
    """A deterministic figure's verdict: FAIL where it failed its rule, else PASS."""
    return GateVerdict.FAIL if failed else GateVerdict.PASS


# `fragbench check`'s questions answer PASS, WARN (met, with a caution), UNKNOWN (not measurable here) or FAIL: as a
# verdict a WARN passes, an UNKNOWN is undecided
QUESTION_VERDICTS = {"PASS": GateVerdict.PASS, "WARN": GateVerdict.PASS, "UNKNOWN": GateVerdict.INCONCLUSIVE,
                     "FAIL": GateVerdict.FAIL}


def check_verdict(statuses: Iterable[str]) -> GateVerdict:
    """`fragbench check`'s verdict: the worst of its questions' statuses read as verdicts."""
    return worst(QUESTION_VERDICTS[s] for s in statuses)
