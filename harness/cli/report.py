"""`fragbench report`: the HTML report of a run, complete or partial."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.cli.args import run_dir


def register(sub) -> None:
    report = sub.add_parser("report", help="the HTML report of a run (complete or partial)")
    report.add_argument("run_dir", help="a bench run's directory (results/RUN_ID)")
    report.add_argument("--out", metavar="FILE", help="the HTML page written (default: reports/RUN_ID.html)")
    report.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load pandas, scipy or plotly
    from harness.analysis.rundir import load_meta
    from harness.analysis.summary import finalize
    from harness.sim.twin import twin_of
    from harness.views.report import render

    directory = run_dir(args.run_dir)
    before = directory / "summary.json"
    simulated = before.is_file() and "twin" in json.loads(before.read_text())
    # a partial run gets its parquet files and summary from what it wrote; a complete one that bench finished
    # before it simulated its twin gets its twin, in the same one write
    complete = load_meta(directory).get("status") == "complete"
    finalize(directory, twin_of(directory) if complete and not simulated else None)
    out = Path(args.out) if args.out else Path("reports") / f"{directory.name}.html"
    print(render(directory, out))
    return 0
