"""`fragbench simulate`: the engines' own KV policies and scheduler at real-model scale, on a step-time model."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from engines import UnknownName, pick
from engines.registry import described, entry, listing, policies
from engines.shapes import DTYPE_BYTES
from harness.cli.args import (
    UsageError,
    fraction_arg,
    positive_int,
    shape_of,
    usage_errors,
    workload_checked,
)
from harness.cli.bounds import block_fits
from harness.cli.engine_flags import alloc_conf_arg
from harness.cli.gpu_flags import add_gpu_flags, gpu_of
from harness.cli.seeds import seed_arg
from harness.cli.sweep_flags import check_sweep_args, sweep_group
from harness.cli.user_paths import file_out, folder_out


def register(sub) -> None:
    sim = sub.add_parser("simulate", help="KV policies and scheduler at real-model scale, step-time model",
                         epilog=described(policies()))
    # required unless --grid gives them (checked in run: argparse cannot make a flag required but for another)
    sim.add_argument("--model", help="model preset or directory (required without --grid)")
    add_gpu_flags(sim, required=False, speed=True)
    sim.add_argument("--workload", help="preset, spec file or trace file (required without --grid)")
    sim.add_argument("--policy", help=f"KV policies, comma-separated ({listing(policies())}; required without --grid)")
    sim.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block of the paged policy")
    sim.add_argument("--placement", choices=["best-fit", "buddy"],
                     help="arena placement for every policy (default: each policy's as the paper places it: "
                          + ", ".join(f"{p} {entry(p).placement}" for p in policies()) + ")")
    sim.add_argument("--memory", choices=["arena", "caching"], default="arena",
                     help="where the KV lives: arena (placed as --placement says), or caching: PyTorch's CUDA caching "
                          "allocator emulated under a cap of the KV budget, each policy's `allocator` its figures")
    sim.add_argument("--alloc-conf", type=alloc_conf_arg, metavar="CONF", action="append",
                     help="PYTORCH_CUDA_ALLOC_CONF's syntax, for --memory caching (default: PyTorch's; `default` "
                          "names it). Given several times, the whole simulation runs once per setting, one after "
                          "another, and each policy's sustained rate, reserved-unallocated share and OOMs by layer "
                          "are put side by side")
    sim.add_argument("--requests", type=positive_int,
                     help="requests simulated (default: the workload's own count, or its spec's)")
    sim.add_argument("--max-seq-len", type=positive_int,
                     help="tokens per sequence (default: the model's max_position_embeddings)")
    sim.add_argument("--max-num-seqs", type=positive_int, default=256, help="sequences the scheduler runs at once")
    sim.add_argument("--gpu-util", type=fraction_arg, default=0.9,
                     help="share (0-1] of GPU memory the server may take; the KV gets what weights leave of it")
    sim.add_argument("--dtype", default="float16", choices=list(DTYPE_BYTES), help="the weights' and KV's dtype")
    sim.add_argument("--seed", type=seed_arg, default=0, help="the workload's seed")
    sim.add_argument("--no-preflight", action="store_true",
                     help="static policies admit without checking free bytes (a naive server) and reject on OOM")
    sim.add_argument("--step-model", metavar="RUN_DIR|FILE",
                     help="step times from a model fitted on a bench run's engine steps (RUN_DIR, steps.parquet or "
                          "a --step-log CSV) or saved as JSON, instead of the GPU's roofline")
    sim.add_argument("--step-engine", help="with a RUN_DIR: fit on this engine's steps alone (default: all of them)")
    sim.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    sim.add_argument("--report", metavar="FILE", type=file_out,
                     help="write an HTML page with the breakdown over time to FILE; with several --alloc-conf, a page "
                          "per setting, its name before FILE's suffix (default: none)")
    sim.add_argument("--jobs", type=positive_int,
                     help="simulations run at once, one process each (default: every core)")
    grid = sim.add_argument_group("configuration grid (docs/simulate.md)")
    grid.add_argument("--grid", metavar="GRID.yaml",
                      help="simulate the product of the file's models, GPUs, budgets, policies, block sizes, "
                           "allocator settings and workloads, a knee search at the SLO each; writes grid.parquet and "
                           "grid.html to --out, resuming from the rows already there (default: none)")
    grid.add_argument("--out", metavar="DIR", type=folder_out,
                      help="with --grid: the directory written (default: results/grid/ and the grid file's name)")
    grid.add_argument("--ray", action="store_true",
                      help="with --grid: run its simulations as Ray tasks on a local Ray started for the run (the "
                           "`ray` extra), --jobs CPUs")
    grid.add_argument("--ray-address", metavar="HOST:PORT",
                      help="with --grid: run on the Ray cluster there (`ray start --head` prints it; implies --ray)")
    sweep_group(sim, "policy", points=12)
    sim.set_defaults(point_duration=None, calibrate_duration=None, warmup=None)  # bench's alone
    sim.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.grid:
        # loaded for --grid alone: `fragbench --help` and a single simulation do not load it
        from harness.cli.simulate_grid import run_grid_verb

        return run_grid_verb(args)
    if args.ray or args.ray_address or args.out:
        raise UsageError("--ray, --ray-address and --out go with --grid GRID.yaml")
    missing = [flag for flag, value in (("--model", args.model), ("--gpu or --gpu-mem", args.gpu or args.gpu_mem),
                                        ("--workload", args.workload), ("--policy", args.policy)) if not value]
    if missing:
        raise UsageError(f"simulate needs {', '.join(missing)} (or --grid GRID.yaml)")
    check_memory_flags(args)  # before the heavy imports and the workload's draw: a wrong flag costs no wait
    # after the flags' checks: a wrong flag exits before pandas and plotly load, and `fragbench --help` loads neither
    from harness.analysis.capacity import SLO
    from harness.plan import PlanRefused, fitting_plan
    from harness.sim.progress import SimulationProgress
    from harness.sim.simulator import run_simulation
    from harness.sim.stepfit import StepModelError, load
    from harness.views.sim_report import render_simulation, render_text

    shape = shape_of(args.model)
    with usage_errors(UnknownName):
        chosen = pick(args.policy, policies(), "--policy", "policies")
    gpu = gpu_of(args)
    spec = workload_checked(args.workload)  # its trace file read and checked, its requests not drawn
    max_seq_len = args.max_seq_len or spec.max_seq_len or shape.max_seq_len
    block_fits(args.block_size, max_seq_len)
    with usage_errors(PlanRefused):
        plan = fitting_plan(shape, gpu.name, gpu.memory_bytes, args.dtype, args.gpu_util, max_seq_len, args.block_size)
    check_sweep_args(args, spec)
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, not {args.jobs}")
    if args.step_engine and not args.step_model:
        raise UsageError("--step-engine needs --step-model RUN_DIR")
    step_model = None
    if args.step_model:
        with usage_errors(StepModelError):
            step_model = load(args.step_model, args.step_engine)
    confs = args.alloc_conf or [None]  # None: PyTorch's defaults, today's single run
    with SimulationProgress() as progress:  # one setting after another: same seed, workload and policies
        sims = [run_simulation(shape, gpu, plan, spec, chosen, args.block_size, args.placement,
                               args.requests or spec.num_requests, args.seed, args.max_num_seqs, args.dtype,
                               preflight=not args.no_preflight, n_jobs=args.jobs or os.cpu_count() or 1,
                               sweep_points=args.points if args.sweep or args.rates else 0,
                               slo=SLO(args.slo_ttft, args.slo_tpot, args.slo_attainment), rates=args.rates,
                               progress=progress, step_model=step_model, memory=args.memory, alloc_conf=conf)
                for conf in confs]
    if len(sims) > 1:
        return print_settings(sims, args)
    if args.report:
        render_simulation(sims[0], Path(args.report))
    print(json.dumps(sims[0].out, indent=2) if args.json else render_text(sims[0].record))
    return 0


def check_memory_flags(args: argparse.Namespace) -> None:
    """--alloc-conf and --placement each belong to one --memory; several settings must differ."""
    # imported when the verb runs: `fragbench --help` does not load pandas
    from harness.sim.alloc_settings_sim import SettingsRefused, check_settings

    if args.memory != "caching" and args.alloc_conf:
        raise UsageError("--alloc-conf configures the caching allocator: it needs --memory caching")
    if args.memory == "caching" and args.placement:
        raise UsageError("--placement places the arena's extents: under --memory caching the allocator places them")
    with usage_errors(SettingsRefused):
        check_settings(args.alloc_conf or [])


def print_settings(sims: list, args: argparse.Namespace) -> int:
    """Several --alloc-conf: each setting's output and the side-by-side table (or their JSON), a page each."""
    # imported for several --alloc-conf alone: `fragbench --help` does not load pandas or plotly
    import sys

    from harness.sim.alloc_settings_sim import combined, side_by_side
    from harness.views.alloc_settings_sim_page import setting_pages, settings_text

    pages = setting_pages(sims, Path(args.report)) if args.report else []
    if args.json:
        print(json.dumps(combined(sims), indent=2))
        if pages:  # stdout is the JSON alone
            print("report: one page per setting: " + ", ".join(map(str, pages)), file=sys.stderr)
    else:
        outs = [sim.record for sim in sims]
        print(settings_text(outs, side_by_side(outs), pages))
    return 0
