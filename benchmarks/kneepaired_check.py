"""The paired estimator (harness/analysis/kneepaired.py) on a fixed design: no search, no placement, no stop, so
that what its interval does is told from what the decision loop does to it (benchmarks/knee_study.py runs the loop).

Run by hand:  .venv/bin/python benchmarks/kneepaired_check.py [--spreads 0.05,0.2,0.5] [--rhos 0,0.5] [--reps 100]

Each repetition: `--streams` paired streams, stream k offered to both engines at `multiples[k % len]` x each one's
true sustained rate, 50 judged requests a point in bursts (knee_study's engines, shifts and verdicts: a stream's
shift is normal of sd s, the two engines' shifts correlated rho). Per cell: the bias and sd of log ratio over the
repetitions, the jackknife's mean standard error, the 90 % interval's coverage (+- its Monte Carlo error) and median
hi / lo, for each engine its own slope (sep) and one slope for both (shared).
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
from knee_study import PAGED, STATIC, TARGET, Params, attainment_p, bursty_verdicts, engine_of

from harness.analysis.knee import Judged
from harness.analysis.kneepaired import paired_ratio

TRUE_RATIO = 1.5
K_STATIC = 2.0


def one_cell(spread: float, rho: float, slope_ratio: float, streams: int, multiples: list[float], reps: int,
             shared: bool) -> dict:
    prm = Params(spread_s=spread)
    engines = {PAGED: engine_of(PAGED, TRUE_RATIO * K_STATIC, prm.slope_b, spread, prm),
               STATIC: engine_of(STATIC, K_STATIC, prm.slope_b * slope_ratio, spread, prm)}
    logs, ses, covered, widths = [], [], [], []
    for rep in range(reps):
        rng = np.random.default_rng([rep, 86])
        pts = {e: [] for e in engines}
        for k in range(streams):
            w = rng.normal()
            for e, en in engines.items():
                u = spread * (math.sqrt(rho) * w + math.sqrt(1 - rho) * rng.normal())
                r = en.sustained_rps * multiples[k % len(multiples)]
                met = bursty_verdicts(rng, attainment_p(en, r, u), prm.judged, prm.burst_mean)
                pts[e].append(Judged(r, f"p{k}", met, np.arange(len(met))))
        pr = paired_ratio(pts, PAGED, STATIC, TARGET, shared=shared)
        logs.append(math.log(pr.ratio))
        ses.append(pr.se_log)
        covered.append(pr.ci[0] <= TRUE_RATIO <= pr.ci[1])
        widths.append(pr.ci[1] / pr.ci[0])
    cover = float(np.mean(covered))
    return {"spread": spread, "rho": rho, "slope_ratio": slope_ratio, "shared": shared, "reps": reps,
            "bias_log": round(float(np.mean(logs)) - math.log(TRUE_RATIO), 3), "sd_log": round(float(np.std(logs)), 3),
            "mean_se_log": round(float(np.mean(ses)), 3), "coverage": round(cover, 3),
            "coverage_se": round(math.sqrt(cover * (1 - cover) / reps), 3),
            "median_hi_lo": round(float(np.median(widths)), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spreads", default="0.05,0.2,0.5")
    ap.add_argument("--rhos", default="0,0.5")
    ap.add_argument("--slope-ratios", default="1,0.07", help="static-oracle's slope over paged's (25)")
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--multiples", default="0.8,0.9,1.0,1.1,1.25", help="rates, as multiples of each true rate")
    ap.add_argument("--reps", type=int, default=100)
    a = ap.parse_args(argv)
    multiples = [float(x) for x in a.multiples.split(",")]
    cols = ("spread", "rho", "slope_ratio", "shared", "reps", "bias_log", "sd_log", "mean_se_log", "coverage",
            "coverage_se", "median_hi_lo")
    print("  ".join(f"{c:>12}" for c in cols))
    for sr in (float(x) for x in a.slope_ratios.split(",")):
        for s in (float(x) for x in a.spreads.split(",")):
            for rho in (float(x) for x in a.rhos.split(",")):
                for shared in (False, True):
                    row = one_cell(s, rho, sr, a.streams, multiples, a.reps, shared)
                    print("  ".join(f"{row[c]!s:>12}" for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
