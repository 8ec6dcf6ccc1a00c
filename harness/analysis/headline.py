"""The headline: the rate the paged engine sustains over the best contiguous engine's, read from one joint knee
fit (harness/analysis/kneefit.py), whether it is decided and precise, what it rests on, and each engine's role.

- `decided`: the ratio's 90 % interval excludes 1.0 (the direction is known) and both engines' knees are
  bracketed (a rate that met the SLO below one that missed it: a knee past every rate measured is a bound, and a
  ratio of bounds decides nothing); `precise`: its hi / lo is at most the precision asked. Both are computed here
  once; the console, the summary, the report, the glance and compare read them.
- `stop`: `precise` where the decision's stop rule holds (harness/analysis/placement.done), else `time spent`.
- Roles: the paged engine is the `headline`'s, the contiguous engine it is measured against the `rival`, every
  other engine `screened` (measured within a bounded time, its knee a figure or a bound at this SLO). An engine
  ruled out (analysis/ruled_out.py: a clear miss at or under the leading contiguous knee) is never the rival.
- What is compared: each engine's sustained rate as the field defines it (kneefit.DEFINITION: the long-run share of
  all requests, every stream pooled, not the median stream's; docs/method.md "The sustained rate"). An engine whose
  knee is not bracketed has a bound (`bound_of`: under the lowest rate measured where its pooled attainment stayed
  under the target at every rate, with the highest it reached; over the highest where every rate met), and the
  headline then says what it compares: the one-sided bound on the ratio those give (`ratio_bound`).
- `resolution`: how long a run would need: more points like the ones measured (each a fresh stream of the same
  judged size) shrink the interval's log-width as 1 / sqrt(their number), whether each stream's binomial draw or
  the spread between streams governs it, so reaching the precision asked takes (width / log precision)^2 times
  the points' arrival time.
"""

from __future__ import annotations

import math

from engines.registry import in_blocks
from harness.analysis.capacity import SLO
from harness.analysis.knee import Judged, bound_of, bracket_of, knee_points, pooled
from harness.analysis.kneefit import DEFINITION, KneeFit
from harness.analysis.placement import MIN_POINTS, done
from harness.analysis.ruled_out import Evidence, Ruling, evidence_of, rulings
from harness.analysis.summary_records import HeadlineBlock

PAGED = in_blocks()  # engines that keep KV in blocks (engines/registry.py); every other one reserves contiguously

METHOD = ("each engine's long-run sustained rate (every stream pooled: the fitted curve averaged over its streams' "
          "effects and offered token loads, solved for the target per draw); "
          "90 % central interval of the posterior of a dose-response fit of every point (kneefit.py): SLO "
          "attainment against log offered rate, a logistic curve per engine (its own knee and slope), "
          "each point a stream whose offered token load (its requests' tokens per second of its window) shifts "
          "its load by a fitted gain, with a heavy-tailed random "
          "shift for the rest (the engine's stream-to-stream spread estimated from its points), judged requests "
          "weighted by the engine's design effect; the decision gives both engines the same streams (paired), "
          "and the knees' ratio is read from {draws} draws of each")


def reference_of(engines) -> str | None:
    """The paged engine the headline is about: fragbench's own where it runs, else the first paged one."""
    engines = list(engines)
    return "paged" if "paged" in engines else next((e for e in engines if e in PAGED), None)


def rival_of(knees: dict[str, tuple[float, float, bool]],
             evidence_by: dict[str, tuple[Evidence | None, float | None]] | None = None) -> str | None:
    """The contiguous engine the paged one is measured against, the one rule (`knees`: engine -> its knee, its
    interval's upper end, whether it is bracketed; `evidence_by`: what analysis/ruled_out.py reads of each
    engine's points): the highest knee among those whose knee is bracketed, unless one whose knee is not could
    still lie above it (its interval's upper end above the leader's knee: every rate it was offered missed, or
    every one met) and is not ruled out (ruled_out.rulings: a clear miss at or under the leader's knee). Then that
    one, the highest reach first, so that the decision brackets it. Knees without intervals (upper end = knee: a
    simulation's sweep) leave the highest knee."""
    est = {e: k for e, k in knees.items() if e not in PAGED}
    out = {e for e, r in rulings(est, evidence_by or {}).items() if r.out}
    closed = [e for e, (_, _, bracketed) in est.items() if bracketed and e not in out]
    leader = max(closed, key=lambda e: est[e][0], default=None)
    contenders = [e for e, (_, hi, bracketed) in est.items()
                  if not bracketed and e not in out and (leader is None or hi > est[leader][0])]
    return max(contenders, key=lambda e: est[e][1]) if contenders else leader


