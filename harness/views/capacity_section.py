"""The capacity section: each engine's sustained rate at the SLO with its interval and what it rests on, the
headline (the paged engine against the best contiguous one) with its resolution, what bound each engine at
its knee, and (with --kv-budgets) rate against budget."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from harness.analysis.headline import PAGED, rival_of, verdict_words
from harness.analysis.knee import KV_USAGE_NEAR_FULL, WAITING_FOR_MEMORY
from harness.analysis.records import RecordedDesign
from harness.analysis.summary_records import CapacityBlock, CapacityPoint, HeadlineBlock, Summary, TimeSpent
from harness.views.html import PALETTE, details, fig_html, fmt, section, table

MiB = 2**20


def where_words(c: CapacityBlock) -> str:
    """A bound in words: every rate met; or none did, and the highest share of requests met (knee.bound_of)."""
    b = c.sustained_bound or {}
    if c.sustained_where == "below" and "highest_attainment" in b:
        return (f" (a bound: the attainment, streams pooled, stayed under the target at every rate swept, at most "
                f"{100 * b['highest_attainment']:.0f} % at {b['highest_at_rps']:.2f} req/s)")
    if b and c.sustained_where == "beyond":
        return " (every rate measured met the SLO)"
    return {"beyond": " or more (every rate met the SLO)", "below": " (under the lowest rate swept)"}.get(
        c.sustained_where, "")


def rate_words(c: CapacityBlock, unit: str = "") -> str:
    """The rate, its interval, its unit (where a sentence needs it, beside the numbers), then what bounds it. A knee
    not bracketed leads with its bound (knee.bound_of: the rates measured); the fit's figure past them follows as
    the extrapolation it is."""
    ci = c.sustained_rps_ci
    unsettled = " (on unsteady points alone: none settled before its time ran out)" if c.rests_on_unsteady \
        else ""
    fitted = f"{c.sustained_rps:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
    b = c.sustained_bound
    if b and c.sustained_where in ("beyond", "below"):
        side = "at least" if c.sustained_where == "beyond" else "under"
        return (f"{side} {b['rps']:.2f}{unit}{where_words(c)}; the fit, past the rates measured, reads {fitted}"
                + unsettled)
    return fitted + unit + where_words(c) + unsettled


def rival_in(summary: Summary) -> str | None:
    """What the paged ones are measured against, by the one rule (analysis/headline.rival_of: an open bracket that
    may reach above a bracketed knee is bracketed first): the headline's contiguous engine where the run has a
    headline (the rule applied to the fit), else the rule over the capacity blocks' knees (a simulation's sweep,
    with no intervals: the contiguous engine that sustains the highest rate)."""
    capacity = summary.capacity
    against = summary.headline.against if summary.headline else None
    if against in capacity:
        return against
    return rival_of({e: knee_of(c) for e, c in capacity.items()})


def knee_of(c: CapacityBlock) -> tuple[float, float, bool]:
    """A block's knee as the rival's rule reads it: its rate, its interval's upper end, whether it is bracketed (the
    fit's word where the block has a knee, else: within the rates measured)."""
    hi = c.sustained_rps_ci[1] if c.sustained_rps_ci else c.sustained_rps
    fitted = c.knee is not None and c.knee.bracketed is not None
    return c.sustained_rps, hi, bool(c.knee.bracketed) if fitted else c.sustained_where == "within"


def ratio_words(summary: Summary, mine: str, theirs: str) -> str:
    """A ratio of two sustained rates with its joint interval; one that holds 1.0 is no measurable difference."""
    r = summary.capacity_ratios.get(f"{mine}/{theirs}")
    if r is None:  # a simulation's sweep: one estimate per rate, no replicates
        cap = summary.capacity
        return f"{cap[mine].sustained_rps / cap[theirs].sustained_rps:.2f}x" \
            if cap[theirs].sustained_rps > 0 else "n/a"
    lo, hi = r.ratio_ci
    return f"{r.ratio:.2f}x [{lo:.2f}, {hi:.2f}]" + (": no measurable difference" if lo <= 1.0 <= hi else "")


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} minutes" if seconds >= 90 else f"{seconds:.0f} s"


