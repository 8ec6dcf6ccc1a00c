"""The deterministic memory gate's records and rule: each KV policy's figures on the fixed trace
(harness/sim/memory_gate_sim.py prints them, once per tree), BASE's against NEW's, every difference named, and a
FAIL where NEW is worse in what memory must never lose.

The rule (FAIL on any of them, per policy; the gate FAILs where one policy does):
- a count that grows: OOMs by cause (capacity, fragmentation), preemptions, requests left unfinished when the trace
  ended, and blocks still held when it ended (a leak);
- the token-state share (Figure 2's useful bytes, time-averaged) falling by more than `margin` (a share, default
  0.01: one percentage point).
The figures come from virtual time alone, so an A/A run differs in nothing: any difference is the code's, printed
whether it gates or not (a policy that got better is named too).

A policy whose code raised in NEW's measurement (a crash: `--inject-kv-fault early-free` trips the pool's own
assertion) FAILs the gate, named with the exception's last line: a memory bug in NEW is NEW's fault, not a run that
could not be made. A crash in BASE is no fault of NEW's: the caller says BASE could not run
(harness/run/memory_gate_runs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engines.json_record import Num, Record
from harness.analysis.gate_verdict import GateVerdict, passed_or_failed, worst

DEFAULT_SHARE_MARGIN = 0.01  # one percentage point of the KV budget's time-averaged bytes
# counts that FAIL the gate when NEW's is higher, each with its unit for the printed difference
GROWING_FAILS = {"oom_capacity": "OOMs", "oom_fragmentation": "OOMs", "preemptions": "preemptions",
                 "requests_unfinished": "requests", "held_blocks_end": "blocks"}
SHARE_GATED = "token_states_share"
UNITS = {**GROWING_FAILS, "oom_total": "OOMs", "requests_completed": "requests", "requests_oom": "requests",
         "max_running": "sequences", "peak_blocks": "blocks", "peak_held_bytes": "B", "kv_capacity_bytes": "B",
         "requests": "requests", "block_size": "tokens"}


class PolicyMemory(Record):
    """One policy's figures on the fixed trace, as the measurement prints them."""

    policy: str
    requests: int
    requests_completed: int
    requests_oom: int
    requests_unfinished: int
    preemptions: int
    oom_total: int
    oom_capacity: int
    oom_fragmentation: int
    token_states_share: Num
    reservation_share: Num
    internal_fragmentation_share: Num
    external_fragmentation_share: Num
    free_share: Num
    max_running: int
    peak_blocks: int
    peak_held_bytes: int
    held_blocks_end: int
    flags: dict[str, Any] = {}

    def numbers(self) -> dict[str, Num]:
        """Every numeric figure by name (what the difference compares), bools left out."""
        return {k: v for k, v in self.written().items() if isinstance(v, int | float) and not isinstance(v, bool)}


class PolicyCrash(Record):
    """A policy whose code raised while the measurement ran it: the exception's last line."""

    policy: str
    error: str


class MemorySide(Record):
    """One tree's measurement: the trace it ran, each policy's figures, and the policies that crashed (none in a tree
    whose measurement predates the field)."""

    trace: dict[str, Any]
    engine_args: list[str] = []
    policies: dict[str, PolicyMemory]
    crashed: list[PolicyCrash] = []


@dataclass(frozen=True)
class GateCrash:
    """A crash the gate FAILs on: which side, which engine (policy), the exception's last line."""

    side: str
    engine: str
    error: str

    def line(self) -> str:
        return f"{self.side}'s {self.engine} crashed: {self.error}"

    def json(self) -> dict:
        return {"side": self.side, "engine": self.engine, "error": self.error}


@dataclass(frozen=True)
class Difference:
    figure: str
    base: Num
    new: Num
    worse: bool  # this difference FAILs the gate

    @property
    def delta(self) -> Num:
        return self.new - self.base

    def line(self) -> str:
        if self.figure.endswith("_share"):
            change = f"{self.base:.2%} -> {self.new:.2%} ({100 * self.delta:+.2f} points)"
        else:
            change = f"{self.base:,} -> {self.new:,} ({self.delta:+,} {UNITS.get(self.figure, '')})".replace(" )", ")")
        return f"{self.figure} {change}" + ("  FAIL" if self.worse else "")

    def json(self) -> dict:
        return {"figure": self.figure, "base": self.base, "new": self.new, "delta": self.delta, "fails": self.worse}


@dataclass(frozen=True)
class PolicyGate:
    policy: str
    base: PolicyMemory | None  # None: the policy is measured on one side only (added or removed), not gated
    new: PolicyMemory | None  # None also where NEW's crashed (`crash`)
    differences: list[Difference] = field(default_factory=list)
    crash: GateCrash | None = None  # NEW's code raised on this policy: a FAIL

    @property
    def verdict(self) -> GateVerdict:
        return passed_or_failed(self.crash is not None or any(d.worse for d in self.differences))

    def json(self) -> dict:
        return {"policy": self.policy, "verdict": self.verdict,
                "base": self.base.written() if self.base else None, "new": self.new.written() if self.new else None,
                "differences": [d.json() for d in self.differences],
                "crashed": self.crash.error if self.crash else None}


@dataclass(frozen=True)
class MemoryGate:
    margin: float  # the token-state share's allowed fall, as a share
    trace: dict[str, Any]
    new_engine_args: list[str]
    policies: list[PolicyGate]

    @property
    def crashed(self) -> list[GateCrash]:
        """NEW's crashes, policy by policy (each FAILs the gate); empty where none."""
        return [p.crash for p in self.policies if p.crash is not None]

    @property
    def verdict(self) -> GateVerdict:
        """The worst of its policies' (harness/analysis/gate_verdict.worst)."""
        return worst(p.verdict for p in self.policies)

    def json(self) -> dict:
        return {"verdict": self.verdict, "share_margin": self.margin, "trace": self.trace,
                "new_engine_args": self.new_engine_args, "crashed": [c.json() for c in self.crashed],
                "policies": {p.policy: p.json() for p in self.policies}}


def differences(base: PolicyMemory, new: PolicyMemory, margin: float) -> list[Difference]:
    """Every figure that differs, in BASE's order, each marked where it FAILs the rule."""
    b, n = base.numbers(), new.numbers()
    out = []
    for name in [*b, *(k for k in n if k not in b)]:
        if name not in b or name not in n or b[name] == n[name]:
            continue
        worse = (name in GROWING_FAILS and n[name] > b[name]) or \
            (name == SHARE_GATED and b[name] - n[name] > margin)
        out.append(Difference(name, b[name], n[name], worse))
    return out


def gate(base: MemorySide, new: MemorySide, margin: float = DEFAULT_SHARE_MARGIN) -> MemoryGate:
    """BASE's figures against NEW's, policy by policy (a policy on one side alone is listed, not gated; one that
    crashed in NEW FAILs, named). BASE's crashes are the caller's to refuse (BASE could not run); ValueError where
    it passes a side with one."""
    if base.crashed:
        raise ValueError(f"BASE's {base.crashed[0].policy} crashed: {base.crashed[0].error}")
    crashes = {c.policy: GateCrash("NEW", c.policy, c.error) for c in new.crashed}
    names = [*base.policies, *(p for p in [*new.policies, *crashes] if p not in base.policies)]
    rows = []
    for name in dict.fromkeys(names):
        b, n = base.policies.get(name), new.policies.get(name)
        rows.append(PolicyGate(name, b, n, differences(b, n, margin) if b and n else [], crashes.get(name)))
    return MemoryGate(margin, base.trace, new.engine_args, rows)