def knees_of(fit: KneeFit) -> dict[str, tuple[float, float, bool]]:
    """The fit's knees as the rival's rule reads them: knee, interval's upper end, bracketed."""
    return {e: (k.rps, k.ci[1], k.bracketed) for e, k in fit.estimates.items()}


def rulings_of(fit: KneeFit, evidence_by: dict[str, tuple[Evidence | None, float | None]]) -> dict[str, Ruling]:
    """Each contiguous engine's ruling (analysis/ruled_out.py) among the fit's knees."""
    return rulings({e: k for e, k in knees_of(fit).items() if e not in PAGED}, evidence_by)


def best_contiguous(fit: KneeFit, evidence_by: dict[str, tuple[Evidence | None, float | None]] | None = None
                    ) -> str | None:
    """The rival (`rival_of`) among the fit's knees."""
    return rival_of(knees_of(fit), evidence_by)


def roles(fit: KneeFit, evidence_by: dict[str, tuple[Evidence | None, float | None]] | None = None
          ) -> dict[str, str]:
    """Each engine's role in the run: `headline` (the paged reference), `rival`, or `screened` (a ruled-out
    engine among them: ruled_out.py)."""
    ref, rival = reference_of(fit.estimates), best_contiguous(fit, evidence_by)
    return {e: "headline" if e == ref else "rival" if e == rival else "screened" for e in fit.estimates}


def rows_of(points: list[Judged]) -> list[dict]:
    """One row per offered rate, its replications pooled (knee.pooled)."""
    return [{"offered_rps": p.offered_rps, "slo_attainment": p.attainment} for p in pooled(points)]


def bracket_ends(points: list[Judged], slo: SLO) -> list[Judged]:
    """The knee's bracket ends among the points a knee rests on (what the search found before the fit)."""
    pts = pooled(knee_points(points))
    lo, hi = bracket_of(rows_of(pts), slo)
    return [p for p in pts if p.offered_rps in (lo, hi)]


def run_to_run_share(ci, within_ci) -> float:
    """The share of an interval's log-width that the stream-to-stream spread adds (what a rerun on other streams
    would see and one stream's binomial draw does not): `within_ci` is the interval with that spread held at 0.
    At least 0; 0 where either interval does not lie above 0 or `ci` has no width."""
    (lo, hi), (wlo, whi) = ci, within_ci
    if min(lo, hi, wlo, whi) <= 0 or hi <= lo:
        return 0.0
    return max(0.0, 1.0 - math.log(whi / wlo) / math.log(hi / lo))


def paired(points: dict[str, list[Judged]], a: str, b: str) -> int:
    """Streams both engines judged among the points their knees rest on (one key: one request sequence)."""
    return len({p.key for p in knee_points(points.get(a, []))} & {p.key for p in knee_points(points.get(b, []))})


def ratio_bound(fit: KneeFit, ref: str, rival: str, bounds: dict[str, dict]) -> dict | None:
    """The one-sided bound on ref / rival that the engines' bounds give (the other engine's interval end on the
    conservative side); None where they give none (both bounds on one side of their rates cancel)."""
    sides = {ref: {"beyond": "at least", "below": "at most"}, rival: {"beyond": "at most", "below": "at least"}}
    said = {sides[e][b["where"]] for e, b in bounds.items()}
    if len(said) != 1:
        return None
    side = said.pop()
    low = side == "at least"  # the ratio's lowest: ref's least over rival's most
    num = bounds[ref]["rps"] if ref in bounds else fit.estimates[ref].ci[0 if low else 1]
    den = bounds[rival]["rps"] if rival in bounds else fit.estimates[rival].ci[1 if low else 0]
    return {"side": side, "value": round(num / den, 4)} if den > 0 else None


