from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import scaled, slowness

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two workers' servers share 2 cores: an OpenMP thread waiting for work sleeps instead of spinning on a core another
# test's server needs (the servers and benches the tests start inherit it; what they compute is the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The suite runs on the CPU on any box, a GPU box included (`--device auto` reads it, in this process and in every
# server and bench it starts): its figures and tolerances are the CPU's. FRAGBENCH_DEVICE=cuda make test runs the
# servers on the GPU instead.
os.environ.setdefault("FRAGBENCH_DEVICE", "cpu")


def pytest_configure(config) -> None:
    # registered here, not in pyproject.toml: a tree whose pyproject.toml differs from the checkout's gets a venv of
    # its own in every A/B run against it (harness/run/trees.py)
    config.addinivalue_line("markers", "valgrind: counts an engine's step in instructions under valgrind's callgrind "
                                       "(harness/run/ab_instr_probes.py): CPU minutes; skipped without valgrind, and "
                                       "unless FRAGBENCH_VALGRIND_TESTS=1")
    config.addinivalue_line("markers", "slow: a build of minutes (wheels and an offline set-up, a bench sweep, a "
                                       "whole bench) in a unit measured over tests/scheduling.SLOW_S: make test "
                                       "leaves it out, make test-all (and CI) runs it")


# The suite runs on pytest-xdist's workers (make test: -n 3 --dist loadfile): a file's tests stay on one worker, so
# a module-scoped fixture (a module's bench run, its servers) is built once; the files that share a session fixture
# (the sweep, the servers) stay on one worker too (tests/scheduling.py, by the hook at the end of this file).


# What pytest itself sets around each phase of a test, and what torch sets for itself on its first use in a process
# (inductor's cache folder, written into os.environ by whichever test first reaches it: test_34_6 when it ran first
# in its worker): not the test's doing.
PYTEST_OWN_ENVIRONMENT = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})


def process_state() -> dict:
    """What one test may change for every later test in its worker: the environment (a server or bench the later
    test starts inherits it; CUDA reads PYTORCH_CUDA_ALLOC_CONF once), the working directory, and the engine
    table (engines/registry.py), where imported."""
    registry = sys.modules.get("engines.registry")
    return {"environment": {k: v for k, v in os.environ.items() if k not in PYTEST_OWN_ENVIRONMENT},
            "working directory": os.getcwd(), "engine table": dict(registry.REGISTRY) if registry else None}


def differences(before: dict, after: dict) -> list[str]:
    out = []
    for name in ("environment", "engine table"):
        was, now = before[name], after[name]
        if was is None or now is None:  # the table was first imported during the test: nothing to compare
            continue
        out += [f"{name}: {key} was {was.get(key, '(unset)')!r}, is {now.get(key, '(unset)')!r}"
                for key in sorted(set(was) | set(now)) if (key in was) != (key in now) or was[key] != now[key]]
    if before["working directory"] != after["working directory"]:
        out.append(f"working directory was {before['working directory']}, is {after['working directory']}")
    return out


def put_environment(saved: dict[str, str]) -> None:
    """os.environ as `saved`, but for what pytest sets itself (it pops PYTEST_CURRENT_TEST after a test)."""
    for key in set(os.environ) - set(saved) - PYTEST_OWN_ENVIRONMENT:
        del os.environ[key]
    os.environ.update({k: v for k, v in saved.items() if os.environ.get(k) != v and k not in PYTEST_OWN_ENVIRONMENT})


def restore(state: dict) -> None:
    put_environment(state["environment"])
    os.chdir(state["working directory"])
    registry = sys.modules.get("engines.registry")
    if registry and state["engine table"] is not None:
        registry.REGISTRY.clear()
        registry.REGISTRY.update(state["engine table"])


@pytest.fixture(autouse=True)
def leaves_no_process_state():
    """Each test leaves the process as it found it: a test that does not is failed, naming what it left, and the
    state is put back (so that one leak fails one test). An autouse fixture is set up before the test's others
    and torn down after them: what monkeypatch undoes is undone by then."""
    before = process_state()
    yield
    left = differences(before, process_state())
    if left:
        restore(before)
        pytest.fail("the test left process state behind (restore it: monkeypatch, or the `environ` fixture):\n"
                    + "\n".join(left), pytrace=False)


