"""`fragbench ab`'s figures and verdicts (harness/analysis/ab.py; its rule's unit tests are tests/test_ab_rule.py),
its blocks' rows (harness/run/ab_blocks.py) and its command line; the measurement itself (servers from two trees,
pairs of blocks) is timed by hand (docs/method.md, Nightly)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest

from harness.analysis.ab import EngineGate, Pair, instructions_figure, side_order
from harness.analysis.gate_verdict import EXIT, GateVerdict, check_verdict, worst
from harness.run.ab_blocks import judged_rows
from tests.conftest import run_cli


def test_pairs_alternate_their_order():
    assert [side_order(k) for k in range(3)] == [("base", "new"), ("new", "base"), ("base", "new")]


def test_the_overall_verdict_is_the_worst():
    """One rule (harness/analysis/gate_verdict.py) for ab, memory-gate, check and compare: FAIL, ERROR, INCONCLUSIVE,
    PASS, worst first; nothing to combine is no PASS."""
    assert worst(["PASS", "PASS"]) == GateVerdict.PASS and worst(["PASS", "INCONCLUSIVE"]) == GateVerdict.INCONCLUSIVE
    assert worst(["INCONCLUSIVE", "FAIL", "PASS"]) == "FAIL" and worst([]) == GateVerdict.INCONCLUSIVE
    assert worst([GateVerdict.ERROR, GateVerdict.INCONCLUSIVE]) == "ERROR" and worst(["ERROR", "FAIL"]) == "FAIL"
    assert [EXIT[v] for v in GateVerdict] == [0, 1, 3, 2] and f"{GateVerdict.FAIL}" == "FAIL"
    assert check_verdict(["PASS", "WARN"]) == "PASS" and check_verdict(["WARN", "UNKNOWN"]) == "INCONCLUSIVE"
    assert check_verdict(["UNKNOWN", "FAIL"]) == "FAIL"
    with pytest.raises(ValueError):
        worst(["OK"])  # a bare string no gate speaks


def block(scale: float, seed: int, n: int = 30, missed: int = 0) -> pd.DataFrame:
    """A block of n requests whose sizes vary 3x (the same stream on both sides), 3 % noise per request; `missed`
    requests of it failed (every third)."""
    sizes = np.random.default_rng(0).uniform(1, 3, n)
    noise = np.random.default_rng(seed).normal(1, 0.03, n)
    failed = (np.arange(n) % 3 == 2) & (np.arange(n) < 3 * missed)
    return pd.DataFrame({"stream_index": np.arange(n), "status": np.where(failed, "error", "ok"), "met": ~failed,
                         "ttft_s": 0.05 * sizes * noise, "tpot_s": 0.01 * sizes * noise * scale,
                         "output_tokens": np.where(failed, 0, (40 * sizes).round())})


def gate_of(new_scale: float, pairs: int, missed: int = 0) -> EngineGate:
    gate = EngineGate("paged", 0.10, 10)
    for k in range(pairs):
        gate.add(Pair("paged", k, 3.2, f"ab{k}", side_order(k), block(1.0, 2 * k), block(new_scale, 2 * k + 1,
                                                                                          missed=missed)))
        if gate.settled():
            break
    return gate


def test_a_crash_of_new_fails_its_engine():
    gate = gate_of(1.0, 2)
    gate.crashed = "paged.new's server exited (70): AssertionError: block 3 freed while read"
    assert gate.verdict() == "FAIL" and gate.settled()
    assert any(f.figure == "crash" and "AssertionError" in f.why for f in gate.figures())


def test_instructions_are_compared_as_counted():
    assert instructions_figure("paged", 1e9, 1.2e9, 0.10).verdict == "FAIL"
    assert instructions_figure("paged", 1e9, 1.004e9, 0.10).verdict == "PASS"
    assert instructions_figure("paged", None, 1e9, 0.10).verdict == "INCONCLUSIVE"
    gate = gate_of(1.0, 16)
    gate.instructions = instructions_figure("paged", 1e9, 1.25e9, 0.10)
    assert gate.verdict() == "FAIL"


def test_a_block_s_judged_request_that_never_ended_is_a_miss():
    from harness.analysis.capacity import SLO

    row = {"status": "ok", "ttft_s": 0.1, "tpot_s": 0.01, "output_tokens": 5, "e2e_s": 0.14, "stream": True}
    late = {**row, "ttft_s": 3.0, "e2e_s": 3.1}
    frame = judged_rows([(0, row), (1, None), (2, late), (3, {**row, "status": "error"})], SLO())
    assert frame.status.tolist() == ["ok", "error", "ok", "error"]
    assert frame.met.tolist() == [True, False, False, False]


def test_bad_input_is_one_line(tmp_path, tiny_model):
    for args in (["no-such-revision-xyz", "--model", str(tiny_model)], ["HEAD", "--engines", "nosuch"],
                 ["HEAD", "--engines", "paged", "--threshold", "0"], ["HEAD", "--model", str(tmp_path)],
                 ["HEAD", "--new-engine-args", "paged=--inject-kv-fault nosuch"], ["HEAD", "--pairs", "3"],
                 ["HEAD", "--knee-time", "-5"], ["HEAD", "--base-engine-args", "nosuch=--x"]):
        r = run_cli("ab", *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    r = run_cli("ab", "HEAD", "--base-engine-args", "nosuch=--x")
    assert "--base-engine-args takes ENGINE=ARGS" in r.stderr, r.stderr  # the flag the user gave, named


def test_the_text_and_the_page_name_every_figure_and_the_memory_gate(tmp_path):
    from harness.analysis.memory_gate import MemorySide, PolicyMemory, gate
    from harness.run.ab_runs import Measured
    from harness.views.ab_page import render_text, write_page
    from tests.test_memory_gate import FIGURES

    side = MemorySide(trace={"workload": "mixed-churn"}, policies={"paged": PolicyMemory(**FIGURES)})
    memory = gate(side, side)
    slow = gate_of(1.2, 16)
    measured = Measured(gates={"paged": slow}, rates={"paged": 3.2},
                        speed=[{"compute_s": [0.010]}, {"compute_s": [0.020]}])
    figures = measured.figures()
    text = render_text("FAIL", {"paged": "FAIL"}, figures, memory, 0.1, measured)
    assert "ab: FAIL" in text and "paged: FAIL at 3.2 req/s" in text and "tpot_p50_s" in text
    assert "memory gate: PASS" in text and "speed moved" in text and "past the floor" in text
    page = write_page("FAIL", {"paged": "FAIL"}, figures, memory, ("HEAD", "working tree"), measured, 0.1,
                      tmp_path / "ab.html")
    assert "tpot_p50_s" in page.read_text() and "Memory gate: PASS" in page.read_text()


def test_a_block_waits_until_no_server_holds_a_request(monkeypatch):
    """The other build's server, still decoding what the last block left it, would share the machine with the next
    block: quiesce waits for both to hold nothing."""
    from types import SimpleNamespace

    import harness.run.ab_runs as ab_runs

    held = {"http://a": [2, 1, 0], "http://b": [0]}

    def stats(url):
        queue = held[url]
        return SimpleNamespace(running=queue.pop(0) if len(queue) > 1 else queue[0], waiting=0)

    monkeypatch.setattr(ab_runs, "fetch_stats", stats)
    monkeypatch.setattr(ab_runs.time, "sleep", lambda s: None)
    said = []
    ab_runs.quiesce({"paged.base": "http://a", "paged.new": "http://b"}, said.append)
    assert held["http://a"] == [0] and said == []
    monkeypatch.setattr(ab_runs, "QUIET_S", 0.0)
    held["http://a"] = [5]
    ab_runs.quiesce({"paged.base": "http://a"}, said.append)
    assert said and "paged.base still held" in said[0]


def test_the_step_diagnostic_prices_both_builds_fits_on_base_s_steps(tmp_path):
    """Each build's steps fitted on their work, priced on BASE's steps: a step 1.2x slower reads 1.2x whatever
    the two builds' batches were."""
    from harness.run.ab_runs import step_figure

    rng = np.random.default_rng(0)
    logs = {}
    for side, scale, n in (("base", 1.0, 200), ("new", 1.2, 300)):
        rows = pd.DataFrame({"decodes": rng.integers(0, 8, n), "prefills": rng.integers(0, 2, n),
                             "context_tokens": rng.integers(0, 4000, n)})
        rows["tokens"] = rows.decodes + 64 * rows.prefills
        rows["duration_s"] = scale * (0.002 + 0.0005 * rows.decodes + 0.00002 * rows.tokens
                                      + 1e-6 * rows.context_tokens)
        logs[side] = tmp_path / f"{side}.csv"
        rows.to_csv(logs[side], index=False)
    f = step_figure("paged", logs)
    assert f.ratio == pytest.approx(1.2, rel=0.01) and f.verdict == "reported" and not f.gated
    (tmp_path / "short.csv").write_text("duration_s,decodes,prefills,tokens,context_tokens\n0.1,1,0,1,10\n")
    assert step_figure("paged", {"base": tmp_path / "short.csv", "new": logs["new"]}).ratio is None


