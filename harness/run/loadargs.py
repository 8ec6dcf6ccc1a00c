"""The load generator's command line, built in one place for every caller (load, bench, check).

The generator runs in a process of its own (`import locust` monkey-patches the interpreter); this module
imports nothing of Locust's.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from engines.procs import spawn
from engines.procs import stop as stop_process

ROOT = Path(__file__).resolve().parents[2]


@dataclass(kw_only=True)
class Traffic:
    """What is replayed: a workload at its seed and context length, for how long, and how long the requests
    still in flight may finish. bench holds it for every engine's runs; each load generator is given it."""

    workload: str
    duration_s: float
    seed: int = 0
    max_seq_len: int = 2048
    grace_s: float = 30.0
    api: str = "completions"  # or "chat"


@dataclass(kw_only=True)
class LoadArgs(Traffic):
    target: str
    out: Path
    vocab_size: int = 4096
    t0: float | None = None  # wall-clock origin of the trace's arrival times (default: when it starts)
    engine: str = "target"  # the rows' label
    model: str | None = None
    api_key: str | None = None
    workers: int = 1
    rate: float | None = None  # offer the workload at this many requests/s (a sweep point)
    start_at_s: float = 0.0  # seconds after t0 when its first arrival falls
    master_bind: str | None = None  # HOST:PORT: a master waiting for `workers` workers from other machines
    connect_timeout_s: float = 30.0  # how long a master waits for its workers
    schedule: Path | None = None  # segments the caller appends while it runs (workloads/schedule.py)
    network_rtt_s: float | None = None  # the round trip to the target measured before the run (load.json keeps it)

    @classmethod
    def of(cls, traffic: Traffic, **rest) -> LoadArgs:
        """The load generator's arguments for `traffic` (a bench's configuration, say) and the rest."""
        return cls(**{f.name: getattr(traffic, f.name) for f in fields(Traffic)}, **rest)

    def argv(self) -> list[str]:
        out = ["--target", self.target, "--workload", self.workload, "--out", str(self.out),
               "--duration", str(self.duration_s), "--seed", str(self.seed), "--max-seq-len", str(self.max_seq_len),
               "--vocab-size", str(self.vocab_size), "--grace", str(self.grace_s), "--engine", self.engine,
               "--workers", str(self.workers), "--start-at", str(self.start_at_s),
               "--connect-timeout", str(self.connect_timeout_s), "--api", self.api]
        for flag, value in (("--t0", self.t0), ("--model", self.model), ("--api-key", self.api_key),
                            ("--rate", self.rate), ("--schedule", self.schedule),
                            ("--network-rtt-s", self.network_rtt_s)):
            if value is not None:
                out += [flag, str(value)]
        if self.master_bind:
            out += ["--master", "--expect-workers", str(self.workers), "--master-bind", self.master_bind]
        return out


def worker_argv(master_host: str, connect_timeout_s: float) -> list[str]:
    return ["--worker", "--master-host", master_host, "--connect-timeout", str(connect_timeout_s)]


def start_loadgen(args: LoadArgs | list[str], **popen_kwargs) -> subprocess.Popen:
    """The generator as a child that dies with us; stop it with `stop_loadgen`."""
    argv = args.argv() if isinstance(args, LoadArgs) else args
    return spawn([sys.executable, "-m", "harness.run.loadgen", *argv], cwd=ROOT, **popen_kwargs)


def run_loadgen(args: LoadArgs | list[str], **popen_kwargs) -> int:
    """Run it to the end; whatever stops us (SIGTERM, Ctrl-C) stops it too."""
    proc = start_loadgen(args, **popen_kwargs)
    try:
        return proc.wait()
    finally:
        stop_process(proc)


stop_loadgen = stop_process
