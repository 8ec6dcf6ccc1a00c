"""`fragbench memory-gate`: each KV policy's memory on a fixed trace in virtual time, BASE's code against NEW's."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engines.registry import names
from harness.analysis.gate_verdict import EXIT
from harness.analysis.memory_gate import DEFAULT_SHARE_MARGIN
from harness.cli.args import UsageError, nonneg_float, usage_errors


def add_sides(parser) -> None:
    """BASE and NEW, the two builds a gate compares (memory-gate's and ab's)."""
    parser.add_argument("base", metavar="BASE", help="a revision (checked out as a work tree beside the checkout) "
                                                     "or a work tree's directory")
    parser.add_argument("new", metavar="NEW", nargs="?", help="the same (default: this checkout's working tree)")


def register(sub) -> None:
    gate = sub.add_parser("memory-gate", help="the deterministic memory gate: preemptions, OOMs by cause, Figure-2 "
                                              "shares and blocks of every KV policy on one fixed trace in virtual "
                                              "time, BASE's code against NEW's; exit 1 where NEW is worse")
    add_sides(gate)
    add_gate_flags(gate, DEFAULT_SHARE_MARGIN)
    gate.add_argument("--json", action="store_true", help="print the gate as one JSON object (default: text)")
    gate.add_argument("--report", metavar="FILE", help="also write the gate as an HTML page to FILE (default: none)")
    gate.set_defaults(func=run)


def add_gate_flags(p: argparse.ArgumentParser, margin: float) -> None:
    """The flags `memory-gate` shares with `ab`."""
    p.add_argument("--new-engine-args", action="append", default=[], metavar="ENGINE=ARGS",
                   help="serve flags for NEW's engine alone, as bench's --engine-args (repeatable): those that change "
                        "memory (--inject-kv-fault, --block-size, --no-preflight, --max-num-seqs, "
                        "--no-prefix-caching) reach NEW's side of the memory gate (default: none)")
    p.add_argument("--share-margin", type=nonneg_float, default=100 * margin, metavar="POINTS",
                   help="percentage points the token-state share may fall before the memory gate FAILs "
                        "(default: %(default)g)")


def checked_engine_args(pairs: list[str], flag: str = "--new-engine-args") -> list[str]:
    """ENGINE=ARGS for a known engine, and a KV fault only where its policy takes one: one line naming `flag` where
    not."""
    # imported when the verb runs: `fragbench --help` does not load yaml or the KV policies
    from engines.kv.faults import FAULTS
    from harness.sim.memory_gate_sim import engine_flags

    known = names()
    for pair in pairs:
        engine, sep, text = pair.partition("=")
        if not sep or engine not in known:
            raise UsageError(f"{flag} takes ENGINE=ARGS for one of {', '.join(known)}, not {pair!r}")
        try:
            flags, _ = engine_flags(text)
        except (argparse.ArgumentError, ValueError) as e:
            raise UsageError(f"{flag} {pair!r}: {e}") from None
        fault = flags.get("inject_kv_fault")
        if fault is not None and (fault not in FAULTS or engine != "paged"):
            raise UsageError(f"{flag} {pair!r}: --inject-kv-fault takes one of {', '.join(FAULTS)}, on "
                             "the paged engine")
    return pairs


def margin_of(points: float) -> float:
    if not 0 <= points < 100:
        raise UsageError(f"--share-margin is in percentage points, 0 to 100, not {points:g}")
    return points / 100


def run(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load these
    from harness.run.memory_gate_runs import memory_gate
    from harness.run.trees import TreeError, tree_of
    from harness.views.memory_gate_section import render_text, write_page

    margin = margin_of(args.share_margin)
    pairs = checked_engine_args(args.new_engine_args)
    with usage_errors(TreeError):
        base, new = tree_of(args.base), tree_of(args.new)
        result = memory_gate(base, new, pairs, margin)
    print(json.dumps(result.json(), indent=2) if args.json else render_text(result))
    if args.report:
        page = write_page(result, base.label, new.label, Path(args.report))
        print(f"report: {page}", file=sys.stderr if args.json else sys.stdout)  # --json: stdout is the JSON alone
    return EXIT[result.verdict]  # 1 FAIL, 0 PASS (harness/analysis/gate_verdict.py)
