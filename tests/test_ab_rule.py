"""The A/B gate's rule (harness/analysis/ab_rule.py) on constructed pairs: the order term, the floor tested at
planned looks with ALPHA spent over them, PASS's planned looks, PASS and FAIL exclusive at every look, the block
shares' sign test (a failure excess FAILs, an A/A whose blocks hiccup does not), and a night past its last look
settled. Its operating characteristic is benchmarks/ab_study.py's (docs/method.md, Nightly)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.analysis.ab import (
    ALPHA,
    MIN_LOOK_PAIRS,
    MISS_MARGIN,
    PASS_LOOK_EVERY,
    PASS_LOOKS,
    EngineGate,
    PairFigures,
    decide,
    decide_misses,
    fail_alpha,
    fail_looks,
    fit_pairs,
    pass_confidence,
)
from harness.analysis.ab_rule import last_look, sign_p
from tests.test_ab import gate_of


def series(rng, mu: float, spread: float, k: int, order_effect: float = 0.0) -> tuple[list[float], list[int]]:
    order = [1 if i % 2 == 0 else -1 for i in range(k)]
    return [mu + order_effect * o + spread * rng.standard_normal() for o in order], order


def test_the_order_term_takes_out_what_the_second_run_of_a_pair_meets():
    """Every pair's second build reads 10 % slower (the machine, not the build): the build's effect stays 0."""
    y = [0.1 if k % 2 else -0.1 for k in range(10)]  # AB: new second, +0.1; BA: base second, -0.1
    f = fit_pairs(np.array(y) * -1, np.array([1 if k % 2 == 0 else -1 for k in range(10)]))
    assert abs(f.mu) < 1e-9 and f.se < 1e-6
    assert fit_pairs(np.zeros(5), np.array([1, -1, 1, -1, 1])) is None  # under the first look
    assert fit_pairs(np.zeros(8), np.ones(8)) is None  # one order alone tells no build from the machine


def test_an_a_a_night_passes_and_a_few_pairs_do_not():
    rng = np.random.default_rng(1)
    y, order = series(rng, 0.0, 0.08, 10)
    assert decide(y, order, 0.10, 10).verdict == "PASS"
    assert decide(y[:8], order[:8], 0.10, 10).verdict == "INCONCLUSIVE"  # fewer pairs than a PASS needs
    noisy, order = series(rng, 0.0, 0.6, 10)
    noisy = list(np.array(noisy) - np.mean(noisy))  # no change, measured loosely: no PASS
    assert decide(noisy, order, 0.10, 10).verdict == "INCONCLUSIVE"


def test_an_improvement_passes():
    y, order = series(np.random.default_rng(2), -math.log(1.2), 0.08, 10)
    assert decide(y, order, 0.10, 10).verdict == "PASS"


def test_fail_is_looked_at_every_pair_to_the_last_look_its_alpha_shared():
    """FAIL's looks: every pair from MIN_LOOK_PAIRS to the last PASS look (6..22 with --pairs 10), ALPHA spent
    equally over them, so a night's chance of a FAIL at the floor is at most ALPHA wherever it ends."""
    assert last_look(10) == 10 + PASS_LOOK_EVERY * (PASS_LOOKS - 1) == 22
    assert fail_looks(10) == 22 - MIN_LOOK_PAIRS + 1 and fail_alpha(10) == pytest.approx(ALPHA / fail_looks(10))


def test_a_regression_fails_at_the_first_look_the_pairs_show_it():
    """20 % slower at the quiet spread (0.01): past the floor at p < ALPHA / fail_looks at the sixth pair, not one
    pair earlier (no look), and a 20 % slower step fed through the gate's own code stops there."""
    y, order = series(np.random.default_rng(3), math.log(1.2), 0.01, 6)
    assert decide(y[:5], order[:5], 0.10, 10).verdict == "INCONCLUSIVE"
    d = decide(y, order, 0.10, 10)
    assert d.verdict == "FAIL" and d.fit.p_worse(math.log(1.1)) < fail_alpha(10) and d.ci[0] > 1.1
    slow = gate_of(1.2, 16)
    assert slow.verdict() == "FAIL" and len(slow.pairs) == MIN_LOOK_PAIRS
    assert next(f for f in slow.figures() if f.figure == "tpot_p50_s").ratio == pytest.approx(1.2, rel=0.03)
    same = gate_of(1.0, 16)
    assert same.verdict() == "PASS" and len(same.pairs) == 10


