"""`fragbench check`: the pre-deployment questions, asked of any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engines.shapes import DTYPE_BYTES
from harness.analysis.gate_verdict import GateVerdict, check_verdict
from harness.cli.args import (
    UsageError,
    add_api_flag,
    http_url,
    nonneg_float,
    positive_float,
    positive_int,
    shape_of,
    usage_errors,
    workload_checked,
)
from harness.cli.gpu_flags import add_gpu_flags, gpu_of
from harness.cli.user_paths import file_out


def register(sub) -> None:
    chk = sub.add_parser("check", help="pre-deployment sanity check of any OpenAI-compatible server")
    chk.add_argument("--target", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    chk.add_argument("--metrics-url", help="Prometheus metrics (default: TARGET/metrics)")
    chk.add_argument("--model", required=True, help="model preset or directory the server runs")
    add_gpu_flags(chk, required=False)
    chk.add_argument("--max-seq-len", type=positive_int,
                     help="the server's context in tokens (default: the model's max_position_embeddings)")
    chk.add_argument("--dtype", choices=list(DTYPE_BYTES), help="default: the model directory's, else float16")
    chk.add_argument("--workload", default="check-churn",
                     help="the churn the questions are asked under: a workload name or a spec's YAML path")
    chk.add_argument("--duration", type=positive_float, default=30.0, help="seconds of that churn's arrivals")
    chk.add_argument("--capacity-time", type=nonneg_float, default=60.0,
                     help="seconds of arrivals the ninth question's knee search may spend (0 skips it)")
    chk.add_argument("--json", action="store_true", help="print the answers as JSON instead of a table")
    chk.add_argument("--report", metavar="FILE", type=file_out, help="also write the answers as an HTML page to FILE")
    add_api_flag(chk)
    chk.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load numpy, pandas or plotly
    from harness.check import CheckConfig, Unreachable, run_check
    from harness.views.check_report import check_text, render_check

    target = http_url("--target", args.target.rstrip("/"))
    shape = shape_of(args.model)
    gpu = gpu_of(args)
    max_seq_len = args.max_seq_len or shape.max_seq_len
    workload_checked(args.workload)
    if not 0 <= args.capacity_time < float("inf"):
        raise UsageError(f"--capacity-time must be a number of seconds, 0 or more, not {args.capacity_time}")
    dtype = args.dtype or shape.dtype or "float16"
    cfg = CheckConfig(target, args.metrics_url or f"{target}/metrics", args.model, gpu, max_seq_len, args.workload,
                      args.duration, dtype if dtype in DTYPE_BYTES else "float16", api=args.api,
                      capacity_s=args.capacity_time)
    with usage_errors(Unreachable):
        result = run_check(cfg)
    if args.report:
        render_check(result, Path(args.report))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(check_text(result))  # its verdict first
    return 1 if check_verdict(q["status"] for q in result["questions"]) == GateVerdict.FAIL else 0

