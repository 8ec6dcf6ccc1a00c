"""`fragbench rules`: Prometheus recording and alerting rules for the seeds' alerts, for a metric family."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.args import fraction_arg, positive_float, positive_int, size_arg, usage_errors
from harness.cli.user_paths import file_out

FAMILIES = ("fragbench", "vllm", "sglang")


def register(sub) -> None:
    p = sub.add_parser("rules", help="Prometheus recording and alerting rules for the seeds' alerts")
    p.add_argument("--family", required=True, choices=FAMILIES,
                   help="whose metric names the rules read: fragbench serve, vLLM or SGLang")
    envelope = p.add_mutually_exclusive_group()
    envelope.add_argument("--from-check", metavar="REPORT.json", type=Path,
                          help="take the envelope from a `fragbench check --json` report: the live tokens its "
                               "server held before its first OOM or preemption")
    envelope.add_argument("--envelope-tokens", type=positive_int,
                          help="the capacity envelope in live tokens (default: the KV capacity in tokens, as "
                               "fragbench:kv_capacity_tokens says)")
    p.add_argument("--envelope-share", type=fraction_arg, default=0.75,
                   help="live tokens under this share of the envelope are 'below the envelope'")
    p.add_argument("--free-below", type=fraction_arg, default=0.25,
                   help="usable free KV (the largest free extent) under this share of capacity is 'running out'")
    p.add_argument("--untokened-above", type=fraction_arg, default=0.3,
                   help="KV held by no token (reservations, rounding, holes outside the largest free extent) over "
                        "this share of capacity is 'fragmented'; a block pool's stays at a few percent")
    p.add_argument("--kv-full", type=fraction_arg, default=0.95, help="KV usage at or above this share is 'full'")
    p.add_argument("--fragmentation-ooms", type=positive_int, default=1,
                   help="fragmentation failures in the window that make an alert")
    p.add_argument("--churn-rps", type=positive_float, default=0.5,
                   help="finished requests per second (aborts included) that make the traffic 'churn'")
    p.add_argument("--preemptions-per-s", type=positive_float, default=0.5,
                   help="preemptions per second that make a storm")
    p.add_argument("--reserved-growth", type=size_arg, default="64MiB",
                   help="growth of reserved memory over the window that counts as retention")
    p.add_argument("--window", default="5m", help="what rates and averages look back over (a Prometheus duration)")
    p.add_argument("--for", dest="hold", default="2m", help="how long a condition holds before its alert fires")
    p.add_argument("--out", metavar="FILE", type=file_out, help="write the rules to FILE (default: print them)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load yaml
    from harness.monitoring.families import rules_for
    from harness.monitoring.rules import RulesRefused, Thresholds, envelope_from_check

    with usage_errors(RulesRefused):
        envelope, source = args.envelope_tokens, "--envelope-tokens"
        if args.from_check is not None:
            envelope, source = envelope_from_check(args.from_check)
        thresholds = Thresholds(
            envelope_tokens=envelope, envelope_source=source if envelope is not None else Thresholds.envelope_source,
            envelope_share=args.envelope_share, free_below=args.free_below,
            untokened_above=args.untokened_above, kv_full=args.kv_full,
            fragmentation_ooms=args.fragmentation_ooms, churn_rps=args.churn_rps,
            preemptions_per_s=args.preemptions_per_s, reserved_growth_bytes=args.reserved_growth,
            window=args.window, hold=args.hold)
    text = rules_for(args.family, thresholds).to_yaml()
    if args.out is None:
        print(text, end="")
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"rules: {args.out}")
    return 0
