"""`fragbench history`: every run in a results folder over time, per engine, and the change points of each gated
series (each engine's sustained rate at the SLO, the headline ratio) found by Apache Otava: E-divisive means
proposes change points, a Student t-test between the neighbouring segments keeps those under the p-value (0.001
by default) and above a minimum relative magnitude (`otava.analysis.compute_change_points`, Fleming et al.,
"Hunter", ICPE 2023). A change point for the worse is a regression; it is confirmed once its new segment holds
`CONFIRM_RUNS` runs (the run that opened it and the ones after). A change point stands only where the runs' own
intervals tell its two segments apart (each segment's median interval, the two disjoint): a step inside them is
"no measurable difference" and listed apart (a short sweep's rate is the grid rate its search offered, so two
segments of identical values differ with p = 0 by a grid step no run could resolve). Runs of another workload or
KV budget are another series, drawn apart."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from harness.analysis.records import RunRecord
from harness.analysis.summary_records import Summary
from harness.views.compare import GATED, HEADLINE, figures
from harness.views.html import ESC, PALETTE, STYLE, fig_html, fmt, table

METRICS = ("sustained_rps", "output_tokens_per_s", "goodput_requests_per_s", "token_states_share", "oom_capacity",
           "oom_fragmentation", "crashes", "ttft_p99_s", "tpot_p99_s")
HIGHER_BETTER = {**HEADLINE, **GATED, "oom_capacity": False, "oom_fragmentation": False}
CONFIRM_RUNS = 3  # runs in a change point's new segment (the one that opened it included) that confirm it
HEADLINE_SERIES = "headline_ratio"


class ChangePointsUnavailable(RuntimeError):
    """Apache Otava is not installed."""


@dataclass(frozen=True)
class ChangePoint:
    setting: str
    engine: str
    figure: str
    run_id: str  # the first run after the change
    index: int  # its position in the series (0: the oldest run)
    mean_before: float
    mean_after: float
    change_pct: float
    pvalue: float
    worse: bool
    runs_after: int  # runs from the change on (the one that opened it included)
    confirmed: bool
    measurable: bool = True  # the segments' median intervals are disjoint (True where the runs carry none)

    def line(self) -> str:
        kind = ("no measurable difference" if not self.measurable
                else "REGRESSION" if self.worse else "improvement")
        state = ("confirmed" if self.confirmed else f"not yet confirmed ({self.runs_after} of {CONFIRM_RUNS} runs)"
                 ) if self.measurable else "inside the runs' own intervals"
        return (f"{self.setting}: {self.engine} {self.figure}: {kind} at run {self.run_id} (#{self.index + 1}): "
                f"{self.mean_before:.4g} -> {self.mean_after:.4g} ({self.change_pct:+.1f} %, p = {self.pvalue:.2g}), "
                f"{state}")


@dataclass
class Run:
    run_id: str
    started: str
    git_sha: str | None
    setting: str  # workload and KV budget: runs compare only within one
    engines: dict[str, dict] = field(default_factory=dict)  # engine -> metric -> value
    headline: tuple[str, float] | None = None  # ("paged/static-oracle", ratio) where the run has a headline
    intervals: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (engine, figure) -> its 90 % CI


def read_runs(results: Path) -> tuple[list[Run], list[tuple[str, str]]]:
    """Readable runs, oldest first, and (folder, why) for each one skipped."""
    runs, skipped = [], []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()) if results.is_dir() else []:
        try:
            meta = RunRecord.of(json.loads((folder / "run.json").read_text()))
            summary = Summary.model_validate(json.loads((folder / "summary.json").read_text()))
            cfg = meta.config
            if meta.started is None:
                raise KeyError("started")
            run = Run(meta.run_id if meta.has("run_id") else folder.name, meta.started, meta.git_sha,
                      f"{cfg.workload} at {cfg.kv_budget}")
            targets = meta.targets or {}
            for engine in summary.engines:
                # a target is its own series per model: a server it did not start changes outside fragbench
                label = f"{engine} (target, {targets[engine].model})" if engine in targets else engine
                run.engines[label] = figures(summary, engine, METRICS)
                cap = summary.capacity.get(engine)
                if cap is not None and cap.sustained_rps_ci:
                    run.intervals[(label, "sustained_rps")] = cap.sustained_rps_ci
            h = summary.headline
            if h is not None:
                run.headline = (f"{h.engine}/{h.against}", float(h.ratio))
                if h.ratio_ci:
                    run.intervals[(run.headline[0], HEADLINE_SERIES)] = h.ratio_ci
        except FileNotFoundError as e:
            skipped.append((folder.name, f"no {Path(e.filename).name}"))
            continue
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            skipped.append((folder.name, f"unreadable ({type(e).__name__}: {str(e)[:80]})"))
            continue
        runs.append(run)
    return sorted(runs, key=lambda r: r.started), skipped


def gated_series(runs: list[Run]) -> dict[tuple[str, str], list[tuple[Run, float]]]:
    """(engine, figure) -> the runs that have it, oldest first, with its value: each engine's sustained rate and
    each headline pair's ratio."""
    out: dict[tuple[str, str], list[tuple[Run, float]]] = {}
    for run in runs:
        for engine, values in run.engines.items():
            if values.get("sustained_rps") is not None:
                out.setdefault((engine, "sustained_rps"), []).append((run, float(values["sustained_rps"])))
        if run.headline is not None:
            out.setdefault((run.headline[0], HEADLINE_SERIES), []).append((run, run.headline[1]))
    return out


