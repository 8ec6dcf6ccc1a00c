"""The `fragbench` command. Bad input exits 2 with one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engines import ENGINES
from engines.shapes import BUILD_DTYPES, DTYPE_BYTES, ModelNotFound, load_shape, preset_names
from harness.units import parse_size


class UsageError(Exception):
    """Bad flags, files or values: one line, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage on top; one line is what we promise
        raise UsageError(message)


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {text!r}")
    return value


def gpu_or_usage(args: argparse.Namespace):
    """--gpu PRESET or --gpu-mem SIZE (with --hbm-bw and --peak-flops where the verb has them)."""
    from harness.gpus import resolve_gpu

    try:
        return resolve_gpu(args.gpu, args.gpu_mem, getattr(args, "hbm_bw", 0.0), getattr(args, "peak_flops", 0.0))
    except ValueError as e:
        raise UsageError(str(e)) from None


def shape_or_usage(model: str):
    try:
        return load_shape(model)
    except ModelNotFound as e:
        raise UsageError(str(e)) from None


# -- model
def cmd_model_list(args: argparse.Namespace) -> int:
    print(f"{'preset':<14}{'params':>10}{'layers':>8}{'kv_heads':>10}{'head_dim':>10}{'kv_bytes/token(fp16)':>22}")
    for name in preset_names():
        s = load_shape(name)
        print(
            f"{name:<14}{s.num_params / 1e9:>9.3f}B{s.num_layers:>8}{s.num_kv_heads:>10}{s.head_dim:>10}"
            f"{s.kv_bytes_per_token('float16'):>22,}"
        )
    return 0


def cmd_model_build(args: argparse.Namespace) -> int:
    from engines.modelbuild import BuildRefused, build_model

    if args.preset not in preset_names():
        raise UsageError(f"unknown model preset {args.preset!r}; presets: {', '.join(preset_names())}")
    try:
        out = build_model(args.preset, Path(args.out), args.dtype, args.seed)
    except BuildRefused as e:
        raise UsageError(str(e)) from None
    print(f"built {args.preset} ({args.dtype}, seed {args.seed}) in {out}")
    return 0


# -- plan
def cmd_plan(args: argparse.Namespace) -> int:
    from harness.plan import SHAREGPT_MIX, make_plan, render_plan, workload_mix

    shape = shape_or_usage(args.model)
    gpu_mem = gpu_or_usage(args).memory_bytes
    mix = SHAREGPT_MIX
    if args.workload:
        max_seq_len = args.max_seq_len or shape.max_seq_len
        mix = workload_mix(trace_or_usage(args.workload, 0, max_seq_len, shape.vocab_size).requests, args.workload,
                           max_seq_len)
    plan = make_plan(shape, gpu_mem, args.dtype, args.gpu_util, args.max_seq_len, args.block_size, mix)
    print(json.dumps(plan.to_json(), indent=2) if args.json else render_plan(plan))
    return 0


# -- generate
def prompt_ids_arg(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, not {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def add_engine_args(p: argparse.ArgumentParser, engines: tuple[str, ...]) -> None:
    p.add_argument("--engine", required=True, choices=engines)
    p.add_argument("--model", required=True, help="model directory (fragbench model build)")
    p.add_argument("--kv-budget", type=size_arg, default=parse_size("128MiB"))
    p.add_argument("--max-seq-len", type=positive_int)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--reserve", choices=["max", "pow2", "oracle"], default="max",
                   help="the static engine's reservation (static-max, static-pow2, static-oracle name it too)")
    p.add_argument("--no-preflight", action="store_true",
                   help="contiguous engines: admit or grow without checking free bytes, as a naive server does "
                        "(an OOM then rejects or crashes); by default a request waits until free bytes cover it")
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's own)")
    p.add_argument("--on-oom", choices=["reject", "crash"], help="default: crash for hf, reject otherwise")
    p.add_argument("--max-batch", type=positive_int, default=8, help="hf: requests per static batch")
    p.add_argument("--max-num-seqs", type=positive_int, default=64)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--memory", choices=["arena", "cuda"], default="arena")
    p.add_argument("--device", default="auto", help="auto (the GPU where CUDA is available), cpu or cuda[:N]")


def device_or_usage(requested: str) -> str:
    from engines.memory import resolve_device

    try:
        return resolve_device(requested)
    except ValueError as e:
        raise UsageError(str(e)) from None


def engine_from_args(args: argparse.Namespace):
    from engines.factory import EngineConfigError, EngineSpec, make_engine

    if not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model!r} is not a model directory (no config.json)")
    spec = EngineSpec(
        engine=args.engine,
        model_dir=args.model,
        kv_budget_bytes=args.kv_budget,
        max_seq_len=args.max_seq_len,
        block_size=args.block_size,
        reserve=args.reserve,
        preflight=not args.no_preflight,
        on_oom=args.on_oom,
        max_num_seqs=args.max_num_seqs,
        max_batch=args.max_batch,
        prefix_caching=not args.no_prefix_caching,
        memory=args.memory,
        device=device_or_usage(args.device),
    )
    quiet_transformers()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        return make_engine(spec)
    except (EngineConfigError, RuntimeError) as e:
        raise UsageError(str(e)) from None


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def cmd_generate(args: argparse.Namespace) -> int:
    if bool(args.prompt) == bool(args.prompt_ids):
        raise UsageError("give prompts either as --prompt TEXT or as --prompt-ids 1,2,3 (each may repeat)")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, not {args.temperature}")
    engine = engine_from_args(args)
    try:
        return generate_with(engine, args)
    finally:  # hf-cb runs a manager thread of its own: it must stop, error or not
        getattr(engine, "close", lambda: None)()


