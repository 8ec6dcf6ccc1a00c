"""The load generator spread over processes with Locust's own master/worker protocol, on loopback."""

import subprocess
import sys
import time

import pandas as pd

from engines.procs import free_port
from harness.run.servers import start_server
from tests.conftest import ROOT, run_cli
from tests.helpers import scaled
from workloads.generate import trace
from workloads.spec import load_spec

DURATION = 6.0


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness.cli", "load", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def every_request_once(out) -> None:
    rows = pd.read_parquet(out / "requests.parquet")
    due = {r.request_id for r in trace(load_spec("chat-short"), 0, 512).requests if r.arrival_s < DURATION}
    assert rows.request_id.is_unique and set(rows.request_id) == due


def test_a_master_and_two_workers_send_every_request_exactly_once(tiny_model, tmp_path):
    port = free_port()
    # the master and the workers each wait --connect-timeout for the other (30 s by default): a busy machine's
    # Python start-ups (Locust's imports) take longer, so the wait is scaled as the test's own bounds are
    connect = ["--connect-timeout", f"{scaled(30):.0f}"]
    common = ["--workload", "chat-short", "--duration", str(DURATION), "--max-seq-len", "512", *connect]
    with start_server("paged", str(tiny_model), "32MiB", tmp_path / "s.log", extra=["--max-seq-len", "512"]) as srv:
        master = cli("--master", "--expect-workers", "2", "--master-bind", f"127.0.0.1:{port}", "--target", srv.url,
                     *common, "--out", str(tmp_path / "load"))
        time.sleep(2)
        workers = [cli("--worker", "--master-host", f"127.0.0.1:{port}", *connect) for _ in range(2)]
        out, err = master.communicate(timeout=scaled(180))
        assert master.returncode == 0, err[-2000:]
        assert all(w.wait(scaled(60)) == 0 for w in workers)
        every_request_once(tmp_path / "load")
        local = run_cli("load", "--workers", "2", "--target", srv.url, *common, "--out", str(tmp_path / "local"),
                        timeout=180)  # the same protocol, its workers spawned on this machine
        assert local.returncode == 0, local.stderr[-2000:]
        every_request_once(tmp_path / "local")


def test_a_worker_without_a_master_and_a_master_without_workers_exit_2(tmp_path):
    port = free_port()
    r = run_cli("load", "--worker", "--master-host", f"127.0.0.1:{port}", "--connect-timeout", "2", timeout=60)
    assert r.returncode == 2 and "no plan from a master" in r.stderr
    r = run_cli("load", "--master", "--expect-workers", "2", "--master-bind", f"127.0.0.1:{port}", "--target",
                "http://127.0.0.1:9", "--workload", "chat-short", "--connect-timeout", "2", "--out",
                str(tmp_path / "m"), timeout=60)
    assert r.returncode == 2 and "0 of 2 workers connected" in r.stderr
