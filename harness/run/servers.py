"""Start a `fragbench serve` in its own process, wait until it answers, stop it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engines.memory.allocconf import alloc_conf_environ
from engines.procs import spawn
from engines.procs import stop as stop_process
from harness.fetch import ok
from harness.units import KvBudget

ROOT = Path(__file__).resolve().parents[2]  # the checkout: servers run from it, as the CLI does

READY = re.compile(r"fragbench serve: \S+ on (http://\S+)")


class ServerFailed(RuntimeError):
    pass


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10) -> int | None:
        """SIGTERM to the server's process group (vLLM's children included), SIGKILL after timeout_s."""
        return stop_process(self.proc, timeout_s)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    engine: str,
    model: str,
    kv_budget: KvBudget | str,
    log_path: Path,
    extra: list[str] | None = None,
    threads: int | None = None,
    timeout_s: float = 600,
    alloc_conf: str | None = None,
) -> ServerProcess:
    """Port 0: the server picks a free port and prints its URL, which we read from its log. The budget goes on
    serve's command line as its bytes (a test's or a script's text is read as a flag's would be)."""
    cmd = [sys.executable, "-m", "harness.cli", "serve", "--engine", engine, "--model", model,
           "--kv-budget", str(KvBudget.parse(kv_budget).bytes), "--port", "0", *(extra or [])]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if alloc_conf:  # the real caching allocator reads it when CUDA starts in the server's process
        env.update(alloc_conf_environ(alloc_conf))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    since = log_path.stat().st_size  # an earlier server's lines (a restart, a calibration) are not this one's
    proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        return ServerProcess(proc, ready_url(proc, log_path, since, timeout_s), log_path)
    except ServerFailed as e:
        raise ServerFailed(f"{engine} server {e}") from None


def ready_url(proc: subprocess.Popen, log_path: Path, since: int, timeout_s: float) -> str:
    """A started server's URL, read from its log's lines after byte `since` (its own: a log appended to by every
    start, a restart's, names the earlier servers' URLs first), once it answers /health. ServerFailed, its message
    to follow the server's name, where it exits first (its own last words) or is not healthy in time (stopped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # its own last words (serve's one-line error), not an earlier server's
            said = tail(log_path, since=since).removeprefix("fragbench: error: ")
            raise ServerFailed(f"exited with {proc.returncode}: {said}")
        with open(log_path, "rb") as f:
            f.seek(since)
            m = READY.search(f.read().decode(errors="replace"))
        if m and healthy(m.group(1)):
            return m.group(1)
        time.sleep(0.2)
    stop_process(proc)
    raise ServerFailed(f"not healthy after {timeout_s:.0f} s: {tail(log_path, since=since)}")


def healthy(url: str) -> bool:
    return ok(f"{url}/health")


def tail(path: Path, lines: int = 3, since: int = 0) -> str:
    """The log's last lines from byte `since` on, joined on one line."""
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "(no output)"
