"""`fragbench model list|build`: the model presets with their KV cost, and a model directory of random weights."""

from __future__ import annotations

import argparse
from pathlib import Path

from engines.shapes import BUILD_DTYPES, load_shape, preset_names
from harness.cli.args import Parser, UsageError, usage_errors


def register(sub) -> None:
    model = sub.add_parser("model", help="model presets and the tiny model").add_subparsers(
        dest="model_verb", required=True, parser_class=Parser
    )
    model.add_parser("list", help="presets with their KV cost").set_defaults(func=run_list)
    build = model.add_parser("build", help="write a model directory with random weights")
    build.add_argument("--preset", required=True, help="a preset name (fragbench model list)")
    build.add_argument("--out", required=True, help="the model directory written (config, weights, tokenizer)")
    build.add_argument("--dtype", default="float32", choices=list(BUILD_DTYPES), help="the weights' dtype")
    build.add_argument("--seed", type=int, default=0, help="the random weights' seed (the same seed, the same model)")
    build.set_defaults(func=run_build)


def run_list(args: argparse.Namespace) -> int:
    print(f"{'preset':<14}{'params':>10}{'layers':>8}{'kv_heads':>10}{'head_dim':>10}{'kv_bytes/token(fp16)':>22}")
    for name in preset_names():
        s = load_shape(name)
        print(f"{name:<14}{s.num_params / 1e9:>9.3f}B{s.num_layers:>8}{s.num_kv_heads:>10}{s.head_dim:>10}"
              f"{s.kv_bytes_per_token('float16'):>22,}")
    return 0


def run_build(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load psutil
    from engines.modelbuild import BuildRefused, build_model

    if args.preset not in preset_names():
        raise UsageError(f"unknown model preset {args.preset!r}; presets: {', '.join(preset_names())}")
    try:  # before the weights are made: an unwritable --out is said in one line, not after the build
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot make the directory ({e.strerror or e})") from None
    with usage_errors(BuildRefused):
        out = build_model(args.preset, Path(args.out), args.dtype, args.seed)
    print(f"built {args.preset} ({args.dtype}, seed {args.seed}) in {out}")
    return 0