def best_words(summary: Summary, rival: str) -> str:
    """"the best contiguous engine", and which contiguous engines it was not measured against (no knee)."""
    capacity = summary.capacity
    unmeasured = [e for e in summary.engines if e not in PAGED and e != rival and e not in capacity]
    if not unmeasured:
        return "the best contiguous engine"
    return (f"the best contiguous engine with a knee measured ({', '.join(unmeasured)}: none measured in this run's "
            "time, so not compared)")


def headline_sentence(summary: Summary) -> str | None:
    """The answer in one line: the ratio, its interval, decided or not and why."""
    h = summary.headline
    if not h:
        return None
    lo, hi = h.ratio_ci
    return (f"{h.engine} sustains {h.ratio:.2f}x [{lo:.2f}, {hi:.2f}] the request rate of {h.against} "
            f"({best_words(summary, h.against)}) with the same memory: {verdict_words(h)}.")


def knee_words(c: CapacityBlock | None, field: str) -> object:
    """What a knee rests on (its points or streams), '?' where the engine has no knee."""
    knee = c.knee if c is not None else None
    return "?" if knee is None or not knee.has(field) else getattr(knee, field)


def evidence_sentence(summary: Summary) -> str | None:
    """What the headline rests on, beneath it: points, streams and judged requests per engine, how they were
    placed, why the decision stopped, how much of the width is stream-to-stream, what a longer run buys."""
    h = summary.headline
    if not h:
        return None
    cap = summary.capacity
    rests = "; ".join(f"{e} on {knee_words(cap.get(e), 'points')} points "
                      f"({knee_words(cap.get(e), 'streams')} independent streams, "
                      f"{h.judged[e]} judged requests)" for e in (h.engine, h.against))
    line = (f"Each rate compared is {h.definition}. " if h.definition else "") + (
            f"Each knee is fitted from every point it may rest on (a dose-response curve of SLO attainment against "
            f"log rate, the 90 % interval from the fit's joint posterior): {rests}. The decision stopped: "
            + (f"the interval was as narrow as asked ({h.precision:g}x) on at least "
               f"{h.min_points if h.has('min_points') else '?'} points per engine" if h.stop == "precise"
               else "its time was spent"))
    spread = ", ".join(f"{e} {100 * v:.0f} %" for e, v in (h.stream_spread or {}).items())
    share = h.run_to_run_share if h.has("run_to_run_share") else 0.0
    line += pairing_words(h)
    line += (f". Beyond what their offered token load explains, streams differ from one another in the load they put "
             f"on an engine by about {spread} (each fit's estimate of that leftover shift's scale, in log load); "
             f"that spread makes up {100 * share:.0f} % of the interval's log-width")
    within = h.ratio_ci_within_runs
    if within:
        line += f" (these streams' sampling alone: [{within[0]:.2f}, {within[1]:.2f}])"
    left = {e: rates for e, rates in (h.unsteady_rates or {}).items() if rates}
    if left:
        line += (". Left out of the knees, their halves on two sides of the target (the load was still moving) when "
                 "the time ran out: " + "; ".join(f"{e} at {', '.join(f'{r:g}' for r in rates)} req/s"
                                                  for e, rates in left.items()))
    if not (h.decided and h.precise):
        more, longer = h.more_arrival_s_to_precision, h.resolvable_ratio_with_20_more_minutes
        spent = f" ({h.time_s:g} s of bench)" if h.time_s else ""
        line += (f". A low-resolution run{spent}: it can tell a difference of {h.resolvable_ratio:.2f}x from "
                 f"none; a run 20 minutes longer would resolve a {longer:.2f}x difference")
        if more is not None and more > 0:
            line += (f", and about {minutes(more)} more of arrivals at points like these would narrow the interval "
                     f"to {h.precision:g}x")
        elif more is not None:
            line += (f"; the interval is already as narrow as asked ({h.precision:g}x) and still holds 1.0: any "
                     "difference is smaller than this run can tell")
    roles = {e: c.role for e, c in cap.items()}
    screened = [e for e, r in roles.items() if r == "screened"]
    if screened:
        line += (". Screened (one point at the rival's lower end first, searched on only where that point did not rule "
                 "the engine out; not decided on): " + ", ".join(screened))
    return line + "." + time_words(summary.time_spent)


