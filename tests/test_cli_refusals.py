"""A user's first hour: every failure is nonzero and says why in one line, every numeric flag is checked where it
is parsed, workload errors name the file, the line and the field, and paths follow the user, not the install.
Traffic goes to loopback alone (stub servers on 127.0.0.1)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pandas as pd
import pytest

from engines.procs import free_port
from tests.conftest import ROOT, run_cli
from tests.helpers import serving


def one_line(r: subprocess.CompletedProcess, code: int = 2) -> str:
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def cli_in(folder: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI run from `folder` (a user in a subfolder, or in another clone), this checkout's code on the path."""
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=folder, env=env)


# -- every numeric flag, checked by its type where argparse reads it
@pytest.mark.parametrize("args, flag", [
    (("bench", "--duration", "-1"), "--duration"),
    (("bench", "--duration", "-1e3"), "--duration"),
    (("bench", "--duration", "0"), "--duration"),
    (("bench", "--grace", "-1"), "--grace"),
    (("bench", "--warmup", "-0.5"), "--warmup"),
    (("bench", "--kill-after", "-3"), "--kill-after"),
    (("bench", "--point-duration", "-inf"), "--point-duration"),
    (("bench", "--search-time", "-5"), "--search-time"),
    (("bench", "--knee-tolerance", "-0.1"), "--knee-tolerance"),
    (("bench", "--calibrate-duration", "-12"), "--calibrate-duration"),
    (("bench", "--time", "nan"), "--time"),
    (("bench", "--precision", "0.5"), "--precision"),
    (("bench", "--slo-ttft", "-2"), "--slo-ttft"),
    (("bench", "--slo-attainment", "1.5"), "--slo-attainment"),
    (("bench", "--kv-budget", "-16MiB"), "--kv-budget"),
    (("load", "--duration", "-1"), "--duration"),
    (("check", "--target", "http://127.0.0.1:1", "--model", "x", "--duration", "-1"), "--duration"),
    (("simulate", "--hbm-bw", "-1"), "--hbm-bw"),
    (("simulate", "--peak-flops", "0"), "--peak-flops"),
    (("simulate", "--jobs", "-2"), "--jobs"),
    (("serve", "--engine", "paged", "--model", "x", "--port", "99999"), "--port"),
    (("serve", "--engine", "paged", "--model", "x", "--port", "-1"), "--port"),
    (("generate", "--temperature", "-1"), "--temperature"),
    (("compare", "a", "b", "--threshold", "-5"), "--threshold"),
])
def test_a_bad_number_is_refused_in_one_line_naming_its_flag(args, flag):
    line = one_line(run_cli(*args))
    assert f"argument {flag}:" in line and "expected one argument" not in line, line


@pytest.mark.parametrize("args, words", [
    (("bench", "--engines", "paged", "--engine-args", 'paged=--oops "'), "No closing quotation"),
    (("model", "build", "--preset", "tiny-llama", "--out", "/proc/no/such"), "cannot make the directory"),
])
def test_other_bad_input_is_one_line(args, words):
    assert words in one_line(run_cli(*args))


def test_a_gpu_preset_refuses_a_bandwidth_or_peak_of_its_own():
    common = ("simulate", "--model", "llama-2-7b", "--workload", "mixed-churn", "--policy", "paged", "--requests", "5")
    for flag in ("--hbm-bw", "--peak-flops"):
        line = one_line(run_cli(*common, "--gpu", "a100-80gb", flag, "1e12"))
        assert flag in line and "--gpu-mem" in line and "preset" in line, line


def test_simulate_reads_its_bandwidth_with_gpu_mem():
    r = run_cli("simulate", "--model", "llama-2-7b", "--workload", "mixed-churn", "--policy", "paged",
                "--requests", "5", "--gpu-mem", "40GiB", "--hbm-bw", "1e12", "--json")
    assert r.returncode == 0, r.stderr
    assert '"hbm_bytes_per_s": 1000000000000.0' in r.stdout and '"peak_flops": 312000000000000.0' in r.stdout


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"fragbench {version('fragbench')}"


