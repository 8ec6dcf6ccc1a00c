"""The instruction-count figure of the A/B gate: an engine's step at a few fixed batch shapes counted in
instructions under callgrind (harness/run/ab_instr_probes.py measures it, harness/run/ab_instr_shapes.py is the
measured side), a reading per build, and BASE's against NEW's as one ratio.

Instructions, not seconds: the same code on the same inputs executes nearly the same instructions whatever else
the machine runs (two runs agreed within 0.22 % at every shape here), so the figure needs no replicates; what moves
it is the code (a 20 % heavier step reads 1.2x: `--burn-step 1.2` read 1.201). What it does not see: time a step
spends not computing (a sleep, a lock, memory stalls, another thread's work)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# callgrind's dump: "summary: N" (older versions) or "totals: N", the first event being Ir (instructions executed)
_TOTAL = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def callgrind_instructions(text: str) -> int:
    """The instructions of one callgrind dump (its `summary:` or `totals:` line; the first event is Ir);
    ValueError where the text has neither."""
    found = _TOTAL.search(text)
    if found is None:
        raise ValueError("not a callgrind dump: no 'summary:' or 'totals:' line")
    return int(found.group(1))


@dataclass(frozen=True)
class ShapeInstructions:
    """One fixed batch shape: `decodes` sequences at `context` tokens decoding beside a fresh `prefill`-token prompt
    a step, over `steps` steps, and the instructions those steps executed."""

    name: str
    decodes: int
    context: int
    prefill: int
    steps: int
    instructions: int

    @property
    def instructions_per_step(self) -> float:
        return self.instructions / self.steps


@dataclass(frozen=True)
class InstrReading:
    """One build's engine at every shape: what ran (engine, its serve flags) and the counts."""

    engine: str
    engine_args: tuple[str, ...]
    shapes: tuple[ShapeInstructions, ...]
    torch_version: str

    @property
    def instructions(self) -> int:
        """Every shape's instructions together."""
        return sum(s.instructions for s in self.shapes)

    def json(self) -> dict[str, Any]:
        return {"engine": self.engine, "engine_args": list(self.engine_args), "torch": self.torch_version,
                "instructions": self.instructions,
                "shapes": [{**vars(s), "instructions_per_step": s.instructions_per_step} for s in self.shapes]}


def shape_ratios(base: InstrReading, new: InstrReading) -> dict[str, float]:
    """NEW's instructions over BASE's, shape by shape; ValueError where the two did not run the same shapes."""
    if [s.name for s in base.shapes] != [s.name for s in new.shapes]:
        raise ValueError(f"the readings ran different shapes: {[s.name for s in base.shapes]} against "
                         f"{[s.name for s in new.shapes]}")
    return {b.name: n.instructions / b.instructions for b, n in zip(base.shapes, new.shapes, strict=True)}


def instr_ratio(base: InstrReading, new: InstrReading) -> float:
    """NEW's step cost over BASE's: the geometric mean of the shapes' ratios (each shape weighs alike, so the
    longest context's decode does not outvote the prefill), 1.2 for a step that computes 20 % more at every
    shape."""
    ratios = shape_ratios(base, new)
    return math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
