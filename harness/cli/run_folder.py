"""Where a run's files go, checked before anything is measured (issue 88): a run id is a folder's name, never a
path; an --out or --reports this user can write in; a run id not taken; each engine once (its rows share its
folder). Bench's own claim of the folder (harness/run/record.claim_run_dir) settles two runs racing for it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from harness.cli.args import UsageError, usage_errors

T = TypeVar("T")


def add_place_flags(parser: argparse.ArgumentParser) -> None:
    """--out, --reports and --run-id: where a bench run's files go."""
    parser.add_argument("--out", default="results", help="directory the run's folder is written under")
    parser.add_argument("--reports", default="reports", help="directory the HTML report is written to")
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


def writable_folder(path: Path, flag: str) -> Path:
    """A folder the verb will write into: the folder itself, or the nearest of its parents that exists (the rest
    made on the way), must be a folder this user may write in."""
    there = path
    while not there.exists() and there.parent != there:
        there = there.parent
    if not there.is_dir():
        raise UsageError(f"{flag} {path}: {there} is a file, not a folder")
    if not os.access(there, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {there} cannot be written (permission denied)")
    return path


def run_place(engines: list[str], out: Path, run_id: str | None, reports: Path) -> None:
    """Every engine once, --out and --reports writable, a given run id not taken: refused before anything loads."""
    if twice := sorted({e for e in engines if engines.count(e) > 1}):
        raise UsageError(f"--engines names {', '.join(twice)} more than once: each engine runs once per run")
    writable_folder(out, "--out")
    if run_id and (out / run_id).exists():
        raise UsageError(f"--run-id {run_id}: {out / run_id} already exists (a run is never merged into another or "
                         f"overwritten): give another --run-id or --out")
    writable_folder(reports, "--reports")  # not found unwritable after the measuring


def claimed(make: Callable[[], T]) -> T:
    """`make()` (a Bench, which claims its folder first), its folder's refusal one line: taken since run_place
    looked (another run raced for it), or not makeable."""
    from harness.run.record import RunFolderRefused  # imported when the verb runs: `fragbench --help` loads no torch

    with usage_errors(RunFolderRefused):
        return make()
