"""--gpu PRESET or --gpu-mem SIZE, defined once for the verbs that size a GPU (plan, check, simulate), with the
bandwidth and peak a step model needs of a GPU given by its memory alone."""

from __future__ import annotations

import argparse

from harness.cli.args import UsageError, positive_float, size_arg, usage_errors

DEFAULT_HBM_BYTES_PER_S = 2.0e12  # --gpu-mem's speed unless told: an A100's bandwidth and fp16 peak
DEFAULT_PEAK_FLOPS = 312e12


def add_gpu_flags(parser: argparse.ArgumentParser, required: bool, speed: bool = False) -> None:
    """--gpu PRESET or --gpu-mem SIZE; with `speed`, the bandwidth and peak a step model needs of --gpu-mem."""
    gpu = parser.add_mutually_exclusive_group(required=required)
    gpu.add_argument("--gpu", help="GPU preset: a100-40gb, a100-80gb, h100-80gb, h200-141gb")
    gpu.add_argument("--gpu-mem", type=size_arg, help="GPU memory in bytes, e.g. 40GiB (or --gpu)")
    if speed:  # None when not given: beside --gpu they are refused (a preset has its own), not silently dropped
        parser.add_argument("--hbm-bw", type=positive_float,
                            help=f"memory bandwidth in bytes/s, with --gpu-mem; refused beside --gpu, whose preset "
                                 f"has its own (default: {DEFAULT_HBM_BYTES_PER_S:g})")
        parser.add_argument("--peak-flops", type=positive_float,
                            help=f"peak FLOP/s, with --gpu-mem; refused beside --gpu, whose preset has its own "
                                 f"(default: {DEFAULT_PEAK_FLOPS:g})")


def gpu_of(args: argparse.Namespace):
    """--gpu PRESET or --gpu-mem SIZE (with --hbm-bw and --peak-flops where the verb has them)."""
    # imported when a verb calls this: `fragbench --help` does not load it
    from harness.gpus import resolve_gpu

    hbm, peak = getattr(args, "hbm_bw", None), getattr(args, "peak_flops", None)
    if args.gpu and (hbm is not None or peak is not None):
        flag = "--hbm-bw" if hbm is not None else "--peak-flops"
        raise UsageError(f"{flag} goes with --gpu-mem: --gpu {args.gpu} has its preset's own bandwidth and peak")
    with usage_errors(ValueError):
        return resolve_gpu(args.gpu, args.gpu_mem, DEFAULT_HBM_BYTES_PER_S if hbm is None else hbm,
                           DEFAULT_PEAK_FLOPS if peak is None else peak)
