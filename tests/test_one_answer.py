"""Issue 88 items 6 and 8: the console opens with the report's verdict and warnings (one Summary, one answer); compare
says when two runs differ in what they measured on; bench says how long it will take; --model takes a preset or
says how to build it; every verb's --help ends with examples to copy and its metavars carry units."""

import argparse
import html
import json
import re
import shlex

import pandas as pd
import pytest

from harness.analysis.records import RunRecord
from harness.analysis.summary import read_summary_record
from harness.cli import build_parser
from harness.cli.args import UsageError
from harness.cli.engine_flags import served_model
from harness.cli.examples import EXAMPLES
from harness.run.config import BenchConfig
from harness.run.duration_estimate import duration_estimate
from harness.run.synthetic import write_run
from harness.units import KvBudget
from harness.views.compare import run_differences
from harness.views.engine_table import engine_table
from harness.views.opening import console_opening
from harness.views.verdict import verdict


def recorded(tmp_path):
    """A recorded two-engine run at one rate: paged's median TTFT over the 2 s SLO, its load generator late."""
    run = write_run(tmp_path / "r", {"paged": {"token_states": 0.8, "running": 4, "ttft_s": 5.6},
                                     "static-oracle": {"token_states": 0.4, "running": 2, "ttft_s": 0.3}},
                    duration_s=20)
    summary = read_summary_record(run)
    late = {**summary.engines, "paged": summary.engines["paged"].model_copy(update={"late_p99_s": 0.4})}
    return run, summary.model_copy(update={"engines": late})


def test_the_console_opens_with_the_reports_verdict_and_warnings(tmp_path):
    run, summary = recorded(tmp_path)
    console = console_opening(run, summary)
    page = html.unescape(re.sub(r"<[^>]+>", "", verdict(summary, RunRecord.read(run), pd.DataFrame())))
    flat = " ".join(console.split())
    first = console.splitlines()[0]
    assert first.startswith("verdict: Goodput at the workload's own rate")
    lines = [" ".join(x.split()) for x in re.split(r"\n(?=verdict: |WARNING)", console)]
    assert len(lines) == 3, console  # the verdict, the load generator behind, paged's TTFT over the SLO
    for line in lines:
        assert line.removeprefix("verdict: ") in " ".join(page.split())
    assert "fell behind its schedule" in flat and "paged's median TTFT" in flat
    table = engine_table(summary)
    assert "n/a" not in table.splitlines()[3] and "goodput req/s" in table  # no column of n/a for a one-rate run


def test_compare_says_how_two_runs_differ_and_still_compares(tmp_path):
    base = write_run(tmp_path / "a", {"paged": {"token_states": 0.8, "running": 4, "ttft_s": 0.2}}, duration_s=5)
    new = write_run(tmp_path / "b", {"paged": {"token_states": 0.8, "running": 4, "ttft_s": 0.2}}, duration_s=5)
    assert run_differences(base, new) == []
    meta = json.loads((new / "run.json").read_text())
    meta["config"].update(workload="chat-short", kv_budget="64MiB")
    (new / "run.json").write_text(json.dumps(meta))
    said = run_differences(base, new)
    assert len(said) == 2 and "workload: mixed-churn (base) vs chat-short (new)" in said[0] and "KV budget" in said[1]


def test_bench_estimates_its_duration_from_its_flags():
    cfg = BenchConfig(engines=["static-oracle", "paged"], workload="mixed-churn", model="m",
                      kv_budget=KvBudget.parse("16MiB"), duration_s=10, out_dir=None, grace_s=20)
    line = duration_estimate(cfg)
    assert line.startswith("estimate: about 100 s = 2 engine(s) x") and "--duration" in line


def test_a_preset_without_weights_is_refused_with_its_build_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"`fragbench model build --preset llama-3-8b --out models/llama-3-8b`"):
        served_model("llama-3-8b")
    (tmp_path / "models" / "tiny-llama").mkdir(parents=True)
    (tmp_path / "models" / "tiny-llama" / "config.json").write_text("{}")
    assert served_model("tiny-llama") == "models/tiny-llama"
    assert served_model("some/dir") == "some/dir"  # the verb's own check says what is wrong with it


def parsers(p: argparse.ArgumentParser, verb: str = ""):
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{verb} {name}".strip())
    if verb and not any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
        yield verb, p


def test_every_verbs_help_ends_with_examples_that_parse_and_units_on_its_metavars():
    root = build_parser()
    walked = list(parsers(root))
    assert len(walked) >= 17
    for verb, p in walked:
        help_text = p.format_help()
        assert "examples:" in help_text and f"fragbench {verb}" in help_text.split("examples:")[-1], verb
        for example in EXAMPLES[verb]:
            root.parse_args(shlex.split(example.split(">")[0])[1:])  # copyable: it parses
        for a in p._actions:
            if a.option_strings and a.dest in ("duration", "grace", "kv_budget", "rates", "slo_ttft"):
                assert a.metavar in ("SECONDS", "BYTES", "REQ_PER_S,..."), (verb, a.dest, a.metavar)
