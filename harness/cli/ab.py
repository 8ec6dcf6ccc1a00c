"""`fragbench ab BASE [NEW]`: two builds in one run on this machine, interleaved, and the memory gate."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import traceback
from pathlib import Path

from engines.registry import IN_HOUSE, names
from harness.analysis.gate_verdict import EXIT, GateVerdict, worst
from harness.analysis.memory_gate import DEFAULT_SHARE_MARGIN
from harness.cli.args import UsageError, nonneg_float, positive_float, positive_int, usage_errors
from harness.cli.kv_budget import add_kv_budget
from harness.cli.memory_gate import add_gate_flags, add_sides, checked_engine_args, margin_of
from harness.cli.user_paths import user_path


def register(sub) -> None:
    ab = sub.add_parser("ab", help="BASE's build against NEW's, served side by side: per engine many short pairs of "
                                   "blocks at one fixed rate (AB, BA, ...; each pair a fresh stream both get), "
                                   "decided as the field's gates decide, and the memory gate; exit 0 PASS, 1 FAIL, "
                                   "3 INCONCLUSIVE, 2 could not run")
    add_sides(ab)
    ab.add_argument("--engines", default="paged,static-oracle",
                    help="engines measured, comma-separated (default: %(default)s, the headline pair)")
    ab.add_argument("--time", type=positive_float, default=1200.0, metavar="S",
                    help="seconds for the pairs, all engines together: pairs go on while an engine is undecided and "
                         "time remains (default: %(default)g; a pair of paged takes about 40 s here, of "
                         "static-oracle about 55 s)")
    ab.add_argument("--pairs", type=positive_int, default=10, metavar="N",
                    help="pairs an engine needs before it can PASS, the first of its 4 looks, then every 4 pairs "
                         "(default: %(default)s, from the rule's study, docs/method.md); a FAIL may come at any look "
                         "from 6 pairs on")
    ab.add_argument("--knee-time", type=nonneg_float, default=300.0, metavar="S",
                    help="seconds for one knee search of each build after the pairs, reported beside the gate and "
                         "never gating it; 0 skips it (default: %(default)g)")
    ab.add_argument("--instructions", action="store_true",
                    help="also count each scheduled engine's step at fixed batch shapes under callgrind in both "
                         "builds, a gated figure no load moves (default: off: about 9 CPU minutes a build and "
                         "engine on this machine)")
    ab.add_argument("--threshold", type=nonneg_float, default=10.0, metavar="PCT",
                    help="the effect floor: a figure FAILs when NEW is worse than 1 + PCT %% times BASE, "
                         "significantly (one-sided p < 0.01, shared over the FAIL's looks); PASSes when the upper "
                         "one-sided bound of NEW / BASE (95 %%, shared over 4 looks) lies under 1 + PCT %% "
                         "(default: %(default)g)")
    ab.add_argument("--out", default="results/ab", metavar="DIR",
                    help="where the run goes: DIR/gate-<run id> (pairs.jsonl, a line a pair as it is measured; the "
                         "blocks' requests; ab.json), each build's knee search (DIR/base, DIR/new: results folders "
                         "`history` reads) and the page (DIR/reports) (default: %(default)s)")
    ab.add_argument("--json", action="store_true", help="print one JSON object: verdict, figures, memory (default: "
                                                        "text)")
    ab.add_argument("--model", default="models/tiny-llama", help="model directory both builds serve (default: "
                                                                  "%(default)s; make model builds it)")
    add_kv_budget(ab, "16MiB", "bytes of KV cache each server gets")
    add_gate_flags(ab, DEFAULT_SHARE_MARGIN)
    ab.add_argument("--base-engine-args", action="append", default=[], metavar="ENGINE=ARGS",
                    help="serve flags for BASE's engine alone, the twin of --new-engine-args (repeatable): a fault "
                         "on BASE's side makes NEW an improvement, which must PASS (default: none)")
    ab.set_defaults(func=run)


def engines_of(text: str) -> list[str]:
    known = names(*IN_HOUSE)
    engines = [e.strip() for e in text.split(",") if e.strip()]
    wrong = [e for e in engines if e not in known]
    if not engines or wrong:
        raise UsageError(f"--engines takes in-house engines, comma-separated ({', '.join(known)}), not {text!r}")
    return list(dict.fromkeys(engines))


def side_args(pairs: list[str], flag: str) -> dict[str, list[str]]:
    """One build's serve flags by engine, from --new-engine-args or --base-engine-args (checked, split)."""
    out: dict[str, list[str]] = {}
    for pair in checked_engine_args(pairs, flag):
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
    if args.pairs < 6:
        raise UsageError(f"--pairs must be at least 6 (the rule's first look), not {args.pairs}")
    if args.knee_time < 0:
        raise UsageError(f"--knee-time must be 0 or more seconds, not {args.knee_time:g}")
    new_args = side_args(args.new_engine_args, "--new-engine-args")  # the flags' syntax before the files
    base_args = side_args(args.base_engine_args, "--base-engine-args")
    if not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model}: no config.json there (run `make model`)")
    # the user's paths absolute: each build's servers and benches run in their trees' folders
    return ABPlan(engines, args.time, args.threshold / 100, user_path(args.out), str(user_path(args.model)),
                  str(args.kv_budget.bytes), new_args, base_args, args.pairs, args.knee_time, args.instructions)


