"""`fragbench simulate --grid`: the grid file's checks, one table whoever ran it (serially, a pool, Ray), resume
from the rows written, the page. The Ray tests are marked `ray` (pytest -m ray runs them alone; -m 'not ray'
skips them): each starts a Ray, seconds and a few hundred MiB."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.sim.grid import GridError, load_grid
from harness.sim.gridrun import ROWS, best_per_model, pareto_front
from tests.conftest import run_cli
from tests.helpers import scaled

# found, not imported: importing ray sets variables in this process' environment
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")

# small enough to run in seconds, wide enough to cover every axis the table keys on
SMALL = """\
model: llama-2-13b
gpu: [a100-40gb, a100-80gb]
policy: [paged, static-max]
workload: paper
block_size: [16, 32]
requests: 120
"""


def grid_file(tmp_path: Path, text: str = SMALL, name: str = "grid.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def simulate_grid(path: Path, out: Path, *flags: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return run_cli("simulate", "--grid", str(path), "--out", str(out), *flags, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> tuple[Path, pd.DataFrame]:
    tmp = tmp_path_factory.mktemp("grid")
    r = simulate_grid(grid_file(tmp), tmp / "serial", "--jobs", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    return tmp, pd.read_parquet(tmp / "serial" / "grid.parquet")


def test_the_table_has_a_row_per_configuration_and_the_contract_columns(serial):
    _, table = serial
    assert len(table) == 8
    for column in ("model", "gpu", "kv_budget", "gpu_util", "policy", "block_size", "alloc_conf", "workload",
                   "sustained_rps", "requests_per_gpu_hour", "oom_policy", "oom_allocator", "token_states_share"):
        assert column in table, column
    assert set(table.gpu) == {"a100-40gb", "a100-80gb"} and set(table.block_size) == {16, 32}
    assert (table.sustained_rps > 0).all()
    assert table.requests_per_gpu_hour.tolist() == pytest.approx((3600 * table.sustained_rps).tolist())
    # each rate lies in its search's bracket, and no rate past what the configuration completes saturated
    assert (table.sustained_lo_rps <= table.sustained_rps + 1e-9).all()
    assert (table.sustained_rps <= table.sustained_hi_rps + 1e-9).all()
    assert (table.sustained_rps <= table.calibrated_rps + 1e-9).all()
    # paged packs more than reserving max_seq_len per request: more rate on the same GPU and block size
    both = table.pivot_table(index=["gpu", "block_size"], columns="policy", values="sustained_rps")
    assert (both["paged"] > both["static-max"]).all()


def test_the_local_pool_and_a_resumed_grid_give_the_same_table(serial, tmp_path):
    grid_dir, table = serial
    r = simulate_grid(grid_dir / "grid.yaml", tmp_path / "pool", "--jobs", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "pool" / "grid.parquet"), table)
    # interrupted after three rows, the third half written: the rerun computes the rest and only the rest
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    lines = (grid_dir / "serial" / ROWS).read_text().splitlines()
    first = json.loads(lines[0])
    first["reason"] = "kept, not recomputed"  # a recomputed row would say "fits"
    (resumed / ROWS).write_text("\n".join([json.dumps(first), *lines[1:3], lines[3][:40]]))
    r = simulate_grid(grid_dir / "grid.yaml", resumed, "--jobs", "1", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["resumed"] == 3
    got = pd.read_parquet(resumed / "grid.parquet")
    assert (got.reason == "kept, not recomputed").sum() == 1
    pd.testing.assert_frame_equal(got.drop(columns="reason"), table.drop(columns="reason"))


def test_the_page_has_both_fronts_and_the_best_per_model(serial):
    grid_dir, table = serial
    page = (grid_dir / "serial" / "grid.html").read_text()
    for sid in ("best", "memory-front", "price-front", "all"):
        assert f'id="{sid}"' in page
    best = best_per_model(table)
    assert len(best) == 1 and best.iloc[0].requests_per_usd == table.requests_per_usd.max()


def test_the_pareto_front_keeps_only_undominated_rows():
    t = pd.DataFrame({"cost": [1, 2, 2, 3, 4], "sustained_rps": [1.0, 3.0, 2.0, 2.5, 4.0]})
    assert pareto_front(t, "cost").index.tolist() == [0, 1, 4]


BAD = [
    ("model: [llama-2-13b]\ngpu: a100-40gb\npolicy: paged\nworkload: paper\nbanana: 1\n", "'banana'"),
    ("model: nope\ngpu: a100-40gb\npolicy: paged\nworkload: paper\n", "'model'"),
    ("model: llama-2-13b\ngpu: tpu\npolicy: paged\nworkload: paper\n", "'gpu'"),
    ("model: llama-2-13b\ngpu: a100-40gb\npolicy: [paged, hf]\nworkload: paper\n", "'policy'"),
    ("model: llama-2-13b\ngpu: a100-40gb\npolicy: paged\nworkload: /no/such.yaml\n", "'workload'"),
    ("model: llama-2-13b\ngpu: a100-40gb\npolicy: paged\nworkload: paper\nkv_budget: 8 gigs\n", "'kv_budget'"),
    ("model: llama-2-13b\ngpu: a100-40gb\npolicy: paged\nworkload: paper\nkv_budget: 8GiB\ngpu_util: 0.9\n",
     "'kv_budget'"),
    ("model: llama-2-13b\ngpu: a100-40gb\npolicy: paged\nworkload: paper\nalloc_conf: max_split_size_mb:1\n",
     "'alloc_conf'"),
    ("model: llama-2-13b\ngpu: a100-40gb\npolicy: paged\nworkload: paper\nblock_size: [16, 0]\n", "'block_size'"),
    ("model: llama-2-13b\ngpu: a100-40gb\npolicy: paged\nworkload: paper\nrequests: [1, 2]\n", "'requests'"),
    ("gpu: a100-40gb\npolicy: paged\nworkload: paper\n", "'model'"),
    ("- model\n- gpu\n", "mapping"),
]


@pytest.mark.parametrize("text, names", BAD)
def test_a_bad_grid_file_is_refused_naming_its_key(tmp_path, text, names):
    with pytest.raises(GridError, match=names):
        load_grid(grid_file(tmp_path, text))


def test_a_bad_grid_file_exits_2_in_one_line(tmp_path):
    r = simulate_grid(grid_file(tmp_path, BAD[3][0]), tmp_path / "out")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "'policy'" in r.stderr, r.stderr
    r = run_cli("simulate", "--grid", str(grid_file(tmp_path)), "--policy", "paged")
    assert r.returncode == 2 and "--policy" in r.stderr, r.stderr


def test_a_workload_file_is_found_from_any_directory(tmp_path, monkeypatch):
    """A Ray worker runs in a directory of its own: a relative spec file is kept by its absolute path."""
    spec = Path(__file__).parents[1] / "workloads" / "presets" / "paper.yaml"
    (tmp_path / "mine.yaml").write_text(spec.read_text())
    monkeypatch.chdir(tmp_path)
    grid = load_grid(grid_file(tmp_path, "model: llama-2-13b\ngpu: a100-40gb\npolicy: paged\nworkload: mine.yaml\n"))
    assert grid.points[0].workload == str(tmp_path.resolve() / "mine.yaml")


def test_a_configuration_that_does_not_fit_is_a_row_without_capacity(tmp_path):
    grid = load_grid(grid_file(tmp_path, "model: llama-2-13b\ngpu: a100-40gb\npolicy: paged\nworkload: paper\n"
                                          "kv_budget: [64GiB, 1MiB]\nrequests: 50\n"))
    from harness.sim.grid import evaluate

    rows = [evaluate(p) for p in grid.points]
    assert [r["fits"] for r in rows] == [False, False] and all(r["sustained_rps"] == 0.0 for r in rows)
    assert "exceeds" in rows[0]["reason"] and "cannot hold" in rows[1]["reason"]


def test_ray_without_the_extra_exits_2_naming_it(tmp_path):
    fake = tmp_path / "noray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no ray here')\n")
    env = {**os.environ, "PYTHONPATH": str(fake.parent)}
    r = simulate_grid(grid_file(tmp_path), tmp_path / "out", "--ray", env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "fragbench[ray]" in r.stderr


@pytest.mark.ray
@needs_ray
def test_an_unreachable_ray_address_exits_2_in_one_line(tmp_path):
    from engines.procs import free_port

    r = simulate_grid(grid_file(tmp_path), tmp_path / "out", "--ray-address", f"127.0.0.1:{free_port()}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--ray-address" in r.stderr, r.stderr


@pytest.mark.ray
@needs_ray
def test_local_ray_gives_the_serial_table(serial, tmp_path):
    grid_dir, table = serial
    r = simulate_grid(grid_dir / "grid.yaml", tmp_path / "ray", "--ray", "--jobs", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "ray" / "grid.parquet"), table)


def ray_node(ray_cmd: str, env: dict, *flags: str) -> subprocess.Popen:
    """`ray start --block` in a session of its own: its group is the node (raylet, workers, the head's GCS), so a
    signal to the group stops this node alone (`ray stop` would stop every Ray on the machine)."""
    return subprocess.Popen([ray_cmd, "start", "--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
                             "--disable-usage-stats", *flags], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_node(node: subprocess.Popen) -> None:
    if node.poll() is None:
        os.killpg(node.pid, signal.SIGTERM)
        try:
            node.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(node.pid, signal.SIGKILL)  # whatever of the node outlived its `ray start`
    except ProcessLookupError:
        pass
    node.wait(timeout=30)


@pytest.mark.ray
@needs_ray
def test_a_two_node_cluster_loses_a_worker_mid_grid_and_gives_the_serial_table(serial, tmp_path):
    """A head and a worker joined to it on loopback, as on two machines; the worker node is killed (its raylet and
    its workers, SIGKILL) once the grid has written a row, and Ray reruns its tasks on the head."""
    from engines.procs import free_port

    grid_dir, table = serial
    ray_cmd = str(Path(sys.executable).parent / "ray")
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           # Ray's token authentication (on by default since 2.5x) protects a cluster across machines; on loopback
           # the nodes and the driver would share ~/.ray/auth_token, which `ray status` does not always read
           "RAY_AUTH_MODE": "disabled",
           # a dead node noticed in seconds, not the default half-minute
           "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
           "RAY_health_check_initial_delay_ms": "0"}
    nodes = [ray_node(ray_cmd, env, "--head", "--port", str(port), "--include-dashboard", "false",
                      "--temp-dir", f"/tmp/ray-{port}")]  # Ray's socket paths must stay short
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + scaled(180)  # the nodes' starts: the machine's
        while subprocess.run([ray_cmd, "status", "--address", address], env=env, capture_output=True,
                             timeout=60).returncode:
            assert nodes[0].poll() is None and time.monotonic() < deadline, "the head did not start"
            time.sleep(1)
        nodes.append(ray_node(ray_cmd, env, "--address", address))
        while "/2.0 CPU" not in subprocess.run([ray_cmd, "status", "--address", address], env=env,
                                               capture_output=True, text=True, timeout=60).stdout:
            assert nodes[1].poll() is None and time.monotonic() < deadline, "the worker did not join"
            time.sleep(1)
        out = tmp_path / "cluster"
        grid = subprocess.Popen([sys.executable, "-m", "harness.cli", "simulate", "--grid",
                                 str(grid_dir / "grid.yaml"), "--out", str(out), "--ray-address", address,
                                 "--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + scaled(300)
        while not ((out / ROWS).exists() and (out / ROWS).read_text().count("\n") >= 1):
            assert grid.poll() is None and time.monotonic() < deadline, grid.stderr.read()[-2000:]
            time.sleep(0.2)
        os.killpg(nodes[1].pid, signal.SIGKILL)  # the worker machine lost, mid-grid
        stdout, stderr = grid.communicate(timeout=scaled(600))
        assert grid.returncode == 0, stderr[-2000:]
        assert json.loads(stdout)["resumed"] == 0
        pd.testing.assert_frame_equal(pd.read_parquet(out / "grid.parquet"), table)
    finally:
        for node in reversed(nodes):
            stop_node(node)
        shutil.rmtree(f"/tmp/ray-{port}", ignore_errors=True)