def change_points(runs: list[Run], setting: str, pvalue: float = 0.001,
                  min_magnitude: float = 0.0) -> list[ChangePoint]:
    """Every gated series' change points (Otava's E-divisive means with its t-test merge), each marked measurable
    or not by the runs' own intervals."""
    try:
        from otava.analysis import compute_change_points
    except ImportError as e:
        raise ChangePointsUnavailable("fragbench history needs Apache Otava: .venv/bin/pip install --no-deps "
                                      "apache-otava==0.8.0 (make setup installs it)") from e
    out = []
    for (engine, figure), points in gated_series(runs).items():
        values = [v for _, v in points]
        if len(values) < 3:
            continue
        found, _ = compute_change_points(values, window_len=50, max_pvalue=pvalue, min_magnitude=min_magnitude)
        bounds = [0, *(int(cp.index) for cp in found), len(values)]
        for k, cp in enumerate(found):
            before, after = float(cp.stats.mean_1), float(cp.stats.mean_2)
            change = (after - before) / abs(before) * 100 if before else 0.0
            higher = figure == HEADLINE_SERIES or HIGHER_BETTER.get(figure, True)
            runs_after = len(values) - cp.index
            out.append(ChangePoint(setting, engine, figure, points[cp.index][0].run_id, int(cp.index), before, after,
                                   change, float(cp.stats.pvalue), bool((change < 0) == higher and change != 0),
                                   int(runs_after), bool(runs_after >= CONFIRM_RUNS),
                                   told_apart([r.intervals.get((engine, figure)) for r, _ in points], bounds[k:k + 3])))
    return sorted(out, key=lambda c: (c.engine, c.figure, c.index))


def told_apart(intervals: list[list[float] | None], bounds: list[int]) -> bool:
    """Whether the segments [bounds[0], bounds[1]) and [bounds[1], bounds[2]) differ by more than their runs' own
    intervals: each segment's median lower and upper ends, the two intervals disjoint. Without an interval in
    either segment the change point stands on the t-test alone."""
    def median_interval(lo: int, hi: int) -> tuple[float, float] | None:
        cis = [ci for ci in intervals[lo:hi] if ci]
        return (float(np.median([c[0] for c in cis])), float(np.median([c[1] for c in cis]))) if cis else None
    before, after = median_interval(bounds[0], bounds[1]), median_interval(bounds[1], bounds[2])
    if before is None or after is None:
        return True
    return before[1] < after[0] or after[1] < before[0]


def quiet(_: str) -> None:
    pass


