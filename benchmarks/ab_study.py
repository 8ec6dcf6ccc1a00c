"""The A/B gate's rule studied by simulation (as knee_study.py studies the knee): how often it FAILs an A/A night
(false FAIL), PASSes it, and FAILs a 20 % slower NEW, over the pairs' spread and the pairs a night holds.

Each simulated night draws pair log ratios y_k = mu + gamma o_k + e_k (o_k = +1 AB, -1 BA, gamma the order
effect, e_k the pair's noise: Student t with 4 degrees of freedom scaled to standard deviation `spread`, heavier
tailed than a normal, as a machine that hiccups is) and runs harness/analysis/ab.decide after every pair exactly
as the gate does (a FAIL first sighted needs its fresh pairs; a PASS needs the night's pairs), stopping at the
first PASS or FAIL or at the night's last pair.

    python benchmarks/ab_study.py [--nights 1000] [--spreads 0.05,0.1,0.2,0.3,0.5] [--pairs 4,6,8,10,12,16,20]

Prints a markdown table per figure: false FAIL (mu = 0), PASS (mu = 0), FAIL at 1.2x (mu = log 1.2), PASS of an
improvement (mu = -log 1.2)."""

from __future__ import annotations

import argparse
import math

import numpy as np

from harness.analysis.ab import decide

ORDER_EFFECT = 0.03  # a pair's second build reads 3 % slower or faster than its first (the A/A runs' order term)
TAIL_DF = 4


def night(rng: np.random.Generator, mu: float, spread: float, pairs: int, threshold: float) -> str:
    """One night's verdict."""
    scale = spread / math.sqrt(TAIL_DF / (TAIL_DF - 2))  # a t(4) of this standard deviation
    y, order, sighted = [], [], None
    for k in range(pairs):
        o = 1 if k % 2 == 0 else -1
        y.append(mu + ORDER_EFFECT * o + scale * float(rng.standard_t(TAIL_DF)))
        order.append(o)
        d = decide(y, order, threshold, pairs, sighted)
        sighted = d.sighted_at
        if d.verdict != "INCONCLUSIVE":
            return d.verdict
    return "INCONCLUSIVE"


def rates(mu: float, spread: float, pairs: int, nights: int, threshold: float, seed: int) -> dict[str, float]:
    rng = np.random.default_rng([seed, round(1000 * spread), pairs, round(1000 * mu) + 1000])
    verdicts = [night(rng, mu, spread, pairs, threshold) for _ in range(nights)]
    return {v: verdicts.count(v) / nights for v in ("PASS", "FAIL", "INCONCLUSIVE")}


def upper95(share: float, n: int) -> float:
    """Wilson's one-sided 95 % upper bound on a share seen in n nights."""
    z = 1.6449
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre + half


def table(spreads: list[float], pair_counts: list[int], nights: int, threshold: float, seed: int) -> str:
    cases = (("A/A: false FAIL", 0.0, "FAIL"), ("A/A: PASS", 0.0, "PASS"),
             ("NEW 1.2x slower: FAIL", math.log(1.2), "FAIL"), ("NEW 1.2x faster: PASS", -math.log(1.2), "PASS"))
    out = []
    for title, mu, verdict in cases:
        out += [f"**{title}** (share of {nights} nights; rows: the pairs' spread, columns: pairs a night)", "",
                "| spread | " + " | ".join(str(k) for k in pair_counts) + " |",
                "|---|" + "---|" * len(pair_counts)]
        for s in spreads:
            cells = []
            for k in pair_counts:
                share = rates(mu, s, k, nights, threshold, seed)[verdict]
                cells.append(f"{share:.3f}" + (f" (<= {upper95(share, nights):.3f})" if verdict == "FAIL" and mu == 0
                                               else ""))
            out.append(f"| {s:g} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nights", type=int, default=1000, help="simulated nights a cell (default: %(default)s)")
    ap.add_argument("--spreads", default="0.05,0.1,0.2,0.3,0.5",
                    help="pair spreads (standard deviation of a pair's log ratio) (default: %(default)s)")
    ap.add_argument("--pairs", default="4,6,8,10,12,16,20", help="pairs a night holds (default: %(default)s)")
    ap.add_argument("--threshold", type=float, default=0.10, help="the effect floor, a share (default: %(default)g)")
    ap.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    a = ap.parse_args(argv)
    print(table([float(x) for x in a.spreads.split(",")], [int(x) for x in a.pairs.split(",")], a.nights,
                a.threshold, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
