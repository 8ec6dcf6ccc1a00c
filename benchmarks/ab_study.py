"""The A/B gate studied by simulation (as knee_study.py studies the knee): simulated nights run through the gate's
own decision code (harness/analysis/ab.EngineGate, the code `fragbench ab` runs after every pair) on the gate's own
schedule to `--time`, and how often each true ratio FAILs and PASSes (docs/method.md, Nightly).

A night, as harness/run/ab_runs.pairs runs it: `--engines` engines, the one studied and the rest unchanged (true
ratio 1, no failures). Each engine's rate check halves its pair rate (each of up to three checks with chance
`--halve`, as BASE missing the SLO halves it), which doubles its pair time. Then round after round, each engine
not yet settled measures one pair, its servers restarted first every RESTART_PAIRS of its pairs (`--restart-s`),
while the time since the first pair is under `--time`: a settled engine gives its turn to the others, a halved one
slows every round. Pair k's TPOT log ratio is mu + offset + gamma o_k + e_k: mu the true ratio's log, `--offset` a
steady difference between the two builds' processes (the A/A runs before issue 87 read 0.980: -0.02), gamma =
0.03 the order effect (o_k = +1 AB, -1 BA), e_k a Student t(4) of standard deviation `spread`, heavier tailed
than a normal. Each side's block of 30 judged requests misses each with chance `--base-miss`, or half of them in a
block that hiccups (`--hiccup`, the misses clustered by block), NEW failing `--new-fail` more of its requests (a
failed request is a miss).

    python benchmarks/ab_study.py [--nights 600] [--spreads 0.01,0.03,0.05,0.1,0.2] [--time 1200] [--offset 0]

Prints a markdown table: per spread and true ratio, the share of nights that FAIL and that PASS (FAIL's one-sided
95 % Wilson upper bound at 1.0 and 1.05), and a column for NEW failing 3 % more requests at an unchanged TPOT."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

import numpy as np

from harness.analysis.ab import EngineGate, PairFigures
from harness.run.ab_runs import RATE_CHECKS, RESTART_PAIRS

ORDER_EFFECT = 0.03  # a pair's second build reads 3 % slower or faster than its first
TAIL_DF = 4
BLOCK = 30  # judged requests a block
RATIOS = (1.0, 1.05, 1.08, 1.10, 1.12, 1.2, 1.5)


@dataclass(frozen=True)
class Night:
    """What a simulated night is made of (the module docstring)."""

    time_s: float = 1200
    pair_s: float = 50  # a pair of paged at the table's rate on the quiet machine: 45-50 s
    restart_s: float = 20  # both servers started afresh and warmed (harness/run/ab_runs.RESTART_PAIRS): ~20 s
    engines: int = 2
    min_pairs: int = 10
    threshold: float = 0.10
    offset: float = 0.0
    halve: float = 0.0  # the quiet machine's checks kept the table's rate in every run measured
    base_miss: float = 0.005
    hiccup: float = 0.01
    new_fail: float = 0.0

    def pair_time(self, rng: np.random.Generator) -> float:
        """An engine's pair time after its rate check: each halving doubles it."""
        halvings = 0
        while halvings < RATE_CHECKS and rng.random() < self.halve:
            halvings += 1
        return self.pair_s * 2 ** halvings


def block_shares(rng: np.random.Generator, n: Night, extra: float = 0.0) -> tuple[float, float]:
    """A block's shares of its judged requests missed and failed: misses clustered (a block that hiccups misses
    half), NEW's failures misses too."""
    miss = 0.5 if rng.random() < n.hiccup else n.base_miss
    failed = rng.binomial(BLOCK, extra)
    return min(1.0, (rng.binomial(BLOCK, miss) + failed) / BLOCK), failed / BLOCK


def pair(rng: np.random.Generator, k: int, mu: float, spread: float, new_fail: float, n: Night) -> PairFigures:
    """Pair k's figures (the module docstring)."""
    scale = spread / math.sqrt(TAIL_DF / (TAIL_DF - 2))  # a t(4) of this standard deviation
    o = 1 if k % 2 == 0 else -1
    y = mu + n.offset + ORDER_EFFECT * o + scale * float(rng.standard_t(TAIL_DF))
    base, new = block_shares(rng, n), block_shares(rng, n, new_fail)
    return PairFigures(o, y, new[0] - base[0], new[1] - base[1])


