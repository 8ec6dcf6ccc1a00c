"""The operating-point gate: figures at the stream two runs both measured below the knee, with intervals."""

import json
from pathlib import Path

import numpy as np
import pandas as pd

from harness.analysis import operating
from harness.analysis.operating import block_indices, point_intervals
from harness.analysis.summary_records import CapacityBlock
from tests.conftest import run_cli
from tests.helpers import speed_probe


def test_block_indices_are_circular_runs_of_neighbours():
    idx = block_indices(27, np.random.default_rng(0), replicates=50)
    assert idx.shape == (50, 27) and idx.min() >= 0 and idx.max() < 27
    steps = np.diff(idx[:, :3], axis=1)  # a block of 3 (27 ** (1/3)) is 3 consecutive indices, wrapping at 27
    assert set(np.unique(steps % 27)) == {1}


def requests(n: int, ttft_s: float, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"status": "ok", "arrival_s": np.arange(n, dtype=float),
                         "ttft_s": ttft_s * rng.lognormal(0, 0.3, n), "tpot_s": 0.02 * rng.lognormal(0, 0.2, n),
                         "output_tokens": rng.integers(10, 60, n)})


def samples(n: int, used: float) -> pd.DataFrame:
    return pd.DataFrame({"t_s": np.arange(n, dtype=float), "kv_capacity_bytes": 1000.0,
                         "allocated_bytes": used * 1000 * (1 + 0.1 * np.sin(np.arange(n)))})


def test_point_intervals_hold_the_estimate_and_narrow_with_more_requests():
    few = point_intervals(requests(20, 0.1), samples(20, 0.5), 20.0, "g3")
    many = point_intervals(requests(400, 0.1), samples(400, 0.5), 400.0, "g3")
    for out, rows in ((few, requests(20, 0.1)), (many, requests(400, 0.1))):
        lo, hi = out["ttft_p50_s_ci"]
        assert lo <= float(np.median(rows.ttft_s)) <= hi
        assert out["output_tokens_per_s_ci"][0] <= out["output_tokens_per_s"] <= out["output_tokens_per_s_ci"][1]
        assert out["kv_usage_ci"][0] < 0.5 < out["kv_usage_ci"][1]
    width = {k: v["ttft_p50_s_ci"][1] - v["ttft_p50_s_ci"][0] for k, v in (("few", few), ("many", many))}
    assert width["many"] < width["few"] / 2
    assert point_intervals(requests(1, 0.1), samples(1, 0.5), 1.0, "g0")["ttft_p50_s_ci"] is None


def point(key: str, rate: float, attainment: float, steady: bool = True, ttft: float = 0.1) -> dict:
    return {"key": key, "offered_rps": rate, "slo_attainment": attainment, "steady": steady,
            "ttft_p50_s": ttft, "ttft_p50_s_ci": [0.95 * ttft, 1.05 * ttft], "tpot_p50_s": 0.02,
            "tpot_p50_s_ci": [0.019, 0.021], "output_tokens_per_s": 50.0, "output_tokens_per_s_ci": [45.0, 55.0],
            "kv_usage": 0.4, "kv_usage_ci": [0.38, 0.42]}


def block(*points: dict) -> dict:
    return {"sustained_rps": 3.0, "sustained_rps_ci": [2.5, 3.5], "slo": {"attainment": 0.9}, "points": list(points)}


def shared_point(base: dict, new: dict):
    """The operating point of two capacity blocks as summary.json has them, read as compare reads them."""
    return operating.shared_point(CapacityBlock.model_validate(base), CapacityBlock.model_validate(new))