def test_a_significant_change_inside_the_floor_does_not_fail():
    """5 % slower, measured tightly: significant against no change, but not past the 10 % floor."""
    y, order = series(np.random.default_rng(5), math.log(1.05), 0.01, 10)
    d = decide(y, order, 0.10, 10)
    assert d.fit.p_worse() < fail_alpha(10) and d.verdict == "PASS"


def test_the_floor_is_tested_not_read_off_the_estimate():
    """Exactly 10 % slower, measured tightly: the estimate lies past the floor in about half the nights, but FAIL
    tests the floor, so none FAILs at any look (nor PASSes: the upper bound lies past 1.1); 13 % slower does."""
    rng = np.random.default_rng(6)
    verdicts, past = [], 0
    for _ in range(40):
        y, order = series(rng, math.log(1.1), 0.01, 22, 0.03)
        looks = [decide(y[:k], order[:k], 0.10, 10) for k in range(MIN_LOOK_PAIRS, 23)]
        past += looks[-1].ratio > 1.1
        verdicts += [d.verdict for d in looks]
    assert past > 5 and set(verdicts) == {"INCONCLUSIVE"}
    assert decide(*series(rng, math.log(1.13), 0.005, 10), 0.10, 10).verdict == "FAIL"


def test_pass_is_looked_at_on_planned_looks_its_error_shared():
    """PASS only at min_pairs and every PASS_LOOK_EVERY pairs after, PASS_LOOKS looks, each at 1 - 0.05 /
    PASS_LOOKS: the night's chance of a false PASS at most 5 % whatever pair it ends at; none past the last."""
    assert pass_confidence() == pytest.approx(1 - 0.05 / PASS_LOOKS)
    y, order = series(np.random.default_rng(8), 0.0, 0.01, 30)
    looks = [k for k in range(6, 31) if decide(y[:k], order[:k], 0.10, 10).verdict == "PASS"]
    assert looks == [10 + PASS_LOOK_EVERY * j for j in range(PASS_LOOKS)]
    assert decide(y[:23], order[:23], 0.10, 10).final and not decide(y[:21], order[:21], 0.10, 10).final


def test_pass_and_fail_exclude_each_other_at_every_look():
    """A FAIL's lower bound past the floor and a PASS's upper bound under it cannot both hold: at every look of
    nights from an improvement to a 1.2x, a FAIL's upper PASS bound lies past the floor and a PASS's p past the
    floor is over FAIL's level."""
    rng = np.random.default_rng(10)
    floor = math.log(1.1)
    for mu in (-0.1, 0.0, 0.05, 0.09, 0.1, 0.11, 0.13, 0.2):
        y, order = series(rng, mu, 0.03, 22, 0.03)
        for k in range(MIN_LOOK_PAIRS, 23):
            d = decide(y[:k], order[:k], 0.10, 10)
            if d.verdict == "FAIL":
                assert d.fit.upper(pass_confidence()) > floor
            if d.verdict == "PASS":
                assert d.fit.p_worse(floor) >= fail_alpha(10)


def test_a_night_past_its_last_look_is_settled():
    """No look is left past the last PASS look: the engine is settled INCONCLUSIVE, its time left to the others."""
    gate = EngineGate("paged", 0.10, 10)
    rng = np.random.default_rng(11)
    for k in range(30):
        gate.add_figures(PairFigures(1 if k % 2 == 0 else -1, math.log(1.1) + 0.01 * rng.standard_normal(), 0.0,
                                     0.0))
        if gate.settled():
            break
    assert gate.verdict() == "INCONCLUSIVE" and len(gate.measured) == last_look(10)


