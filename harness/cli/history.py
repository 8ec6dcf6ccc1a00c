"""`fragbench history`: every run of a results folder over time, regressions marked."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.args import UsageError, usage_errors


def register(sub) -> None:
    hist = sub.add_parser("history", help="every run of a results folder over time, regressions marked")
    hist.add_argument("results", help="a results folder (results/ by default for bench)")
    hist.add_argument("--out", default="reports/history.html", help="the HTML page written")
    hist.add_argument("--baseline", type=int, default=7, help="previous runs whose median the last is held to")
    hist.add_argument("--threshold", type=float, default=10.0,
                      help="percent a figure may worsen against that median before it is marked a regression")
    hist.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from harness.views.history import render_history

    if args.baseline < 1 or not 0 <= args.threshold < float("inf"):
        raise UsageError("--baseline must be at least 1 and --threshold a percentage >= 0")
    with usage_errors(ValueError):
        out, count = render_history(Path(args.results), Path(args.out), args.baseline, args.threshold)
    print(f"history of {count} runs: {out}")
    return 0
