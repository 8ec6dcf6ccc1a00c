"""`fragbench serve`: the OpenAI-compatible server for any engine (a peer's own behind a proxy, e.g. vLLM's)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engines import SERVED
from engines.registry import Kind, described, entry
from engines.shapes import DTYPE_BYTES, load_shape
from harness.cli.args import UsageError, device_of, model_dir, number_in, port_arg, positive_int, usage_errors
from harness.cli.engine_flags import (
    add_engine_flags,
    engine_from_flags,
    refuse_cuda_memory_settings,
    use_real_alloc_conf,
)
from harness.cli.user_paths import file_out


def register(sub) -> None:
    srv = sub.add_parser("serve", help="an OpenAI-compatible server for any engine", epilog=described())
    add_engine_flags(srv, SERVED)
    srv.add_argument("--host", default="127.0.0.1", help="the address listened on (loopback unless told)")
    srv.add_argument("--port", type=port_arg, default=8000, help="0 picks a free port")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: none, open)")
    srv.add_argument("--served-model-name", help="the model id /v1/models answers (default: --model as given, as "
                                                   "vLLM does)")
    srv.add_argument("--fail-at-step", type=positive_int, metavar="N",
                     help="fault injection: an engine-wide error after N engine steps (the server fails its "
                          "open requests and exits with code 71; default: none)")
    srv.add_argument("--crash-after", type=positive_int, metavar="N",
                     help="fault injection: the process killed (SIGKILL) after N engine steps, answering nothing, as "
                          "a segfault or the OOM killer ends it (default: none)")
    srv.add_argument("--slow-step", type=slow_factor, default=1.0, metavar="F",
                     help="fault injection, to test a regression gate: every engine step takes F times its wall time, "
                          "asleep (a scheduled engine sleeps (F - 1) x its step's time inside the step, after its "
                          "forward and before its tokens go out, so TTFT, TPOT and the step's duration_s see it; hf "
                          "and hf-cb sleep after their step; F >= 1; bench passes it with --engine-args "
                          "ENGINE='--slow-step F'; default: 1, off)")
    srv.add_argument("--burn-step", type=slow_factor, default=1.0, metavar="F",
                     help="fault injection, to test a regression gate: a scheduled engine's step computes F times "
                          "its forward on the CPU, as a real regression would (the forward repeated inside the step, "
                          "before its tokens go out: one in five steps runs it twice at F = 1.2); F >= 1; bench passes "
                          "it with --engine-args ENGINE='--burn-step F'; default: 1, off)")
    srv.add_argument("--inject-kv-fault", choices=["early-free", "leak-block"],
                     help="fault injection, to test a KV-integrity check: early-free hands each paged sequence's "
                          "next-to-last block back to the pool while the sequence still reads it; to test the memory "
                          "gate: leak-block keeps each finished paged sequence's tail block for good (default: none)")
    srv.add_argument("--step-log", metavar="FILE", type=file_out,
                     help="scheduled engines: append every step's duration and what it computed to FILE (CSV), "
                          "the rows `simulate --step-model` fits (default: none)")
    srv.add_argument("--oom-snapshot", metavar="FILE", type=file_out,
                     help="--memory cuda: write the CUDA allocator's segments at the engine's first OOM to FILE "
                          "(JSON), before a crashing engine goes down (default: none; GET /memory_snapshot has it)")
    srv.add_argument("--record-memory-history", metavar="FILE", type=file_out,
                     help="an engine on CUDA: record every action of PyTorch's caching allocator from before the "
                          "model loads (torch.cuda.memory._record_memory_history, no stack traces) and write the "
                          "snapshot pickle, with the cap and PYTORCH_CUDA_ALLOC_CONF it ran under, to FILE when "
                          "the server stops; `fragbench allocator replay FILE` replays it (default: none)")
    srv.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import threading

    refuse_cuda_memory_settings(args.memory, args.alloc_conf)  # before recording sets the allocator's settings
    port_free(args.host, args.port)  # before the model loads: a busy port is said in a second, not a minute
    if entry(args.engine).kind is not Kind.PEER:
        budget_fits(args)  # from config.json alone, before torch and the weights load
    recording = memory_recording(args) if args.record_memory_history else None  # before CUDA allocates
    if entry(args.engine).kind is Kind.PEER:  # another server, fronted by fragbench's proxy
        for flag, factor in (("--slow-step", args.slow_step), ("--burn-step", args.burn_step)):
            if factor != 1.0:
                raise UsageError(f"{flag}: the {args.engine} engine steps in a process of its own; fragbench "
                                 "cannot slow its steps")
        # a peer's proxy (aiohttp) loads for a peer engine alone
        from engines.peers.base import PeerUnavailable, serve_peer

        with usage_errors(PeerUnavailable):
            return serve_peer(args.engine, args.model, args.kv_budget.bytes, args.max_seq_len, args.block_size,
                              args.host, args.port)
    # torch, transformers and aiohttp load when the verb runs: `fragbench --help` loads none of them
    from transformers import AutoTokenizer

    from engines.api.server import CompletionServer, serve

    engine = engine_from_flags(args)
    after_step = step_faults(engine, args)
    if recording is not None:
        recording.note_cap(device_of(args.device))
    if args.step_log:
        if not hasattr(engine, "step_recorder"):
            raise UsageError(f"--step-log: the {args.engine} engine is not scheduled by fragbench; it has no steps "
                             "to record")
        # loaded for --step-log alone
        from engines.scheduled.steps import StepRecorder

        engine.step_recorder = StepRecorder(Path(args.step_log))
    server = CompletionServer(engine, AutoTokenizer.from_pretrained(args.model), args.served_model_name or args.model,
                              args.api_key, args.fail_at_step, model_root=str(Path(args.model).resolve()),
                              oom_snapshot=Path(args.oom_snapshot) if args.oom_snapshot else None,
                              slow_step=after_step, crash_after=args.crash_after)

    def ready(port: int) -> None:
        print(f"fragbench serve: {args.engine} on http://{args.host}:{port}", flush=True)

    def write_history() -> None:
        with once:  # the engine thread's exit and a SIGTERM's unwinding may meet: the history is written once
            if recording is not None and not written:
                written.append(recording.dump())
                print(f"fragbench serve: memory history in {written[0]}", flush=True)

    written: list[Path] = []
    once = threading.Lock()
    # an engine that crashes (exit 70) or fails (71) leaves through os._exit, past the `finally` below: the
    # history is written first, with the OOM it was recorded for
    server.before_exit.append(write_history)
    try:
        asyncio.run(serve(server, args.host, args.port, ready))
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    finally:  # SIGTERM unwinds to here once the engine has stopped: its trace is whole
        write_history()
    return 0


def port_free(host: str, port: int) -> None:
    """The address can be listened on: bound and let go at once (port 0 always can). The server binds it again once
    its model is loaded; another process taking it in between is told by serve's own error then."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UsageError(f"--host {host}: not an address of this machine ({e.strerror or e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own bind: TIME_WAIT is free
        try:
            sock.bind(address)
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def budget_fits(args: argparse.Namespace) -> None:
    """The KV budget holds one max-length sequence by the engine's own rule, read from the model's config.json (the
    factory checks it again on the loaded model, whose dtype is the weights')."""
    model_dir(args.model)
    shape = load_shape(args.model)
    max_seq_len = args.max_seq_len or shape.max_seq_len
    if max_seq_len > shape.max_seq_len:
        raise UsageError(f"--max-seq-len {max_seq_len} exceeds the model's context of {shape.max_seq_len}")
    kvb = shape.kv_bytes_per_token(shape.dtype if shape.dtype in DTYPE_BYTES else "float16")
    if refused := entry(args.engine).budget.refusal(args.kv_budget.bytes, max_seq_len, kvb):
        raise UsageError(f"--kv-budget {args.kv_budget} is {refused}")


