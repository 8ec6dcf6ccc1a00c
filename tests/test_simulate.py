"""fragbench simulate against the vLLM paper's Figure 2, and its inputs."""

import json

import pytest

from tests.conftest import run_cli

PAPER_CMD = ("simulate", "--model", "llama-2-13b", "--gpu", "a100-40gb", "--workload", "paper", "--policy",
             "static-max,static-pow2,static-oracle,paged", "--json")


@pytest.fixture(scope="module")
def paper(tmp_path_factory):
    report = tmp_path_factory.mktemp("sim") / "sim.html"
    r = run_cli(*PAPER_CMD, "--report", str(report), timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), report


def test_paper_figure_2_within_five_points(paper):
    out, _ = paper
    p = out["policies"]
    assert abs(100 * p["static-max"]["token_states_share"] - 20.4) <= 5
    assert abs(100 * p["paged"]["token_states_share"] - 96.3) <= 5
    order = [p[n]["token_states_share"] for n in ("static-max", "static-pow2", "static-oracle", "paged")]
    assert order == sorted(order)
    assert p["paged"]["mean_running"] >= 3 * p["static-max"]["mean_running"]
    assert (p["static-max"]["placement"], p["static-pow2"]["placement"], p["static-oracle"]["placement"]) == (
        "buddy", "buddy", "best-fit")


def test_every_policy_accounts_for_all_of_its_capacity(paper):
    out, _ = paper
    for result in out["policies"].values():
        shares = [result[k] for k in result if k.endswith("_share")]
        assert abs(sum(shares) - 1) < 1e-6 and min(shares) >= 0
        assert result["requests_completed"] + result["requests_oom"] == out["requests"]
    assert out["kv_budget_bytes"] > 11e9 and out["step_model"]["kv_bytes_per_token"] == 819_200


def test_report_page_has_the_breakdown_and_the_paper_bars(paper):
    _, report = paper
    html = report.read_text()
    assert 'id="figure2"' in html.replace("'", '"') and "Orca (Max)" in html


def test_naive_static_admission_oom_counts_concurrency(tmp_path):
    r = run_cli("simulate", "--model", "llama-2-13b", "--gpu", "a100-80gb", "--workload", "paper", "--max-seq-len",
                "4096", "--policy", "static-max", "--no-preflight", "--placement", "best-fit", "--requests", "300",
                "--json")
    out = json.loads(r.stdout)["policies"]["static-max"]
    plan = json.loads(run_cli("plan", "--model", "llama-2-13b", "--gpu", "a100-80gb", "--max-seq-len", "4096",
                              "--json").stdout)
    assert out["oom_total"] > 0 and out["first_oom_running"] == plan["static_max_concurrency"]


@pytest.mark.parametrize(
    "args",
    [("--policy", "banana"), ("--gpu", "tpu"), ("--workload", "/no/such.csv"), ("--model", "nope")],
)
def test_bad_simulate_input_exits_2(args):
    base = {"--model": "llama-2-13b", "--gpu": "a100-40gb", "--workload": "paper", "--policy": "paged"}
    base[args[0]] = args[1]
    r = run_cli("simulate", *[x for kv in base.items() for x in kv], "--requests", "10")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