@pytest.fixture
def environ():
    """os.environ, put back as it was after the test: for code under test that writes it itself (monkeypatch
    records nothing to undo when it deletes a variable that is not set)."""
    saved = dict(os.environ)
    yield os.environ
    put_environment(saved)


def run_cli(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """The CLI in a process of its own; `timeout`: the bound on the developers' quiet machine, scaled to this one
    (tests/helpers.scaled: a bound that catches a hang, never the reason a slow machine's run fails)."""
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=scaled(timeout), cwd=ROOT, **kw)


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


# The bound a module's or the session's build gets (conftest.swept, test_bench's bench: run_cli's timeout=900 on the
# developers' quiet machine), on top of the test's own: pytest-timeout's timer covers a test's set-up, and the first
# test to use a build pays for it.
BUILD_S = 900


def builds_of(item) -> list[str]:
    """The module and session fixtures the test uses, but for the cheap ones each worker builds (tests/scheduling.py's
    PER_WORKER) and pytest's own."""
    from tests.scheduling import PER_WORKER

    tests = ROOT / "tests"
    return sorted(name for name, defs in item._fixtureinfo.name2fixturedefs.items()
                  if defs[-1].scope in ("module", "session") and name not in PER_WORKER
                  and Path(inspect.getfile(defs[-1].func)).resolve().is_relative_to(tests))


def pytest_report_header(config) -> str:
    """The factor every bound of this session is scaled by, printed where the suite starts (each xdist worker
    measures its own)."""
    return f"machine slowness (tests/helpers.slowness, bounds scaled by it): {slowness():.2f}"


def scale_timeouts(config, items) -> None:
    """pytest-timeout's bound on each test (pyproject.toml's `timeout`, or the test's own `timeout` mark), plus
    BUILD_S where it uses a module's or the session's build, scaled by the machine's slowness (tests/helpers.scaled):
    the bounds were set on the developers' quiet machine, and a busy or slower one (a fresh clone's `make test` with
    other processes on the cores: the session's sweep passed 300 s) must not fail on them. A hang still fails."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    default = config.getoption("timeout", None)  # --timeout=0 switches the bounds off, as pytest-timeout reads it
    if default is None:
        default = os.environ.get("PYTEST_TIMEOUT") or config.getini("timeout")
    for item in items:
        mark = item.get_closest_marker("timeout")
        base = mark.args[0] if mark and mark.args else (mark.kwargs.get("timeout") if mark else None) or default
        if not base or float(base) <= 0:  # no bound configured, or switched off (0): none added
            continue
        kwargs = {k: v for k, v in (mark.kwargs if mark else {}).items() if k != "timeout"}
        bound = float(base) + (BUILD_S if builds_of(item) else 0)
        item.add_marker(pytest.mark.timeout(scaled(bound), **kwargs), append=False)


@pytest.hookimpl(tryfirst=True)  # before -k, -m or --deselect leave tests out
def pytest_collection_modifyitems(config, items):
    """This session's collection kept where it is the whole suite's (each of make test's workers collects all of
    it): tests/test_scheduling.py reads it instead of collecting the suite again in a process of its own. The cases
    of hf-cb skip, with its own refusal as the reason, where the installed transformers is older than hf-cb needs (a
    GPU image's 5.17): the rest of the suite runs on it (engines/peers/transformers_api.py)."""
    from engines.peers.transformers_api import continuous_batching_refusal
    from tests.scheduling import WHOLE_SUITE, collection_rows

    if {item.path for item in items} >= set((ROOT / "tests").glob("test_*.py")):
        config.stash[WHOLE_SUITE] = collection_rows(items)
    scale_timeouts(config, items)

    refused = continuous_batching_refusal()
    if refused is None:
        return
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "hf-cb" in callspec.params.values():
            item.add_marker(pytest.mark.skip(reason=refused))