def generate_with(engine, args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from engines.offline import generate
    from engines.sequence import SamplingParams
    from engines.validation import InvalidRequest, check_engine, check_lengths, check_prompts

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = args.prompt_ids or [tok(t).input_ids for t in args.prompt]
    try:  # the server's own checks, so that generate and serve refuse the same things
        check_prompts(prompts, engine.vocab_size, engine.max_seq_len)
        check_lengths(prompts, args.max_tokens, engine.max_seq_len)
        check_engine(engine, args.temperature)
    except InvalidRequest as e:
        raise UsageError(f"{e} (--{'prompt-ids' if e.param == 'prompt' else e.param.replace('_', '-')})") from None
    params = SamplingParams(args.max_tokens, args.temperature, args.top_p, args.seed, args.ignore_eos)
    peak: dict = {}

    def track_peak() -> None:
        s = engine.stats()
        if s.allocated_bytes > peak.get("allocated_bytes", -1):
            peak.update(s.to_json())

    engine.poll = track_peak
    results = generate(engine, prompts, params, args.n, after_step=track_peak)
    outputs = [
        {"prompt_ids": o.prompt_ids, "token_ids": o.token_ids, "text": tok.decode(o.token_ids),
         "finish_reason": o.finish_reason, **({"sample": o.sample} if args.n > 1 else {})}
        for per_prompt in results for o in per_prompt
    ]
    if args.json:
        print(json.dumps({"engine": args.engine, "outputs": outputs, "peak_stats": peak,
                          "stats": engine.stats().to_json()}))
    else:
        for o in outputs:
            tag = f" [sample {o['sample']}]" if "sample" in o else ""
            print(f"{len(o['prompt_ids'])} prompt tokens{tag} -> {o['text']!r} ({o['finish_reason']})")
    return 0


# -- serve
def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    if args.engine == "vllm":
        from engines.vllm_peer import VLLMUnavailable, serve_vllm

        try:
            return serve_vllm(args.model, args.kv_budget, args.max_seq_len, args.block_size, args.host, args.port)
        except VLLMUnavailable as e:
            raise UsageError(str(e)) from None
    from transformers import AutoTokenizer

    from engines.server import CompletionServer, serve

    engine = engine_from_args(args)
    server = CompletionServer(engine, AutoTokenizer.from_pretrained(args.model), Path(args.model).name, args.api_key,
                              args.fail_at_step)

    def ready(port: int) -> None:
        print(f"fragbench serve: {args.engine} on http://{args.host}:{port}", flush=True)

    try:
        asyncio.run(serve(server, args.host, args.port, ready))
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    return 0


# -- workloads and load
def spec_or_usage(name: str):
    from workloads.spec import SpecError, load_spec

    try:
        return load_spec(name)
    except SpecError as e:
        raise UsageError(str(e)) from None


def trace_or_usage(name: str, seed: int, max_seq_len: int, vocab_size: int):
    from workloads.generate import trace
    from workloads.traces import TraceError

    spec = spec_or_usage(name)
    try:
        return trace(spec, seed, max_seq_len, vocab_size)
    except TraceError as e:
        raise UsageError(str(e)) from None


def cmd_workload(args: argparse.Namespace) -> int:
    from workloads.generate import describe
    from workloads.spec import preset_names

    if args.workload_verb == "list":
        for name in preset_names():
            spec = spec_or_usage(name)
            print(f"{name:<22}{spec.description.splitlines()[0] if spec.description else ''}")
        return 0
    t = trace_or_usage(args.name, args.seed, args.max_seq_len, args.vocab_size)
    if args.workload_verb == "show":
        print(describe(t))
        return 0
    out = Path(args.out)
    if out.parent and not out.parent.exists():
        raise UsageError(f"--out directory does not exist: {out.parent}")
    with open(out, "w") as f:
        for req in t.requests:
            f.write(req.to_json() + "\n")
    print(f"wrote {len(t.requests)} requests to {out}")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from urllib.parse import urlparse

    from harness.loadrun import LoadArgs, run_loadgen, worker_argv

    if args.worker:  # everything else comes from the master
        return run_loadgen(worker_argv(args.master_host, args.connect_timeout))
    if not args.target or not args.workload:
        raise UsageError("load needs --target and --workload (a --worker takes them from its master)")
    target = urlparse(args.target)
    if target.scheme not in ("http", "https") or not target.hostname:
        raise UsageError(f"--target must be an http URL, not {args.target!r}")
    trace_or_usage(args.workload, args.seed, args.max_seq_len, args.vocab_size)  # fail here, not in the child
    return run_loadgen(LoadArgs(args.target, args.workload, Path(args.out), args.duration, args.seed,
                                args.max_seq_len, args.vocab_size, engine=args.engine_label, api_key=args.api_key,
                                workers=args.expect_workers if args.master else args.workers,
                                master_bind=args.master_bind if args.master else None,
                                connect_timeout_s=args.connect_timeout))


# -- bench, report, compare
def engine_args(pairs: list[str], engines: list[str]) -> dict[str, list[str]]:
    import shlex

    out: dict[str, list[str]] = {}
    for pair in pairs:
        engine, sep, rest = pair.partition("=")
        if not sep or engine not in engines:
            raise UsageError(f"--engine-args takes ENGINE=ARGS for one of {', '.join(engines)}, not {pair!r}")
        out.setdefault(engine, []).extend(shlex.split(rest))
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    from harness.bench import Bench, BenchConfig
    from harness.report import render

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in (*ENGINES, "vllm")]
    if unknown or not engines:
        raise UsageError(f"--engines: unknown {', '.join(unknown) or '(none given)'}; engines: "
                         f"{', '.join((*ENGINES, 'vllm'))}")
    if "vllm" in engines:
        from engines.vllm_peer import vllm_python

        if vllm_python() is None:
            raise UsageError("--engines vllm: vLLM is not installed: run `make vllm`")
    if not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model!r} is not a model directory (run `make model`)")
    workload = trace_or_usage(args.workload, args.seed, args.max_seq_len, 4096)
    check_sweep(args, workload)
    cfg = BenchConfig(engines=engines, workload=args.workload, model=args.model, kv_budget=args.kv_budget,
                      duration_s=args.duration, out_dir=Path(args.out), seed=args.seed, max_seq_len=args.max_seq_len,
                      threads=args.threads, run_id=args.run_id or "", grace_s=args.grace,
                      kill_after_s=args.kill_after, engine_args=engine_args(args.engine_args, engines),
                      warmup_s=args.warmup, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                      slo_attainment=args.slo_attainment, sweep=args.sweep or bool(args.rates), rates=args.rates,
                      points=args.points, point_s=args.point_duration, calibrate_s=args.calibrate_duration,
                      device=device_or_usage(args.device), memory=args.memory)
    bench = Bench(cfg)
    print(f"fragbench bench: run {cfg.run_id} -> {bench.dir}", flush=True)
    run_dir = bench.run()
    report = render(run_dir, Path(args.reports) / f"{cfg.run_id}.html")
    print(f"results: {run_dir}\nreport:  {report}")
    return 0