def test_the_instruction_count_gates_and_a_crash_of_new_s_probe_fails_it(monkeypatch):
    """Both builds counted (the probe stubbed): 20 % more instructions at every shape FAILs; NEW's engine raising
    under the probe is NEW's crash; a probe that could not run leaves the figure INCONCLUSIVE."""
    from types import SimpleNamespace

    import harness.run.ab_runs as ab_runs
    from harness.analysis.ab_instr import InstrReading, ShapeInstructions
    from harness.run.ab_instr_probes import InstrProbeError

    def reading(scale):
        return InstrReading("paged", (), (ShapeInstructions("decode", 4, 16, 0, 5, int(1e8 * scale)),
                                          ShapeInstructions("prefill", 0, 0, 32, 5, int(2e8 * scale))), "2.13")

    def probe(outcome):
        def run(path, python, engine, args, model, limit):
            if isinstance(outcome[path], Exception):
                raise outcome[path]
            return reading(outcome[path])
        return run

    plan = ab_runs.ABPlan(["paged"], 60, 0.10, Path("/tmp"), "m", "1", {}, {})
    base, new = SimpleNamespace(path="b", python="p"), SimpleNamespace(path="n", python="p")
    monkeypatch.setattr(ab_runs, "instructions", probe({"b": 1.0, "n": 1.2}))
    f = ab_runs.counted("paged", base, new, plan, lambda text: None)
    assert f.verdict == "FAIL" and f.ratio == pytest.approx(1.2, rel=1e-3) and f.gated
    monkeypatch.setattr(ab_runs, "instructions", probe({"b": 1.0, "n": 1.001}))
    assert ab_runs.counted("paged", base, new, plan, lambda text: None).verdict == "PASS"
    monkeypatch.setattr(ab_runs, "instructions", probe({"b": 1.0, "n": InstrProbeError("boom", crashed=True)}))
    assert "crashed" in ab_runs.counted("paged", base, new, plan, lambda text: None)
    monkeypatch.setattr(ab_runs, "instructions", probe({"b": 1.0, "n": InstrProbeError("no valgrind")}))
    assert ab_runs.counted("paged", base, new, plan, lambda text: None).verdict == "INCONCLUSIVE"


