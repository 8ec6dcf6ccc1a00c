"""A half-written run looks half-written, and its tables load as a whole run's (issue 88, items 5 and 7): `report`
marks a partial or failed run at the top of every format, naming what it kept; `report --format csv` of a whole
and a partial run gives the same columns and dtypes (tables.json's), lists as tokens.csv, the KV shares in
engines.csv, written where told and never into the run's own folder. In-process, on synthetic runs."""

import argparse
import json

import pandas as pd
import pytest

from harness.cli import main
from harness.run.synthetic import write_run
from tests.test_answer_first import FAST, SLOW


def partial_run(path):
    """A run killed mid-way: the second engine unfinished, its journal cut mid-line, run.json still partial."""
    run = write_run(path, {"paged": FAST, "static-max": SLOW}, duration_s=4)
    meta = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**meta, "status": "partial", "engines_done": ["paged"],
                                              "stopped": "Ctrl-C"}))
    journal = run / "engines" / "static-max" / "requests.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:2]) + lines[2][:40])  # two rows and half a third
    return run


def csv_of(run, out, capsys):
    assert main(["report", str(run), "--format", "csv", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    dtypes = json.loads((out / "tables.json").read_text())["dtypes"]
    return printed, {name: pd.read_csv(out / name, dtype=dtypes[name]) for name in dtypes}


def test_a_whole_and_a_partial_run_export_the_same_columns_and_dtypes(tmp_path, capsys):
    whole = write_run(tmp_path / "whole", {"paged": FAST, "static-max": SLOW}, duration_s=4)
    said_whole, a = csv_of(whole, tmp_path / "a", capsys)
    said_partial, b = csv_of(partial_run(tmp_path / "part"), tmp_path / "b", capsys)
    assert "PARTIAL" not in said_whole and said_partial.startswith("PARTIAL RUN: stopped by Ctrl-C")
    assert "engines finished: paged" in said_partial and "static-max 2" in said_partial
    for name in a:
        assert list(a[name].columns) == list(b[name].columns), name
        assert a[name].dtypes.equals(b[name].dtypes), name
    assert len(a["requests.csv"].columns) == 26 and "inter_token_s" not in a["requests.csv"]
    assert a["requests.csv"].late_s.isna().all() and str(a["requests.csv"].late_s.dtype) == "Float64"
    tokens = a["tokens.csv"]  # 49 gaps a request, keyed by its row in requests.csv
    assert len(tokens) == 49 * len(a["requests.csv"]) and tokens.inter_token_s.eq(0.04).all()
    assert (tokens.request_id == a["requests.csv"].request_id[tokens.request_row].to_numpy()).all()
    engines = a["engines.csv"].set_index("engine")
    assert engines.loc["paged", "kv_token_states_share"] > engines.loc["static-max", "kv_token_states_share"]
    assert (a["engines.csv"].run_status == "complete").all() and (b["engines.csv"].run_status == "partial").all()
    assert sorted(p.name for p in whole.iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())


def test_an_empty_column_keeps_its_dtype_with_no_dtype_given_where_it_has_values(tmp_path, capsys):
    """With no dtype= at all, pandas reads the same columns in both (a filled column's dtype as it was)."""
    _, a = csv_of(write_run(tmp_path / "whole", {"paged": FAST}, duration_s=4), tmp_path / "a", capsys)
    plain = pd.read_csv(tmp_path / "a" / "requests.csv")
    assert list(plain.columns) == list(a["requests.csv"].columns)
    assert plain.ttft_s.dtype == "float64" and plain.prompt_tokens.dtype == "int64"


def test_the_tables_go_where_told_never_into_the_runs_own_folder(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "r", {"paged": FAST}, duration_s=4)
    assert main(["report", str(run), "--format", "csv", "--out", str(run)]) == 2
    assert "the run's own folder" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(run), "--format", "json"]) == 0
    assert (tmp_path / "reports" / "r" / "engines.json").is_file() and not (run / "engines.json").exists()


def test_json_opens_with_the_partial_mark(tmp_path, capsys):
    run = partial_run(tmp_path / "p")
    assert main(["report", str(run), "--format", "json", "--out", str(tmp_path / "o")]) == 0
    assert capsys.readouterr().out.startswith("PARTIAL RUN: stopped by Ctrl-C; kept: engines finished: paged")
    assert json.loads((tmp_path / "o" / "tables.json").read_text())["mark"].startswith("PARTIAL RUN")