def pairing_words(h: HeadlineBlock) -> str:
    """What the pairing rests on: the streams both engines judged, what their offered token load explained, and
    the correlation the fit implies between the two engines' stream effects on one stream."""
    if h.paired_streams is None:
        return ""
    explained = ", ".join(f"{e} {100 * v:.0f} %" for e, v in (h.load_explained_share or {}).items())
    return (f". Paired streams: the decision gave both engines the same streams, each at its own rate; "
            f"{h.paired_streams:g} streams were judged by both. A stream's offered token load (its requests' tokens "
            f"per second of its window) explained {explained} of each engine's stream-to-stream spread, and the fit "
            f"takes it out of every point; the load alone implies a correlation of {h.paired_correlation:.2f} between "
            "the two engines' stream effects on one stream (read from the fitted gains and spreads, not measured)"
            + joint_words(h) + prior_words(h))


def joint_words(h: HeadlineBlock) -> str:
    """What the ratio's interval takes from what the load leaves of the two engines' stream effects."""
    c = (h.spread_prior or {}).get("correlation")
    if not h.residual_correlation or not c:
        why = (f"their twins' streams put its lower bound at {c['lower']:.2f} (estimate {c['estimate']:.2f})" if c
               else "no twins measured it")
        return f". What the load leaves is taken as independent between the two engines: {why}"
    return (f". What the load leaves was fitted jointly, its correlation between the engines taken at "
            f"{h.residual_correlation:.2f}, {c['rule']} on the {c['streams']} streams both twins judged (estimate "
            f"{c['estimate']:.2f}): the ratio is read from the joint fit's reweighted draws "
            f"({h.joint_effective_draws or 0:g} effective)")


def prior_words(h: HeadlineBlock) -> str:
    """Where each engine's stream-spread prior came from: its twin (harness/sim/spread_prior.py), or the half-t."""
    engines = (h.spread_prior or {}).get("engines") or {}
    if not engines:
        return ". Each engine's stream spread had the weakly informative half-t prior"
    told = "; ".join(f"{e} {p['centre']:.3f}" + (f" (gain {p['gain']:.2f})" if p.get("gain") is not None else "")
                     for e, p in engines.items())
    return (f". Stream-spread priors from the {h.spread_prior.get('source', 'twin')}, centred on the spread its "
            f"fresh streams showed, with a tail toward wider: {told}")


def time_words(spent: TimeSpent | None) -> str:
    """How the run's time went: per engine, set-up, operating point, search and decision, in seconds."""
    if not spent or not spent.engines:
        return ""
    parts = "; ".join(f"{e} {t.setup_s:.0f} s set-up, {t.operating_point_s:.0f} s operating point, "
                      f"{t.search_s:.0f} s search, {t.decision_s:.0f} s decision"
                      for e, t in spent.engines.items())
    whole = f" of {spent.bench_s:.0f} s" if spent.bench_s else ""
    return f" How the time{whole} went (seconds of load per phase): {parts}."


def capacity_sentence(summary: Summary) -> str:
    capacity = summary.capacity
    slo = next(iter(capacity.values())).slo
    order = sorted(capacity, key=lambda e: -capacity[e].sustained_rps)
    has_ci = any(c.sustained_rps_ci for c in capacity.values())
    rates = ", ".join(f"{e} {rate_words(capacity[e], ' req/s')}" for e in order)
    line = (f"Sustained request rate within the SLO (TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s for "
            f"{100 * slo.attainment:.0f} % of requests{', 90 % interval in brackets' if has_ci else ''}, at "
            f"steady state): {rates}")
    missing = [e for e in summary.engines if e not in capacity]
    if missing:  # an engine the search could not measure is said, not left out in silence
        line += "; no rate measured for " + ", ".join(
            f"{e} ({summary.engines[e].crashes} crashes; its calibration found no rate its share of the "
            "time could measure)" for e in missing)
    rival = rival_in(summary)
    if rival is not None and not summary.headline:
        for e in (e for e in capacity if e in PAGED):
            if capacity[rival].sustained_rps <= 0:
                line += f"; no contiguous engine sustained any rate, {e} {capacity[e].sustained_rps:.2f} req/s"
                continue
            line += f"; {e} sustains {ratio_words(summary, e, rival)} the rate of the best contiguous engine ({rival})"
    return line + "."