# -- every NEW failure a FAIL, BASE's a 2, the verdict written on every path


def ab_json(out: Path) -> dict:
    import json

    (found,) = out.glob("gate-*/ab.json")
    return json.loads(found.read_text())


def test_new_crashing_mid_block_fails_its_engine_and_the_verdict_is_written(tmp_path, tiny_model):
    """Real servers: NEW's paged killed outright (SIGKILL, as a segfault ends it) at its 20th step, inside its first
    block; the knee turn at its default time (the nightly's) skips the dead engine instead of benching it (exit 2
    before issue 87), and no process of the run is left."""
    out = tmp_path / "ab"
    r = run_cli("ab", "HEAD", "--engines", "paged", "--new-engine-args", "paged=--crash-after 20", "--time", "60",
                "--model", str(tiny_model), "--out", str(out), timeout=600)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    record = ab_json(out)
    assert record["verdict"] == "FAIL" and record["engines"] == {"paged": "FAIL"} and record["passed"] is None
    crash = next(f for f in record["figures"] if f["figure"] == "crash")
    assert "paged.new" in crash["why"] and "(-9)" in crash["why"] and "injected-crash at step 20" in crash["why"]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert any("knee turn skipped" in n for n in record["notes"]) and Path(record["page"]).is_file()
    assert record["base"]["sha"] and record["new"]["sha"] and record["base"]["label"] == "HEAD"


