"""Two stored runs side by side (`fragbench compare`): a comparison of two runs measured apart, not the nightly gate
(`fragbench ab`, both builds in one run pair by pair, harness/analysis/ab.py); it fails only where a gated figure
regressed beyond its noise (`compare_verdict`).

Gated: figures that mean the same thing in two runs of one commit, each with the interval its run computed:
every engine's sustained rate at the SLO (`capacity.<engine>.sustained_rps`, `sustained_rps_ci`), the
headline ratio (`headline.ratio`, `ratio_ci`) where both runs compare the same two engines, and each engine's
latency, throughput and memory at its operating point: the highest-rate stream both runs measured below the
knee and below both runs' sustained-rate intervals, so the same requests at the same offered load, sustained in
both with confidence (analysis/operating.py). A sustained rate whose knee one run
did not bracket (every rate it measured met the SLO, or none did) is a bound there, and a headline ratio over
such a knee a ratio of bounds: both are shown, not gated. A gated figure regressed when its
two intervals separate (the new one wholly on the worse side of the old one: a difference inside either is "no
measurable difference") and its point estimate is worse by more than the threshold.

The machine: every gated figure above but the headline ratio scales with the machine's speed (a slow night made
paged's sustained rate -54 % and its TPOT 5.4 -> 30.5 ms with nothing changed). run.json's speed probe
(analysis/speed_probe.py) says whether the two machines agreed; where they did not, or a run has no probe, those
absolute figures are shown and not gated, and the text says the machine differed. The same-run ratios (the
headline, and summary.json's `capacity_ratios` of the headline engine to each other engine: two engines measured
interleaved in one run, which cancels most of the machine) are gated always.

Not gated (printed, marked "info"): figures pooled over whichever rates a sweep visited (output tokens/s, TTFT
percentiles, shares, OOM counts). Two sweeps visit different rates by design, so these differ between two runs
of one commit without anything having changed; they stay in the report and in the comparison, ungated.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

from harness.analysis.gate_verdict import GateVerdict, passed_or_failed, worst
from harness.analysis.operating import OPERATING_FIGURES, shared_point
from harness.analysis.records import RunRecord
from harness.analysis.speed_probe import Agreement, SpeedProbe
from harness.analysis.summary import summarize
from harness.analysis.summary_records import CapacityBlock, Summary

# figure -> whether higher is better (the ungated figures pooled over a run's points)
HEADLINE = {
    "output_tokens_per_s": True,
    "requests_per_s": True,
    "goodput_requests_per_s": True,
    "token_states_share": True,
    "ttft_p50_s": False,
    "ttft_p99_s": False,
    "tpot_p50_s": False,
    "tpot_p99_s": False,
    "oom_total": False,
    "crashes": False,
    "cancel_release_p99_s": False,
}
GATED = {"sustained_rps": True, "headline_ratio": True, "capacity_ratio": True, **OPERATING_FIGURES}
SAME_RUN = ("headline_ratio", "capacity_ratio")  # ratios within one run: gated whatever the machine


@dataclass
class Row:
    engine: str
    metric: str
    base: float | None
    new: float | None
    change_pct: float | None
    regressed: bool
    gated: bool = False
    base_ci: list[float] | None = None
    new_ci: list[float] | None = None
    why: str = ""
    at_rps: float | None = None  # an operating-point figure: the offered rate both runs measured it at

    @property
    def figure(self) -> str:
        return self.metric if self.at_rps is None else f"{self.metric} at {self.at_rps:.3g}/s"


def load_summary(run_dir: Path) -> Summary:
    """A run's summary.json (a run never summarized: summarized now, not written)."""
    path = run_dir / "summary.json"
    return Summary.model_validate(json.loads(path.read_text()) if path.is_file() else summarize(run_dir))


def load_probe(run_dir: Path) -> SpeedProbe | None:
    """A run's speed probe from its run.json (None: a run recorded before the probe, or no run.json)."""
    try:
        return RunRecord.read(run_dir).speed_probe
    except (FileNotFoundError, ValueError):
        return None


SAME = (("workload", ("config", "workload")), ("model", ("config", "model")), ("KV budget", ("config", "kv_budget")),
        ("KV budgets", ("config", "kv_budgets")), ("machine", ("hardware", "machine")), ("CPUs", ("hardware", "cpus")),
        ("RAM bytes", ("hardware", "ram_bytes")), ("device", ("hardware", "device")),
        ("device name", ("hardware", "device_name")))


