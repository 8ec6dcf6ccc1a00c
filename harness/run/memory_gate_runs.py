"""The memory gate's two measurements, one per tree: harness/sim/memory_gate_sim.py (this checkout's copy, so both
sides measure the same trace the same way) run as a child whose import path starts at the tree, so every policy,
scheduler and simulator function it calls is that tree's own; its JSON read into the gate's records."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from pydantic import ValidationError

from harness.analysis.memory_gate import DEFAULT_SHARE_MARGIN, MemoryGate, MemorySide, PolicyCrash, gate
from harness.run.trees import ROOT, Tree, TreeError, run_child

SIM_FILE = ROOT / "harness" / "sim" / "memory_gate_sim.py"
# the measured run takes 2-4 s a side; a busy 2-core night, and a BASE that must import torch, take longer
SIDE_TIMEOUT_S = 300
# `python -c`: the import path starts at the working directory (the tree), not at the script's folder
RUN_FILE = "import runpy, sys; path = sys.argv.pop(1); sys.argv[0] = path; runpy.run_path(path, run_name='__main__')"


def measure_side(tree: Tree, engine_args: list[str]) -> MemorySide:
    """One tree's figures on the fixed trace, with `engine_args` (ENGINE=ARGS, as bench's --engine-args)."""
    cmd = [tree.python, "-c", RUN_FILE, str(SIM_FILE), *(f"--engine-args={a}" for a in engine_args)]
    done = run_child(cmd, tree.path, tree.env(), SIDE_TIMEOUT_S)
    if done.returncode != 0:
        raise TreeError(f"the memory gate's measurement failed in {tree.label} ({tree.path}): {done.last_line}")
    try:
        return MemorySide.model_validate(json.loads(done.stdout))
    except (ValueError, ValidationError) as e:
        raise TreeError(f"the memory gate's measurement in {tree.label} printed no figures it can read: "
                        f"{str(e).splitlines()[0]}") from None


def memory_gate(base: Tree, new: Tree, new_engine_args: list[str],
                margin: float = DEFAULT_SHARE_MARGIN) -> MemoryGate:
    """Both sides at once (two children; each is one core's work), then BASE's figures against NEW's. A crash in
    NEW's code is in the gate (a FAIL that names it), its whole measurement failing (an import) too; one in BASE's
    is a TreeError: BASE could not run, which is no
    verdict on NEW."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        base_side = pool.submit(measure_side, base, [])
        new_side = pool.submit(measure_side, new, new_engine_args)
        base_figures = base_side.result()
        try:
            new_figures = new_side.result()
        except TreeError as e:  # NEW's code would not run (an import that fails): every policy crashed in NEW
            new_figures = MemorySide(trace=base_figures.trace, engine_args=new_engine_args, policies={},
                                     crashed=[PolicyCrash(policy=p, error=str(e)) for p in base_figures.policies])
    if base_figures.crashed:
        crash = base_figures.crashed[0]
        raise TreeError(f"BASE ({base.label}) could not run the memory gate: its {crash.policy} crashed: {crash.error}")
    return gate(base_figures, new_figures, margin)