def stubbed_ab(monkeypatch, tmp_path, tiny_model, start, *flags: str) -> tuple[int, dict]:
    """`fragbench ab` in this process with each server's start stubbed (`start(engine, side)` raises or returns) and
    the trees and the memory gate stood in for: what the run does around a server that fails."""
    import sys

    import harness.run.ab_runs as ab_runs
    import harness.run.memory_gate_runs as memory_gate_runs
    import harness.run.trees as trees
    from harness.analysis.memory_gate import MemorySide, PolicyMemory, gate
    from harness.cli import main
    from tests.test_memory_gate import FIGURES

    side = MemorySide(trace={"workload": "mixed-churn"}, policies={"paged": PolicyMemory(**FIGURES)})
    monkeypatch.setattr(trees, "tree_of", lambda name: trees.Tree(name or "working tree", trees.ROOT, None,
                                                                  sys.executable))
    monkeypatch.setattr(memory_gate_runs, "memory_gate", lambda *a: gate(side, side))
    monkeypatch.setattr(ab_runs, "start", lambda tree, engine, side, plan, logs: start(engine, side))
    monkeypatch.setattr(ab_runs, "reading", lambda at: {"at": at, "compute_s": [0.01]})
    out = tmp_path / "ab"
    code = main(["ab", "HEAD", "--model", str(tiny_model), "--out", str(out), "--time", "5", *flags])
    return code, ab_json(out)


def test_new_that_never_starts_fails_each_engine_named(monkeypatch, tmp_path, tiny_model):
    import harness.run.ab_runs as ab_runs
    from harness.run.ab_blocks import Crashed

    def start(engine, side):
        if side == "new":
            raise Crashed(f"{engine}.new", side, f"{engine}.new not healthy after 300 s: ImportError: no module")
        return None, "http://127.0.0.1:9", tmp_path / "log"

    closed = []
    monkeypatch.setattr(ab_runs, "open_server", lambda name, *a: name)
    monkeypatch.setattr(ab_runs, "close_server", closed.append)
    code, record = stubbed_ab(monkeypatch, tmp_path, tiny_model, start)
    assert code == 1 and record["verdict"] == "FAIL" and record["engines"] == {"paged": "FAIL", "static-oracle": "FAIL"}
    assert all("ImportError" in f["why"] for f in record["figures"] if f["figure"] == "crash")
    assert closed == ["paged.base", "static-oracle.base"]  # each engine's BASE stopped with its NEW


