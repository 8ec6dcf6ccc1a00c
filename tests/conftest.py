from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two workers' servers share 2 cores: an OpenMP thread waiting for work sleeps instead of spinning on a core another
# test's server needs (the servers and benches the tests start inherit it; what they compute is the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The suite runs on pytest-xdist's workers (make test: -n 2 --dist loadfile): a file's tests stay on one worker, so
# a module-scoped fixture (a module's bench run, its servers) is built once; the files that share a session fixture
# (the sweep, the servers) stay on one worker too (tests/scheduling.py, by the hook at the end of this file).


def run_cli(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw
    )


@pytest.fixture(scope="session")
def swept(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """One bench sweep of a fragmenting contiguous engine and the paged one, at two offered rates: the
    capacity tests and the fragmentation tests both read it (one run, to keep the suite short)."""
    out = tmp_path_factory.mktemp("sweep")
    r = run_cli("bench", "--engines", "static-oracle,paged", "--model", str(tiny_model), "--rates", "0.5,4",
                "--point-duration", "9", "--grace", "4", "--kv-budget", "32MiB", "--workload", "mixed-churn",
                "--out", str(out), "--reports", str(out), "--run-id", "sweep", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return out / "sweep", out / "sweep.html"


class Servers:
    """One `fragbench serve` per engine (budget and flags) for the whole session, started when a test first
    asks for it and stopped at the end: a start costs seconds (torch, transformers, the model), and the
    server tests only read what they change (each measures its own requests, or counters before and after).
    A server a test brought down is started again for the next one."""

    def __init__(self, model: Path, logs: Path):
        self.model, self.logs, self.running = model, logs, {}

    def __call__(self, engine: str, budget: str = "32MiB", *extra: str):
        from harness.run.servers import start_server

        key = (engine, budget, extra)
        srv = self.running.get(key)
        if srv is None or not srv.alive():
            log = self.logs / f"{engine}-{budget}-{len(self.running)}.log"
            srv = self.running[key] = start_server(engine, str(self.model), budget, log, extra=list(extra))
        return srv

    def stop(self) -> None:
        for srv in self.running.values():
            srv.stop()


@pytest.fixture(scope="session")
def servers(tiny_model, tmp_path_factory):
    pool = Servers(tiny_model, tmp_path_factory.mktemp("servers"))
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny model, built once per test session (seeded: the same weights every time)."""
    from engines.modelbuild import build_model

    return build_model("tiny-llama", tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without xdist (pytest -p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` keeps the files that share a session build on one worker (tests/scheduling.py)."""
    if config.getvalue("dist") == "loadfile":
        from tests.scheduling import SharedBuildScheduling

        return SharedBuildScheduling(config, log)
    return None