def run_differences(base_dir: Path, new_dir: Path) -> list[str]:
    """A line for each way the two runs' run.json differ in what they measured on (workload, model, KV budget,
    machine): the comparison still follows, but its changes may be the setting's, not the code's."""
    def read(d: Path) -> dict:
        try:
            return json.loads((d / "run.json").read_text())
        except (OSError, ValueError):
            return {}

    runs, out = (read(base_dir), read(new_dir)), []
    for name, (block, key) in SAME:
        base, new = ((r.get(block) or {}).get(key) if isinstance(r.get(block), dict) else None for r in runs)
        if base is not None and new is not None and base != new:
            out.append(f"WARNING: the runs differ in {name}: {base} (base) vs {new} (new); compared anyway, a change "
                       "below may be the setting's")
    return out


def figures(summary: Summary, engine: str, names: tuple[str, ...] | dict) -> dict[str, object]:
    """An engine's figures by name (those of `names` it has; the rest None), with its sustained rate when the run
    swept rates."""
    mine = summary.engines.get(engine)
    out = {m: mine.figure(m) if mine is not None else None for m in names}
    if engine in summary.capacity:
        out["sustained_rps"] = summary.capacity[engine].sustained_rps
    return out


def change_pct(b: float, n: float) -> float:
    return (n - b) / abs(b) * 100 if b else (0.0 if n == b else float("inf"))


def separated(base_ci: list[float] | None, new_ci: list[float] | None, higher_better: bool) -> bool:
    """The new interval lies wholly on the worse side of the old one."""
    if not base_ci or not new_ci:
        return False
    return new_ci[1] < base_ci[0] if higher_better else new_ci[0] > base_ci[1]


def gated_row(engine: str, metric: str, base: tuple, new: tuple, threshold_pct: float,
              at_rps: float | None = None) -> Row:
    """A gated figure: (estimate, interval) in each run."""
    (b, b_ci), (n, n_ci) = base, new
    if b is None or n is None:
        return Row(engine, metric, b, n, None, False, True, b_ci, n_ci, "measured in one run only", at_rps)
    change = change_pct(b, n)
    worse = -change if GATED[metric] else change
    apart = separated(b_ci, n_ci, GATED[metric])
    if b_ci is None or n_ci is None:
        why = "no interval in one run: not gated"
    elif not apart:
        why = "intervals overlap: no measurable difference"
    elif worse <= threshold_pct:
        why = f"intervals separate, worse by {max(worse, 0):.1f} % <= {threshold_pct:g} %"
    else:
        why = f"intervals separate and worse by {worse:.1f} %"
    return Row(engine, metric, b, n, change, apart and worse > threshold_pct, True, b_ci, n_ci, why, at_rps)


WHERE = {"below": "below the lowest rate measured", "beyond": "beyond the highest rate measured"}


def unbracketed(caps: list[CapacityBlock | None]) -> str | None:
    """Why an engine's sustained rate is not gated: its knee lay outside the rates one run measured, so that run's
    figure is a bound (its interval reaches only one search step past the rates measured), not an estimate."""
    where = [(run, c.sustained_where if c else None) for run, c in zip(("base", "new"), caps, strict=True)]
    open_ = [f"{WHERE[w]} in {run}" for run, w in where if w in WHERE]
    return f"knee not bracketed ({', '.join(open_)}): a bound, not gated" if open_ else None


def sustained_row(engine: str, caps: list[CapacityBlock | None], threshold_pct: float) -> Row:
    """An engine's sustained rate: gated on its intervals, or shown where a knee was not bracketed."""
    (b, b_ci), (n, n_ci) = [(c.sustained_rps, c.sustained_rps_ci) if c else (None, None) for c in caps]
    if open_ := unbracketed(caps):
        return Row(engine, "sustained_rps", b, n, None if b is None or n is None else change_pct(b, n),
                   False, True, b_ci, n_ci, open_)
    return gated_row(engine, "sustained_rps", (b, b_ci), (n, n_ci), threshold_pct=threshold_pct)


