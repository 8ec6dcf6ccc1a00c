"""`fragbench workload list|show|trace`: the presets, a spec's class mix and lengths, its JSONL trace."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.args import Parser, positive_int, spec_of, trace_of
from harness.cli.bounds import vocab_size_arg
from harness.cli.seeds import seed_arg
from harness.cli.user_paths import file_out


def register(sub) -> None:
    wl = sub.add_parser("workload", help="workload presets, specs and traces").add_subparsers(
        dest="workload_verb", required=True, parser_class=Parser
    )
    wl.add_parser("list", help="the presets").set_defaults(func=run_list)
    for verb in ("show", "trace"):
        w = wl.add_parser(verb, help="class mix, lengths and rate" if verb == "show" else "write the JSONL")
        w.add_argument("name", help="preset, spec file (.yaml) or trace file (.csv, .jsonl)")
        w.add_argument("--seed", type=seed_arg, default=0, required=verb == "trace", help="the workload's seed")
        w.add_argument("--max-seq-len", type=positive_int, default=2048, help="the model's context")
        w.add_argument("--vocab-size", type=vocab_size_arg, default=4096,
                       help="token ids of synthetic prompts are drawn below this")
        if verb == "trace":
            w.add_argument("--out", type=file_out, required=True, metavar="FILE", help="the JSONL trace written")
        w.set_defaults(func=run_show if verb == "show" else run_trace)


def run_list(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load yaml or the workload specs
    from workloads.spec import preset_names

    for name in preset_names():
        spec = spec_of(name)
        print(f"{name:<22}{spec.description.splitlines()[0] if spec.description else ''}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load numpy
    from workloads.generate import describe

    print(describe(trace_of(args.name, args.seed, args.max_seq_len, args.vocab_size)))
    return 0


def run_trace(args: argparse.Namespace) -> int:
    t = trace_of(args.name, args.seed, args.max_seq_len, args.vocab_size)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # file_out found the nearest folder there writable
    with open(out, "w") as f:
        for req in t.requests:
            f.write(req.to_json() + "\n")
    print(f"wrote {len(t.requests)} requests to {out}")
    return 0