def night(rng: np.random.Generator, mu: float, spread: float, n: Night) -> str:
    """One night's verdict for the studied engine (the first), by the gate's own code on its schedule."""
    gates = [EngineGate(f"sim{e}", n.threshold, n.min_pairs) for e in range(n.engines)]
    truth = [(mu, n.new_fail)] + [(0.0, 0.0)] * (n.engines - 1)
    pair_s = [n.pair_time(rng) for _ in gates]
    spent = 0.0
    while (open_ := [e for e, g in enumerate(gates) if not g.settled()]) and spent < n.time_s:
        for e in open_:
            done = len(gates[e].measured)
            spent += pair_s[e] + (n.restart_s if done and done % RESTART_PAIRS == 0 else 0.0)
            gates[e].add_figures(pair(rng, done, truth[e][0], spread, truth[e][1], n))
    return gates[0].verdict()


def shares(mu: float, spread: float, nights: int, n: Night, seed: int) -> dict[str, float]:
    rng = np.random.default_rng([seed, round(1000 * spread), round(1000 * mu) + 1000, round(1000 * n.new_fail)])
    verdicts = [night(rng, mu, spread, n) for _ in range(nights)]
    return {v: verdicts.count(v) / nights for v in ("PASS", "FAIL", "INCONCLUSIVE")}


def upper95(share: float, n: int) -> float:
    """Wilson's one-sided 95 % upper bound on a share seen in n nights."""
    z = 1.6449
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre + half


def cell(s: dict[str, float], nights: int, bound: bool) -> str:
    fail = f"{s['FAIL']:.3f}" + (f" (<= {upper95(s['FAIL'], nights):.3f})" if bound else "")
    return f"F {fail} / P {s['PASS']:.3f}"


def table(spreads: list[float], nights: int, n: Night, seed: int) -> str:
    head = [f"x{r:g}" for r in RATIOS] + ["x1 and 3 % more failed"]
    out = [f"**FAIL (F) and PASS (P), share of {nights} nights** (rows: the pairs' spread; columns: NEW's true "
           f"TPOT / BASE's; offset {n.offset:g}, halving chance {n.halve:g}, {n.time_s:g} s for {n.engines} "
           f"engine(s) at {n.pair_s:g} s a pair, a restart {n.restart_s:g} s; Monte Carlo standard error of a "
           f"share p: sqrt(p (1 - p) / {nights}), at most {0.5 / math.sqrt(nights):.3f})", "",
           "| spread | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    failing = replace(n, new_fail=0.03)
    for sp in spreads:
        cells = [cell(shares(math.log(r), sp, nights, n, seed), nights, r <= 1.05) for r in RATIOS]
        cells.append(cell(shares(0.0, sp, nights, failing, seed), nights, False))
        out.append(f"| {sp:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nights", type=int, default=600, help="simulated nights a cell (default: %(default)s)")
    ap.add_argument("--spreads", default="0.01,0.03,0.05,0.1,0.2",
                    help="pair spreads (standard deviation of a pair's log ratio) (default: %(default)s)")
    d = Night()
    for name, what in (("time", "the pairs' time, s"), ("pair_s", "a pair's time at the table's rate, s"),
                       ("restart_s", "both servers' restart and warm-up, s"),
                       ("engines", "engines sharing the time"), ("pairs", "the gate's --pairs"),
                       ("threshold", "the effect floor, a share"), ("offset", "steady NEW-over-BASE log offset"),
                       ("halve", "chance each rate check halves the rate"), ("base_miss", "a request's miss chance"),
                       ("hiccup", "chance a block hiccups (half its requests miss)")):
        field = {"time": "time_s", "pairs": "min_pairs"}.get(name, name)
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(getattr(d, field)), default=getattr(d, field),
                        dest=field, help=f"{what} (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    a = ap.parse_args(argv)
    n = Night(**{k: v for k, v in vars(a).items() if k not in ("nights", "spreads", "seed")})
    print(table([float(x) for x in a.spreads.split(",")], a.nights, n, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