def operating_rows(engine: str, base: CapacityBlock, new: CapacityBlock, threshold_pct: float) -> list[Row]:
    """An engine's latency, throughput and memory at the stream both runs measured below its knee."""
    shared = shared_point(base, new)
    if shared is None:
        return [Row(engine, "operating point", None, None, None, False, True,
                    why="no stream both runs sustained below both knee intervals: not gated")]
    b, n = shared
    return [gated_row(engine, fig, (b.figure(fig), b.figure(f"{fig}_ci")), (n.figure(fig), n.figure(f"{fig}_ci")),
                      threshold_pct, b.offered_rps) for fig in OPERATING_FIGURES]


def ratio_rows(base: Summary, new: Summary, threshold_pct: float) -> list[Row]:
    """The headline engine's same-run ratio to each other engine both runs fitted (the headline pair's own is the
    headline ratio's row): higher is better, the headline engine's advantage over that one."""
    if base.headline is None:
        return []
    ref, rows = base.headline.engine, []
    for key, b in base.capacity_ratios.items():
        num, _, other = key.partition("/")
        n = new.capacity_ratios.get(key)
        if num != ref or other == base.headline.against or n is None:
            continue
        caps = [s.capacity.get(e) for s in (base, new) for e in (ref, other)]
        row = gated_row(key, "capacity_ratio", (b.ratio, b.ratio_ci), (n.ratio, n.ratio_ci), threshold_pct)
        if any(c is None or c.sustained_where in WHERE for c in caps):  # a bound in either run
            row.regressed, row.why = False, "a knee not bracketed in one run: a ratio of bounds, not gated"
        rows.append(row)
    return rows


def machine_blind(rows: list[Row], machine: Agreement | None) -> list[Row]:
    """Absolute figures where the machines differed (or went unprobed): shown, never a regression."""
    if machine is None or machine.same:
        return rows
    for r in rows:
        if r.gated and r.metric not in SAME_RUN:
            r.regressed, r.why = False, f"{r.why}; the machine differed: not gated"
    return rows


def compare(base: Summary, new: Summary, threshold_pct: float, machine: Agreement | None = None) -> list[Row]:
    """Every row; `machine` (the runs' speed probes compared), where given, decides whether absolute figures gate."""
    return machine_blind(rows_of(base, new, threshold_pct), machine)


def rows_of(base: Summary, new: Summary, threshold_pct: float) -> list[Row]:
    rows = []
    for engine in base.engines:
        if engine not in new.engines:
            continue
        caps = [s.capacity.get(engine) for s in (base, new)]
        if any(caps):
            rows.append(sustained_row(engine, caps, threshold_pct))
        if all(caps):
            rows += operating_rows(engine, caps[0], caps[1], threshold_pct)
    hb, hn = base.headline, new.headline
    same = hb and hn and (hb.engine, hb.against) == (hn.engine, hn.against)
    if same and not all(all((h.bracketed or {}).values()) for h in (hb, hn)):
        rows.append(Row(f"{hb.engine}/{hb.against}", "headline_ratio", hb.ratio, hn.ratio, None,
                        False, True, hb.ratio_ci, hn.ratio_ci,
                        "a knee not bracketed in one run: a ratio of bounds, not gated"))
    elif same:
        rows.append(gated_row(f"{hb.engine}/{hb.against}", "headline_ratio",
                              (hb.ratio, hb.ratio_ci), (hn.ratio, hn.ratio_ci), threshold_pct))
    rows += ratio_rows(base, new, threshold_pct)
    for engine in base.engines:
        if engine not in new.engines:
            continue
        for metric in HEADLINE:
            b, n = figures(base, engine, HEADLINE).get(metric), figures(new, engine, HEADLINE).get(metric)
            rows.append(Row(engine, metric, b, n, None if b is None or n is None else change_pct(b, n), False,
                            why="pooled over the rates the sweep visited: not gated"))
    return rows


def fmt_ci(ci: list[float] | None) -> str:
    return "" if not ci else f"[{ci[0]:.3g}, {ci[1]:.3g}]"


NOT_THE_GATE = ("a comparison of two stored runs, measured apart: not the nightly gate (fragbench ab measures both "
                "builds in one run, pair by pair)")


def compare_verdict(rows: list[Row]) -> GateVerdict:
    """FAIL where a gated figure regressed, else PASS (harness/analysis/gate_verdict.worst over the rows)."""
    return worst(passed_or_failed(r.regressed) for r in rows) if rows else GateVerdict.INCONCLUSIVE