def history(results: Path, pvalue: float = 0.001, min_magnitude: float = 0.0,
            say: Callable[[str], None] = quiet) -> dict:
    """The runs, the skipped folders and every setting's change points, as `history --json` prints them; `say`
    hears a line per phase (the CLI's progress on stderr)."""
    runs, skipped = read_runs(results)
    if not runs:
        reasons = "; ".join(f"{name}: {why}" for name, why in skipped) or "the folder holds no run"
        raise ValueError(f"no readable run in {results} ({reasons})")
    say(f"{len(runs)} runs read ({len(skipped)} skipped); finding change points")
    settings = list(dict.fromkeys(r.setting for r in runs))
    cps = [c for st in settings for c in change_points([r for r in runs if r.setting == st], st, pvalue, min_magnitude)]
    return {"runs": [{"run_id": r.run_id, "started": r.started, "git_sha": r.git_sha, "setting": r.setting}
                     for r in runs],
            "skipped": [{"folder": n, "why": w} for n, w in skipped],
            "method": f"Apache Otava compute_change_points (E-divisive means, t-test merge at p < {pvalue:g}, minimum "
                      f"relative magnitude {min_magnitude:g}) on each engine's sustained rate and the headline ratio; "
                      f"a change point stands where its segments' median 90 % intervals are disjoint, and is confirmed "
                      f"once {CONFIRM_RUNS} runs stand after it (it included)",
            "change_points": [asdict(c) for c in cps if c.measurable],
            # proposed by the t-test but inside the runs' own intervals: no measurable difference
            "within_intervals": [asdict(c) for c in cps if not c.measurable]}


def render_history(results: Path, out: Path, pvalue: float = 0.001, min_magnitude: float = 0.0,
                   say: Callable[[str], None] = quiet) -> tuple[Path, dict]:
    """The page, and what `history` found. Raises ValueError when no run is readable."""
    found = history(results, pvalue, min_magnitude, say)
    runs, skipped = read_runs(results)
    say("drawing the page")
    parts = []
    for setting in dict.fromkeys(r.setting for r in runs):
        series = [r for r in runs if r.setting == setting]
        fig = make_subplots(rows=len(METRICS), cols=1, shared_xaxes=True, subplot_titles=METRICS,
                            vertical_spacing=0.02)
        engines = list(dict.fromkeys(e for r in series for e in r.engines))
        for i, engine in enumerate(engines):
            mine = [r for r in series if engine in r.engines]
            hover = [f"{r.run_id} @ {(r.git_sha or 'no git')[:10]}" for r in mine]
            for row, metric in enumerate(METRICS, start=1):
                fig.add_trace(go.Scatter(x=[r.started for r in mine], y=[r.engines[engine][metric] for r in mine],
                                         mode="lines+markers", name=engine, legendgroup=engine, showlegend=row == 1,
                                         line_color=PALETTE[i % len(PALETTE)], text=hover,
                                         hovertemplate="%{text}: %{y}<extra></extra>"), row=row, col=1)
        fig.update_layout(height=170 * len(METRICS))
        cps = [ChangePoint(**c) for c in found["change_points"] + found["within_intervals"] if c["setting"] == setting]
        for c in cps:
            if c.figure == "sustained_rps" and c.measurable:  # marked where the change begins
                fig.add_vline(x=series_started(series, c.run_id), line_dash="dash",
                              line_color="#c0392b" if c.worse else "#27ae60", row=1, col=1)
        rows = [[c.engine, c.figure, c.run_id, fmt(c.mean_before), fmt(c.mean_after), f"{c.change_pct:+.1f} %",
                 f"{c.pvalue:.2g}", ("no measurable difference (inside the runs' intervals)" if not c.measurable
                                     else "REGRESSION" if c.worse else "improvement"),
                 "confirmed" if c.confirmed else f"{c.runs_after} of {CONFIRM_RUNS} runs"] for c in cps]
        listed = (table(["engine", "figure", "first run after", "mean before", "mean after", "change", "p",
                         "", "confirmed"], rows) if rows
                  else f"<p>No change point in {len(series)} runs (p &lt; {pvalue:g}).</p>")
        parts.append(f"<section class='setting'><h2>{ESC(setting)}: {len(series)} runs</h2>{fig_html(fig)}"
                     f"<h3>Change points</h3>{listed}</section>")
    note = ("<p class='partial' id='skipped'>Skipped: " + "; ".join(f"{ESC(n)} ({ESC(w)})" for n, w in skipped)
            + "</p>") if skipped else ""
    title = f"fragbench history of {results}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{ESC(title)}</title>"
                   f"<style>{STYLE}</style><script>{get_plotlyjs()}</script></head><body><h1>{ESC(title)}</h1>"
                   f"<p class='how'>{len(runs)} runs. {ESC(found['method'])}; a change point for the worse is a "
                   f"regression.</p>{note}{''.join(parts)}</body></html>")
    return out, found


def series_started(series: list[Run], run_id: str) -> str:
    return next(r.started for r in series if r.run_id == run_id)
