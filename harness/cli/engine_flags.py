"""The flags that make one engine, shared by `generate` and `serve`, and the engine they make."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from harness.cli.args import UsageError, device_of, model_dir, positive_int, usage_errors
from harness.cli.kv_budget import add_kv_budget


def add_engine_flags(p: argparse.ArgumentParser, engines: tuple[str, ...]) -> None:
    p.add_argument("--engine", required=True, choices=engines, help="the engine (README: The engines)")
    p.add_argument("--model", required=True, type=served_model,
                   help="model directory, or a preset built as `fragbench model build` says (`model list`)")
    add_kv_budget(p, "128MiB", "bytes of KV cache")
    p.add_argument("--max-seq-len", type=positive_int,
                   help="tokens per sequence, prompt and output (default: the model's max_position_embeddings)")
    p.add_argument("--block-size", type=positive_int, default=16, help="paged: tokens per KV block")
    p.add_argument("--reserve", choices=["max", "pow2", "oracle"], default="max",
                   help="the static engine's reservation (static-max, static-pow2, static-oracle name it too)")
    p.add_argument("--no-preflight", action="store_true",
                   help="contiguous engines: admit or grow without checking free bytes, as a naive server does "
                        "(an OOM then rejects or crashes); by default a request waits until free bytes cover it")
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's own)")
    p.add_argument("--on-oom", choices=["reject", "crash"],
                   help="what a failed KV allocation does to the server (default: crash for hf, reject otherwise)")
    p.add_argument("--max-batch", type=positive_int, default=8, help="hf: requests per static batch")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="scheduled engines: sequences run at once")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="paged: never share a prompt's blocks with an earlier one's")
    p.add_argument("--memory", choices=["arena", "cuda", "caching"], default="arena",
                   help="arena: one pre-allocated buffer carved exactly; cuda: PyTorch's caching allocator; caching: "
                        "PyTorch's caching allocator emulated rule for rule under a cap of the KV budget (any machine)")
    p.add_argument("--alloc-conf", type=alloc_conf_arg, metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF's syntax, e.g. expandable_segments:True: the emulator's settings "
                        "under --memory caching, the real allocator's under --memory cuda (default: PyTorch's)")
    p.add_argument("--device", default="auto", help="auto (the GPU where CUDA is available), cpu or cuda[:N]")


def alloc_conf_arg(text: str) -> str:
    """A PYTORCH_CUDA_ALLOC_CONF string, checked as PyTorch checks it (the bad key or value, named)."""
    # imported when a flag is read: `fragbench --help` does not load it
    from engines.memory.allocconf import AllocConfError, parse_alloc_conf

    try:
        parse_alloc_conf(text)
    except AllocConfError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def refuse_cuda_memory_settings(memory: str, alloc_conf: str | None) -> None:
    """--memory cuda under allocator settings it cannot read (backend:cudaMallocAsync, given or in the
    environment): exit 2 in one line before a model loads, not a server that fails to start."""
    if memory != "cuda":
        return
    # imported when a flag is checked: `fragbench --help` does not load it
    from engines.memory.allocconf import cuda_memory_refusal, torch_alloc_conf

    if refused := cuda_memory_refusal(alloc_conf if alloc_conf is not None else torch_alloc_conf()):
        raise UsageError(refused)


def engine_from_flags(args: argparse.Namespace):
    # imported when an engine is built: `fragbench --help` does not load the factory and the KV policies
    from engines.factory import EngineConfigError, EngineSpec, make_engine

    refuse_cuda_memory_settings(args.memory, args.alloc_conf)
    model_dir(args.model)
    spec = EngineSpec(
        engine=args.engine,
        model_dir=args.model,
        kv_budget_bytes=args.kv_budget.bytes,
        max_seq_len=args.max_seq_len,
        block_size=args.block_size,
        reserve=args.reserve,
        preflight=not args.no_preflight,
        on_oom=args.on_oom,
        max_num_seqs=args.max_num_seqs,
        max_batch=args.max_batch,
        prefix_caching=not args.no_prefix_caching,
        memory=args.memory,
        alloc_conf=args.alloc_conf,
        device=device_of(args.device),
        kv_fault=getattr(args, "inject_kv_fault", None),
    )
    quiet_transformers()
    if args.alloc_conf and args.memory == "cuda":
        use_real_alloc_conf(args.alloc_conf)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with usage_errors(EngineConfigError, RuntimeError):
        return make_engine(spec)


def use_real_alloc_conf(conf: str) -> None:
    """The real allocator reads its settings' variables when it starts (bench sets them in the server's environment);
    a server started by hand sets them here, before the model touches CUDA, and in the allocator if it already runs."""
    import os

    # torch and the allocator's settings load for --alloc-conf under --memory cuda alone
    import torch

    from engines.memory.allocconf import alloc_conf_environ

    os.environ.update(alloc_conf_environ(conf))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(conf)


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def served_model(value: str) -> str:
    """--model of a verb that loads weights: a model directory, or a preset's name where its weights were built to
    models/PRESET; a preset never built is refused with the one command that builds it (a preset is a shape, and
    random weights of a 7B are gigabytes: built when asked, not behind a user's back)."""
    from engines.shapes import preset_names  # the presets' names: a listing of package files, no torch

    if (Path(value) / "config.json").is_file() or value not in preset_names():
        return value  # a directory, or what the verb's own check refuses with its words
    built = Path("models") / value
    if (built / "config.json").is_file():
        return str(built)
    raise UsageError(f"--model {value} is a preset with no weights here: build them with `fragbench model build "
                     f"--preset {value} --out {built}`, then pass --model {built}")


def engine_args(pairs: list[str], engines: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for pair in pairs:
        engine, sep, rest = pair.partition("=")
        if not sep or engine not in engines:
            raise UsageError(f"--engine-args takes ENGINE=ARGS for one of {', '.join(engines)}, not {pair!r}")
        try:
            out.setdefault(engine, []).extend(shlex.split(rest))
        except ValueError as e:  # an unclosed quote: shlex's words, on the flag's line
            raise UsageError(f"--engine-args {pair!r}: {e}") from None
    return out