def test_base_that_fails_exits_2_and_an_unforeseen_error_too_with_the_verdict_written(monkeypatch, tmp_path,
                                                                                     tiny_model, capsys):
    from harness.run.ab_blocks import Crashed

    def base_dies(engine, side):
        raise Crashed(f"{engine}.base", side, f"{engine}.base did not start (exit 1): OSError: no port")

    code, record = stubbed_ab(monkeypatch, tmp_path / "a", tiny_model, base_dies)
    assert code == 2 and record["verdict"] == "ERROR" and "BASE's paged.base did not start" in record["error"]
    assert Path(record["page"]).is_file() and record["passed"] is None

    def bug(engine, side):
        raise KeyError("a bug nobody foresaw")

    code, record = stubbed_ab(monkeypatch, tmp_path / "b", tiny_model, bug)
    assert code == 2 and record["verdict"] == "ERROR" and "KeyError" in record["error"]
    assert "Traceback" in capsys.readouterr().err  # said in full: a CI's log shows where


def test_a_block_its_live_server_answered_none_of_is_that_build_s_failure(tmp_path):
    """A hung NEW (its HTTP loop up, its engine stuck) would leave every later pair INCONCLUSIVE until --time ran
    out: a block with no completed request is its server's failure."""
    from types import SimpleNamespace

    from harness.run.ab_blocks import Crashed
    from harness.run.ab_runs import answered

    server = SimpleNamespace(name="paged.new", side="new", log=tmp_path / "log")
    rows = block(1.0, 0)
    assert answered(server, rows) is rows and answered(server, rows.iloc[:0]).empty
    with pytest.raises(Crashed) as hung:
        answered(server, rows.assign(status="error"))
    assert hung.value.side == "new" and "none of its 30 judged" in str(hung.value)


def test_the_knee_turn_s_own_failures_are_notes_and_a_new_that_died_in_it_fails(monkeypatch, tmp_path):
    from types import SimpleNamespace

    import harness.run.ab_runs as ab_runs
    from harness.run.servers import ServerFailed

    def bench_fails(*args, **kwargs):
        raise ServerFailed("the knee turn's bench (x) failed: paged server exited with 71")

    monkeypatch.setattr(ab_runs, "bench_run", bench_fails)
    monkeypatch.setattr(ab_runs, "quiesce", lambda urls, say: None)
    plan = ab_runs.ABPlan(["paged"], 60, 0.10, tmp_path, "m", "1", {}, {}, knee_time_s=20)
    m = ab_runs.Measured(gates={"paged": gate_of(1.0, 16)})
    ab_runs.knee_turn({"paged.base": "u", "paged.new": "u"}, plan, ["paged"], 20, m, lambda text: None)
    assert len(m.notes) == 2 and "exited with 71" in m.notes[0] and not m.knee_points
    assert all(f.figure != "knee" for f in m.figures())
    (tmp_path / "log").write_text("Traceback\nAssertionError: block freed twice\n")
    dead = {side: SimpleNamespace(name=f"paged.{side}", alive=lambda: False, proc=SimpleNamespace(returncode=70),
                                  log=tmp_path / "log") for side in ("base", "new")}
    ab_runs.after_knee(ab_runs.Serving({"paged": dead}), plan, m, lambda text: None)
    assert m.gates["paged"].verdict() == "FAIL" and "block freed twice" in m.gates["paged"].crashed
    assert "BASE's paged.base" in m.notes[-1]


def test_new_s_memory_measurement_that_cannot_import_fails_the_memory_gate(tmp_path):
    """Real children: NEW's tree whose engines package raises on import: the memory gate FAILs every policy,
    naming the error (it exited 2, "could not run", before)."""
    import sys

    from harness.run.memory_gate_runs import memory_gate
    from harness.run.trees import ROOT, Tree

    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "__init__.py").write_text("raise ImportError('a module this change deleted')\n")
    gate = memory_gate(Tree("HEAD", ROOT, None, sys.executable), Tree("broken", tmp_path, None, sys.executable), [])
    assert gate.verdict == "FAIL" and gate.crashed
    assert all("a module this change deleted" in c.error for c in gate.crashed)


# -- a BASE found from git alone, and an anchor


