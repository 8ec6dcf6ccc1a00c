"""`fragbench simulate --grid GRID.yaml`: the handler (simulate.py registers the flags; a module of its own to keep
each under the CLI's size)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from harness.cli.args import UsageError, usage_errors
from harness.sim.progress import SimulationProgress

# flags of a single simulation that a grid file replaces (it names its models, GPUs, ... itself)
SINGLE_ONLY = ("model", "gpu", "gpu_mem", "workload", "policy", "placement", "alloc_conf", "requests", "max_seq_len",
               "step_model", "step_engine", "report", "rates")


def run_grid_verb(args: argparse.Namespace) -> int:
    given = [f"--{name.replace('_', '-')}" for name in SINGLE_ONLY if getattr(args, name, None)]
    if given:
        raise UsageError(f"--grid takes its configurations from {args.grid}: drop {', '.join(given)}")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, not {args.jobs}")
    # after the flags' checks: a wrong flag exits before pandas loads (simulate.py imports this module for --grid)
    from harness.sim.grid import GridError, load_grid
    from harness.sim.gridrun import RayUnavailable, best_per_model, check_address, import_ray, run_grid

    with usage_errors(RayUnavailable):  # before the grid's checks: a missing extra is told at once
        if args.ray or args.ray_address:
            import_ray()
        if args.ray_address:
            check_address(args.ray_address)
    with usage_errors(GridError):
        grid = load_grid(args.grid)
    out_dir = Path(args.out) if args.out else Path("results") / "grid" / Path(args.grid).stem
    # after the grid file's checks: a bad file exits before plotly loads
    from harness.views.grid_page import render_grid, render_grid_text

    started = time.perf_counter()
    # Ray's driver prints its cluster's events (a node lost) on stdout: stdout is for the result (--json) alone
    with usage_errors(RayUnavailable), contextlib.redirect_stdout(sys.stderr), SimulationProgress() as progress:
        table, resumed = run_grid(grid, out_dir, args.jobs or os.cpu_count() or 1, args.ray, args.ray_address,
                                  progress)
    wall_s = time.perf_counter() - started
    page = render_grid(table, resumed, out_dir)
    if args.json:
        best = best_per_model(table)
        print(json.dumps({"configurations": len(table), "resumed": resumed, "wall_s": wall_s,
                          "where": "ray" if args.ray or args.ray_address else f"{args.jobs or os.cpu_count()} jobs",
                          "parquet": str(out_dir / "grid.parquet"), "html": str(page),
                          "best": json.loads(best.to_json(orient="records"))}, indent=2))
    else:
        print(render_grid_text(table, resumed, out_dir) + f"\n  wall {wall_s:.1f} s")
    return 0
