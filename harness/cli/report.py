"""`fragbench report`: the HTML report of a run, complete or partial."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.args import run_dir


def register(sub) -> None:
    report = sub.add_parser("report", help="the HTML report of a run (complete or partial)")
    report.add_argument("run_dir", help="a bench run's directory (results/RUN_ID)")
    report.add_argument("--out", metavar="FILE", help="the HTML page written (default: reports/RUN_ID.html)")
    report.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from harness.analysis.summary import finalize, load_meta
    from harness.sim.twin import write_twin
    from harness.views.report import render

    directory = run_dir(args.run_dir)
    summary = finalize(directory)  # a partial run gets its parquet files and summary from what it wrote
    if "twin" not in summary and load_meta(directory).get("status") == "complete":
        write_twin(directory)  # a run bench finished before it simulated its twin
    out = Path(args.out) if args.out else Path("reports") / f"{directory.name}.html"
    print(render(directory, out))
    return 0
