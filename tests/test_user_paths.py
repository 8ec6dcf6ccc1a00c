"""Every path a verb writes is checked before any work (issue 88, item 4): an --out that is a folder where a file
goes, a file where a folder goes, or a folder this process cannot write in is one line, exit 2, no traceback, and
nothing written or lost; sizes past any model's and a spec's wrong type are one line too; two runs of one run id
never share a report page. In-process, on synthetic runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.run.synthetic import write_run
from tests.test_answer_first import FAST
from tests.test_safe_results import refused


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A folder this process cannot write in: a read-only one, or for root (whom permission bits do not stop)
    sysfs's top, where no file can be made."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        (ro / "probe").touch()
        (ro / "probe").unlink()
        folder = Path("/sys")
    except OSError:
        folder = ro
    try:
        (folder / "fragbench-probe").touch()
        pytest.skip("no folder here refuses this process's writes")
    except OSError:
        pass
    yield folder
    ro.chmod(0o755)


@pytest.fixture
def places(tmp_path, unwritable) -> dict[str, tuple[str, str]]:
    """Where a file cannot go, each with the words its refusal says."""
    (tmp_path / "afile").write_text("kept")
    (tmp_path / "afolder").mkdir()
    return {"folder": (str(tmp_path / "afolder"), "is a folder, not a file"),
            "under a file": (str(tmp_path / "afile" / "x.out"), "is a file, not a folder"),
            "unwritable": (str(unwritable / "x.out"), "cannot be written")}


def listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("run") / "conc", {"paged": FAST}, duration_s=4)


@pytest.mark.parametrize("where", ["folder", "under a file", "unwritable"])
@pytest.mark.parametrize("verb", ["history", "compare", "rules", "workload trace", "simulate --report"])
def test_a_file_out_that_cannot_be_written_is_refused_as_parsed(tmp_path, capsys, places, run, verb, where):
    path, says = places[where]
    argv = {"history": ["history", str(tmp_path), "--out", path],
            "compare": ["compare", str(run), str(run), "--out", path],
            "rules": ["rules", "--family", "vllm", "--out", path],
            "workload trace": ["workload", "trace", "mixed-churn", "--seed", "1", "--out", path],
            "simulate --report": ["simulate", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--workload",
                                  "mixed-churn", "--policy", "paged", "--requests", "5", "--report", path]}[verb]
    before = listing(tmp_path)
    line = refused(capsys, *argv)
    flag = "--report" if verb.startswith("simulate") else "--out"
    assert line.startswith(f"fragbench: error: argument {flag}: ") and says in line, line
    assert listing(tmp_path) == before


@pytest.mark.parametrize("fmt", ["html", "csv", "json", "text"])
@pytest.mark.parametrize("where", ["folder", "under a file", "unwritable"])
def test_report_refuses_an_out_its_format_cannot_take_before_any_work(tmp_path, capsys, places, run, fmt, where):
    path, says = places[where]
    if fmt in ("csv", "json") and where == "folder":  # a folder is where csv and json go: a file is refused instead
        path, says = str(tmp_path / "afile"), "is a file, not a folder"
    if fmt in ("csv", "json") and where == "unwritable":
        path = str(Path(path).parent / "tables")
    before, kept = listing(tmp_path), listing(run)
    line = refused(capsys, "report", str(run), "--format", fmt, "--out", path)
    assert ("prints to stdout" if fmt == "text" else says) in line and line.startswith("fragbench: error: --out"), line
    assert listing(tmp_path) == before and listing(run) == kept


def test_compare_refuses_its_default_page_where_reports_is_a_file(tmp_path, capsys, monkeypatch, run):
    monkeypatch.chdir(tmp_path)
    Path("reports").write_text("kept")
    line = refused(capsys, "compare", str(run), str(run))
    assert "--out reports/compare-conc-vs-conc.html: reports is a file" in line, line
    assert Path("reports").read_text() == "kept"


@pytest.mark.parametrize("flag", ["--out", "--reports"])
def test_bench_refuses_an_unwritable_out_or_reports_before_it_measures(tmp_path, capsys, unwritable, flag):
    out = {"--out": str(tmp_path / "results"), "--reports": str(tmp_path / "reports"), flag: str(unwritable / "x")}
    line = refused(capsys, "bench", "--engines", "paged", "--duration", "1", "--out", out["--out"],
                   "--reports", out["--reports"])
    assert line.startswith(f"fragbench: error: argument {flag}: ") and "cannot be written" in line, line
    assert not (tmp_path / "results").exists() and not (tmp_path / "reports").exists()


@pytest.mark.parametrize("verb", [["simulate", "--workload", "mixed-churn", "--policy", "paged"], ["plan"]])
@pytest.mark.parametrize("size", ["1000000000", "8193"])
def test_a_kv_block_longer_than_a_sequence_is_refused(capsys, verb, size):
    line = refused(capsys, *verb, "--model", "llama-3-8b", "--gpu", "h100-80gb", "--block-size", size)
    assert f"--block-size {size}: a KV block holds at most one sequence's 8192 tokens" in line, line


@pytest.mark.parametrize("verb", [["workload", "show", "mixed-churn"], ["load", "--target", "http://127.0.0.1:1"]])
def test_a_vocabulary_past_int32_token_ids_is_refused(capsys, verb):
    line = refused(capsys, *verb, "--vocab-size", str(2**31))
    assert "argument --vocab-size: a vocabulary holds at most 2**31 - 1 token ids" in line, line


ARRIVAL = "arrival: {process: poisson, rate: 1}"
CLASSES = ("classes: [{name: a, weight: 1, prompt: {dist: uniform, low: 1, high: 5}, "
           "output: {dist: uniform, low: 1, high: 5}}]")


@pytest.mark.parametrize("fourth, others, says", [
    ("classes: 5", [ARRIVAL], "line 4: classes: Input should be a valid list"),
    ("trace: 5", [ARRIVAL, CLASSES], "line 4: trace: Input should be a valid dictionary"),
    ("arrival: [1]", [CLASSES], "line 4: arrival: Input should be a valid dictionary"),
])
def test_a_specs_wrong_type_is_named_with_its_file_line_and_field(tmp_path, capsys, fourth, others, says):
    spec = tmp_path / "w.yaml"
    spec.write_text("\n".join(["name: w", "num_requests: 10", "description: x", fourth, *others]) + "\n")
    line = refused(capsys, "workload", "show", str(spec))
    assert line.startswith(f"fragbench: error: {spec}: ") and says in line, line


def test_two_runs_of_one_run_id_keep_a_report_page_each(tmp_path, capsys, monkeypatch):
    """Runs named alike under two --out: the second's page is numbered apart and said; each run's page is its own
    on a second report (it holds the run's start time, which run.json records to the microsecond)."""
    first = write_run(tmp_path / "a" / "conc", {"paged": FAST}, duration_s=4, started="2026-12-01T10:00:00.000001")
    second = write_run(tmp_path / "b" / "conc", {"paged": FAST}, duration_s=4, started="2026-12-01T11:00:00.000002")
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(first)]) == 0
    capsys.readouterr()
    assert main(["report", str(second)]) == 0
    said = capsys.readouterr()
    assert said.out.strip().splitlines()[-1] == "reports/conc-2.html"
    assert "reports/conc.html is another run's page (kept): this run's is reports/conc-2.html" in said.err
    assert "2026-12-01T10:00:00.000001" in Path("reports/conc.html").read_text()
    assert "2026-12-01T11:00:00.000002" in Path("reports/conc-2.html").read_text()
    assert main(["report", str(first)]) == 0  # its own page, replaced: not a third
    assert capsys.readouterr().out.strip().splitlines()[-1] == "reports/conc.html"
    assert sorted(p.name for p in Path("reports").iterdir()) == ["conc-2.html", "conc.html"]
    assert json.loads((second / "run.json").read_text())["run_id"] == "conc"


def test_a_grid_files_negative_seed_is_one_line_and_its_overlong_block_an_unfit_point(tmp_path, capsys):
    from harness.sim.grid import evaluate, load_grid

    grid = tmp_path / "g.yaml"
    axes = "model: [llama-3-8b]\ngpu: [h100-80gb]\npolicy: [paged]\nworkload: [mixed-churn]\nrequests: 10\n"
    grid.write_text(axes + "seed: -1\n")
    line = refused(capsys, "simulate", "--grid", str(grid), "--out", str(tmp_path / "out"))
    assert "key 'seed': a whole number from 0 to 2**63 - 1, not -1" in line, line
    grid.write_text(axes + "block_size: [16, 1000000000]\n")
    rows = [evaluate(p) for p in load_grid(grid).points if p.block_size > 16]
    assert [(r["fits"], r["reason"]) for r in rows] == [
        (False, "a KV block of 1000000000 tokens is longer than one 8192-token sequence")]
