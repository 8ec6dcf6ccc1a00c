"""`fragbench ab`'s verdict as text and as an HTML page: every figure NEW / BASE with its interval and verdict, the
memory gate beside it, the turns' run folders (each a bench run: its own report)."""

from __future__ import annotations

from html import escape
from pathlib import Path

from harness.analysis.ab import ABFigure
from harness.analysis.memory_gate import MemoryGate
from harness.views.memory_gate_section import render_html as memory_html
from harness.views.memory_gate_section import render_text as memory_text


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def figure_line(f: ABFigure) -> str:
    ci = f"[{f.ci[0]:.3f}, {f.ci[1]:.3f}]" if f.ci else "n/a"
    tail = f" ({f.why})" if f.why else ""
    return f"  {f.engine:<14}{f.figure:<22}{fmt(f.base):>10}{fmt(f.new):>10}{fmt(f.ratio):>9} {ci:<18}{f.verdict}{tail}"


def render_text(verdict: str, figures: list[ABFigure], memory: MemoryGate, threshold: float,
                turn_dirs: list[Path]) -> str:
    lines = [f"ab: {verdict}",
             f"figures (NEW / BASE, 90 % interval; FAIL wholly past 1 -+ {100 * threshold:g} % on the worse side, PASS "
             "inside 1 +- it)",
             f"  {'engine':<14}{'figure':<22}{'base':>10}{'new':>10}{'ratio':>9} {'90 %':<18}verdict"]
    lines += [figure_line(f) for f in figures]
    lines += [memory_text(memory), "turns: " + (", ".join(str(d) for d in turn_dirs) or "none")]
    return "\n".join(lines)


def write_page(verdict: str, figures: list[ABFigure], memory: MemoryGate, labels: tuple[str, str],
               turn_dirs: list[Path], out: Path) -> Path:
    rows = "".join(
        f"<tr class='{f.verdict.lower()}'><td>{escape(f.engine)}</td><td>{escape(f.figure)}</td><td>{fmt(f.base)}</td>"
        f"<td>{fmt(f.new)}</td><td>{fmt(f.ratio)}</td><td>{escape(str(list(f.ci)) if f.ci else 'n/a')}</td>"
        f"<td>{f.verdict}</td><td>{escape(f.why)}</td></tr>" for f in figures)
    turns = "".join(f"<li>{escape(str(d))}</li>" for d in turn_dirs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>ab</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:3px 8px}"
        "table{border-collapse:collapse}.fail{background:#fde2e1}.inconclusive{background:#fff6d5}"
        ".diff{background:#fff6d5}</style></head><body>"
        f"<h1>{escape(labels[0])} (BASE) vs {escape(labels[1])} (NEW): {verdict}</h1>"
        "<h2>Measured, one run per turn</h2><table><tr><th>engine</th><th>figure</th><th>BASE</th><th>NEW</th>"
        f"<th>NEW / BASE</th><th>90 %</th><th>verdict</th><th>why</th></tr>{rows}</table>"
        f"<p>Turns (each a bench run with its own report):</p><ul>{turns}</ul>{memory_html(memory)}</body></html>")
    return out