def headline(fit: KneeFit | None, within: KneeFit | None, precision: float,
             points: dict[str, list[Judged]] | None = None, target: float | None = None) -> HeadlineBlock | None:
    """The paged engine against the best contiguous one, or None when either is missing: summary.json's headline
    as read from the fit (summary.headline_with adds what the run's points and time say of it). With the points and
    the SLO's attainment `target`, an engine they rule out (ruled_out.py) is never the rival."""
    if fit is None:
        return None
    evidence_by = evidence_of(points, target) if points and target is not None else None
    ref, rival = reference_of(fit.estimates), best_contiguous(fit, evidence_by)
    if ref is None or rival is None:
        return None
    ratio, ci = fit.ratio(ref, rival)
    within_ci = within.ratio(ref, rival)[1] if within is not None else ci
    est, pair = fit.estimates, (ref, rival)
    bracketed = {e: est[e].bracketed for e in pair}
    counts = {e: est[e].points for e in pair}
    decided = not ci[0] <= 1.0 <= ci[1] and all(bracketed.values())
    precise = ci[1] <= ci[0] * precision
    bounds = {e: bound_of(points[e], target) for e in pair if not bracketed[e] and points and target is not None
              and points.get(e)}
    return HeadlineBlock(
        engine=ref, against=rival, ratio=round(ratio, 4), ratio_ci=list(ci), definition=DEFINITION,
        method=METHOD.format(draws=f"{len(fit.log_knees[ref]):,}"), decided=decided, precise=precise,
        precision=precision, stop="precise" if done(precise, counts) else "time spent", min_points=MIN_POINTS,
        points=counts, judged={e: est[e].judged for e in pair},
        run_to_run_share=round(run_to_run_share(ci, within_ci), 3), ratio_ci_within_runs=list(within_ci),
        replications={e: est[e].streams for e in pair}, bracketed=bracketed,
        stream_spread={e: round(fit.spread_s[e], 3) for e in pair}, paired_streams=paired(points or {}, ref, rival),
        paired_correlation=round(fit.paired_correlation(*pair), 3),
        load_explained_share={e: round(fit.explained_share(e), 3) for e in pair},
        load_gain={e: [round(g, 3), *ci_] for e in pair for g, ci_ in [fit.gain(e)]},
        bounds=bounds or None, ratio_bound=ratio_bound(fit, ref, rival, bounds) if bounds else None)


def verdict_words(h: HeadlineBlock) -> str:
    """Decided or not, and why, in a few words: the one wording of the headline's verdict (`decided` and `precise`
    as `headline` computed them), which the console's `decision:` line (run/verdicts.py), the report's headline
    sentence and its glance say. It lives beside the rule, not in views/: the console (run/) sits below the views."""
    lo, hi = h.ratio_ci
    if h.decided:
        if h.precise:
            return "decided"
        return f"decided, not precise (hi / lo {hi / lo:.2f} > {h.precision:g})" if lo > 0 else "decided, not precise"
    if lo <= 1.0 <= hi:
        return "undecided (the interval holds 1.0)"
    open_ = [e for e, closed in (h.bracketed or {}).items() if not closed]
    if not h.bounds:
        return f"undecided ({' and '.join(open_)} not bracketed: a knee past the rates measured is a bound)"
    said = "; ".join(bound_words(e, b) for e, b in h.bounds.items())
    r = h.ratio_bound
    return f"undecided ({' and '.join(open_)} not bracketed: {said}" + (
        f"; so {h.engine} / {h.against} is {r['side']} {r['value']:.2f})" if r else ")")


def bound_words(engine: str, b: dict) -> str:
    """An unbracketed engine's bound (`bound_of`) in words."""
    if b["where"] == "beyond":
        return f"{engine} met the target at every rate measured: its sustained rate is at least {b['rps']:.2f} req/s"
    return (f"{engine}'s attainment stayed under the target at every rate measured (at most "
            f"{100 * b['highest_attainment']:.0f} % at {b['highest_at_rps']:.2f} req/s): its sustained rate is under "
            f"{b['rps']:.2f} req/s")


def time_to_resolve(h: HeadlineBlock, points: dict[str, list[Judged]], precision: float) -> float | None:
    """Seconds of arrivals more, at points like the ones measured (fresh streams of the same judged size), for the
    ratio's interval to narrow to the precision."""
    pts = [p for e in (h.engine, h.against) for p in knee_points(points[e])]
    if not pts or h.ratio_ci[0] <= 0:
        return None
    factor = (math.log(h.ratio_ci[1] / h.ratio_ci[0]) / math.log(precision)) ** 2
    return max(0.0, (factor - 1) * sum(len(p.met) / p.offered_rps for p in pts))


def resolvable(h: HeadlineBlock, factor: float) -> float:
    """The smallest ratio an interval `factor` times as many judged requests would tell from 1.0: its
    half-width in log, the present log-width shrunk by sqrt(factor)."""
    width = math.log(h.ratio_ci[1] / h.ratio_ci[0]) if h.ratio_ci[0] > 0 else math.inf
    return math.exp(width / math.sqrt(max(factor, 1e-9)) / 2)
