"""compare honest about the machine: run.json's speed probe (analysis/speed_probe.py) decides whether absolute
figures gate; the same-run ratios gate always; the fixed operating point gates only where it is one."""

from __future__ import annotations

import json
from pathlib import Path

from harness.analysis.operating import fixed_point, shared_point
from harness.analysis.speed_probe import SpeedProbe, agreement
from harness.analysis.summary_records import CapacityBlock
from harness.run.speed_probes import reading
from tests.conftest import run_cli
from tests.helpers import speed_probe


def probe(scale: float = 1.0, **changed) -> SpeedProbe:
    return SpeedProbe.model_validate({**speed_probe(scale), **changed})


def test_one_machine_agrees_and_a_slower_one_differs():
    assert agreement(probe(), probe(1.04)).same  # within the floor's 10 %
    slow = agreement(probe(), probe(1.5))
    assert not slow.same and "the machine differed" in slow.sentence() and "+50 %" in slow.sentence()
    assert not agreement(None, probe()).same and "BASE recorded no speed probe" in agreement(None, probe()).sentence()


def test_a_run_that_drifted_gates_no_absolute_figure():
    """A run whose own moments moved 1.4x (a hog from its middle on) cannot say which machine it ran on: even a
    second run of the same speed as its start does not agree with it."""
    drifted = speed_probe()
    for r, f in zip(drifted["readings"], (1.0, 1.4, 1.4), strict=True):
        r["compute_s"], r["interpreter_s"] = [0.010 * f] * 3, [0.015 * f] * 3
    verdict = agreement(probe(), SpeedProbe.model_validate(drifted))
    assert not verdict.same and "NEW's compute_s moved x1.40 within the run" in verdict.sentence()


def test_a_moment_is_its_fastest_repetition():
    """One slow repetition (another process took the core) moves nothing."""
    noisy = speed_probe()
    noisy["readings"][1]["compute_s"] = [0.010, 0.200, 0.011]
    assert agreement(probe(), SpeedProbe.model_validate(noisy)).same


def test_a_reading_times_both_probes_several_times():
    r = reading("start")
    assert r["at"] == "start" and len(r["compute_s"]) == len(r["interpreter_s"]) == 7
    assert min(r["compute_s"] + r["interpreter_s"]) > 0


def point(key: str, rate: float, attainment: float = 1.0, steady: bool = True, ttft: float = 0.1) -> dict:
    return {"key": key, "offered_rps": rate, "slo_attainment": attainment, "steady": steady, "ttft_p50_s": ttft,
            "ttft_p50_s_ci": [0.95 * ttft, 1.05 * ttft], "tpot_p50_s": 0.02, "tpot_p50_s_ci": [0.019, 0.021],
            "output_tokens_per_s": 50.0, "output_tokens_per_s_ci": [45.0, 55.0], "kv_usage": 0.4,
            "kv_usage_ci": [0.38, 0.42]}


def block(rps: float, ci: list[float], *points: dict, fixed: str | None = None) -> dict:
    return {"sustained_rps": rps, "sustained_rps_ci": ci, "slo": {"attainment": 0.9}, "points": list(points),
            "operating_point": {"offered_rps": None, "keys": [fixed] if fixed else []}}


def test_the_fixed_point_gates_only_where_it_was_an_operating_point():
    """Paged's table rate 3.83/s against a knee of 3.76 [3.00, 4.37]: inside the interval, so the rule's point
    (g2, under both lower ends) stands in; the same key well under the knee is the fixed point; unsteady or
    missing the SLO in one run, it is not."""
    fixed = "g20r1000"
    inside = [block(3.76, [3.0, 4.37], point("g2", 1.5), point(fixed, 3.83), fixed=fixed) for _ in range(2)]
    blocks = [CapacityBlock.model_validate(b) for b in inside]
    assert fixed_point(*blocks) is None and shared_point(*blocks)[0].key == "g2"
    under = [CapacityBlock.model_validate(block(5.0, [4.5, 5.5], point("g2", 1.5), point(fixed, 3.83), fixed=fixed))
             for _ in range(2)]
    assert fixed_point(*under)[0].key == fixed
    for bad in (point(fixed, 3.83, steady=False), point(fixed, 3.83, attainment=0.7)):
        missed = CapacityBlock.model_validate(block(5.0, [4.5, 5.5], point("g2", 1.5), bad, fixed=fixed))
        assert fixed_point(under[0], missed) is None and shared_point(under[0], missed)[0].key == "g2"


