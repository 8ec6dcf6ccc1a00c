"""A bench run cut off (Ctrl-C, SIGTERM, an error): why in words, recorded in run.json, and one line saying where its
partial run is, before the exit."""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path


def stop_cause(e: BaseException) -> str:
    """Why a run stopped, in words: Ctrl-C, the signal (procs.exit_on_sigterm's SystemExit(128 + signum)), an error."""
    if isinstance(e, KeyboardInterrupt):
        return "Ctrl-C"
    if isinstance(e, SystemExit):
        code = e.code if isinstance(e.code, int) else 0
        return signal.Signals(code - 128).name if code - 128 in signal.valid_signals() else f"exit {e.code}"
    return f"{type(e).__name__}: {e}"


def stopping_says_where(bench) -> Path:
    """bench.run(); cut off (Ctrl-C, SIGTERM, an error), run.json says why, and one line where the partial run is
    (`fragbench report` reads it, marked PARTIAL) before the exit (130 for Ctrl-C)."""
    try:
        return bench.run()
    except (KeyboardInterrupt, SystemExit, Exception) as e:
        why = stop_cause(e)
        with contextlib.suppress(Exception):  # the run's record is best effort here: the cause is what matters
            bench.record.stopped(why)
        print(f"fragbench bench: stopped ({why}): the partial run is in {bench.dir} (`fragbench report "
              f"{bench.dir}` reads what it kept)", file=sys.stderr, flush=True)
        raise