def run(args: argparse.Namespace) -> int:
    """The gate, its verdict written on every path once both builds resolve; whatever nobody foresaw (a bug, a
    failed write) exits 2, "could not run", and never 1, which a CI reads as NEW's FAIL."""
    try:
        return gated(args)
    except UsageError:
        raise
    except Exception as e:
        traceback.print_exc()
        raise UsageError(f"ab could not run: {type(e).__name__}: {e}") from None


def gated(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load these (numpy, pandas, scipy)
    from harness.run.ab_runs import Measured, measure
    from harness.run.memory_gate_runs import memory_gate
    from harness.run.servers import ServerFailed
    from harness.run.trees import TreeError, tree_of

    margin = margin_of(args.share_margin)
    plan = checked(args)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else \
        (lambda text: print(text, flush=True))
    with usage_errors(TreeError):  # an unknown revision: nothing ran, nothing to write
        base, new = tree_of(args.base), tree_of(args.new)
    if base.sha is not None and base.sha == new.sha and not new.dirty:
        flags = plan.new_engine_args or plan.base_engine_args
        what = "the builds differ by their serve flags alone" if flags else "an A/A run"
        say(f"ab: BASE and NEW are one commit ({base.sha[:12]}): {what}")
    measured, memory = Measured(), None
    try:
        memory = memory_gate(base, new, args.new_engine_args, margin)
        say(f"ab: memory gate {memory.verdict}; serving {len(plan.engines) * 2} servers")
        measure(base, new, plan, say, measured)
    except (TreeError, ServerFailed) as e:  # BASE's side could not run: no verdict on NEW
        measured.error = str(e)
    except Exception as e:  # unforeseen: said in full, and still a verdict written, "could not run"
        traceback.print_exc()
        measured.error = f"{type(e).__name__}: {e}"
    return written(args, plan, base, new, memory, measured)


def written(args: argparse.Namespace, plan, base, new, memory, measured) -> int:
    """The verdict (ERROR where the run could not judge NEW), ab.json and the page, then the exit code."""
    # imported when the verb runs, as run() imports its own: `fragbench --help` does not load the page's analysis
    from harness.run.trees import identity
    from harness.views.ab_page import render_text, write_page

    engines = {e: g.verdict() for e, g in measured.gates.items()}
    missing = [GateVerdict.INCONCLUSIVE for e in plan.engines if e not in engines]  # BASE sustained no rate
    verdict = GateVerdict.ERROR if measured.error else worst(list(engines.values()) + missing + [memory.verdict])
    if measured.error:
        measured.notes.append(f"could not run: {measured.error}")
    figures = measured.figures()
    page = plan.out / "reports" / f"ab-{plan.run_id}.html"
    sides = {"base": identity(base), "new": identity(new)}
    record = {"verdict": verdict, "error": measured.error, **sides,
              "passed": passed(verdict, sides["new"]),
              "engines": engines, "rates_rps": measured.rates, "figures": [f.json() for f in figures],
              "memory": memory.json() if memory else None, "notes": measured.notes, "speed_probe": measured.speed,
              "restarts": sum(1 for s in measured.servings if s["serving"] > 0), "servings": measured.servings,
              "turns": [str(d) for d in measured.dirs], "page": str(page),
              "pairs": str(plan.gate_dir / "pairs.jsonl")}
    plan.gate_dir.mkdir(parents=True, exist_ok=True)
    (plan.gate_dir / "ab.json").write_text(json.dumps(record, indent=2))  # before the page: the verdict first
    write_page(verdict, engines, figures, memory, (base.label, new.label), measured, plan.threshold, page)
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(render_text(verdict, engines, figures, memory, plan.threshold, measured) + f"\npage: {page}")
    return EXIT[verdict]


def passed(verdict: str, new: dict) -> str | None:
    """The revision that passed: NEW's commit on a PASS, and only where NEW's tree was that commit unchanged (a
    dirty tree's PASS is of code no commit holds)."""
    return new["sha"] if verdict == GateVerdict.PASS and not new["dirty"] else None
