"""Where a run's files go, checked before anything is measured (issue 88): a run id is a folder's name, never a
path; an --out or --reports this user can write in; a run id not taken; each engine once (its rows share its
folder). Bench's own claim of the folder (harness/run/record.claim_run_dir) settles two runs racing for it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from harness.cli.args import UsageError, usage_errors
from harness.cli.user_paths import folder_out

T = TypeVar("T")


def add_place_flags(parser: argparse.ArgumentParser) -> None:
    """--out, --reports and --run-id: where a bench run's files go."""
    parser.add_argument("--out", type=folder_out, default="results", metavar="DIR",
                        help="directory the run's folder is written under")
    parser.add_argument("--reports", type=folder_out, default="reports", metavar="DIR",
                        help="directory the HTML report is written to (reports/RUN_ID.html; another run's page of "
                             "that name is kept, this one numbered -2, -3...)")
    parser.add_argument("--run-id", type=run_id_arg,
                        help="the run's folder's name under --out, a new one: a run is never merged into another or "
                             "overwritten (default: the start time and the workload, numbered -2, -3... if taken)")


def run_id_arg(text: str) -> str:
    """A run id is a folder's name, never a path: nothing that leaves --out, hides, or names no folder."""
    if not text or text in (".", "..") or text.startswith(".") or len(text) > 200:
        raise argparse.ArgumentTypeError(f"a run id is a folder's name (1 to 200 characters, not starting with "
                                         f"'.'), not {text!r}")
    if any(c in text for c in "/\\") or any(ord(c) < 32 for c in text):
        raise argparse.ArgumentTypeError(f"a run id is a folder's name, not a path: {text!r} has a separator or a "
                                         f"control character")
    return text


def run_place(engines: list[str], out: Path, run_id: str | None) -> None:
    """Every engine once, a given run id not taken: refused before anything loads (--out and --reports, writable
    folders, are checked as they are parsed: user_paths.folder_out)."""
    if twice := sorted({e for e in engines if engines.count(e) > 1}):
        raise UsageError(f"--engines names {', '.join(twice)} more than once: each engine runs once per run")
    if run_id and (out / run_id).exists():
        raise UsageError(f"--run-id {run_id}: {out / run_id} already exists (a run is never merged into another or "
                         f"overwritten): give another --run-id or --out")


def claimed(make: Callable[[], T]) -> T:
    """`make()` (a Bench, which claims its folder first), its folder's refusal one line: taken since run_place
    looked (another run raced for it), or not makeable."""
    from harness.run.record import RunFolderRefused  # imported when the verb runs: `fragbench --help` loads no torch

    with usage_errors(RunFolderRefused):
        return make()


def report_page(reports: Path, run_dir: Path) -> tuple[Path, str | None]:
    """The run's page under `reports`: RUN_ID.html, unless that is another run's page (one of the same run id under
    another --out), kept, this one numbered -2, -3... A page is the run's where it holds the run's start time to the
    microsecond (the page quotes its run.json). With the line that says so where it was numbered apart."""
    from harness.analysis.records import RunRecord  # imported when the page is written: `fragbench --help` loads less

    meta = RunRecord.read(run_dir)
    run_id, started = meta.run_id or run_dir.name, meta.started
    for n in range(1, 1000):
        page = reports / (f"{run_id}.html" if n == 1 else f"{run_id}-{n}.html")
        if not page.exists() or (started and started in page.read_text(errors="replace")):
            said = None if n == 1 else (f"{reports / f'{run_id}.html'} is another run's page (kept): this run's is "
                                        f"{page}")
            return page, said
    raise UsageError(f"--reports {reports}: {run_id}.html and 998 numbered after it are other runs' pages")
