"""Contiguous allocation's signature failure, seen in a bench run: an OOM while enough memory is free.
The run is the session's sweep (conftest.swept): static-oracle and paged in 32 MiB of KV on mixed-churn."""

import json
import subprocess

import pandas as pd
import pytest

from tests.conftest import run_cli
from tests.helpers import scaled
from tests.test_bench import chromium


@pytest.fixture
def run(swept):
    return swept


@pytest.mark.slow  # reads the session's sweep (conftest.swept): make test-all
def test_variable_size_reservations_fail_with_memory_free_and_blocks_do_not(run):
    run_dir, _ = run
    engines = json.loads((run_dir / "summary.json").read_text())["engines"]
    assert engines["static-oracle"]["oom_fragmentation"] > 0
    assert engines["paged"]["oom_fragmentation"] == 0 and engines["paged"]["external_fragmentation_share"] == 0
    events = pd.read_parquet(run_dir / "events.parquet")
    frag = events[(events.kind == "oom") & (events.cause == "fragmentation")]
    assert len(frag) and (frag.free_bytes >= frag.requested_bytes).all()
    assert (frag.requested_bytes > frag.largest_free_bytes).all()


@pytest.mark.slow  # reads the session's sweep (conftest.swept): make test-all
@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (.ci/run installs it with apt)")
def test_the_report_draws_the_memory_map_of_a_fragmentation_oom(run, tmp_path):
    run_dir, report = run
    assert list(run_dir.glob("memory_map-static-oracle-oom-*.json"))
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp_path}",
           "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=15000",
           "--dump-dom", report.resolve().as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(120)).stdout
    assert "static-oracle at a fragmentation OOM" in dom
    heading = dom[dom.index("static-oracle at a fragmentation OOM"):]
    free = int(heading.split(" free extents")[0].rsplit(";", 1)[1].split()[0])
    assert free >= 2  # the holes: free memory split into extents no request fitted
    assert "FRAGMENTATION (enough bytes were free" in dom  # the debugging pass marks them


def test_simulate_and_bench_agree_in_direction():
    r = run_cli("simulate", "--model", "tiny-llama", "--gpu-mem", "64MiB", "--workload", "mixed-churn", "--policy",
                "static-oracle,paged", "--requests", "400", "--json")
    assert r.returncode == 0, r.stderr
    sim = json.loads(r.stdout)["policies"]
    assert sim["static-oracle"]["external_fragmentation_share"] > 0
    assert sim["paged"]["external_fragmentation_share"] == 0
