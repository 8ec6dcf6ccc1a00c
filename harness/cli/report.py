"""`fragbench report`: the HTML report of a run, complete or partial; or its per-request and per-engine tables as
CSV or JSON (units in the column names), or the per-engine table as text."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from harness.cli.args import UsageError, run_dir
from harness.cli.run_folder import report_page
from harness.cli.user_paths import writable_file, writable_folder

FORMATS = ("html", "csv", "json", "text")


def register(sub) -> None:
    report = sub.add_parser("report", help="the HTML report of a run (complete or partial), or its tables as CSV, "
                                           "JSON or text")
    report.add_argument("run_dir", help="a bench run's directory (results/RUN_ID)")
    report.add_argument("--format", choices=FORMATS, default="html",
                        help="html: the report page (default); csv or json: requests.csv, tokens.csv and engines.csv "
                             "(or .json), the per-request, per-token and per-engine tables, units in the column names "
                             "(ttft_s, sustained_rps), their dtypes in tables.json; text: the per-engine table bench "
                             "ends with, on stdout")
    report.add_argument("--out", metavar="PATH",
                        help="html: the page written (default: reports/RUN_ID.html, numbered -2, -3... where that is "
                             "another run's page); csv, json: the folder the tables are written to (default: "
                             "reports/RUN_ID/; never the run's own folder); text prints to stdout and takes none")
    report.set_defaults(func=run)


def read_json(path: Path) -> dict:
    """A run's JSON file, or the CLI's one line naming it (a run cut off mid-write, a file edited by hand)."""
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not JSON ({e})") from None
    if not isinstance(out, dict):
        raise UsageError(f"{path} is not a JSON object")
    return out


def phase(t0: float, what: str) -> None:
    """A line per phase on stderr: finalizing a long run, or simulating its twin, takes a while."""
    print(f"fragbench report: at {time.monotonic() - t0:.1f} s: {what}", file=sys.stderr, flush=True)


def tables_out(run: Path, out: str | None) -> Path:
    """Where csv or json tables go: --out, else reports/RUN_ID/; never the run's own folder (its files are its
    record: engines.csv there is finalize's)."""
    path = Path(out) if out else Path("reports") / run.name
    if path.resolve() == run.resolve():
        raise UsageError(f"--out {path}: the run's own folder (its files are the run's record): give another folder")
    return writable_folder(path, "--out")


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    # imported when the verb runs: `fragbench --help` does not load pandas, scipy or plotly
    import pandas as pd

    from harness.analysis.records import RunRecord
    from harness.analysis.run_state import run_mark
    from harness.analysis.rundir import load_meta
    from harness.analysis.summary import finalize
    from harness.analysis.tables import export_tables
    from harness.sim.twin import twin_of

    directory = run_dir(args.run_dir)
    tables = tables_out(directory, args.out) if args.format in ("csv", "json") else None  # refused before any work
    if args.format == "text" and args.out:
        raise UsageError("--out goes with --format html, csv or json: text prints to stdout (redirect it: > FILE)")
    if args.format == "html" and args.out:
        writable_file(Path(args.out), "--out")
    elif args.format == "html":  # the default page's folder
        writable_folder(Path("reports"), "--out's default")
    before = directory / "summary.json"
    simulated = before.is_file() and "twin" in read_json(before)
    # a partial run gets its parquet files and summary from what it wrote; a complete one that bench finished
    # before it simulated its twin gets its twin, in the same one write
    read_json(directory / "run.json")  # its one line where it is not JSON, before load_meta reads it
    complete = load_meta(directory).get("status") == "complete"
    twin = complete and not simulated
    phase(t0, "summarizing the journals" + (" (a swept run's twin simulated too: seconds to minutes)" if twin else ""))
    summary = finalize(directory, twin_of(directory) if twin else None)
    if args.format != "html" and (mark := run_mark(RunRecord.read(directory),
                                                          pd.read_parquet(directory / "requests.parquet"))):
        print(mark)  # a partial or failed run says so at the top of every format
    if args.format == "text":  # what bench's console ends with: the report's opening lines, then the table
        from harness.views.engine_table import engine_table  # rich's table alone: no plotly
        from harness.views.opening import console_opening  # its sentences alone: no plotly

        print(console_opening(directory, summary) + "\n" + engine_table(summary))
        return 0
    if args.format in ("csv", "json"):
        for path in export_tables(directory, summary, tables, args.format):
            print(path)
        return 0
    from harness.views.report import render  # plotly and its page: html alone

    phase(t0, "drawing the report")
    out, apart = (Path(args.out), None) if args.out else report_page(Path("reports"), directory)
    if apart:
        print(apart, file=sys.stderr)
    print(render(directory, out))
    phase(t0, "done")
    return 0