def git_repo(path: Path) -> Path:
    """A repository with a harness/ (a fragbench work tree, as trees.repository() asks) and two commits."""
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=path, check=True, capture_output=True)

    (path / "harness").mkdir(parents=True)
    git("init", "-q", "-b", "main")
    for n in (1, 2):
        (path / "harness" / "x.py").write_text(f"X = {n}\n")
        git("add", ".")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", f"c{n}")
    return path


def make_value(name: str) -> str:
    """What make reads the Makefile's variable as, here, with nothing given."""
    import subprocess

    from harness.run.trees import ROOT

    done = subprocess.run(["make", "-s", "--no-print-directory", f"--eval=show-it: ; @echo $({name})", "show-it"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_the_nightly_s_base_is_found_from_git_in_a_fresh_clone(monkeypatch, tmp_path):
    """Two fresh clones one commit apart: the second's BASE is the first's commit, no file carried between them;
    a shallow clone says what to fetch; the anchor is a commit of this repository."""
    import subprocess

    from harness.run.trees import ROOT, TreeError, resolve

    origin = git_repo(tmp_path / "origin")
    first, second = (subprocess.run(["git", "-C", str(origin), "rev-parse", rev], capture_output=True, text=True,
                                    check=True).stdout.strip() for rev in ("HEAD~1", "HEAD"))
    base = make_value("BASE")
    assert base == "HEAD~1"
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(origin), str(clone)], check=True)
    monkeypatch.chdir(clone)
    assert resolve("HEAD") == second and resolve(base) == first
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{origin}", str(tmp_path / "shallow")], check=True)
    monkeypatch.chdir(tmp_path / "shallow")
    with pytest.raises(TreeError, match="shallow clone: fetch the history it needs"):
        resolve(base)
    monkeypatch.chdir(ROOT)
    assert resolve(make_value("ANCHOR")) == make_value("ANCHOR")


def test_a_dirty_tree_is_never_recorded_as_a_revision_that_passed(tmp_path):
    import sys

    from harness.cli.ab import passed
    from harness.run.trees import Tree, identity

    repo = git_repo(tmp_path / "repo")
    clean = identity(Tree("working tree", repo, None, sys.executable))
    assert clean["sha"] and not clean["dirty"] and passed("PASS", clean) == clean["sha"]
    assert passed("FAIL", clean) is None and passed("INCONCLUSIVE", clean) is None
    (repo / "harness" / "y.py").write_text("Y = 1\n")  # a file the commit does not hold
    dirty = identity(Tree("working tree", repo, None, sys.executable))
    assert dirty["sha"] == clean["sha"] and dirty["dirty"] and passed("PASS", dirty) is None


# -- two builds that run alike


def test_new_s_tree_is_built_as_base_s_from_its_commit_or_a_snapshot(monkeypatch, tmp_path):
    """NEW, the working tree, is served from a tree of its own under .ab/trees, as BASE is: a clean one is its HEAD's
    tree (an A/A run's two builds are one tree), a dirty one a snapshot of its files (changes and untracked files,
    not ignored ones) that leaves the user's index and stash as they were, made once per content."""
    import subprocess

    from harness.cli.ab import passed
    from harness.run import trees

    repo = git_repo(tmp_path / "repo")

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()

    (repo / "pyproject.toml").write_bytes((trees.ROOT / "pyproject.toml").read_bytes())  # this venv serves it
    (repo / ".gitignore").write_text(".ab/\n*.log\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c3")
    monkeypatch.chdir(repo)
    monkeypatch.setattr(trees, "TREES", tmp_path / "trees")
    base, new = trees.tree_of("HEAD"), trees.tree_of(None)
    assert new.path == base.path and new.path.parent == tmp_path / "trees" and new.sha == base.sha
    assert not new.dirty and new.snapshot is None and new.env()["PYTHONPATH"] == str(new.path)
    (repo / "harness" / "x.py").write_text("X = 'changed'\n")
    (repo / "harness" / "y.py").write_text("Y = 'untracked'\n")
    (repo / "server.log").write_text("ignored\n")
    git("add", "harness/x.py")  # a staged change: the user's index must stay exactly as it is
    staged = git("diff", "--cached", "--name-only")
    new = trees.tree_of(None)
    assert new.path.parent == tmp_path / "trees" and new.path != base.path and new.env()["PYTHONPATH"] == str(new.path)
    assert (new.path / "harness" / "x.py").read_text() == "X = 'changed'\n"
    assert (new.path / "harness" / "y.py").read_text() == "Y = 'untracked'\n" and not (new.path / "server.log").exists()
    assert new.sha == base.sha and new.dirty and new.snapshot and new.python == base.python
    assert git("diff", "--cached", "--name-only") == staged and not git("stash", "list")
    assert git("status", "--porcelain", "--", "harness/y.py").startswith("??")
    assert trees.tree_of(None).path == new.path  # the same content: the same snapshot, its tree reused
    record = trees.identity(new)
    assert record["sha"] == base.sha and record["dirty"] and record["snapshot"] == new.snapshot
    assert passed("PASS", record) is None