def bound_lines(summary: Summary) -> tuple[str, list[str]]:
    """What bound each engine: a lead, then a short line per engine (the verdict lists them)."""
    parts = [f"{e}: {c.bound} ({c.bound_evidence}, at {c.knee_point.offered_rps:.2f} req/s)."
             for e, c in sorted(summary.capacity.items(), key=lambda kv: -kv[1].sustained_rps) if c.has("bound")]
    return "What bound each engine at its knee, the lowest rate that missed the SLO:", parts


def floor_sentence(summary: Summary) -> str | None:
    """Engines whose misses lighter load does not remove (summary.json's `load_independent_misses`), where they
    take at least half the SLO's allowance of misses: their attainment barely falls at the knee."""
    parts = []
    for e, c in summary.capacity.items():
        m = c.load_independent_misses
        if m is None or m.share < (1 - c.slo.attainment) / 2:
            continue
        ooms = f"; {m.oom_total:g} OOMs, {m.oom_fragmentation:g} of them fragmentation's" if m.oom_total else ""
        parts.append(f"{e} missed {100 * m.share:.1f} % [{100 * m.share_ci[0]:.1f}, {100 * m.share_ci[1]:.1f}] of "
                     f"{m.judged:g} judged requests at rates at most {m.at_most_rps:.2f} req/s{ooms}")
    if not parts:
        return None
    return ("Misses that lighter load does not remove, at rates well under the knee: " + "; ".join(parts)
            + ": near the SLO's allowance, such an engine's attainment barely falls at its knee, which is then "
            "barely identified.")


def steady_sentence(summary: Summary) -> str | None:
    """The points a knee does not take as they are: over the knee (attainment collapsing while the queue grew: a
    miss) or unsteady (halves on two sides of the target, disjoint, the queue not growing: left out)."""
    def words(e: str, p: CapacityPoint) -> str:
        return (f"{e} at {p.offered_rps:g} req/s ({fmt(p.halves[0], '%')} then {fmt(p.halves[1], '%')} met "
                f"the SLO; mean queue {fmt(p.running_halves[0])} then {fmt(p.running_halves[1])})")

    points = [(e, p) for e, c in summary.capacity.items() for p in c.points]
    if not any(p.has("steady") for _, p in points):
        return None
    over = [words(e, p) for e, p in points if p.knee_use == "over_knee"]
    left = [words(e, p) for e, p in points if p.steady is False and p.knee_use != "over_knee"]
    rule = ("a point counts as measured when its two halves' SLO attainments fall on one side of the target or their "
            "intervals overlap, whatever its queue did")
    if not over and not left:
        return f"Every one of the {len(points)} judged points counts as measured ({rule})."
    parts = []
    if over:
        parts.append(f"{len(over)} are counted as misses, over the knee (attainment collapsed under the target while "
                     "the queue, running and waiting, grew: the second half's interval wholly under the target, "
                     "whatever the first half did): " + "; ".join(over))
    if left:
        parts.append(f"{len(left)} are left out of every knee and interval (halves on two sides of the target with "
                     f"disjoint intervals, the queue not growing; {rule}): " + "; ".join(left))
    line = f"Of the {len(points)} judged points, " + ". And ".join(parts)
    return line + "."


def knee_cells(c: CapacityBlock) -> list[str]:
    k = c.knee_point
    if not k:
        return ["n/a"] * 7
    return [f"{c.bound}", fmt(k.kv_usage, "%"), fmt(k.waiting_for_memory_share, "%"), fmt(k.running),
            fmt(k.step_s, "ms"), str(k.oom_total), str(k.preemptions)]


