"""`fragbench ab`'s figures and verdicts (harness/analysis/ab.py) and its command line; the measurement itself
(servers from two trees, a bench per turn) is the same bench `make bench` runs, timed by hand (docs/method.md)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from harness.analysis.ab import (
    FixedSide,
    TurnRatio,
    knee_figure,
    margin_rate,
    operating_figures,
    overall,
    pooled,
    side_name,
    verdict_of,
)
from harness.analysis.knee import Judged
from harness.analysis.summary_records import CapacityPoint
from harness.run.ab_runs import side_order
from tests.conftest import run_cli
from workloads.streams import key_of, snap


@pytest.mark.parametrize(("ci", "higher", "verdict"), [
    ((0.95, 1.04), True, "PASS"), ((0.70, 0.85), True, "FAIL"), ((0.85, 1.02), True, "INCONCLUSIVE"),
    ((1.15, 1.30), True, "INCONCLUSIVE"), ((1.15, 1.30), False, "FAIL"), ((0.70, 0.85), False, "INCONCLUSIVE"),
    ((0.92, 1.08), False, "PASS"), (None, True, "INCONCLUSIVE")])
def test_a_figure_fails_wholly_on_the_worse_side_and_passes_inside_the_threshold(ci, higher, verdict):
    assert verdict_of(ci, 0.10, higher) == verdict


def test_the_overall_verdict_is_the_worst():
    assert overall(["PASS", "PASS"]) == "PASS" and overall(["PASS", "INCONCLUSIVE"]) == "INCONCLUSIVE"
    assert overall(["INCONCLUSIVE", "FAIL", "PASS"]) == "FAIL" and overall([]) == "INCONCLUSIVE"


def test_turns_are_abba():
    assert [side_order(k) for k in range(3)] == [("base", "new"), ("new", "base"), ("base", "new")]


def test_pooling_weighs_the_tighter_turn_and_narrows():
    loose, tight = TurnRatio(1.0, 1.2, math.log(1.2), 0.2), TurnRatio(1.0, 1.0, 0.0, 0.02)
    _, _, ratio, ci = pooled([loose, tight])
    assert 1.0 <= ratio < 1.01 and ci[1] - ci[0] < 2 * 1.6449 * 0.02 * 1.01


def test_turns_that_disagree_beyond_their_intervals_widen_the_pooled_one():
    """An A/A whose AB turn met a busy machine during B (3.9x, tight) and whose BA turn did not (1.0x): the
    spread between turns enters the interval, which then holds 1 (no FAIL)."""
    busy, quiet = TurnRatio(1.0, 3.9, math.log(3.9), 0.1), TurnRatio(1.0, 1.0, 0.0, 0.1)
    _, _, _, ci = pooled([busy, quiet])
    assert ci[0] < 1 < ci[1]
    _, _, _, agree = pooled([TurnRatio(1.0, 1.0, 0.01, 0.03), TurnRatio(1.0, 1.0, -0.01, 0.03)])
    assert 0.95 < agree[0] and agree[1] < 1.05


def curve(rate: float, knee: float) -> float:
    return 1 / (1 + math.exp(-(math.log(9) - 25 * (math.log(rate) - math.log(knee)))))


def points(rng, knee: float, n: int = 80) -> list[Judged]:
    rates = [snap(knee * f) for f in (0.8, 0.93, 1.0, 1.07, 1.2)]
    return [Judged(r, key_of(r, i + 1), (rng.random(n) < curve(r, knee)).astype(float), np.arange(n))
            for i, r in enumerate(rates)]


def test_the_knee_ratio_fails_a_slower_new_build_and_holds_one_on_a_a():
    """Two turns each: NEW's knee 30 % under BASE's FAILs; the same knee on both sides never FAILs."""
    rng = np.random.default_rng(5)
    slower = [{side_name("paged", "base"): points(rng, 3.0), side_name("paged", "new"): points(rng, 2.1)}
              for _ in range(2)]
    f = knee_figure("paged", slower, 0.9, 0.10)
    assert f.verdict == "FAIL" and f.ci[1] < 0.9 and f.base > f.new
    same = [{side_name("paged", "base"): points(rng, 3.0), side_name("paged", "new"): points(rng, 3.0)}
            for _ in range(2)]
    g = knee_figure("paged", same, 0.9, 0.10)
    assert g.verdict != "FAIL" and g.ci[0] < 1 < g.ci[1]
    assert knee_figure("paged", [{}], 0.9, 0.1).verdict == "INCONCLUSIVE"


def test_the_margin_rate_is_half_the_lower_knee_interval_s_low_end():
    rng = np.random.default_rng(7)
    turns = [{side_name("paged", "base"): points(rng, 3.0), side_name("paged", "new"): points(rng, 2.4)}]
    rate = margin_rate("paged", turns, 0.9)
    assert rate is not None and 0.8 < rate <= 0.5 * 2.4  # half of new's lower end (about 2.2), on the grid
    assert margin_rate("paged", [{side_name("paged", "base"): points(rng, 3.0)}], 0.9) is None


def fixed(tpot_scale: float, seed: int, failed: int = 0, n: int = 30) -> FixedSide:
    """A fixed-rate point of n requests whose sizes (hence latencies) vary 3x between requests, as a stream's
    do; `tpot_scale` the build's speed, 2 % noise per request, `failed` requests failed (every fifth)."""
    sizes = np.random.default_rng(0).uniform(1, 3, n)  # the stream: the same on both sides
    noise = np.random.default_rng(seed).normal(1, 0.02, n)
    ok = ~((np.arange(n) % 5 == 4) & (np.arange(n) < 5 * failed))
    requests = pd.DataFrame({"stream_index": np.arange(n), "arrival_s": np.arange(n) / 1.5,
                             "status": np.where(ok, "ok", "error"), "ttft_s": 0.05 * sizes * noise,
                             "tpot_s": 0.01 * sizes * noise * tpot_scale, "output_tokens": (40 * sizes).round()})
    point = CapacityPoint.model_validate({"key": "g2", "offered_rps": 1.5, "slo_attainment": 1.0, "steady": True})
    return FixedSide(point, requests)