def test_the_shared_point_is_the_highest_stream_both_runs_sustained():
    base = block(point("g1", 1.0, 1.0), point("g3", 2.0, 0.95), point("g4", 2.6, 0.97), point("g6", 4.0, 0.3))
    new = block(point("g1", 1.0, 1.0), point("g3", 2.0, 0.99), point("g4", 2.6, 0.8), point("g5", 3.1, 0.95))
    b, n = shared_point(base, new)  # g4 missed the SLO in the new run, g5 and g6 were measured once
    assert b.key == n.key == "g3"
    unsteady = block(point("g3", 2.0, 0.95, steady=False))
    assert shared_point(base, unsteady) is None


def test_a_paired_stream_is_shared_only_at_one_rate():
    """A paired key (the decision's turn n) is read at whatever rate its turn placed it: one key at two rates
    judged the same requests under two loads, which is no shared point."""
    base = block(point("g3", 2.0, 1.0), point("p0", 2.4, 1.0))
    new = block(point("g3", 2.0, 1.0), point("p0", 2.2, 1.0))
    b, n = shared_point(base, new)
    assert b.key == n.key == "g3"
    new["points"].append(point("p1", 2.4, 1.0))
    base["points"].append(point("p1", 2.4, 0.95))
    b, n = shared_point(base, new)
    assert (b.key, b.offered_rps) == (n.key, n.offered_rps) == ("p1", 2.4)


def test_the_shared_point_lies_below_both_runs_sustained_rate_intervals():
    """A stream inside one run's knee interval is not an operating point: there one run may queue and the
    other not (two runs of one commit put paged's TTFT p50 at 0.13 and 0.64 s at 3.83/s, inside its knee's
    interval [3.39, 4.29]). The highest stream below both lower ends is, and ties go to the first realization."""
    base = block(point("g3", 2.0, 1.0), point("g3r1", 2.0, 1.0), point("g5", 3.1, 0.95))
    new = block(point("g3r1", 2.0, 1.0), point("g3", 2.0, 1.0), point("g5", 3.1, 0.93))
    new["sustained_rps_ci"] = [3.0, 3.6]  # g5 (3.1) met the SLO in both, but lies inside base's [2.5, 3.5]
    b, n = shared_point(base, new)
    assert b.key == n.key == "g3"
    base["sustained_rps_ci"] = None
    base["sustained_rps"] = 1.5  # without an interval the estimate is the ceiling: no stream below it
    assert shared_point(base, new) is None


def fake_run(path: Path, ttft: float, other_ttft: float = 0.1) -> Path:
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"run_id": path.name, "status": "complete",
                                               "speed_probe": speed_probe()}))  # one machine: absolute figures gate
    cap = {"paged": block(point("g2", 1.5, 1.0), point("g3", 2.0, 0.95, ttft=ttft), point("g6", 4.0, 0.2)),
           "static-oracle": block(point("g1", 1.0, 1.0, ttft=other_ttft), point("g4", 2.6, 0.4))}
    (path / "summary.json").write_text(json.dumps({"run_id": path.name, "status": "complete",
                                                   "engines": {e: {} for e in cap}, "capacity": cap}))
    return path


def test_compare_gates_each_engines_operating_point_and_names_its_rate(tmp_path):
    """TTFT p50 1.5x at paged's shared stream (intervals +-5 %: they separate) is a regression named with its
    rate; static-oracle's unchanged point is not; 1.03x (intervals overlap) is no measurable difference."""
    base, slow, same = fake_run(tmp_path / "base", 0.1), fake_run(tmp_path / "slow", 0.15), \
        fake_run(tmp_path / "same", 0.103)
    bad = run_cli("compare", str(base), str(slow), "--out", str(tmp_path / "b.html"))
    assert bad.returncode == 1, bad.stdout
    flagged = [line for line in bad.stdout.splitlines() if "REGRESSION" in line]
    assert len(flagged) == 1 and flagged[0].startswith("paged") and "ttft_p50_s at 2/s" in flagged[0]
    assert "static-oracle" in bad.stdout and "kv_usage at 1/s" in bad.stdout
    ok = run_cli("compare", str(base), str(same), "--out", str(tmp_path / "a.html"))
    assert ok.returncode == 0 and "REGRESSION" not in ok.stdout
    assert "operating point" in (tmp_path / "a.html").read_text()