def shares_gate(rng, new_fail: float, base_miss: float, pairs: int, hiccup: float = 0.0) -> EngineGate:
    """A gate fed block shares (as benchmarks/ab_study.py feeds it): 30 requests a block, each side missing
    `base_miss` of its requests, a hiccup (a block whose requests miss together) in `hiccup` of blocks, NEW failing
    `new_fail` more; TPOT equal."""
    gate = EngineGate("paged", 0.10, 10)
    for k in range(pairs):
        share = [rng.binomial(30, 0.5 if rng.random() < hiccup else base_miss) / 30 for _ in range(2)]
        failed = rng.binomial(30, new_fail) / 30
        gate.add_figures(PairFigures(1 if k % 2 == 0 else -1, 0.001 * rng.standard_normal(),
                                     min(1.0, share[1] + failed) - share[0], failed))
        if gate.settled():
            break
    return gate


def test_a_failure_excess_fails_on_the_blocks_sign_test():
    """NEW fails 3 % of its requests (20 of 22 blocks' 660), BASE none: 17 blocks worse, none better, FAILs the
    errors, once 11 blocks are worse (the sign test's p 2^-11 under ALPHA / fail_looks); the same failures spread
    over both builds alike do not (they PASS)."""
    new = [1 / 30] * 14 + [2 / 30] * 3 + [0.0] * 5
    order = [1 if k % 2 == 0 else -1 for k in range(22)]
    cut = [i + 1 for i in range(22) if sum(v > 0 for v in new[: i + 1]) == 11][0]
    assert decide_misses(new[:cut - 1], order[:cut - 1], 10, errors=True).verdict != "FAIL"
    d = decide_misses(new[:cut], order[:cut], 10, errors=True)
    assert d.verdict == "FAIL" and sign_p(new[:cut]) == pytest.approx(2 ** -11)
    alike = [v if k % 2 else -v for k, v in enumerate(new)]
    assert decide_misses(alike, order, 10, errors=True).verdict == "PASS"  # its mean rise bounded under 2 points


def test_sparse_misses_in_one_order_are_no_fail():
    """NEW missing one request more in each AB pair and none in BA (the order term fitted them exactly, a t's
    standard error of 0): 3 of 3 blocks worse is p = 1/8 by the sign test, no FAIL."""
    d = decide_misses([1 / 30, 0.0] * 3, [1, -1] * 3, 10)
    assert d.verdict == "INCONCLUSIVE" and sign_p([1 / 30, 0.0] * 3) == pytest.approx(1 / 8)
    flat = decide_misses([0.0] * 10, [1, -1] * 5, 10)
    assert flat.verdict == "PASS" and f"{100 * MISS_MARGIN:+.1f} pp" in flat.why


def test_misses_are_judged_by_block_an_a_a_that_hiccups_does_not_fail():
    """An A/A whose blocks hiccup together (a tenth of blocks miss half their requests) FAILs in none and mostly
    PASSes, a quiet A/A PASSes; NEW failing 3 % more of its requests rarely PASSes and FAILs in most 22-pair
    nights."""
    rng = np.random.default_rng(9)
    same = [shares_gate(rng, 0.0, 0.01, 24, hiccup=0.1).verdict() for _ in range(40)]
    assert "FAIL" not in same and same.count("PASS") >= 30
    quiet = [shares_gate(rng, 0.0, 0.005, 24).verdict() for _ in range(40)]
    assert quiet.count("PASS") >= 38
    worse = [shares_gate(rng, 0.03, 0.005, 24).verdict() for _ in range(40)]
    assert worse.count("FAIL") >= 24 and worse.count("PASS") <= 1


def test_requests_new_fails_where_base_met_them_fail_and_are_never_dropped():
    """NEW fails a third of its requests at the same speed: its latency on the rest is BASE's, but every block
    worse, the misses FAIL it."""
    gate = gate_of(1.0, 16, missed=10)
    figures = {f.figure: f for f in gate.figures()}
    assert figures["slo_misses"].verdict == "FAIL" and gate.verdict() == "FAIL"
    assert figures["tpot_p50_s"].verdict != "FAIL"
    assert figures["output_tokens_per_s"].ratio < 0.8
