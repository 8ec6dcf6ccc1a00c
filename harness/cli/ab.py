"""`fragbench ab BASE [NEW]`: two builds in one run on this machine, interleaved, and the memory gate."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from engines.registry import IN_HOUSE, names
from harness.analysis.memory_gate import DEFAULT_SHARE_MARGIN
from harness.cli.args import UsageError, nonneg_float, positive_float, usage_errors
from harness.cli.kv_budget import add_kv_budget
from harness.cli.memory_gate import add_gate_flags, add_sides, checked_engine_args, margin_of
from harness.cli.user_paths import user_path

EXIT = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}


def register(sub) -> None:
    ab = sub.add_parser("ab", help="BASE's build against NEW's, served side by side and benched in one run per turn "
                                   "(ABBA, each turn a fresh stream both get), and the memory gate; exit 0 PASS, "
                                   "1 FAIL, 3 INCONCLUSIVE, 2 bad input")
    add_sides(ab)
    ab.add_argument("--engines", default="paged,static-oracle",
                    help="engines measured, comma-separated (default: %(default)s, the headline pair)")
    ab.add_argument("--time", type=positive_float, default=1800.0, metavar="S",
                    help="seconds of measurement, all turns together (default: %(default)g; each turn half of it, "
                         "at least 150 s a server, so two turns, ABBA, which run even where they overrun it; more "
                         "while a figure is INCONCLUSIVE and time remains)")
    ab.add_argument("--threshold", type=nonneg_float, default=10.0, metavar="PCT",
                    help="a figure FAILs when its 90 %% interval of NEW / BASE lies wholly past 1 -+ PCT %% on the "
                         "worse side, PASSes inside 1 +- PCT %% (default: %(default)g, as compare's)")
    ab.add_argument("--out", default="results/ab", metavar="DIR",
                    help="where each build's bench runs go (DIR/base and DIR/new, its searches, and DIR/base-fixed, "
                         "DIR/new-fixed: results folders `history` reads) and the page (DIR/reports) (default: "
                         "%(default)s)")
    ab.add_argument("--json", action="store_true", help="print one JSON object: verdict, figures, memory (default: "
                                                        "text)")
    ab.add_argument("--model", default="models/tiny-llama", help="model directory both builds serve (default: "
                                                                  "%(default)s; make model builds it)")
    add_kv_budget(ab, "16MiB", "bytes of KV cache each server gets")
    add_gate_flags(ab, DEFAULT_SHARE_MARGIN)
    ab.set_defaults(func=run)


def engines_of(text: str) -> list[str]:
    known = names(*IN_HOUSE)
    engines = [e.strip() for e in text.split(",") if e.strip()]
    wrong = [e for e in engines if e not in known]
    if not engines or wrong:
        raise UsageError(f"--engines takes in-house engines, comma-separated ({', '.join(known)}), not {text!r}")
    return list(dict.fromkeys(engines))


def new_args(pairs: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for pair in checked_engine_args(pairs):
        engine, _, text = pair.partition("=")
        out.setdefault(engine, []).extend(shlex.split(text))
    return out


def checked(args: argparse.Namespace):
    # imported when the verb runs: `fragbench --help` does not load numpy, pandas or scipy
    from harness.run.ab_runs import ABPlan

    engines = engines_of(args.engines)
    if args.time <= 0:
        raise UsageError(f"--time must be positive, not {args.time:g}")
    if not 0 < args.threshold < 100:
        raise UsageError(f"--threshold is a percentage between 0 and 100, not {args.threshold:g}")
    if not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model}: no config.json there (run `make model`)")
    # the user's paths absolute: each build's servers and benches run in their trees' folders
    return ABPlan(engines, args.time, args.threshold / 100, user_path(args.out), str(user_path(args.model)),
                  str(args.kv_budget.bytes), new_args(args.new_engine_args))


def run(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load these (numpy, pandas, scipy)
    from harness.analysis.ab import overall
    from harness.run.ab_runs import measure
    from harness.run.memory_gate_runs import memory_gate
    from harness.run.servers import ServerFailed
    from harness.run.trees import TreeError, tree_of
    from harness.views.ab_page import render_text, write_page

    margin = margin_of(args.share_margin)
    plan = checked(args)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else \
        (lambda text: print(text, flush=True))
    with usage_errors(TreeError, ServerFailed):
        base, new = tree_of(args.base), tree_of(args.new)
        memory = memory_gate(base, new, args.new_engine_args, margin)
        say(f"ab: memory gate {memory.verdict}; serving {len(plan.engines) * 2} servers")
        turns, figures = measure(base, new, plan, say)
    verdict = overall([f.verdict for f in figures] + [memory.verdict])
    page = write_page(verdict, figures, memory, (base.label, new.label), turns.dirs,
                      plan.out / "reports" / f"ab-{time.strftime('%Y%m%d-%H%M%S')}.html")
    if args.json:
        print(json.dumps({"verdict": verdict, "figures": [f.json() for f in figures], "memory": memory.json(),
                          "turns": [str(d) for d in turns.dirs], "page": str(page)}, indent=2))
    else:
        print(render_text(verdict, figures, memory, plan.threshold, turns.dirs) + f"\npage: {page}")
    return EXIT[verdict]