def stand_ins(monkeypatch, tmp_path, new_scale: float = 1.0) -> list[tuple]:
    """ab_runs with its servers, load generators and blocks stood in for: each server start, stop and block sent
    recorded, in order, as ("start" | "stop", engine.side) and ("block", engine.side, stream key)."""
    from types import SimpleNamespace

    import harness.run.ab_runs as ab_runs

    events: list[tuple] = []
    sent: dict[str, int] = {}

    def start(tree, engine, side, plan, logs):
        events.append(("start", f"{engine}.{side}"))
        return SimpleNamespace(), f"http://{engine}.{side}", tmp_path / "log"

    def run_block(server, number, key, rate, judged, limit_s):
        events.append(("block", server.name, key))
        sent[server.name] = sent.get(server.name, 0) + 1
        return block(new_scale if server.side == "new" else 1.0, 1000 * (server.side == "new") + sent[server.name])

    monkeypatch.setattr(ab_runs, "start", start)
    monkeypatch.setattr(ab_runs, "open_server", lambda name, side, *a: SimpleNamespace(name=name, side=side))
    monkeypatch.setattr(ab_runs, "close_server", lambda server: events.append(("stop", server.name)))
    monkeypatch.setattr(ab_runs, "run_block", run_block)
    monkeypatch.setattr(ab_runs, "quiesce", lambda urls, say: None)
    monkeypatch.setattr(ab_runs, "reading", lambda at: {"at": at, "compute_s": [0.01]})
    return events