def point_words(p: CapacityPoint) -> str:
    mark = " (over its knee: a miss)" if p.knee_use == "over_knee" else \
        "" if p.steady is not False else " (unsteady: left out)"
    judged = p.judged if p.has("judged") else p.requests if p.has("requests") else "?"
    return f"{p.offered_rps:g}: {fmt(p.slo_attainment, '%')} of {judged}{mark}"


def capacity_table(summary: Summary) -> str:
    cap = summary.capacity
    rival = rival_in(summary)
    rows = []
    for e, c in sorted(cap.items(), key=lambda kv: -kv[1].sustained_rps):
        vs = "the best contiguous" if e == rival else ratio_words(summary, e, rival) \
            if rival is not None and cap[rival].sustained_rps > 0 else "n/a"
        rests = (f"{c.judged_total if c.has('judged_total') else '?'} "
                 f"({c.distinct_requests if c.has('distinct_requests') else '?'} distinct)")
        rows.append([e, rate_words(c), vs, rests, *knee_cells(c), " / ".join(point_words(p) for p in c.points)])
    return table(["engine", "sustained req/s [90 % interval]", "vs best contiguous [90 %]", "judged requests",
                  "bound at the knee", "KV usage", "waiting for memory", "running", "step", "OOMs", "preemptions",
                  "SLO attainment per rate (of requests judged)"], rows)


def curves(summary: Summary) -> go.Figure:
    cap = summary.capacity
    fig = make_subplots(rows=1, cols=3, subplot_titles=("SLO attainment", "normalized latency (s/token)",
                                                         "mean running requests"), horizontal_spacing=0.07)
    for i, (engine, c) in enumerate(cap.items()):
        pts = sorted(c.points, key=lambda p: p.offered_rps)
        x = [p.offered_rps for p in pts]
        color = PALETTE[i % len(PALETTE)]
        for col, key in enumerate(("slo_attainment", "normalized_latency_s_per_token", "mean_running"), start=1):
            fig.add_trace(go.Scatter(x=x, y=[p.figure(key) for p in pts], mode="lines+markers", name=engine,
                                     legendgroup=engine, showlegend=col == 1, line_color=color), row=1, col=col)
    target = next(iter(cap.values())).slo.attainment
    fig.add_hline(y=target, line_dash="dot", line_color="#888", row=1, col=1)
    fig.update_xaxes(title_text="offered req/s", type="log")
    fig.update_layout(height=380)
    return fig


def measured_budgets(pts: list[tuple[int, CapacityBlock]], **style) -> go.Scatter:
    """(KV budget, capacity block) pairs as one trace: each sustained rate with its 90 % interval as error bars."""
    y = [c.sustained_rps for _, c in pts]
    lo = [y_ - (c.sustained_rps_ci or [y_])[0] for y_, (_, c) in zip(y, pts, strict=True)]
    hi = [(c.sustained_rps_ci or [y_, y_])[1] - y_ for y_, (_, c) in zip(y, pts, strict=True)]
    return go.Scatter(x=[b / MiB for b, _ in pts], y=y, error_y=dict(type="data", symmetric=False, array=hi,
                                                                     arrayminus=lo), **style)


def budget_curve(summary: Summary) -> str:
    """Sustained rate against KV budget per engine: what memory each needs for a given rate."""
    by_budget = summary.capacity_by_budget
    fig = go.Figure()
    engines = list(dict.fromkeys(e for blocks in by_budget.values() for e in blocks))
    for i, engine in enumerate(engines):
        pts = sorted(((int(b), blocks[engine]) for b, blocks in by_budget.items() if engine in blocks),
                     key=lambda bc: bc[0])
        fig.add_trace(measured_budgets(pts, mode="lines+markers", name=engine, line_color=PALETTE[i % len(PALETTE)]))
    fig.update_layout(height=380, xaxis_title="KV budget (MiB)", yaxis_title="sustained req/s at the SLO")
    return "<h3>Sustained rate against KV budget</h3>" + fig_html(fig)