def test_an_engines_pooled_rates_are_over_its_judged_spans_not_the_time_to_its_last_request():
    """Two points of 20 judged seconds each, the second 500 s later (the decision revisits the engine after the
    others' turns), each with 40 judged requests of 10 output tokens and 10 sent in its warm-up: by hand, 80
    judged requests over 40 s are 2.0 req/s and 20 output tokens/s; the time to the last request (525 s) would
    give 0.18 req/s. The requests column still counts every request sent."""
    from harness.analysis.records import RunRecord
    from harness.analysis.summary import engine_summary
    from harness.results import COLUMNS

    points, rows = [], []
    for i, start in enumerate((0.0, 500.0)):
        points.append({"point": i, "offered_rps": 2.0, "key": f"g16r{i}",
                       "segments": [{"point": i, "start_s": start, "end_s": start + 30, "warmup_s": 5.0,
                                     "judged_end_s": start + 25}]})
        for t in np.r_[np.arange(10) * 0.5, 5 + np.arange(40) * 0.5]:
            rows.append({"engine": "paged", "point": i, "arrival_s": start + t, "end_s": start + t + 1.0,
                         "status": "ok", "output_tokens": 10, "ttft_s": 0.1, "tpot_s": 0.02, "e2e_s": 1.0})
    req = pd.DataFrame(rows).reindex(columns=[*COLUMNS["requests"], "point"])
    req["status"], req["error"] = "ok", None
    meta = {"config": {"kv_budget": "16MiB"}, "sweep": {"points": {"paged": points}}}
    out = engine_summary("paged", req, pd.DataFrame(columns=COLUMNS["samples"]),
                         pd.DataFrame(columns=COLUMNS["events"]), RunRecord.of(meta))
    assert out.requests_per_s == 2.0 and out.output_tokens_per_s == 20.0 and out.figure("window_s") == 40.0
    assert out.figure("requests") == out.requests_ok == 100


def test_the_fixed_operating_point_is_gated_where_both_runs_measured_it(tmp_path):
    """Every default run measures each engine first at a rate from the repository's table, on a stream no search
    reaches: the pair's operating point, whatever else the two searches visited."""
    from harness.analysis.operating import (
        OPERATING_REPLICATION,
        TABLE,
        fixed_point,
        operating_key,
        operating_rate,
        rule_rate,
    )
    from workloads.streams import replication_of, snap

    assert rule_rate([3.39]) == snap(1.68) and rule_rate([3.39]) <= 0.5 * 3.39
    assert rule_rate([0.9]) is None and rule_rate([]) is None  # 30 judged requests at 0.45/s: over a minute
    key = operating_key(1.681793)
    assert replication_of(key) == OPERATING_REPLICATION
    table = json.loads(TABLE.read_text())["tables"]["mixed-churn/16777216/tiny-llama"]
    assert operating_rate("workloads/presets/mixed-churn.yaml", 16 * 2**20, "models/tiny-llama", "paged") == \
        table["paged"] and snap(table["paged"]) == table["paged"]
    assert operating_rate("mixed-churn", 32 * 2**20, "models/tiny-llama", "paged") is None
    fixed = point(key, 1.681793, 1.0, ttft=0.05)
    base = {**block(point("g3", 2.0, 0.95), fixed), "operating_point": {"offered_rps": 1.681793, "keys": [key]}}
    new = {**block(point("g3", 2.0, 0.95), {**fixed, "ttft_p50_s": 0.06}),
           "operating_point": {"offered_rps": 1.681793, "keys": [key]}}
    assert fixed_point(*(CapacityBlock.model_validate(b) for b in (base, new)))[0].key == key
    assert shared_point(base, new)[1].ttft_p50_s == 0.06
    assert shared_point({**base, "operating_point": None}, new)[0].key == "g3"  # one run without it: the rule
