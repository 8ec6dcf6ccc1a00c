"""`fragbench bench`: every engine on the same model, KV budget and request stream; the report at the end."""

from __future__ import annotations

import argparse

from engines import SERVED, UnknownName, pick
from engines.registry import described, entry, listing, memory_refusal
from engines.shapes import load_shape
from harness.cli.args import (
    MeasuredNothing,
    UsageError,
    above_one,
    add_api_flag,
    device_of,
    model_dir,
    nonneg_float,
    positive_float,
    positive_int,
    usage_errors,
    workload_checked,
)
from harness.cli.engine_flags import alloc_conf_arg, engine_args, refuse_cuda_memory_settings, served_model
from harness.cli.kv_budget import add_kv_budget, add_kv_budgets
from harness.cli.partial_run import stopping_says_where
from harness.cli.run_folder import add_place_flags, claimed, report_page, run_place
from harness.cli.seeds import seed_arg
from harness.cli.sweep_flags import check_sweep_args, saturation_flag, sweep_group
from harness.cli.user_paths import user_path, user_workload
from harness.units import KvBudget


def register(sub) -> None:
    bench = sub.add_parser("bench", epilog=described(),
                           help="every engine under the same churn, memory sampled, report (exit 1: nothing measured)")
    bench.add_argument("--engines", default="hf,static-max,static-oracle,paged,hf-cb",
                       help=f"engines to run, comma-separated, one after another on the same traffic ({listing()}); "
                            "\"\" runs --target alone")
    bench.add_argument("--workload", default="mixed-churn", help="a workload name (`workload list`) or a spec file")
    bench.add_argument("--model", type=served_model, default="models/tiny-llama",
                       help="model directory, or a preset built as `fragbench model build` says (`model list`)")
    add_kv_budget(bench, "16MiB", "bytes of KV cache every engine gets")
    add_kv_budgets(bench, "run every engine's knee search at each of these KV budgets (the first is the run's own); "
                          "the report draws sustained rate against budget")
    bench.add_argument("--duration", type=positive_float, default=45.0, help="seconds of churn per engine")
    bench.add_argument("--grace", type=nonneg_float, default=20.0, help="seconds in-flight requests may finish")
    bench.add_argument("--warmup", type=nonneg_float,
                       help="seconds of churn left out of the memory shares (default: a tenth of --duration)")
    bench.add_argument("--max-seq-len", type=positive_int, default=2048, help="tokens a sequence may hold")
    bench.add_argument("--threads", type=positive_int, default=2, help="torch threads, the same for every engine")
    bench.add_argument("--seed", type=seed_arg, default=0, help="the workload's seed (the same for every engine)")
    add_place_flags(bench)
    bench.add_argument("--device", default="auto", help="auto (the GPU where CUDA is available), cpu or cuda[:N]")
    bench.add_argument("--memory", choices=["arena", "cuda", "caching"], default="arena",
                       help="arena: one pre-allocated buffer carved exactly (OOM causes identical on CPU and GPU); "
                            "cuda: every KV allocation a real tensor from PyTorch's caching allocator; caching: that "
                            "allocator emulated rule for rule under a cap of the KV budget (any machine)")
    bench.add_argument("--alloc-conf", type=alloc_conf_arg, metavar="CONF",
                       help="PYTORCH_CUDA_ALLOC_CONF's syntax: the emulator's settings under --memory caching, the "
                            "servers' real allocator's under --memory cuda (default: PyTorch's)")
    bench.add_argument("--compare-alloc-conf", action="append", default=[], type=alloc_conf_arg, metavar="CONF",
                       help="with --memory caching: the contiguous engines and hf again under this setting ('default': "
                            "PyTorch's), a run of its own in the run's folder, side by side in the report "
                            "(repeatable; default: none)")
    bench.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                       help="a running OpenAI-compatible server (vLLM, SGLang, TGI, fragbench) benched as one more "
                            "engine; fragbench never starts, stops or restarts it (repeatable)")
    bench.add_argument("--metrics-url", action="append", default=[], metavar="NAME=URL",
                       help="a target's Prometheus metrics where they are not at URL/metrics (repeatable)")
    bench.add_argument("--api-key", help="the targets' API key (sent as a bearer token)")
    add_api_flag(bench)
    bench.add_argument("--kill-after", type=positive_float,
                       help="fault injection: SIGKILL each engine this many seconds into its churn")
    bench.add_argument("--engine-args", action="append", default=[], metavar="ENGINE=ARGS",
                       help="extra serve flags for one engine, e.g. 'static=--no-preflight --reserve pow2' "
                            "(repeatable)")
    sweep = saturation_flag(sweep_group(bench, "engine", points=8))
    sweep.add_argument("--time", type=positive_float, default=900.0, metavar="SECONDS",
                       help="the whole bench's time budget in seconds (default 900): every engine's set-up and knee "
                            "search, then the decision phase; the design's rules share it out (report: Capacity)")
    sweep.add_argument("--precision", type=above_one, default=1.5,
                       help="the headline ratio's 90 %% interval asked, as hi / lo (default 1.5): the decision phase "
                            "measures until the interval is this narrow (each engine on enough points), or the time "
                            "is spent; whether it excludes 1.0 does not stop it")
    sweep.add_argument("--point-duration", type=positive_float, default=None,
                       help="seconds of judged arrivals per point, at least (default: none in a search; 20 s a rate "
                            "with --rates)")
    sweep.add_argument("--point-requests", type=positive_int, default=None,
                       help="judged requests per point, at least (default: the fewest that tell a point from the "
                            "target, x the workload's burstiness: 25 at 90 %% for Poisson arrivals; 1 with --rates)")
    sweep.add_argument("--search-time", type=positive_float, default=None,
                       help="seconds one engine's knee search may spend per budget, at most (default: its share of "
                            "--time)")
    sweep.add_argument("--knee-tolerance", type=positive_float, default=None,
                       help="bisect each bracket until the lowest failing rate is within 1 + this of the passing one "
                            "(default: none: each search brackets its knee and stops; the knee is fitted from every "
                            "point)")
    sweep.add_argument("--calibrate-duration", type=positive_float, default=12.0,
                       help="seconds per calibration window (default 12)")
    bench.set_defaults(func=run)