def method_words(summary: Summary, design: RecordedDesign | None) -> str:
    slo = next(iter(summary.capacity.values())).slo
    if summary.simulated:  # fragbench simulate's sweep
        return (f"Simulated: the workload's request mix offered at each rate (its arrival shape kept, its clock "
                f"rescaled). A request meets the SLO with TTFT <= {slo.ttft_s:g} s and TPOT <= "
                f"{slo.tpot_s:g} s; sustained: the highest rate at which {100 * slo.attainment:.0f} % meet "
                "it, interpolated between the rates simulated.")
    how = (f"A request meets the SLO with TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s; rejected, "
           "OOM'd, crashed or failed requests miss it; client cancellations are left out; a request still in flight "
           "when the run ended is judged on what it showed (within both limits so far: met; already past one: "
           "missed; too young to tell: left out). Sustained: the highest rate at which "
           f"{100 * slo.attainment:.0f} % meet it, interpolated between the rates measured. Each point draws "
           "fresh requests from the whole workload: every offered rate has its own stream of the workload's "
           "requests (a generator seeded per rate, or a trace read on from its own place), and engines offered "
           "one rate judge the same requests in the same order. One load generator per engine sends the points "
           "one after another without a gap; each point's requests that arrive during its warm-up (one p90 E2E "
           "latency of its own finished requests, at least 1 s: the engine's population has turned over) are "
           "sent but not judged, and so are those of its tail guard (one median E2E, 1-10 s, so that the judged "
           "ones finish under the load they arrived in). Steady: the judged requests' two halves (by arrival) "
           "agree: their SLO attainments' Wilson 90 % intervals overlap, and so do their mean running counts' "
           "batch-means 90 % intervals. ")
    if design:
        how += ("Each engine's rates come from its own knee search (from 0.75x its calibrated saturation rate, "
                "steps of x1.6, x1.6^2, ... until one rate meets the SLO and a higher one misses it, on a grid of "
                "2^(1/16)); the headline's two engines then get points placed around their fitted knees, under these "
                "rules: " + "; ".join(design.rules) + ". ")
    if summary.headline:
        how += f"Intervals: {summary.headline.method}. "
    how += ("Bound at the knee, from the lowest rate that missed the SLO: failures (crashes, or failed"
            " requests half of the misses), else memory (OOMs, preemptions, KV usage >= "
            f"{100 * KV_USAGE_NEAR_FULL:.0f} %, or requests waiting for memory alone in >= "
            f"{100 * WAITING_FOR_MEMORY:.0f} % of samples), else compute (KV room left while steps slow).")
    return how


def vllm_sentence(summary: Summary) -> str:
    """Where the run compares with the vLLM peer: how that vLLM ran."""
    if "vllm" not in summary.capacity:
        return ""
    from engines.peers.vllm import EAGER_WORDS  # the peer's own words of how it runs: loaded where it ran

    return EAGER_WORDS


def capacity_section(summary: Summary, regime: str = "", design: RecordedDesign | None = None) -> str:
    """`regime`: the KV budget's regime in words (harness/views/regime.py)."""
    cap = summary.capacity
    if not cap:
        return section("capacity", "Capacity at the SLO", "This run did not sweep request rates "
                       "(fragbench bench --sweep does): see the verdict's goodput instead.", "")
    how = method_words(summary, design) + regime
    # the answer is the verdict's (headline, rates, bounds): here the figures, each with how it was measured
    # folded under it, said once; an engine whose misses lighter load does not remove, and a vLLM peer run eager,
    # are said so above them
    said = "".join(f"<p>{x}</p>" for x in (floor_sentence(summary), vllm_sentence(summary)) if x)
    body = said + fig_html(curves(summary)) + capacity_table(summary)
    body += details("What the knees rest on: points, streams, the fit, why the decision stopped",
                    evidence_sentence(summary), steady_sentence(summary))
    if summary.capacity_by_budget:
        body += budget_curve(summary)
    body += details("How this was measured", how)
    return section("capacity", "Capacity at the SLO: what the memory buys",
                   "Each engine's sustained rate, the points it rests on and what bound it at its knee (the verdict "
                   "above says what they add up to).", body)