def fake_run(path: Path, scale: float, rps: float, ratio: float, probe_scale: float | None = 1.0) -> Path:
    """paged and static-oracle, paged's rate `rps` and its ratio to hf (a third engine) `ratio`: a run of one
    machine's speed x `probe_scale` (None: an older run without a probe)."""
    path.mkdir(parents=True)
    meta = {"run_id": path.name, "status": "complete"}
    if probe_scale is not None:
        meta["speed_probe"] = speed_probe(probe_scale)
    (path / "run.json").write_text(json.dumps(meta))
    cap = {"paged": block(rps, [0.9 * rps, 1.1 * rps]), "static-oracle": block(1.5 * scale, [1.4 * scale, 1.6 * scale]),
           "hf": block(0.5 * scale, [0.45 * scale, 0.55 * scale])}
    ratios = {"paged/static-oracle": {"ratio": rps / (1.5 * scale), "ratio_ci": [0.95 * rps / (1.5 * scale),
                                                                                  1.05 * rps / (1.5 * scale)]},
              "paged/hf": {"ratio": ratio, "ratio_ci": [0.95 * ratio, 1.05 * ratio]}}
    headline = {"engine": "paged", "against": "static-oracle", "ratio": ratios["paged/static-oracle"]["ratio"],
                "ratio_ci": ratios["paged/static-oracle"]["ratio_ci"], "bracketed": {"paged": True,
                                                                                  "static-oracle": True}}
    (path / "summary.json").write_text(json.dumps({"run_id": path.name, "status": "complete",
                                                   "engines": {e: {} for e in cap}, "capacity": cap,
                                                   "capacity_ratios": ratios, "headline": headline}))
    return path


def compare(base: Path, new: Path, tmp_path: Path):
    return run_cli("compare", str(base), str(new), "--out", str(tmp_path / f"{new.name}.html"))


def test_a_slow_machine_flags_no_absolute_figure_and_says_so(tmp_path):
    """Every engine 1.6x slower with the probe 1.6x slower: the rates' intervals separate, but the machine
    differed, so nothing is a regression and compare exits 0; the same figures on an agreeing probe fail."""
    base = fake_run(tmp_path / "base", 1.0, 3.0, 6.0)
    slow_night = fake_run(tmp_path / "slow", 1 / 1.6, 3.0 / 1.6, 6.0, probe_scale=1.6)
    r = compare(base, slow_night, tmp_path)
    assert r.returncode == 0 and "REGRESSION" not in r.stdout, r.stdout
    assert "the machine differed" in r.stdout and "not gated" in r.stdout
    same_machine = fake_run(tmp_path / "same", 1 / 1.6, 3.0 / 1.6, 6.0)
    assert compare(base, same_machine, tmp_path).returncode == 1
    unprobed = fake_run(tmp_path / "old", 1 / 1.6, 3.0 / 1.6, 6.0, probe_scale=None)
    r = compare(base, unprobed, tmp_path)
    assert r.returncode == 0 and "NEW recorded no speed probe" in r.stdout


def test_a_same_run_ratio_gates_whatever_the_machine(tmp_path):
    """paged's ratio to hf (one run, interleaved) down a third on a differing machine: a regression all the same."""
    base = fake_run(tmp_path / "base", 1.0, 3.0, 6.0)
    worse = fake_run(tmp_path / "worse", 1 / 1.6, 3.0 / 1.6, 4.0, probe_scale=1.6)
    r = compare(base, worse, tmp_path)
    flagged = [line for line in r.stdout.splitlines() if "REGRESSION" in line]
    assert r.returncode == 1 and len(flagged) == 1 and flagged[0].startswith("paged/hf"), r.stdout


def test_a_same_run_ratio_over_a_bound_is_shown_not_gated(tmp_path):
    base = fake_run(tmp_path / "base", 1.0, 3.0, 6.0)
    worse = fake_run(tmp_path / "worse", 1.0, 3.0, 4.0)
    summary = json.loads((worse / "summary.json").read_text())
    summary["capacity"]["hf"]["sustained_where"] = "beyond"  # every rate hf was offered met the SLO: a bound
    (worse / "summary.json").write_text(json.dumps(summary))
    r = compare(base, worse, tmp_path)
    row = next(line for line in r.stdout.splitlines() if line.startswith("paged/hf"))
    assert r.returncode == 0 and "a ratio of bounds, not gated" in row, r.stdout
