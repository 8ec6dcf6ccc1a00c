"""`fragbench plan`: what one token of KV costs a model on a GPU, what fits, and how many requests run."""

from __future__ import annotations

import argparse
import json
import sys

from engines.shapes import DTYPE_BYTES
from harness.cli.args import fraction_arg, positive_int, shape_of, trace_of
from harness.cli.bounds import block_fits
from harness.cli.gpu_flags import add_gpu_flags, gpu_of


def register(sub) -> None:
    plan = sub.add_parser("plan", help="capacity plan for a model on a GPU (exit 1: it does not fit)")
    plan.add_argument("--model", required=True, help="preset name or model directory")
    add_gpu_flags(plan, required=True)
    plan.add_argument("--gpu-util", type=fraction_arg, default=0.9,
                      help="share (0-1] of GPU memory the server may take, as vLLM's --gpu-memory-utilization")
    plan.add_argument("--max-seq-len", type=positive_int,
                      help="tokens per sequence (default: the model's max_position_embeddings)")
    plan.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block of the paged estimate")
    plan.add_argument("--max-num-seqs", type=positive_int, default=256,
                      help="the server's cap on running sequences: the logits and decode gathers the headroom "
                      "leaves room for, and the most the paged estimate runs (default: 256, vLLM's)")
    plan.add_argument("--dtype", default="float16", choices=list(DTYPE_BYTES), help="the weights' and KV's dtype")
    plan.add_argument("--workload", help="length mix for the paged estimate (default: ShareGPT-like means)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    plan.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load the planner
    from harness.plan import SHAREGPT_MIX, make_plan, render_plan, workload_mix

    shape = shape_of(args.model)
    gpu_mem = gpu_of(args).memory_bytes
    mix = SHAREGPT_MIX
    block_fits(args.block_size, args.max_seq_len or shape.max_seq_len)
    if args.workload:
        max_seq_len = args.max_seq_len or shape.max_seq_len
        mix = workload_mix(trace_of(args.workload, 0, max_seq_len, shape.vocab_size).requests, args.workload,
                           max_seq_len)
    plan = make_plan(shape, gpu_mem, args.dtype, args.gpu_util, args.max_seq_len, args.block_size, mix,
                     args.max_num_seqs)
    print(json.dumps(plan.to_json(), indent=2) if args.json else render_plan(plan))
    if not plan.fits:  # a plan that cannot serve is a failed answer, for a script as for a reader
        where = args.gpu or f"{gpu_mem / 2**30:.2f} GiB"
        print(f"fragbench plan: {shape.name} does not fit on {where}: {plan.reason}", file=sys.stderr)
        return 1
    return 0
