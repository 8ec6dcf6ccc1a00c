"""The deterministic memory gate (fragbench memory-gate, harness/analysis/memory_gate.py): its rule on records, the
leak-block fault it must catch, and the gate run whole on two trees, one of them changed."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from engines.kv.faults import inject
from engines.kv.paged import PagedKV
from engines.memory.arena import Arena
from harness.analysis.memory_gate import MemorySide, PolicyCrash, PolicyMemory, gate
from tests.conftest import ROOT, run_cli
from tests.helpers import seq

FIGURES = dict(policy="paged", requests=100, requests_completed=100, requests_oom=0, requests_unfinished=0,
               preemptions=10, oom_total=0, oom_capacity=0, oom_fragmentation=0, token_states_share=0.8,
               reservation_share=0.05, internal_fragmentation_share=0.01, external_fragmentation_share=0.0,
               free_share=0.14, max_running=20, peak_blocks=256, peak_held_bytes=2**24, held_blocks_end=0)


def side(**changed) -> MemorySide:
    return MemorySide(trace={"workload": "mixed-churn"}, policies={"paged": PolicyMemory(**{**FIGURES, **changed})})


def test_equal_sides_pass_with_no_difference():
    result = gate(side(), side())
    assert result.verdict == "PASS" and result.policies[0].differences == []


@pytest.mark.parametrize("figure", ["preemptions", "oom_capacity", "oom_fragmentation", "requests_unfinished",
                                    "held_blocks_end"])
def test_a_count_that_grows_fails_and_one_that_falls_passes(figure):
    grew = gate(side(), side(**{figure: FIGURES[figure] + 1}))
    fell = gate(side(**{figure: FIGURES[figure] + 1}), side())
    assert grew.verdict == "FAIL" and [(d.figure, d.delta, d.worse) for d in grew.policies[0].differences] == \
        [(figure, 1, True)]
    assert fell.verdict == "PASS" and [(d.figure, d.worse) for d in fell.policies[0].differences] == [(figure, False)]


def test_the_token_state_share_fails_only_past_its_margin():
    within = gate(side(), side(token_states_share=0.795), margin=0.01)
    past = gate(side(), side(token_states_share=0.785), margin=0.01)
    assert within.verdict == "PASS" and within.policies[0].differences[0].figure == "token_states_share"
    assert past.verdict == "FAIL"


def test_a_policy_measured_on_one_side_is_listed_not_gated():
    new = MemorySide(trace={}, policies={**side().policies, "novel": PolicyMemory(**{**FIGURES, "policy": "novel"})})
    result = gate(side(), new)
    assert result.verdict == "PASS" and [p.policy for p in result.policies] == ["paged", "novel"]
    assert result.json()["policies"]["novel"]["base"] is None


def test_a_crash_in_new_fails_naming_side_engine_and_error_and_one_in_base_is_refused():
    crashed = MemorySide(trace={}, policies={}, crashed=[PolicyCrash(policy="paged", error="AssertionError: boom")])
    result = gate(side(), crashed)
    assert result.verdict == "FAIL"
    assert [c.line() for c in result.crashed] == ["NEW's paged crashed: AssertionError: boom"]
    assert result.json()["crashed"] == [{"side": "NEW", "engine": "paged", "error": "AssertionError: boom"}]
    assert result.json()["policies"]["paged"]["crashed"] == "AssertionError: boom"
    assert gate(side(), side()).json()["crashed"] == []
    with pytest.raises(ValueError, match="BASE's paged crashed"):
        gate(crashed, side())


def test_a_crash_in_base_is_a_tree_that_could_not_run(monkeypatch):
    """BASE's measurement crashing is no verdict on NEW: memory_gate raises a TreeError naming BASE (exit 2)."""
    from harness.run import memory_gate_runs
    from harness.run.trees import Tree, TreeError

    base, new = Tree("base-rev", ROOT, None, "python"), Tree("working tree", ROOT, None, "python")
    crashed = MemorySide(trace={}, policies={}, crashed=[PolicyCrash(policy="growth", error="KeyError: 3")])
    monkeypatch.setattr(memory_gate_runs, "measure_side", lambda tree, args: crashed if tree is base else side())
    with pytest.raises(TreeError, match=r"BASE \(base-rev\) could not run .*growth crashed: KeyError: 3"):
        memory_gate_runs.memory_gate(base, new, [])


@pytest.mark.parametrize("counted", [False, True])
def test_leak_block_keeps_one_block_per_freed_sequence(counted):
    kv = PagedKV(Arena(64 * 16 * 64, backing_device=None), 64, 512, block_size=16, prefix_caching=False)
    if counted:
        kv.count_blocks()
    kv = inject(kv, "leak-block")
    total = kv.pool.num_free
    for i in range(3):
        s = seq(f"r{i}", 40, 8)
        kv.allocate(s, 40)  # three blocks of 16
        kv.free(s)
    assert kv.pool.num_free == total - 3 and kv.leaked_blocks == 3
    held = kv.breakdown_of(0)  # the leaked slots: held, holding no live token, never to be filled
    assert held.token_states_bytes == 0 and held.internal_fragmentation_bytes == 3 * 16 * 64


