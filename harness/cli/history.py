"""`fragbench history`: every run of a results folder over time, and the change points of its gated series."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness.cli.args import number_in, usage_errors
from harness.cli.user_paths import file_out


def register(sub) -> None:
    hist = sub.add_parser("history", help="every run of a results folder over time, and the change points of each "
                                          "engine's sustained rate and of the headline ratio (Apache Otava)")
    hist.add_argument("results", help="a results folder (results/ for make bench)")
    hist.add_argument("--out", type=file_out, default="reports/history.html", metavar="FILE",
                      help="the HTML page written (default: %(default)s)")
    hist.add_argument("--json", action="store_true", help="print the runs and change points as JSON (default: text)")
    hist.add_argument("--pvalue", type=pvalue_arg, default=0.001,
                      help="the t-test's p-value a change point must be under (Otava's default: %(default)s)")
    hist.add_argument("--min-magnitude", type=magnitude_arg, default=0.0,
                      help="the relative change (0.05 = 5 %%) a change point must exceed (default: %(default)s)")
    hist.set_defaults(func=run)


def pvalue_arg(text: str) -> float:
    return number_in(text, lambda v: 0 < v < 1, "a p-value between 0 and 1")


def magnitude_arg(text: str) -> float:
    return number_in(text, lambda v: 0 <= v < float("inf"), "a finite relative change >= 0")


def progress(t0: float) -> Callable[[str], None]:
    """A line per phase on stderr (stdout keeps the answer, or the JSON)."""
    return lambda line: print(f"fragbench history: at {time.monotonic() - t0:.1f} s: {line}", file=sys.stderr,
                              flush=True)


def run(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load pandas or plotly
    from harness.views.history import ChangePoint, ChangePointsUnavailable, render_history

    with usage_errors(ValueError, ChangePointsUnavailable):
        out, found = render_history(Path(args.results), Path(args.out), args.pvalue, args.min_magnitude,
                                    progress(time.monotonic()))
    if args.json:
        print(json.dumps({**found, "report": str(out)}, indent=2))
        return 0
    cps = [ChangePoint(**c) for c in found["change_points"]]
    print(f"history of {len(found['runs'])} runs: {len(cps)} change point{'s' * (len(cps) != 1)}")
    for c in cps:
        print(c.line())
    for c in (ChangePoint(**c) for c in found["within_intervals"]):
        print(f"(proposed by the t-test, inside the runs' own intervals) {c.line()}")
    print(f"report: {out}")
    return 0

