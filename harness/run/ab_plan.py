"""`fragbench ab`'s plan and what its run measured, below the run itself (harness/run/ab_runs.py): ABPlan (the
engines, the time, the threshold, the model, the KV budget and each build's serve flags), a build's serve flags and
step log by it, Measured (each engine's gate, its rate, the knee turn's points, the notes) and BaseFailed (BASE's
build failed: no verdict on NEW)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engines.registry import Kind, entry
from harness.analysis.ab import SIDES, ABFigure, EngineGate, knee_figure, side_name
from harness.analysis.knee import Judged
from harness.run.ab_blocks import Crashed


@dataclass(frozen=True)
class ABPlan:
    engines: list[str]
    time_s: float  # the pairs' time, all engines together
    threshold: float  # a share
    out: Path
    model: str
    kv_budget: str  # bytes
    new_engine_args: dict[str, list[str]]
    base_engine_args: dict[str, list[str]] = field(default_factory=dict)
    min_pairs: int = 10
    knee_time_s: float = 0.0
    instructions: bool = False  # count each scheduled engine's step under callgrind (about 9 CPU minutes a build)
    seed0: int = 0
    run_id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S"))

    @property
    def gate_dir(self) -> Path:
        """This run's pairs, blocks, servers' logs and ab.json: OUT/gate-<run id> (a night's, beside the others)."""
        return self.out / f"gate-{self.run_id}"


@dataclass
class Measured:
    """What the run measured: each engine's gate, its rate, the knee turn's points and the runs' folders."""

    gates: dict[str, EngineGate] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    knee_points: list[dict[str, list[Judged]]] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)
    target: float = 0.9
    speed: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    steps: dict[str, ABFigure] = field(default_factory=dict)
    instructions: dict[str, ABFigure | str] = field(default_factory=dict)  # a figure, or NEW's crash in words
    servings: list[dict] = field(default_factory=list)  # each start of an engine's two servers: when, which first
    error: str | None = None  # BASE's build failed: the run could not judge NEW (exit 2)

    def figures(self) -> list[ABFigure]:
        out = []
        for engine, gate in self.gates.items():
            out += gate.figures()
            if engine in self.steps:
                out.append(self.steps[engine])
            if any(side_name(engine, s) in turn for turn in self.knee_points for s in SIDES):
                out.append(knee_figure(engine, self.knee_points, self.target))
        return out

    def fail(self, engine: str, crash: Crashed, plan: ABPlan, say: Callable[[str], None]) -> None:
        """A build's server failed (crashed, hung, or never started): NEW's FAILs its engine, naming what its log
        said last; BASE's stops the run, no verdict on NEW (BaseFailed)."""
        if crash.side == "base":
            raise BaseFailed(f"BASE's {crash}")
        gate = self.gates.setdefault(engine, EngineGate(engine, plan.threshold, plan.min_pairs))
        gate.crashed = gate.crashed or str(crash)
        say(f"ab: {engine}: FAIL: {crash}")


class BaseFailed(RuntimeError):
    """BASE's build failed (its server, its instruction count): the run cannot judge NEW, exit 2."""


def engine_args(plan: ABPlan, engine: str, side: str) -> list[str]:
    """A build's serve flags: bench's defaults for the engine (static-max admits unchecked, as make bench serves
    it) and that side's own (--base-engine-args, --new-engine-args)."""
    base = ["--no-preflight"] if engine == "static-max" else []
    own = plan.new_engine_args if side == "new" else plan.base_engine_args
    return base + own.get(engine, [])


def step_log(plan: ABPlan, engine: str, side: str) -> Path | None:
    """Where a scheduled engine's server records its steps (None for an engine fragbench does not schedule)."""
    if entry(engine).kind != Kind.SCHEDULED:
        return None
    return plan.gate_dir / "servers" / f"{side_name(engine, side)}.steps.csv"
