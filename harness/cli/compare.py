"""`fragbench compare`: two runs side by side; exit 1 on a regression (the nightly gate)."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.args import UsageError, nonneg_float, run_dir
from harness.cli.user_paths import file_out, writable_file


def register(sub) -> None:
    cmp_ = sub.add_parser("compare", help="two runs side by side; exit 1 when a gated figure (the headline ratio "
                                          "and the headline engine's other same-run ratios always; a sustained rate, "
                                          "latency, throughput or memory at an engine's operating point where the "
                                          "runs' speed probes say the machine agreed) regressed: its intervals "
                                          "separate and it is worse by more than the threshold")
    cmp_.add_argument("base", help="the earlier run's directory")
    cmp_.add_argument("new", help="the later run's directory")
    cmp_.add_argument("--threshold", type=nonneg_float, default=10.0,
                      help="percent a gated figure whose intervals separate may worsen before it counts as a "
                           "regression (default: %(default)s)")
    cmp_.add_argument("--out", metavar="FILE", type=file_out,
                      help="write the comparison as an HTML page to FILE (default: reports/compare-BASE-vs-NEW.html)")
    cmp_.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load numpy or pandas
    from harness.analysis.gate_verdict import EXIT
    from harness.analysis.speed_probe import agreement
    from harness.views.compare import (
        compare,
        compare_verdict,
        load_probe,
        load_summary,
        render_html,
        render_text,
        run_differences,
    )

    dirs = [run_dir(args.base), run_dir(args.new)]
    out = writable_file(Path(args.out or f"reports/compare-{dirs[0].name}-vs-{dirs[1].name}.html"), "--out")
    base, new = (load_summary(d) for d in dirs)
    machine = agreement(*(load_probe(d) for d in dirs))
    rows = compare(base, new, args.threshold, machine)
    if not rows:
        raise UsageError("the two runs share no engine")
    differ = run_differences(*dirs)  # said first, a line each: two runs of different settings still compare
    print(render_text(rows, args.threshold, machine, differ))
    out = render_html(rows, dirs[0].name, dirs[1].name, args.threshold, out, machine, differ)
    print(f"report: {out}")
    return EXIT[compare_verdict(rows)]  # 1 where a gated figure regressed, else 0