def gate_cli(*args: str) -> tuple[int, dict]:
    r = run_cli("memory-gate", *args, "--json", timeout=600)  # stdout the JSON alone, --report or not
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def test_a_a_reports_no_difference_and_a_leak_fails_naming_its_blocks(tmp_path):
    """The checkout against itself (its directory as BASE): no difference anywhere; NEW with paged's leak: paged
    alone FAILs, with the blocks it still holds at the end as the exact difference."""
    rc, same = gate_cli(str(ROOT))
    assert rc == 0 and same["verdict"] == "PASS"
    assert all(p["differences"] == [] for p in same["policies"].values()), same["policies"]
    rc, leak = gate_cli(str(ROOT), "--new-engine-args", "paged=--inject-kv-fault leak-block --slow-step 1.2",
                        "--report", str(tmp_path / "gate.html"))
    assert "held_blocks_end" in (tmp_path / "gate.html").read_text()
    assert rc == 1 and leak["verdict"] == "FAIL"
    assert {name for name, p in leak["policies"].items() if p["verdict"] == "FAIL"} == {"paged"}
    blocks = {d["figure"]: d for d in leak["policies"]["paged"]["differences"]}["held_blocks_end"]
    assert blocks["base"] == 0 and blocks["delta"] == leak["policies"]["paged"]["new"]["held_blocks_end"] > 0
    assert blocks["fails"]


def test_early_free_in_new_is_a_fail_naming_the_crash_exit_1(tmp_path):
    """`--inject-kv-fault early-free` makes NEW's paged pool raise: the gate FAILs (exit 1), naming NEW, paged and
    the exception's last line, in the JSON and the text; the other policies are still measured and pass."""
    rc, result = gate_cli(str(ROOT), "--new-engine-args", "paged=--inject-kv-fault early-free")
    assert rc == 1 and result["verdict"] == "FAIL"
    [crash] = result["crashed"]
    assert crash["side"] == "NEW" and crash["engine"] == "paged" and crash["error"].startswith("AssertionError: ")
    assert {n: p["verdict"] for n, p in result["policies"].items()} == \
        {"static-max": "PASS", "static-oracle": "PASS", "growth": "PASS", "paged": "FAIL"}
    r = run_cli("memory-gate", str(ROOT), "--new-engine-args", "paged=--inject-kv-fault early-free", timeout=600)
    assert r.returncode == 1 and "NEW's paged crashed: AssertionError" in r.stdout, (r.stdout, r.stderr)


def test_base_runs_its_own_tree_s_code(tmp_path):
    """BASE a copy of the checkout whose counted pool leaks: the figures it prints are its code's (blocks held at the
    end where NEW holds none); swapped, the leak is NEW's and the gate fails on it."""
    base = tmp_path / "base"
    for room in ("engines", "harness", "workloads"):
        shutil.copytree(ROOT / room, base / room, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", base)  # the same dependencies: it shares this venv
    pool = base / "engines" / "kv" / "pool.py"
    text = pool.read_text()
    assert "self.free_blocks += len(table)\n" in text
    pool.write_text(text.replace("self.free_blocks += len(table)\n", "self.free_blocks += len(table) - 1\n"))
    subprocess.run(["git", "init", "-q", str(base)], check=True)
    _, result = gate_cli(str(base), str(ROOT))
    paged = result["policies"]["paged"]
    assert paged["base"]["held_blocks_end"] > paged["new"]["held_blocks_end"] == 0
    rc, swapped = gate_cli(str(ROOT), str(base))
    failing = {d["figure"] for d in swapped["policies"]["paged"]["differences"] if d["fails"]}
    assert rc == 1 and "held_blocks_end" in failing


def test_bad_input_is_one_line(tmp_path):
    for args in (["no-such-revision-xyz"], ["HEAD", "--new-engine-args", "nosuch=--block-size 8"],
                 ["HEAD", "--new-engine-args", "growth=--inject-kv-fault leak-block"],
                 ["HEAD", "--share-margin", "-1"], [str(tmp_path)]):
        r = run_cli("memory-gate", *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_a_revision_is_checked_out_beside_the_checkout_once(tmp_path, monkeypatch):
    from harness.run import trees

    monkeypatch.setattr(trees, "TREES", tmp_path / "trees")
    head = trees.git("rev-parse", "HEAD")
    tree = trees.tree_of("HEAD")
    try:
        assert tree.sha == head and trees.git("rev-parse", "HEAD", cwd=tree.path) == head
        assert (tree.path / "harness").is_dir() and tree.env()["PYTHONPATH"] == str(tree.path)
        assert trees.tree_of(head).path == tree.path  # reused, not made again
    finally:
        trees.git("worktree", "remove", "--force", str(tree.path))


def test_only_the_trees_made_last_are_kept(tmp_path, monkeypatch):
    from harness.run import trees

    monkeypatch.setattr(trees, "TREES", tmp_path / "trees")
    monkeypatch.setattr(trees, "KEPT_TREES", 1)
    first = trees.tree_of("HEAD~1")
    second = trees.tree_of("HEAD")
    try:
        assert not first.path.exists() and second.path.is_dir()
        assert str(first.path) not in trees.git("worktree", "list")
    finally:
        trees.git("worktree", "remove", "--force", str(second.path))