def render_text(rows: list[Row], threshold_pct: float, machine: Agreement | None = None,
                differ: list[str] = ()) -> str:
    lines = [f"compare: {compare_verdict(rows)}, {NOT_THE_GATE}", *differ,
             *([machine.sentence()] if machine is not None else [])]
    lines += [f"gated figures (a regression: the intervals separate and the estimate is worse by > {threshold_pct:g} "
              "%)",
             f"{'engine':<22}{'figure':<34}{'base [90 %]':>26}{'new [90 %]':>26}{'change':>9}  verdict"]
    for r in (r for r in rows if r.gated):
        change = "n/a" if r.change_pct is None else f"{r.change_pct:+.1f}%"
        b = "n/a" if r.base is None else f"{r.base:.4g} {fmt_ci(r.base_ci)}"
        n = "n/a" if r.new is None else f"{r.new:.4g} {fmt_ci(r.new_ci)}"
        verdict = "REGRESSION: " + r.why if r.regressed else r.why
        lines.append(f"{r.engine:<22}{r.figure:<34}{b:>26}{n:>26}{change:>9}  {verdict}")
    lines.append("info, not gated (pooled over the rates each sweep visited, which differ between runs by design)")
    for r in (r for r in rows if not r.gated):
        change = "n/a" if r.change_pct is None else f"{r.change_pct:+.1f}%"
        b = "n/a" if r.base is None else f"{r.base:.4g}"
        n = "n/a" if r.new is None else f"{r.new:.4g}"
        lines.append(f"{r.engine:<22}{r.metric:<24}{b:>12}{n:>12}{change:>9}")
    return "\n".join(lines)


def render_html(rows: list[Row], base_id: str, new_id: str, threshold_pct: float, out: Path,
                machine: Agreement | None = None, differ: list[str] = ()) -> Path:
    esc = html.escape
    said = "".join(f"<p class=bad><b>{esc(x)}</b></p>" for x in differ)
    said += f"<p><b>{esc(machine.sentence())}</b></p>" if machine is not None else ""

    def num(x):
        return "n/a" if x is None else f"{x:.4g}"

    gated = "".join(
        f"<tr{' class=bad' if r.regressed else ''}><td>{esc(r.engine)}</td><td>{esc(r.figure)}</td>"
        f"<td>{num(r.base)} {fmt_ci(r.base_ci)}</td><td>{num(r.new)} {fmt_ci(r.new_ci)}</td>"
        f"<td>{'n/a' if r.change_pct is None else f'{r.change_pct:+.1f} %'}</td>"
        f"<td>{'REGRESSION: ' if r.regressed else ''}{esc(r.why)}</td></tr>" for r in rows if r.gated)
    info = "".join(
        f"<tr><td>{esc(r.engine)}</td><td>{esc(r.metric)}</td><td>{num(r.base)}</td><td>{num(r.new)}</td>"
        f"<td>{'n/a' if r.change_pct is None else f'{r.change_pct:+.1f} %'}</td></tr>" for r in rows if not r.gated)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>compare</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:3px 8px}"
        "table{border-collapse:collapse}.bad{background:#fde2e1}</style></head><body>"
        f"<h1>{esc(base_id)} vs {esc(new_id)}: {compare_verdict(rows)}</h1>"
        f"<p>This page is {esc(NOT_THE_GATE)}.</p>{said}"
        "<h2>Gated</h2><p>A regression: the two runs' 90 % intervals "
        f"separate and the estimate is worse by more than {threshold_pct:g} %. A figure 'at R/s' is the engine's "
        "operating point: the highest-rate stream both runs measured below its knee and below both runs' "
        "sustained-rate intervals (the same requests at the same offered load, sustained in both).</p>"
        "<table><tr><th>engine</th><th>figure</th><th>base [90 %]</th><th>new [90 %]</th><th>change</th>"
        f"<th>verdict</th></tr>{gated}</table><h2>Not gated</h2><p>Pooled over the rates each sweep visited, which "
        "differ between two runs by design: shown, not gated.</p><table><tr><th>engine</th><th>figure</th>"
        f"<th>base</th><th>new</th><th>change</th></tr>{info}</table></body></html>")
    return out