def test_both_builds_are_warmed_alike_and_restarted_every_few_pairs_the_first_to_start_alternating(monkeypatch,
                                                                                                  tmp_path):
    """Stand-in servers: the rate check's block goes to both builds; both servers restart every RESTART_PAIRS of
    an engine's pairs, the build started first alternating, each fresh pair warmed alike before its next pair;
    ab.json's servings (and pairs.jsonl) say which serving each pair ran on."""
    import json

    import harness.run.ab_runs as ab_runs
    from harness.run.trees import ROOT, Tree

    events = stand_ins(monkeypatch, tmp_path)
    tree = Tree("HEAD", ROOT, "0" * 40, "python")
    plan = ab_runs.ABPlan(["paged"], 3600, 0.10, tmp_path, "m", "1", {}, {}, min_pairs=14)
    m = ab_runs.measure(tree, tree, plan, lambda text: None)
    n = len(m.gates["paged"].pairs)
    assert m.gates["paged"].verdict() == "PASS" and n >= 14
    servings = 1 + (n - 1) // ab_runs.RESTART_PAIRS
    assert m.servings == [{"engine": "paged", "serving": i, "from_pair": ab_runs.RESTART_PAIRS * i,
                           "first": ("base", "new")[i % 2]} for i in range(servings)]
    starts = [e[1] for e in events if e[0] == "start"]
    assert starts == [name for i in range(servings) for name in (("paged.base", "paged.new"),
                                                                 ("paged.new", "paged.base"))[i % 2]]
    blocks = [e[1:] for e in events if e[0] == "block"]
    assert blocks[:2] == [("paged.base", "abcheck0"), ("paged.new", "abcheck0")]  # the check warms both
    for i in range(1, servings):  # a restart: both stopped, both started, both warmed before the next pair
        at = next(j for j, e in enumerate(events) if e[0] == "block" and e[2] == f"abwarm{i}")
        first, second = ("paged.base", "paged.new")[::1 if i % 2 == 0 else -1]
        assert [e[0] for e in events[at - 4:at]] == ["stop", "stop", "start", "start"]
        assert events[at:at + 2] == [("block", first, f"abwarm{i}"), ("block", second, f"abwarm{i}")]
        assert events[at + 2][2] == f"ab{ab_runs.RESTART_PAIRS * i}"
    lines = [json.loads(line) for line in (plan.gate_dir / "pairs.jsonl").read_text().splitlines()]
    assert [p["serving"] for p in lines] == [k // ab_runs.RESTART_PAIRS for k in range(n)]


def test_a_restarted_server_is_found_by_its_own_url_not_the_stopped_one_s(monkeypatch, tmp_path):
    """A server's log is appended to at each restart: the start reads the URL the new process prints, not the first
    the log names (the stopped server's, never healthy again: a real run's NEW 'not healthy after 300 s' at its
    first restart, FAILing an A/A night)."""
    from types import SimpleNamespace

    import harness.run.ab_runs as ab_runs
    import harness.run.servers as servers
    from harness.run.trees import ROOT, Tree

    logs = tmp_path / "servers"
    logs.mkdir()
    (logs / "paged.new.log").write_text("fragbench serve: paged on http://127.0.0.1:1111\n")  # the first serving's

    def spawn(cmd, stdout, **kw):
        stdout.write(b"fragbench serve: paged on http://127.0.0.1:2222\n")
        stdout.flush()
        return SimpleNamespace(poll=lambda: None)

    monkeypatch.setattr(ab_runs, "spawn", spawn)
    monkeypatch.setattr(servers, "healthy", lambda url: url.endswith(":2222"))
    monkeypatch.setattr(ab_runs, "SERVE_TIMEOUT_S", 3)
    plan = ab_runs.ABPlan(["paged"], 60, 0.10, tmp_path, "m", "1", {}, {})
    _, url, _ = ab_runs.start(Tree("HEAD", ROOT, "0" * 40, "python"), "paged", "new", plan, logs)
    assert url == "http://127.0.0.1:2222"


def test_new_that_fails_its_restart_fails_its_engine(monkeypatch, tmp_path):
    from harness.run import ab_runs
    from harness.run.ab_blocks import Crashed
    from harness.run.trees import ROOT, Tree

    events = stand_ins(monkeypatch, tmp_path)
    started = ab_runs.start

    def start(tree, engine, side, plan, logs):
        if side == "new" and sum(e[0] == "start" for e in events) >= 2:
            raise Crashed(f"{engine}.new", side, f"{engine}.new did not start (exit 1): OSError: no port")
        return started(tree, engine, side, plan, logs)

    monkeypatch.setattr(ab_runs, "start", start)
    tree = Tree("HEAD", ROOT, "0" * 40, "python")
    plan = ab_runs.ABPlan(["paged"], 3600, 0.10, tmp_path, "m", "1", {}, {}, min_pairs=14)
    m = ab_runs.measure(tree, tree, plan, lambda text: None)
    gate = m.gates["paged"]
    assert gate.verdict() == "FAIL" and "OSError: no port" in gate.crashed
    assert len(gate.pairs) == ab_runs.RESTART_PAIRS and m.error is None