def kv_budgets(args: argparse.Namespace, engines: list[str]) -> list[KvBudget]:
    """--kv-budget or --kv-budgets' sizes, each one max-length sequence by every engine's own rule."""
    given = args.kv_budgets is not None
    budgets, flag = (args.kv_budgets, "--kv-budgets") if given else ([args.kv_budget], "--kv-budget")
    if not budgets:
        raise UsageError(f"{flag} is empty: give sizes such as 16MiB,32MiB")
    shape = load_shape(args.model)
    kvb = shape.kv_bytes_per_token(shape.dtype or "float16")
    for budget in budgets:
        for engine in engines:  # each engine's own rule (engines/registry.py), as its server will check it
            if refused := entry(engine).budget.refusal(budget.bytes, args.max_seq_len, kvb):
                raise UsageError(f"{flag}: {budget} is {refused}")
    return budgets


def settings_refusal(memory: str, engines: list[str]) -> None:
    # imported when the verb runs: `fragbench --help` does not load numpy or pandas
    from harness.analysis.alloc_settings_summary import compared_engines

    if memory != "caching":
        raise UsageError(f"--compare-alloc-conf compares the caching allocator's settings: it needs --memory caching, "
                         f"not {memory}")
    if not compared_engines(engines):
        raise UsageError("--compare-alloc-conf: no engine of --engines has its KV placed by the allocator piece by "
                         "piece (hf and the contiguous ones do)")


