"""The KV budget: typed once at the edge (harness/cli/kv_budget.py, a harness.units.KvBudget), carried by its
bytes, recorded by the label the user wrote, and read back into bytes once (harness/analysis/rundir.py)."""

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.parametrize("verb", [("bench", "--engines", "paged"), ("serve", "--engine", "paged", "--model", "m"),
                                  ("generate", "--engine", "paged", "--model", "m")])
def test_every_verb_reads_kv_budget_through_one_flag_that_refuses_a_bad_size_in_one_line(verb):
    """bench, serve and generate share --kv-budget's definition (harness/cli/args.py): the same refusal,
    naming the flag, before anything loads."""
    for bad in ("0", "lots"):
        r = run_cli(*verb, "--kv-budget", bad)
        assert r.returncode == 2 and "--kv-budget" in r.stderr and repr(bad) in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_kv_budget_is_its_bytes_and_the_label_written_and_one_budget_runs_once(tiny_model, tmp_path):
    """16MiB and 16777216 are one budget: --kv-budgets keeps the first label and runs it once; run.json's
    config keeps the labels, and serve reads the bytes bench hands it as the same budget."""
    from harness.cli import build_parser
    from harness.cli.bench import config
    from harness.units import KvBudget

    serve = build_parser().parse_args(["serve", "--engine", "paged", "--model", "m", "--kv-budget", "16777216"])
    assert serve.kv_budget == KvBudget.parse("16MiB") and serve.kv_budget.bytes == 2**24
    default = build_parser().parse_args(["serve", "--engine", "paged", "--model", "m"]).kv_budget
    assert default.bytes == 128 * 2**20 and str(default) == "128MiB"
    args = build_parser().parse_args(["bench", "--engines", "paged", "--model", str(tiny_model), "--out", str(tmp_path),
                                      "--device", "cpu", "--kv-budgets", "16MiB, 16777216,32MiB,33554432"])
    cfg = config(args)
    assert [(b.bytes, str(b)) for b in cfg.kv_budgets] == [(2**24, "16MiB"), (2**25, "32MiB")]
    assert cfg.kv_budget == KvBudget.parse("16777216") and str(cfg.kv_budget) == "16MiB"
    record = cfg.record()
    assert record["kv_budget"] == "16MiB" and record["kv_budgets"] == ["16MiB", "32MiB"]
    json.dumps(record, default=str)  # what run.json writes


def test_the_recorded_labels_are_read_into_bytes_once_where_the_run_is_read():
    """run.json keeps each budget's label; the readers take its bytes from the run's typed config (RunConfig);
    a bench of targets alone records `own` (their own memory), which has no bytes of ours."""
    from harness.analysis.records import RunRecord

    cfg = RunRecord.of({"config": {"kv_budget": "16MiB", "kv_budgets": ["16MiB", "0.5GiB"]}}).config
    assert {b.label: b.bytes for b in cfg.budgets} == {"16MiB": 2**24, "0.5GiB": 2**29}
    assert cfg.budget.bytes == 2**24 and str(cfg.budget) == "16MiB"
    assert RunRecord.of({"config": {"kv_budget": "own"}}).config.budget is None
    assert RunRecord.of({"config": {}}).config.budget is None


def test_bench_runs_each_budget_once_by_bytes_and_records_the_labels(tmp_path):
    """Bench.budgets de-duplicates by bytes (the run's own label kept); run.json's config keeps each label."""
    from harness.run.bench import Bench, BenchConfig
    from harness.units import KvBudget

    own, same, more = KvBudget.parse("16777216"), KvBudget.parse("16MiB"), KvBudget.parse("32MiB")
    bench = Bench(BenchConfig(engines=[], model="m", kv_budget=own, kv_budgets=[same, more], out_dir=tmp_path,
                              workload="mixed-churn", duration_s=1, run_id="w"))
    assert [(b.bytes, str(b)) for b in bench.budgets] == [(2**24, "16777216"), (2**25, "32MiB")]
    config = json.loads((tmp_path / "w" / "run.json").read_text())["config"]
    assert config["kv_budget"] == "16777216" and config["kv_budgets"] == ["16MiB", "32MiB"]