def rate_list(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates takes comma-separated numbers, not {text!r}") from None
    if not rates or any(not 0 < r < float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"--rates needs one or more positive finite rates, not {text!r}")
    return sorted(set(rates))


def sweep_group(parser: argparse.ArgumentParser, per: str, points: int):
    """The capacity-sweep flags bench and simulate share; the group, for the verb's own."""
    group = parser.add_argument_group("capacity sweep (the vLLM paper's Figure 12)")
    group.add_argument("--sweep", action="store_true",
                       help=f"offer the workload at several request rates per {per} and find the highest each "
                            "sustains within the SLO; the rates come from a calibration unless --rates gives them")
    group.add_argument("--rates", type=rate_list, help="offered requests/s, comma-separated (skips calibration)")
    group.add_argument("--points", type=positive_int, default=points, help="rates to sweep after calibration")
    group.add_argument("--slo-ttft", type=float, default=2.0, help="SLO: time to first token, seconds")
    group.add_argument("--slo-tpot", type=float, default=0.25, help="SLO: time per output token, seconds")
    group.add_argument("--slo-attainment", type=float, default=0.9,
                       help="share of requests that must meet the SLO for a rate to count as sustained")
    return group


def check_sweep(args: argparse.Namespace, workload) -> None:
    """Flags that cannot make a sweep: one line each, before anything starts."""
    for flag in ("slo_ttft", "slo_tpot", "point_duration", "calibrate_duration"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < float("inf"):
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive number of seconds, not {value}")
    if not 0 < args.slo_attainment <= 1:
        raise UsageError(f"--slo-attainment must be in (0, 1], not {args.slo_attainment}")
    if (args.sweep or args.rates) and args.point_duration is not None:
        warmup = args.warmup if args.warmup is not None else 0.1 * args.point_duration
        if args.point_duration <= warmup:
            raise UsageError(f"--point-duration {args.point_duration} s is not longer than the warm-up of {warmup} s")
    if args.sweep or args.rates:
        if workload.closed_concurrency:
            raise UsageError(f"--sweep: workload {args.workload} is closed-loop; it has no arrival rate to sweep")


def cmd_report(args: argparse.Namespace) -> int:
    from harness.report import render
    from harness.summary import finalize

    run_dir = Path(args.run_dir)
    if not (run_dir / "run.json").is_file():
        raise UsageError(f"{args.run_dir} is not a run directory (no run.json)")
    finalize(run_dir)  # a partial run gets its parquet files and summary from what it wrote
    out = Path(args.out) if args.out else Path("reports") / f"{run_dir.name}.html"
    print(render(run_dir, out))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from harness.compare import compare, load_summary, render_html, render_text

    dirs = [Path(args.base), Path(args.new)]
    for d in dirs:
        if not (d / "run.json").is_file():
            raise UsageError(f"{d} is not a run directory (no run.json)")
    base, new = (load_summary(d) for d in dirs)
    rows = compare(base, new, args.threshold)
    if not rows:
        raise UsageError("the two runs share no engine")
    print(render_text(rows, args.threshold))
    out = render_html(rows, dirs[0].name, dirs[1].name, args.threshold,
                      Path(args.out or f"reports/compare-{dirs[0].name}-vs-{dirs[1].name}.html"))
    print(f"report: {out}")
    return 1 if any(r.regressed for r in rows) else 0


def cmd_history(args: argparse.Namespace) -> int:
    from harness.history import render_history

    if args.baseline < 1 or not 0 <= args.threshold < float("inf"):
        raise UsageError("--baseline must be at least 1 and --threshold a percentage >= 0")
    try:
        out, count = render_history(Path(args.results), Path(args.out), args.baseline, args.threshold)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(f"history of {count} runs: {out}")
    return 0


# -- simulate
def cmd_simulate(args: argparse.Namespace) -> int:
    from engines.kv import POLICIES
    from harness.plan import make_plan
    from harness.simulate import run_simulation

    shape = shape_or_usage(args.model)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise UsageError(f"--policy: unknown {', '.join(bad) or '(none)'}; policies: {', '.join(POLICIES)}")
    gpu = gpu_or_usage(args)
    spec = spec_or_usage(args.workload)
    max_seq_len = args.max_seq_len or spec.max_seq_len or shape.max_seq_len
    plan = make_plan(shape, gpu.memory_bytes, args.dtype, args.gpu_util, max_seq_len, args.block_size)
    if not plan.fits:
        raise UsageError(f"{shape.name} on {gpu.name}: {plan.reason} (see fragbench plan)")
    if spec.trace is not None:
        from workloads.traces import TraceError, resolve

        try:
            resolve(spec.trace.path)
        except TraceError as e:
            raise UsageError(str(e)) from None
    from harness.capacity import SLO
    from harness.simreport import render_simulation, render_text

    check_sweep(args, trace_or_usage(args.workload, args.seed, max_seq_len, shape.vocab_size))
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, not {args.jobs}")
    with simulation_progress() as progress:
        sim = run_simulation(shape, gpu, plan, spec, policies, args.block_size, args.placement,
                             args.requests or spec.num_requests, args.seed, args.max_num_seqs, args.dtype,
                             preflight=not args.no_preflight, n_jobs=args.jobs or os.cpu_count() or 1,
                             sweep_points=args.points if args.sweep or args.rates else 0,
                             slo=SLO(args.slo_ttft, args.slo_tpot, args.slo_attainment), rates=args.rates,
                             progress=progress)
    if args.report:
        render_simulation(sim, Path(args.report))
    print(json.dumps(sim.out, indent=2) if args.json else render_text(sim.out))
    return 0


class simulation_progress:
    """A rich bar on stderr while simulations run (a sweep is many of them)."""

    def __enter__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("simulate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True), transient=True)
        self.bar.start()
        self.task = None
        return self.update

    def update(self, done: int, total: int) -> None:
        if self.task is None or done == 0:
            self.task = self.bar.add_task("", total=total)
        self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        self.bar.stop()


# -- check
def cmd_check(args: argparse.Namespace) -> int:
    from urllib.parse import urlparse

    from harness.check import CheckConfig, Unreachable, render_check, run_check

    target = args.target.rstrip("/")
    if urlparse(target).scheme not in ("http", "https") or not urlparse(target).hostname:
        raise UsageError(f"--target must be an http URL, not {args.target!r}")
    shape = shape_or_usage(args.model)
    gpu = gpu_or_usage(args)
    max_seq_len = args.max_seq_len or shape.max_seq_len
    trace_or_usage(args.workload, 0, max_seq_len, shape.vocab_size)
    dtype = args.dtype or shape.config.get("dtype") or shape.config.get("torch_dtype") or "float16"
    cfg = CheckConfig(target, args.metrics_url or f"{target}/metrics", args.model, gpu, max_seq_len, args.workload,
                      args.duration, dtype if dtype in DTYPE_BYTES else "float16")
    try:
        result = run_check(cfg)
    except Unreachable as e:
        raise UsageError(str(e)) from None
    if args.report:
        render_check(result, Path(args.report))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(f"fragbench check {result['target']} (metrics: {result['metrics_found']})")
        for q in result["questions"]:
            print(f"{q['id']}. [{q['status']}] {q['question']}\n   answer: {q['answer']}\n   {q['evidence']}")
    return 1 if any(q["status"] == "FAIL" for q in result["questions"]) else 0


def build_parser() -> Parser:
    p = Parser(prog="fragbench", description="Where does the KV-cache memory go?")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=Parser)

    model = sub.add_parser("model", help="model presets and the tiny model").add_subparsers(
        dest="model_verb", required=True, parser_class=Parser
    )
    model.add_parser("list", help="presets with their KV cost").set_defaults(func=cmd_model_list)
    build = model.add_parser("build", help="write a model directory with random weights")
    build.add_argument("--preset", required=True)
    build.add_argument("--out", required=True)
    build.add_argument("--dtype", default="float32", choices=list(BUILD_DTYPES))
    build.add_argument("--seed", type=int, default=0)
    build.set_defaults(func=cmd_model_build)

    plan = sub.add_parser("plan", help="capacity plan for a model on a GPU")
    plan.add_argument("--model", required=True, help="preset name or model directory")
    gpu = plan.add_mutually_exclusive_group(required=True)
    gpu.add_argument("--gpu", help="GPU preset: a100-40gb, a100-80gb, h100-80gb, h200-141gb")
    gpu.add_argument("--gpu-mem", type=size_arg, help="GPU memory, e.g. 40GiB")
    plan.add_argument("--gpu-util", type=fraction_arg, default=0.9)
    plan.add_argument("--max-seq-len", type=positive_int)
    plan.add_argument("--block-size", type=positive_int, default=16)
    plan.add_argument("--dtype", default="float16", choices=list(DTYPE_BYTES))
    plan.add_argument("--workload", help="length mix for the paged estimate (default: ShareGPT-like means)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)

    gen = sub.add_parser("generate", help="offline generation through any engine")
    add_engine_args(gen, ENGINES)
    gen.add_argument("--prompt", action="append", default=[])
    gen.add_argument("--prompt-ids", type=prompt_ids_arg, action="append", default=[])
    gen.add_argument("--max-tokens", type=positive_int, required=True)
    gen.add_argument("--n", type=positive_int, default=1)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=fraction_arg, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="an OpenAI-compatible server for any engine")
    add_engine_args(srv, (*ENGINES, "vllm"))
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--fail-at-step", type=positive_int, metavar="N",
                     help="fault injection: an engine-wide error after N engine steps (the server fails its "
                          "open requests and exits with code 71)")
    srv.set_defaults(func=cmd_serve)

    wl = sub.add_parser("workload", help="workload presets, specs and traces").add_subparsers(
        dest="workload_verb", required=True, parser_class=Parser
    )
    wl.add_parser("list", help="the presets").set_defaults(func=cmd_workload)
    for verb in ("show", "trace"):
        w = wl.add_parser(verb, help="class mix, lengths and rate" if verb == "show" else "write the JSONL")
        w.add_argument("name", help="preset, spec file (.yaml) or trace file (.csv, .jsonl)")
        w.add_argument("--seed", type=int, default=0, required=verb == "trace")
        w.add_argument("--max-seq-len", type=positive_int, default=2048, help="the model's context")
        w.add_argument("--vocab-size", type=positive_int, default=4096)
        if verb == "trace":
            w.add_argument("--out", required=True)
        w.set_defaults(func=cmd_workload)

    load = sub.add_parser("load", help="replay a workload against a server (Locust, its own process)")
    load.add_argument("--target")
    load.add_argument("--workload")
    load.add_argument("--duration", type=float, default=60.0)
    load.add_argument("--workers", type=positive_int, default=1)
    load.add_argument("--out", default="results/load")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--max-seq-len", type=positive_int, default=2048)
    load.add_argument("--vocab-size", type=positive_int, default=4096)
    load.add_argument("--engine-label", default="target")
    load.add_argument("--api-key")
    spread = load.add_argument_group("over several machines (Locust's master/worker protocol)")
    spread.add_argument("--master", action="store_true", help="hand the trace to --expect-workers workers")
    spread.add_argument("--expect-workers", type=positive_int, default=1)
    spread.add_argument("--master-bind", default="0.0.0.0:5557",
                        help="HOST:PORT the master listens on (its workers may be on other machines)")
    spread.add_argument("--worker", action="store_true", help="take a share of a master's trace")
    spread.add_argument("--master-host", default="127.0.0.1:5557", help="HOST[:PORT] of the master")
    spread.add_argument("--connect-timeout", type=float, default=30.0,
                        help="seconds a worker waits for its master, and a master for its workers")
    load.set_defaults(func=cmd_load)

    bench = sub.add_parser("bench", help="every engine under the same churn, memory sampled, report")
    bench.add_argument("--engines", default="hf,static-max,static-oracle,paged,hf-cb")
    bench.add_argument("--workload", default="mixed-churn")
    bench.add_argument("--model", default="models/tiny-llama")
    bench.add_argument("--kv-budget", default="16MiB", type=str)
    bench.add_argument("--duration", type=float, default=45.0, help="seconds of churn per engine")
    bench.add_argument("--grace", type=float, default=20.0, help="seconds in-flight requests may finish")
    bench.add_argument("--warmup", type=float,
                       help="seconds of churn left out of the memory shares (default: a tenth of --duration)")
    bench.add_argument("--max-seq-len", type=positive_int, default=2048)
    bench.add_argument("--threads", type=positive_int, default=2, help="torch threads, the same for every engine")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default="results")
    bench.add_argument("--reports", default="reports")
    bench.add_argument("--run-id")
    bench.add_argument("--device", default="auto", help="auto (the GPU where CUDA is available), cpu or cuda[:N]")
    bench.add_argument("--memory", choices=["arena", "cuda"], default="arena",
                       help="arena: one pre-allocated buffer carved exactly (OOM causes identical on CPU and GPU); "
                            "cuda: every KV allocation a real tensor from PyTorch's caching allocator")
    bench.add_argument("--kill-after", type=float, help="fault injection: SIGKILL each engine S seconds into its churn")
    bench.add_argument("--engine-args", action="append", default=[], metavar="ENGINE=ARGS",
                       help="extra serve flags for one engine, e.g. 'static=--no-preflight --reserve pow2'")
    sweep = sweep_group(bench, "engine", points=4)
    sweep.add_argument("--point-duration", type=float, default=20.0, help="seconds of arrivals per rate")
    sweep.add_argument("--calibrate-duration", type=float, default=12.0, help="seconds per calibration window")
    bench.set_defaults(func=cmd_bench)

    report = sub.add_parser("report", help="the HTML report of a run (complete or partial)")
    report.add_argument("run_dir")
    report.add_argument("--out")
    report.set_defaults(func=cmd_report)

    cmp_ = sub.add_parser("compare", help="two runs side by side; exit 1 on a regression")
    cmp_.add_argument("base")
    cmp_.add_argument("new")
    cmp_.add_argument("--threshold", type=float, default=10.0, help="percent")
    cmp_.add_argument("--out")
    cmp_.set_defaults(func=cmd_compare)

    hist = sub.add_parser("history", help="every run of a results folder over time, regressions marked")
    hist.add_argument("results", help="a results folder (results/ by default for bench)")
    hist.add_argument("--out", default="reports/history.html")
    hist.add_argument("--baseline", type=int, default=7, help="previous runs whose median the last is held to")
    hist.add_argument("--threshold", type=float, default=10.0, help="percent")
    hist.set_defaults(func=cmd_history)

    sim = sub.add_parser("simulate", help="KV policies and scheduler at real-model scale, step-time model")
    sim.add_argument("--model", required=True, help="model preset or directory")
    sgpu = sim.add_mutually_exclusive_group(required=True)
    sgpu.add_argument("--gpu", help="GPU preset")
    sgpu.add_argument("--gpu-mem", type=size_arg)
    sim.add_argument("--hbm-bw", type=float, default=2.0e12, help="bytes/s, with --gpu-mem")
    sim.add_argument("--peak-flops", type=float, default=312e12, help="FLOP/s, with --gpu-mem")
    sim.add_argument("--workload", required=True, help="preset, spec file or trace file")
    sim.add_argument("--policy", required=True, help="static-max,static-pow2,static-oracle,growth,paged")
    sim.add_argument("--block-size", type=positive_int, default=16)
    sim.add_argument("--placement", choices=["best-fit", "buddy"],
                     help="arena placement for every policy (default: buddy for static-max/pow2, as the paper)")
    sim.add_argument("--requests", type=positive_int)
    sim.add_argument("--max-seq-len", type=positive_int)
    sim.add_argument("--max-num-seqs", type=positive_int, default=256)
    sim.add_argument("--gpu-util", type=fraction_arg, default=0.9)
    sim.add_argument("--dtype", default="float16", choices=list(DTYPE_BYTES))
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--no-preflight", action="store_true",
                     help="static policies admit without checking free bytes (a naive server) and reject on OOM")
    sim.add_argument("--json", action="store_true")
    sim.add_argument("--report", help="write an HTML page with the breakdown over time")
    sim.add_argument("--jobs", type=int, help="simulations run at once, one process each (default: every core)")
    sweep_group(sim, "policy", points=12)
    sim.set_defaults(point_duration=None, calibrate_duration=None, warmup=None)  # bench's alone
    sim.set_defaults(func=cmd_simulate)

    chk = sub.add_parser("check", help="pre-deployment sanity check of any OpenAI-compatible server")
    chk.add_argument("--target", required=True)
    chk.add_argument("--metrics-url", help="Prometheus metrics (default: TARGET/metrics)")
    chk.add_argument("--model", required=True, help="model preset or directory the server runs")
    cgpu = chk.add_mutually_exclusive_group()
    cgpu.add_argument("--gpu")
    cgpu.add_argument("--gpu-mem", type=size_arg)
    chk.add_argument("--max-seq-len", type=positive_int)
    chk.add_argument("--dtype", choices=list(DTYPE_BYTES), help="default: the model directory's, else float16")
    chk.add_argument("--workload", default="check-churn")
    chk.add_argument("--duration", type=float, default=30.0)
    chk.add_argument("--json", action="store_true")
    chk.add_argument("--report")
    chk.set_defaults(func=cmd_check)
    return p


def main(argv: list[str] | None = None) -> int:
    from engines.procs import exit_on_sigterm

    exit_on_sigterm()  # every verb unwinds on SIGTERM, stopping the processes it started
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        print(f"fragbench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
