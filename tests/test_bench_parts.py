"""The bench's pieces (harness/run/: record.py, clock.py, console.py, supervisor.py), each on its own, and the
rule that holds them together: Bench hands them down, nothing below it calls back up (issue 61)."""

from __future__ import annotations

import ast
import json
import time

from engines.api.stats import OomEventRow
from harness.analysis.design import Design
from harness.run.clock import Clock
from harness.run.config import BenchConfig
from harness.run.console import Console
from harness.run.engine_run import EngineRun
from harness.run.record import RunWriter
from tests.conftest import ROOT


def config(tmp_path, **changes) -> BenchConfig:
    return BenchConfig(engines=["paged"], model="m", kv_budget="16MiB", out_dir=tmp_path, workload="mixed-churn",
                       duration_s=1, run_id="r", **changes)


def test_the_record_starts_partial_writes_whole_and_never_the_api_key(tmp_path):
    record = RunWriter.start(config(tmp_path, api_key="secret"), tmp_path)
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["status"] == "partial" and meta["engines_done"] == [] and meta["config"]["api_key"] == "(given)"
    assert "secret" not in (tmp_path / "run.json").read_text() and not (tmp_path / "run.json.tmp").exists()
    record.calibration("paged", "16MiB", 2.5)  # written at once
    record.setup_s("paged", 12.345)  # written with the next write
    assert "setup_s" not in json.loads((tmp_path / "run.json").read_text())
    record.engine_done("paged")
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["calibration"] == {"paged": {"16MiB": 2.5}} and meta["setup_s"] == {"paged": 12.3}
    assert meta["engines_done"] == ["paged"]
    record.complete(time.time() - 5)
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["status"] == "complete" and meta["bench_s"] >= 5.0 and meta["finished"]


def test_the_records_lists_are_run_jsons_own(tmp_path):
    """A point appended to `points`, a look to `decision_log`: recorded with the next write."""
    record = RunWriter.start(config(tmp_path), tmp_path)
    record.sweep([1.0], None, Design.of(900, 1.5, 0.9), None)
    record.points("paged").append({"point": 0})
    record.decision_log().append({"visit": 0})
    record.write()
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["sweep"]["points"] == {"paged": [{"point": 0}]} and meta["decision"] == [{"visit": 0}]
    assert meta["sweep"]["design"] == Design.of(900, 1.5, 0.9).to_json() and meta["sweep"]["search"] is None
    assert record.setups_s() == []


def test_an_oom_event_names_its_layer_only_where_a_caching_allocator_holds_the_kv(tmp_path):
    run = EngineRun("paged", time.time() - 10, 0)
    ev = OomEventRow.model_validate({"t_s": 0.5, "running": 3, "kv_usage": 0.5, "requested_bytes": 64,
                                     "cause": "fragmentation", "layer": "allocator"})
    for memory in ("arena", "caching"):
        out = tmp_path / memory
        out.mkdir()
        RunWriter(config(out, memory=memory), out).oom_event(run, 1.23456, ev, "the request failed")
        [row] = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
        assert row["kind"] == "oom" and row["t_s"] == 1.2346 and row["t_wall"] == run.t0 + 1.23456
        assert row["detail"] == "the request failed; running 3, kv usage 0.50"
        assert row["layer"] == ("allocator" if memory == "caching" else None)
    # the server's crash line is the same row without its clock (the supervisor times it): read as one
    crash = OomEventRow.model_validate({"requested_bytes": 64, "free_bytes": 32, "cause": "capacity", "running": 2})
    out = tmp_path / "crash"
    out.mkdir()
    RunWriter(config(out), out).oom_event(run, 2.0, crash, "the engine crashed on it")
    [row] = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert row["detail"] == "the engine crashed on it; running 2" and row["free_bytes"] == 32


def test_the_clock_spends_what_it_has_left():
    clock = Clock(100.0, started=time.time() - 30)
    assert 69 < clock.left_s <= 70 and 30 <= clock.spent_s < 31


def test_the_console_prints_plain_lines_where_no_terminal_shows_the_bars(capsys):
    from rich.console import Console as RichConsole

    Console(RichConsole(stderr=True, force_terminal=False)).plain("paged: searching")
    Console(RichConsole(stderr=True, force_terminal=False)).say("decision: none")
    Console(RichConsole(stderr=True, force_terminal=True)).plain("not on a terminal")
    err = capsys.readouterr().err
    assert "fragbench bench: paged: searching\n" in err and "fragbench bench: decision: none\n" in err
    assert "not on a terminal" not in err


def test_nothing_below_the_bench_holds_it():
    """The collaborators are handed the run's pieces: none imports bench.py, none names a host."""
    for path in sorted((ROOT / "harness" / "run").glob("*.py")):
        if path.name == "bench.py":
            continue
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "harness.run.bench" not in imported, path.name
    for name in ("visits.py", "search.py"):  # the bench's own collaborators once reached it as `self.host`
        tree = ast.parse((ROOT / "harness" / "run" / name).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)} | \
                {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not {"host", "Host"} & names, name


def test_a_targets_description_is_written_in_describes_order(tmp_path):
    """run.json's `targets` and `config.targets` keep the keys Target.describe wrote, in its order."""
    from harness.analysis.records import RecordedTarget

    seen = RecordedTarget(url="http://127.0.0.1:9", model="m", metrics_url=None, family=None, sees=[],
                     cannot_see=["any memory figure (no metrics read)"])
    record = RunWriter.start(config(tmp_path, targets={"t": seen}), tmp_path)
    record.target("t", seen)
    meta = json.loads((tmp_path / "run.json").read_text())
    keys = ["url", "model", "metrics_url", "family", "sees", "cannot_see"]
    assert list(meta["targets"]["t"]) == keys and list(meta["config"]["targets"]["t"]) == keys