def memory_recording(args: argparse.Namespace):
    """--record-memory-history: refused in one line where there is no CUDA allocator of this process to record
    (no CUDA device, the engine on the CPU, a peer serving from its own process)."""
    # loaded for --record-memory-history alone: `fragbench --help` does not load the replay (pickle, difflib)
    from engines.memory.snapshot_replay import MemoryRecording

    if entry(args.engine).kind is Kind.PEER:
        raise UsageError(f"--record-memory-history: the {args.engine} engine serves from a process of its own; "
                         "its allocator cannot be recorded here")
    if not device_of(args.device).startswith("cuda"):
        raise UsageError("--record-memory-history records PyTorch's CUDA caching allocator: it needs the engine on "
                         "a CUDA device (--device cuda or auto, on a machine that has one)")
    if args.alloc_conf and args.memory == "cuda":
        use_real_alloc_conf(args.alloc_conf)  # read when the allocator starts, which recording does
    with usage_errors(RuntimeError):
        return MemoryRecording(Path(args.record_memory_history))


def step_faults(engine, args: argparse.Namespace) -> float:
    """--slow-step and --burn-step: a scheduled engine takes both inside its step (engines/step_faults.py); another
    in-house engine (hf, hf-cb) has no forward of fragbench's to repeat, and sleeps after its step. Returns the
    factor the server's engine thread sleeps by after each step."""
    if hasattr(engine, "step_fault"):
        # loaded with the engine: `fragbench --help` does not load it
        from engines.step_faults import StepFault

        engine.step_fault = StepFault(slow=args.slow_step, burn=args.burn_step)
        return 1.0
    if args.burn_step != 1.0:
        raise UsageError(f"--burn-step: the {args.engine} engine's step is transformers' own; fragbench repeats "
                         "the forward of a scheduled engine only")
    return args.slow_step


def slow_factor(text: str) -> float:
    return number_in(text, lambda v: 1.0 <= v < float("inf"), "a finite number >= 1")