@pytest.mark.parametrize("partial", [True, False])
def test_text_opens_as_the_console_and_the_page_do(tmp_path, capsys, partial):
    """The partial mark (a partial run), then the verdict and warnings bench's console and the page open with
    (views/opening.py, from the one Summary), then the engine table."""
    from harness.analysis.records import RunRecord
    from harness.analysis.summary import read_summary_record
    from harness.views.opening import console_opening, opening_lines

    run = partial_run(tmp_path / "p") if partial else write_run(tmp_path / "w", {"paged": FAST, "static-max": SLOW},
                                                                duration_s=4)
    assert main(["report", str(run), "--format", "text"]) == 0
    out = capsys.readouterr().out.splitlines()
    summary = read_summary_record(run)
    opening = console_opening(run, summary).splitlines()
    if partial:
        assert out[0].startswith("PARTIAL RUN: stopped by Ctrl-C; kept: engines finished: paged")
        out = out[1:]
    assert out[:len(opening)] == opening and opening[0].startswith("verdict: Goodput at the workload's own rate")
    lines = opening_lines(summary, RunRecord.read(run))
    assert any(line.startswith("WARNING: static-max's median TTFT") for line in lines), lines
    assert any(line.startswith("WARNING: static-max's median TTFT") for line in out), out
    assert "static-max" in "\n".join(out[len(opening):])  # the table after


def test_text_takes_no_out(tmp_path, capsys):
    run = write_run(tmp_path / "w", {"paged": FAST}, duration_s=4)
    assert main(["report", str(run), "--format", "text", "--out", str(tmp_path / "t.txt")]) == 2
    assert "--out goes with --format html, csv or json" in capsys.readouterr().err
    assert not (tmp_path / "t.txt").exists()


def test_an_all_empty_column_keeps_its_dtype_where_another_run_filled_it(tmp_path, capsys):
    """A whole run where a request failed (its `error` filled) and a partial run where none did: read with
    tables.json's dtypes and no converters, the same dtypes; read with none, pandas types a column it finds all empty
    as float64 (docs/verbs.md says so), which is why tables.json names each."""
    whole = write_run(tmp_path / "whole", {"paged": FAST, "static-max": SLOW}, duration_s=4)
    journal = whole / "engines" / "paged" / "requests.jsonl"
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    rows[0].update(status="error", error="HTTP 500: the server answered an error body", output_tokens=0)
    journal.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _, a = csv_of(whole, tmp_path / "a", capsys)
    _, b = csv_of(partial_run(tmp_path / "part"), tmp_path / "b", capsys)
    assert a["requests.csv"].error.notna().sum() == 1 and b["requests.csv"].error.isna().all()
    for name in a:
        assert a[name].dtypes.equals(b[name].dtypes), name
    assert str(a["requests.csv"].error.dtype) == "string"
    plain = [pd.read_csv(tmp_path / x / "requests.csv") for x in "ab"]
    assert plain[1].error.dtype == "float64" and plain[0].error.dtype != "float64"  # str (pandas 3) or object


def test_a_failed_runs_page_opens_with_its_cause(tmp_path):
    from harness.views.report import render

    run = write_run(tmp_path / "f", {"paged": FAST}, duration_s=4)
    meta = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**meta, "status": "failed", "failure": "all 20 requests failed"}))
    page = render(run, tmp_path / "f.html").read_text()
    top = page[:page.index("id='verdict'") if "id='verdict'" in page else page.index('id="verdict"')]
    assert "FAILED RUN: all 20 requests failed" in top and "PARTIAL" not in page


def test_ctrl_c_says_where_the_partial_run_is_and_records_why(tmp_path, capsys):
    from harness.cli.bench import stopping_says_where

    class Stopped:
        dir = tmp_path / "run"
        record = argparse.Namespace(stopped=lambda why: said.append(why))

        def run(self):
            raise KeyboardInterrupt

    said = []
    with pytest.raises(KeyboardInterrupt):
        stopping_says_where(Stopped())
    err = capsys.readouterr().err
    assert said == ["Ctrl-C"] and len(err.splitlines()) == 1
    assert f"the partial run is in {tmp_path / 'run'}" in err and "fragbench report" in err
