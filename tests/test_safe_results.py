"""Nothing a user does loses or merges a run (issue 88): a run's folder is its own, made by it alone; a run id is a
name; one engine runs once per run; a model build never mixes into a folder's other files; files rewritten while a
run goes on are replaced whole. Each refusal is one line, exit 2, before anything is measured or built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.results import whole_file, write_whole
from harness.run.record import RunFolderRefused, claim_run_dir


def refused(capsys, *argv: str) -> str:
    """The CLI in this process: exit 2, one line on stderr and no traceback; that line."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fragbench: error: "), err
    return err[0]


def bench(tmp_path: Path, *flags: str) -> tuple[str, ...]:
    return ("bench", "--engines", "paged", "--duration", "1", "--out", str(tmp_path / "out"),
            "--reports", str(tmp_path / "reports"), *flags)


# -- a run's folder: its own
def test_a_taken_run_id_is_refused_before_anything_runs_and_the_run_kept(tmp_path, capsys):
    earlier = tmp_path / "out" / "conc"
    earlier.mkdir(parents=True)
    (earlier / "run.json").write_text('{"run_id": "conc"}')
    line = refused(capsys, *bench(tmp_path, "--run-id", "conc"))
    assert "--run-id conc" in line and "already exists" in line, line
    assert [p.name for p in earlier.iterdir()] == ["run.json"] and not (tmp_path / "reports").exists()
    assert (earlier / "run.json").read_text() == '{"run_id": "conc"}'


@pytest.mark.parametrize("run_id", ["../escape", "a/b", "", ".", "..", ".hidden", "a\\b", "x\ny"])
def test_a_run_id_is_a_name_not_a_path(tmp_path, capsys, run_id):
    line = refused(capsys, *bench(tmp_path, "--run-id", run_id))
    assert "--run-id" in line and "run id is a folder's name" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "escape").exists()


def test_an_engine_named_twice_is_refused(tmp_path, capsys):
    line = refused(capsys, "bench", "--engines", "paged,static,paged", "--out", str(tmp_path / "out"))
    assert line == "fragbench: error: --engines names paged more than once: each engine runs once per run", line


def test_an_out_or_reports_that_cannot_take_the_run_is_refused_before_it(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert "is a file" in refused(capsys, *bench(tmp_path, "--run-id", "r")[:-2], "--out", str(tmp_path / "file"))
    line = refused(capsys, *bench(tmp_path, "--run-id", "r"), "--reports", str(tmp_path / "file" / "reports"))
    assert line.startswith("fragbench: error: argument --reports: ") and "is a file" in line, line
    assert not (tmp_path / "out").exists()


def test_of_two_runs_asking_for_one_folder_one_gets_it_the_other_is_refused(tmp_path):
    """Bench's claim (mkdir, no exist_ok): the second is refused even where the CLI's early check raced past it."""
    from harness.run.bench import Bench, BenchConfig
    from harness.units import KvBudget

    def config(workload: str) -> BenchConfig:
        return BenchConfig(engines=[], model="m", kv_budget=KvBudget.parse("16MiB"), out_dir=tmp_path,
                           workload=workload, duration_s=1, run_id="conc")

    first = Bench(config("mixed-churn"))
    before = (first.dir / "run.json").read_text()
    with pytest.raises(RunFolderRefused, match="conc.*already exists"):
        Bench(config("chat-short"))
    assert (first.dir / "run.json").read_text() == before and json.loads(before)["config"]["workload"] == "mixed-churn"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conc"]


def test_a_default_run_id_taken_in_the_same_second_is_numbered(tmp_path):
    assert claim_run_dir(tmp_path, "20261207-190000-mixed-churn", numbered=True).name == "20261207-190000-mixed-churn"
    assert claim_run_dir(tmp_path, "20261207-190000-mixed-churn", numbered=True).name == \
        "20261207-190000-mixed-churn-2"
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFolderRefused, match="cannot make the run's folder"):
        claim_run_dir(tmp_path / "file", "r", numbered=False)


# -- model build: never mixed into other files
def test_model_build_refuses_a_folder_holding_other_files(tmp_path, capsys):
    theirs = tmp_path / "mine"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    line = refused(capsys, "model", "build", "--preset", "tiny-llama", "--out", str(theirs))
    assert "is not empty and holds no model fragbench built" in line, line
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"] and not list(tmp_path.glob(".mine.*"))


def test_a_rebuild_replaces_an_earlier_build_whole(tmp_path):
    """`make model` rebuilds in place: the earlier build's files go, none of them left beside the new ones."""
    from harness.cli.model import buildable, put_in_place

    out, building = tmp_path / "m", tmp_path / ".m.building-1"
    assert not buildable(out)
    out.mkdir()
    assert not buildable(out)  # empty
    (out / "fragbench.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors").write_text("old shard")
    assert buildable(out)
    building.mkdir()
    (building / "fragbench.json").write_text('{"preset": "tiny-llama"}')
    put_in_place(building, out)
    assert [p.name for p in out.iterdir()] == ["fragbench.json"] and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# -- files rewritten during a run: whole, or the old one
def test_a_file_is_replaced_whole_or_left_as_it_was(tmp_path):
    path = tmp_path / "run.json"
    write_whole(path, "first")
    with pytest.raises(RuntimeError), whole_file(path) as tmp:
        tmp.write_text("half of the se")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["run.json"]
    write_whole(path, "second")
    assert path.read_text() == "second" and [p.name for p in tmp_path.iterdir()] == ["run.json"]