def config(args: argparse.Namespace):
    # imported when the verb runs: `fragbench --help` does not load numpy or pandas
    from harness.run.targets import TargetRefused, open_targets

    args.model, args.workload = str(user_path(args.model)), user_workload(args.workload)  # servers run elsewhere
    with usage_errors(UnknownName):
        engines = [] if args.target and not args.engines.strip() else pick(args.engines, SERVED, "--engines",
                                                                           "engines")
    run_place(engines, user_path(args.out), args.run_id)
    extra_args = engine_args(args.engine_args, engines)  # the flag's own syntax first: it needs nothing loaded
    with usage_errors(TargetRefused):  # before any load is sent
        targets = open_targets(args.target, args.metrics_url, engines, args.api_key)
    for name in engines:
        if not entry(name).installed():
            raise UsageError(f"--engines {name}: {name} is not installed: run `{entry(name).install}`")
    if refused := memory_refusal(engines, args.memory):
        raise UsageError(refused)
    if args.compare_alloc_conf:
        settings_refusal(args.memory, engines)
    if engines:  # targets bring their own model and memory; what each server's CudaMemory would refuse at its start
        model_dir(args.model, "run `make model`")
        refuse_cuda_memory_settings(args.memory, args.alloc_conf)
    check_sweep_args(args, workload_checked(args.workload))
    budgets = kv_budgets(args, engines) if engines else [args.kv_budget]
    device = device_of(args.device)  # last: "auto" asks torch whether CUDA is there, seconds of import
    if args.memory == "cuda" and not device.startswith("cuda"):
        raise UsageError(f"--memory cuda takes KV from the GPU's allocator: it needs --device cuda[:N] (or auto "
                         f"on a GPU), not {device}")
    from harness.run.bench import BenchConfig  # after the checks: a refusal need not load torch and the harness
    return BenchConfig(engines=engines, workload=args.workload, model=args.model, kv_budget=budgets[0],
                       duration_s=args.duration, out_dir=user_path(args.out), seed=args.seed, search_s=args.search_time,
                       max_seq_len=args.max_seq_len, threads=args.threads, run_id=args.run_id or "", grace_s=args.grace,
                       kill_after_s=args.kill_after, engine_args=extra_args, precision=args.precision,
                       warmup_s=args.warmup, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                       slo_attainment=args.slo_attainment, sweep=args.sweep or bool(args.rates), rates=args.rates,
                       points=args.points, point_s=args.point_duration, calibrate_s=args.calibrate_duration,
                       point_requests=args.point_requests, throughput_repeats=args.throughput_repeats,
                       knee_tolerance=args.knee_tolerance, kv_budgets=budgets, device=device, time_s=args.time,
                       memory=args.memory, alloc_conf=args.alloc_conf, compare_alloc_confs=args.compare_alloc_conf,
                       api=args.api, api_key=args.api_key, targets={name: t.describe() for name, t in targets.items()})


def run(args: argparse.Namespace) -> int:
    cfg = config(args)
    # after every refusal: a bad command line exits at once, before the harness (torch, plotly) loads
    from harness.analysis.summary import read_summary_record
    from harness.run.bench import Bench
    from harness.run.duration_estimate import duration_estimate
    from harness.views.engine_table import engine_table
    from harness.views.opening import console_opening
    from harness.views.report import render

    bench = claimed(lambda: Bench(cfg))  # its own folder, or one line before any measuring
    print(f"fragbench bench: run {cfg.run_id} -> {bench.dir}\n{duration_estimate(cfg)}", flush=True)
    run_dir = stopping_says_where(bench)
    if bench.failure is not None:  # nonzero, and why in one line (the run's folder keeps the logs)
        raise MeasuredNothing(f"the run measured nothing: {bench.failure} (run: {run_dir})")
    summary = read_summary_record(run_dir)  # the one record the report reads: the same verdict, warnings, figures
    print(console_opening(run_dir, summary) + "\n" + engine_table(summary), flush=True)
    page, apart = report_page(user_path(args.reports), run_dir)  # never over another run's page of its run id
    report = render(run_dir, page)
    print(f"{apart}\n" if apart else "", end="")
    print(f"results: {run_dir} (summary.json, engines.csv, requests.parquet)\nreport:  {report}")
    return 0