# -- serve: port and budget before the model loads
@pytest.fixture
def config_only(tiny_model, tmp_path) -> Path:
    """A model directory with the tiny model's config.json and no weights: a serve that got as far as loading the
    model would fail on the weights, so a refusal that names the port or the budget came before the load."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_model / "config.json", folder / "config.json")
    return folder


def test_serve_refuses_a_busy_port_before_the_model_loads(config_only):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line(run_cli("serve", "--engine", "paged", "--model", str(config_only), "--port", str(port)))
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line, line


def test_serve_refuses_a_small_budget_before_the_model_loads(config_only):
    line = one_line(run_cli("serve", "--engine", "paged", "--model", str(config_only), "--port", "0",
                            "--kv-budget", "4KiB"))
    assert "--kv-budget 4KiB is smaller than one max-length sequence" in line, line


# -- load: the target checked before the run; a run that measured nothing is nonzero
class FailingServer(BaseHTTPRequestHandler):
    """Up (its /health answers) but every completion fails with a 500."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"error": {"message": "broken on purpose", "type": "server_error"}}).encode()
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def failing_url():
    with serving(FailingServer) as url:
        yield url


def test_load_to_nothing_listening_exits_2_before_the_run(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line(run_cli("load", "--target", url, "--workload", "mixed-churn", "--duration", "3",
                            "--out", str(tmp_path / "out")))
    assert line == f"fragbench: error: --target {url} does not answer (tried /health and /v1/models)"
    assert not (tmp_path / "out").exists()


def test_a_load_whose_every_request_failed_exits_1_and_its_paths_follow_the_user(failing_url, tmp_path):
    here = tmp_path / "a" / "sub"
    here.mkdir(parents=True)
    r = cli_in(here, "load", "--target", failing_url, "--workload", "mixed-churn", "--duration", "2",
               "--out", "out")
    line = one_line(r, code=1)
    assert line.startswith(f"fragbench: error: {failing_url}: all ") and "requests failed" in line, line
    rows = pd.read_parquet(here / "out" / "requests.parquet")  # under the user's folder, not the install's
    assert len(rows) and set(rows.status) <= {"rejected", "error"}
    assert json.loads((here / "out" / "load.json").read_text())["network_rtt_s"] > 0  # measured before the run
    assert not (ROOT / "out").exists()


def test_measured_nothing_tells_failures_from_answers():
    from harness.results import measured_nothing

    def frame(*statuses):
        return pd.DataFrame({"status": list(statuses), "error": ["boom" if s == "error" else None for s in statuses]})

    assert measured_nothing(frame()) == "no request was sent"
    assert measured_nothing(frame("error", "rejected", "crashed")) == "all 3 requests failed: the first said boom"
    for answered in ("ok", "oom", "cancelled"):  # an OOM or a cancel is what a run measures
        assert measured_nothing(frame("error", answered)) is None


# -- bench: no engine started
def test_a_bench_where_no_engine_started_exits_1_with_the_servers_own_line(tiny_model, tmp_path):
    """Run from a subfolder with relative paths: the run's folder is under it and the model recorded absolute."""
    here = tmp_path / "sub"
    here.mkdir()
    (here / "m").symlink_to(tiny_model)
    r = cli_in(here, "bench", "--engines", "paged", "--engine-args", "paged=--bogus-flag", "--model", "m",
               "--duration", "2", "--grace", "1", "--out", "out", "--reports", "reports", "--run-id", "r")
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("fragbench: error: the run measured nothing: no engine started: paged server exited with 2: "
                    f"unrecognized arguments: --bogus-flag (run: {here / 'out' / 'r'})"), last
    assert "Traceback" not in r.stderr
    meta = json.loads((here / "out" / "r" / "run.json").read_text())
    assert meta["status"] == "failed" and "--bogus-flag" in meta["failure"]
    assert json.loads((here / "out" / "r" / "summary.json").read_text())["status"] == "failed"
    assert meta["config"]["model"] == str(here / "m")  # absolute: the server runs in the install's folder
    assert not (here / "reports").exists()  # no report of nothing


class FailingVllm(FailingServer):
    """An OpenAI model list and vLLM's metrics page (a target bench accepts), every completion a 500."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/metrics":
            body = (ROOT / "tests" / "fixtures" / "metrics" / "vllm.txt").read_bytes()
        elif self.path in ("/v1/models", "/health"):
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        else:
            return super().do_GET()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)


def test_a_bench_whose_every_request_failed_exits_1(tmp_path):
    with serving(FailingVllm) as url:
        r = run_cli("bench", "--engines", "", "--target", f"t={url}", "--duration", "3", "--grace", "1",
                    "--out", str(tmp_path), "--reports", str(tmp_path / "rep"), "--run-id", "r")
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("fragbench: error: the run measured nothing: t: all ") and "broken on purpose" in last
    meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert meta["status"] == "failed" and "requests failed" in meta["failure"]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["status"] == "failed"
    assert meta["targets"]["t"]["network_rtt_s"] > 0  # measured before the run


# -- workloads: the file, the line, the field
SPEC = ("name: x\narrival:\n  process: poisson\n  rate: {rate}\nclasses: [{{name: a, weight: 1, prompt: {{dist: fixed, "
        "value: 4}}, output: {{dist: fixed, value: 4}}}}]\n")


def test_a_spec_refusal_names_the_file_line_and_field(tmp_path):
    from workloads.spec import SpecError, load_spec

    bad = tmp_path / "w.yaml"
    bad.write_text(SPEC.format(rate=-2))
    with pytest.raises(SpecError, match=r"w\.yaml: line 4: arrival\.rate: Input should be greater than 0"):
        load_spec(str(bad))
    broken = tmp_path / "b.yaml"
    broken.write_text("name: x\n  arrival: [\n")
    with pytest.raises(SpecError, match=r"b\.yaml: line 2: not valid YAML"):
        load_spec(str(broken))


def test_a_json_spec_is_read_and_its_errors_have_lines(tmp_path):
    from workloads.spec import SpecError, load_spec

    good = tmp_path / "w.json"
    good.write_text(json.dumps({"name": "j", "arrival": {"process": "poisson", "rate": 2}, "classes": [
        {"name": "a", "weight": 1, "prompt": {"dist": "fixed", "value": 4}, "output": {"dist": "fixed", "value": 4}}]},
        indent=1))
    spec = load_spec(str(good))
    assert spec.name == "j" and spec.arrival.rate == 2
    broken = tmp_path / "b.json"
    broken.write_text('{"name": "x",\n "arrival": {"process": "poisson" "rate": 1}}\n')
    with pytest.raises(SpecError, match=r"b\.json: line 2: not valid JSON"):
        load_spec(str(broken))
    line = one_line(run_cli("workload", "show", str(tmp_path / "nothere.json")))
    assert "workload spec not found" in line


@pytest.mark.parametrize("name, text, needle", [
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,12,4\n"
              "2023-11-16 18:15:47.0,abc,4\n", "line 3: field 'ContextTokens': 'abc' is not a whole number of tokens"),
    ("t.csv", "time,ContextTokens,GeneratedTokens\n1,2,3\n", "line 1: the header has no 'TIMESTAMP'"),
    ("t.jsonl", '{"timestamp": 1, "input_length": 3, "output_length": 2, "hash_ids": [1]}\n'
                '{"timestamp": 2, "input_length": 3}\n', "line 2: no 'output_length' field"),
    ("t.jsonl", '{"timestamp": 1, "input_length": 3, "output_length": 2, "hash_ids": [1]}\nnot json\n',
     "line 2: not a JSON object"),
])
def test_a_bad_trace_names_the_file_line_and_field(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    line = one_line(run_cli("workload", "show", str(path)))
    assert str(path) in line and needle in line, line


# -- revisions from the repository the user stands in
def test_revisions_come_from_the_repository_the_user_stands_in(tmp_path, monkeypatch):
    from harness.run import trees

    other = tmp_path / "clone"
    (other / "harness").mkdir(parents=True)
    (other / "harness" / "x.py").write_text("x = 1\n")
    shutil.copy(ROOT / "pyproject.toml", other)  # the same dependencies: it shares this venv
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(other)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.chdir(other / "harness")  # a subfolder of the other clone
    assert trees.repository() == other.resolve()
    assert trees.resolve("HEAD") == head  # its HEAD, not the install's
    new = trees.tree_of(None)  # its working tree, served from a tree of its own beside it (as BASE's is)
    assert new.sha == head and new.path == other.resolve() / ".ab" / "trees" / head[:12]
    assert trees.trees_dir() == other.resolve() / ".ab" / "trees"
    monkeypatch.chdir(tmp_path)  # no repository here: the install's checkout
    assert trees.repository() == trees.ROOT


def test_a_specs_trace_path_is_read_beside_the_spec(tmp_path, monkeypatch):
    """A spec's relative trace path names the file beside the spec, wherever the reader stands (the load generator
    runs in the install's folder)."""
    from workloads.generate import trace
    from workloads.spec import load_spec

    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,12,4\n"
                                  "2023-11-16 18:15:47.5,20,6\n")
    (folder / "w.yaml").write_text("name: w\narrival: {process: trace}\ntrace: {path: t.csv}\n")
    monkeypatch.chdir(tmp_path)  # not the spec's folder
    spec = load_spec(str(folder / "w.yaml"))
    assert spec.trace.path == str((folder / "t.csv").resolve())
    assert trace(spec, 0, 512).requests  # read from beside the spec, not from the working directory