def test_latency_at_the_fixed_rate_pairs_the_requests_and_fails_a_slower_step():
    """The requests' own spread (3x) cancels in the pairing: 20 % slower steps FAIL, an A/A PASSes."""
    turns = [{"paged.base": fixed(1.0, 2 * k), "paged.new": fixed(1.2, 2 * k + 1)} for k in range(2)]
    figures = {f.figure: f for f in operating_figures("paged", turns, 0.10, 0.9)}
    assert figures["tpot_p50_s"].verdict == "FAIL" and figures["tpot_p50_s"].ratio == pytest.approx(1.2, abs=0.03)
    assert figures["ttft_p50_s"].verdict == "PASS" and figures["output_tokens_per_s"].verdict == "PASS"
    same = [{"paged.base": fixed(1.0, 2 * k), "paged.new": fixed(1.0, 2 * k + 1)} for k in range(2)]
    assert {f.verdict for f in operating_figures("paged", same, 0.10, 0.9)} == {"PASS"}
    none = operating_figures("paged", [{"paged.base": fixed(1.0, 0)}], 0.10, 0.9)
    assert {f.verdict for f in none} == {"INCONCLUSIVE"}
    one_order = operating_figures("paged", turns[:1], 0.10, 0.9)  # AB alone: the machine's drift is not told apart
    assert {f.verdict for f in one_order} == {"INCONCLUSIVE"} and all(f.ci is None for f in one_order)


def test_requests_new_failed_count_against_its_tokens():
    turns = [{"paged.base": fixed(1.0, 2 * k), "paged.new": fixed(1.0, 2 * k + 1, failed=6)} for k in range(2)]
    tokens = {f.figure: f for f in operating_figures("paged", turns, 0.10, 0.9)}["output_tokens_per_s"]
    assert tokens.verdict == "FAIL" and tokens.ratio < 0.85


def test_bad_input_is_one_line(tmp_path, tiny_model):
    for args in (["no-such-revision-xyz", "--model", str(tiny_model)], ["HEAD", "--engines", "nosuch"],
                 ["HEAD", "--engines", "paged", "--threshold", "0"], ["HEAD", "--model", str(tmp_path)],
                 ["HEAD", "--new-engine-args", "paged=--inject-kv-fault nosuch"]):
        r = run_cli("ab", *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_the_text_and_the_page_name_every_figure_and_the_memory_gate(tmp_path):
    from harness.analysis.ab import figure
    from harness.analysis.memory_gate import MemorySide, PolicyMemory, gate
    from harness.views.ab_page import render_text, write_page
    from tests.test_memory_gate import FIGURES

    side = MemorySide(trace={"workload": "mixed-churn"}, policies={"paged": PolicyMemory(**FIGURES)})
    memory = gate(side, side)
    figures = [figure("paged", "knee", 3.0, 2.0, 0.667, (0.6, 0.75), 0.1),
               figure("paged", "tpot_p50_s", None, None, None, None, 0.1, "no shared stream")]
    text = render_text("FAIL", figures, memory, 0.1, [tmp_path / "turn1"])
    assert "ab: FAIL" in text and "[0.600, 0.750]" in text and "no shared stream" in text
    assert "memory gate: PASS" in text
    page = write_page("FAIL", figures, memory, ("HEAD", "working tree"), [tmp_path / "turn1"], tmp_path / "ab.html")
    assert "tpot_p50_s" in page.read_text() and "Memory gate: PASS" in page.read_text()


def test_a_build_s_run_waits_until_no_server_holds_a_request(monkeypatch):
    """The other build's server, still decoding what the last run left it, would share the machine with the next
    build's run: quiesce waits for both to hold nothing."""
    from types import SimpleNamespace

    import harness.run.ab_runs as ab_runs

    held = {"http://a": [2, 1, 0], "http://b": [0]}

    def stats(url):
        queue = held[url]
        return SimpleNamespace(running=queue.pop(0) if len(queue) > 1 else queue[0], waiting=0)

    monkeypatch.setattr(ab_runs, "fetch_stats", stats)
    monkeypatch.setattr(ab_runs.time, "sleep", lambda s: None)
    said = []
    ab_runs.quiesce({"paged.base": "http://a", "paged.new": "http://b"}, said.append)
    assert held["http://a"] == [0] and said == []
    monkeypatch.setattr(ab_runs, "QUIET_S", 0.0)
    held["http://a"] = [5]
    ab_runs.quiesce({"paged.base": "http://a"}, said.append)
    assert said and "paged.base still held" in said[0]
