"""Two runs side by side; a regression beyond the threshold fails the comparison (nightly)."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

# metric -> whether higher is better
HEADLINE = {
    "sustained_rps": True,
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


@dataclass
class Row:
    engine: str
    metric: str
    base: float | None
    new: float | None
    change_pct: float | None
    regressed: bool


def load_summary(run_dir: Path) -> dict:
    from harness.analysis.summary import summarize

    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else summarize(run_dir)


def figures(summary: dict, engine: str) -> dict:
    """An engine's headline numbers, with its sustained rate when the run swept rates."""
    out = dict(summary["engines"].get(engine, {}))
    if engine in summary.get("capacity", {}):
        out["sustained_rps"] = summary["capacity"][engine]["sustained_rps"]
    return out


def compare(base: dict, new: dict, threshold_pct: float) -> list[Row]:
    rows = []
    for engine in base["engines"]:
        if engine not in new["engines"]:
            continue
        for metric, higher_better in HEADLINE.items():
            b, n = figures(base, engine).get(metric), figures(new, engine).get(metric)
            if metric == "sustained_rps" and b is None and n is None:
                continue  # neither run swept rates
            if b is None or n is None:
                rows.append(Row(engine, metric, b, n, None, False))
                continue
            change = (n - b) / abs(b) * 100 if b else (0.0 if n == b else float("inf"))
            worse = -change if higher_better else change
            rows.append(Row(engine, metric, b, n, change, worse > threshold_pct))
    return rows


def render_text(rows: list[Row], threshold_pct: float) -> str:
    lines = [f"{'engine':<8}{'metric':<26}{'base':>12}{'new':>12}{'change':>10}  (regression: worse by > "
             f"{threshold_pct:g} %)"]
    for r in rows:
        change = "n/a" if r.change_pct is None else f"{r.change_pct:+.1f}%"
        b = "n/a" if r.base is None else f"{r.base:.4g}"
        n = "n/a" if r.new is None else f"{r.new:.4g}"
        lines.append(f"{r.engine:<8}{r.metric:<26}{b:>12}{n:>12}{change:>10}{'  REGRESSION' if r.regressed else ''}")
    return "\n".join(lines)


def render_html(rows: list[Row], base_id: str, new_id: str, threshold_pct: float, out: Path) -> Path:
    esc = html.escape
    body = "".join(
        f"<tr{' class=bad' if r.regressed else ''}><td>{esc(r.engine)}</td><td>{esc(r.metric)}</td>"
        f"<td>{'n/a' if r.base is None else f'{r.base:.4g}'}</td><td>{'n/a' if r.new is None else f'{r.new:.4g}'}</td>"
        f"<td>{'n/a' if r.change_pct is None else f'{r.change_pct:+.1f} %'}</td></tr>" for r in rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>compare</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:3px 8px}"
        "table{border-collapse:collapse}.bad{background:#fde2e1}</style></head><body>"
        f"<h1>{esc(base_id)} vs {esc(new_id)}</h1><p>Regression: worse by more than {threshold_pct:g} %.</p>"
        f"<table><tr><th>engine</th><th>metric</th><th>base</th><th>new</th><th>change</th></tr>{body}</table>"
        "</body></html>")
    return out
