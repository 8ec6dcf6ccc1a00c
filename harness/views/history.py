"""`fragbench history`: every run in a results folder over time, per engine, and the last run against the
median of the ones before it. Runs of another workload or KV budget are another series, drawn apart."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from harness.views.compare import HEADLINE, figures
from harness.views.html import ESC, PALETTE, STYLE, fig_html, fmt, table

METRICS = ("sustained_rps", "output_tokens_per_s", "goodput_requests_per_s", "token_states_share", "oom_capacity",
           "oom_fragmentation", "crashes", "ttft_p99_s", "tpot_p99_s")
HIGHER_BETTER = {**HEADLINE, "oom_capacity": False, "oom_fragmentation": False}


@dataclass
class Run:
    run_id: str
    started: str
    git_sha: str | None
    setting: str  # workload and KV budget: runs compare only within one
    engines: dict[str, dict] = field(default_factory=dict)  # engine -> metric -> value


def read_runs(results: Path) -> tuple[list[Run], list[tuple[str, str]]]:
    """Readable runs, oldest first, and (folder, why) for each one skipped."""
    runs, skipped = [], []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()) if results.is_dir() else []:
        try:
            meta = json.loads((folder / "run.json").read_text())
            summary = json.loads((folder / "summary.json").read_text())
            cfg = meta.get("config", {})
            run = Run(meta.get("run_id", folder.name), meta["started"], meta.get("git_sha"),
                      f"{cfg.get('workload')} at {cfg.get('kv_budget')}")
            targets = meta.get("targets") or {}
            for engine in summary["engines"]:
                # a target is its own series per model: a server it did not start changes outside fragbench
                label = f"{engine} (target, {targets[engine]['model']})" if engine in targets else engine
                run.engines[label] = {m: figures(summary, engine).get(m) for m in METRICS}
        except FileNotFoundError as e:
            skipped.append((folder.name, f"no {Path(e.filename).name}"))
            continue
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            skipped.append((folder.name, f"unreadable ({type(e).__name__}: {str(e)[:80]})"))
            continue
        runs.append(run)
    return sorted(runs, key=lambda r: r.started), skipped


def regressions(runs: list[Run], baseline: int, threshold_pct: float) -> list[list]:
    """The last run against the median of up to `baseline` runs before it, per engine and metric."""
    last, before = runs[-1], runs[-1 - baseline : -1]
    rows = []
    for engine, values in last.engines.items():
        for metric in METRICS:
            history = [r.engines[engine][metric] for r in before
                       if engine in r.engines and r.engines[engine][metric] is not None]
            new = values[metric]
            if new is None or not history:
                continue
            median = statistics.median(history)
            change = (new - median) / abs(median) * 100 if median else (0.0 if new == median else float("inf"))
            worse = -change if HIGHER_BETTER[metric] else change
            rows.append([engine, metric, fmt(median), fmt(new), f"{change:+.1f} %",
                         "REGRESSION" if worse > threshold_pct else ""])
    return rows


def render_history(results: Path, out: Path, baseline: int = 7, threshold_pct: float = 10.0) -> tuple[Path, int]:
    """The page, and how many runs it drew. Raises ValueError when no run is readable."""
    runs, skipped = read_runs(results)
    if not runs:
        reasons = "; ".join(f"{name}: {why}" for name, why in skipped) or "the folder holds no run"
        raise ValueError(f"no readable run in {results} ({reasons})")
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
        rows = regressions(series, baseline, threshold_pct)
        compared = (table(["engine", "metric", f"median of previous {min(baseline, len(series) - 1)}", "last",
                           "change", ""], rows) if rows else "<p>Only one run of this setting: nothing to compare.</p>")
        parts.append(f"<section class='setting'><h2>{ESC(setting)}: {len(series)} runs</h2>{fig_html(fig)}"
                     f"<h3>Last run ({ESC(series[-1].run_id)}) against the runs before it</h3>{compared}</section>")
    note = ("<p class='partial' id='skipped'>Skipped: " + "; ".join(f"{ESC(n)} ({ESC(w)})" for n, w in skipped)
            + "</p>") if skipped else ""
    title = f"fragbench history of {results}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{ESC(title)}</title>"
                   f"<style>{STYLE}</style><script>{get_plotlyjs()}</script></head><body><h1>{ESC(title)}</h1>"
                   f"<p class='how'>{len(runs)} runs. A regression is the last run worse than the median of the "
                   f"previous {baseline} of its setting by more than {threshold_pct:g} %.</p>{note}{''.join(parts)}"
                   "</body></html>")
    return out, len(runs)
