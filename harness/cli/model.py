"""`fragbench model list|build`: the model presets with their KV cost, and a model directory of random weights."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from engines.shapes import BUILD_DTYPES, load_shape, preset_names
from harness.cli.args import Parser, UsageError, usage_errors
from harness.cli.seeds import seed_arg


def register(sub) -> None:
    model = sub.add_parser("model", help="model presets and the tiny model").add_subparsers(
        dest="model_verb", required=True, parser_class=Parser
    )
    model.add_parser("list", help="presets with their KV cost").set_defaults(func=run_list)
    build = model.add_parser("build", help="write a model directory with random weights")
    build.add_argument("--preset", required=True, help="a preset name (fragbench model list)")
    build.add_argument("--out", required=True,
                       help="the model directory written (config, weights, tokenizer): a new or empty folder, or one "
                            "an earlier build wrote (replaced whole, never mixed)")
    build.add_argument("--dtype", default="float32", choices=list(BUILD_DTYPES), help="the weights' dtype")
    build.add_argument("--seed", type=seed_arg, default=0,
                       help="the random weights' seed (the same seed, the same model)")
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
    out = Path(args.out).resolve()  # ".", "m/" and a link name the folder they mean: it is the one replaced
    replaced = buildable(out)
    building = out.with_name(f".{out.name}.building-{os.getpid()}")  # beside it: one rename puts it in place
    try:  # before the weights are made: an unwritable --out is said in one line, not after the build
        building.mkdir(parents=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot make the directory ({e.strerror or e})") from None
    try:
        with usage_errors(BuildRefused):
            build_model(args.preset, building, args.dtype, args.seed)
        put_in_place(building, out)
    finally:
        shutil.rmtree(building, ignore_errors=True)  # a failed or killed build leaves no half model behind
    said = " (replacing the model an earlier build wrote there)" if replaced else ""
    print(f"built {args.preset} ({args.dtype}, seed {args.seed}) in {out}{said}")
    return 0


def buildable(out: Path) -> bool:
    """Whether --out may take the build: new, an empty folder, or a model an earlier build wrote (its fragbench.json:
    `make model` rebuilds in place); True for the last, which the build replaces whole. Anything else is refused:
    the new files are never mixed into a folder's others."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise UsageError(f"--out {out} is a file: it takes a model directory")
    if not any(out.iterdir()):
        return False
    if (out / "fragbench.json").is_file():
        return True
    raise UsageError(f"--out {out} is not empty and holds no model fragbench built (no fragbench.json): give a new "
                     f"or empty folder (the build never mixes its files into others)")


def put_in_place(building: Path, out: Path) -> None:
    """The built folder at --out: renamed there whole, an earlier build moved aside first and removed after."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)  # an empty folder, or an earlier build (buildable said which)
    building.rename(out)
    shutil.rmtree(old, ignore_errors=True)
