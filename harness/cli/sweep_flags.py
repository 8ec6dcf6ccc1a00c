"""The capacity sweep's flags, defined once for the verbs that sweep (bench, simulate), and the check of the
values that cannot make a sweep, made before anything starts."""

from __future__ import annotations

import argparse

from harness.cli.args import fraction_arg, positive_float, positive_int, rate_list, usage_errors
from harness.cli.bounds import nonneg_int


def sweep_group(parser: argparse.ArgumentParser, per: str, points: int):
    """The capacity-sweep flags bench and simulate share; the group, for the verb's own."""
    group = parser.add_argument_group("capacity sweep (the vLLM paper's Figure 12)")
    group.add_argument("--sweep", action="store_true",
                       help=f"offer the workload at several request rates per {per} and find the highest each "
                            "sustains within the SLO, or a bound on it (bench: an engine its one screening point "
                            "rules out); the rates come from a calibration unless --rates gives them")
    group.add_argument("--rates", type=rate_list,
                       help="offered requests/s, comma-separated, the same for every engine (skips the calibration "
                            "and the knee search)")
    group.add_argument("--points", type=positive_int, default=points,
                       help="the knee search's most points (offered rates) per engine and budget")
    group.add_argument("--slo-ttft", type=positive_float, default=2.0, help="SLO: time to first token, seconds")
    group.add_argument("--slo-tpot", type=positive_float, default=0.25, help="SLO: time per output token, seconds")
    group.add_argument("--slo-attainment", type=fraction_arg, default=0.9,
                       help="share of requests (0-1) that must meet the SLO for a rate to count as sustained")
    return group


def saturation_flag(group):
    """bench's saturation throughput beside the headline (harness/analysis/saturation.py); the group, given back."""
    group.add_argument("--throughput-repeats", type=nonneg_int, default=None, metavar="N",
                       help="pairs of saturation-throughput sets (one fixed request set offered all at once to each "
                            "headline engine, ABBA) after the decision; default by rule from --time, 0 disables")
    return group


def check_sweep_args(args: argparse.Namespace, spec) -> None:
    """Flags that cannot make a sweep: one line each, before anything starts."""
    # imported when a verb checks its sweep: `fragbench --help` does not load numpy or pandas
    from harness.analysis.capacity import SweepRefused, check_sweep
    from workloads.generate import closed_concurrency

    with usage_errors(SweepRefused):
        check_sweep(args.slo_ttft, args.slo_tpot, args.slo_attainment, args.point_duration, args.calibrate_duration,
                    args.warmup, args.sweep or bool(args.rates), closed_concurrency(spec), args.workload,
                    getattr(args, "search_time", None), getattr(args, "knee_tolerance", None),
                    getattr(args, "time", None), getattr(args, "precision", None))
