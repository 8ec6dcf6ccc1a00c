"""The `fragbench` command. Bad input exits 2 with one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from engines.shapes import DTYPE_BYTES, ModelNotFound, load_shape, preset_names
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
    from harness.gpus import gpu_preset
    from harness.plan import make_plan, render_plan

    shape = shape_or_usage(args.model)
    try:
        gpu_mem = gpu_preset(args.gpu).memory_bytes if args.gpu else args.gpu_mem
    except ValueError as e:
        raise UsageError(str(e)) from None
    plan = make_plan(shape, gpu_mem, args.dtype, args.gpu_util, args.max_seq_len, args.block_size)
    print(json.dumps(plan.to_json(), indent=2) if args.json else render_plan(plan))
    return 0


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
    build.add_argument("--dtype", default="float32", choices=list(DTYPE_BYTES))
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
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)
    return p


VERBS: dict[str, Callable[[argparse.Namespace], int]] = {}


def main(argv: list[str] | None = None) -> int:
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
