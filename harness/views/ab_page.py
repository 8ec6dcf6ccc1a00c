"""`fragbench ab`'s verdict as text and as an HTML page: each engine's verdict first, then every figure NEW / BASE
(gated or reported) with its interval, the rule in one paragraph, the memory gate, the machine's speed probe, and
the pairs' and the knee turn's files."""

from __future__ import annotations

import statistics
from html import escape
from pathlib import Path

from harness.analysis.ab import ALPHA, MIN_LOOK_PAIRS, PASS_LOOKS, ABFigure, pass_confidence
from harness.analysis.memory_gate import MemoryGate
from harness.views.memory_gate_section import render_html as memory_html
from harness.views.memory_gate_section import render_text as memory_text


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def rule(threshold: float) -> str:
    return (f"per engine, pairs of blocks at one fixed rate (AB, BA, ...), one paired log ratio a pair; FAIL: at "
            f"every look from {MIN_LOOK_PAIRS} pairs to the last PASS look, past {1 + threshold:g} at one-sided "
            f"p < {ALPHA:g} spent equally over those looks; PASS: at {PASS_LOOKS} planned looks, the upper one-sided "
            f"{pass_confidence():.2%} bound under {1 + threshold:g}; SLO misses and errors by block, FAIL by the "
            "pairs' sign test at the same looks; reported figures never gate")


def speed_line(speed: list[dict]) -> str:
    """What the machine's speed probe read at the start and the end (the median of its compute repeats)."""
    if len(speed) < 2:
        return "speed probe: not read"
    first, last = (statistics.median(r["compute_s"]) for r in (speed[0], speed[-1]))
    return (f"speed probe (numpy compute, median): {1e3 * first:.1f} ms at the start, {1e3 * last:.1f} ms at the end "
            f"(x{last / first:.2f}): " + ("the machine's speed held" if 0.8 <= last / first <= 1.25 else
                                          "the machine's speed moved during the run"))


def figure_line(f: ABFigure) -> str:
    ci = f"[{f.ci[0]:.3f}, {f.ci[1]:.3f}]" if f.ci else "n/a"
    tail = f" ({f.why})" if f.why else ""
    return f"  {f.engine:<14}{f.figure:<21}{fmt(f.ratio):>9} {ci:<17}{f.pairs:>6}  {f.verdict}{tail}"


def at_rate(engine: str, measured) -> str:
    """Where an engine's pairs ran: its rate, or none where it stopped before its rate was set (NEW failed first)."""
    rate = measured.rates.get(engine)
    return f" at {rate:g} req/s" if rate is not None else " (stopped before its rate was set)"


def render_text(verdict: str, engines: dict[str, str], figures: list[ABFigure], memory: MemoryGate | None,
                threshold: float, measured) -> str:
    lines = [f"ab: {verdict}"]
    lines += [f"  {e}: {v}{at_rate(e, measured)}" for e, v in engines.items()]
    lines += [f"  {n}" for n in measured.notes]
    lines += [f"rule: {rule(threshold)}",
              f"  {'engine':<14}{'figure':<21}{'ratio':>9} {'90 %':<17}{'pairs':>6}  verdict"]
    lines += [figure_line(f) for f in figures]
    lines += [memory_text(memory) if memory else "memory gate: not run", speed_line(measured.speed),
              "knee turn: " + (", ".join(str(d) for d in measured.dirs) or "none")]
    return "\n".join(lines)


def write_page(verdict: str, engines: dict[str, str], figures: list[ABFigure], memory: MemoryGate | None,
               labels: tuple[str, str], measured, threshold: float, out: Path) -> Path:
    verdicts = "".join(f"<li><b>{escape(e)}</b>: {v}{escape(at_rate(e, measured))}</li>"
                       for e, v in engines.items()) + "".join(f"<li>{escape(n)}</li>" for n in measured.notes)
    rows = "".join(
        f"<tr class='{f.verdict.lower()}'><td>{escape(f.engine)}</td><td>{escape(f.figure)}</td>"
        f"<td>{'gated' if f.gated else 'reported'}</td><td>{fmt(f.ratio)}</td>"
        f"<td>{escape(f'[{f.ci[0]:.3f}, {f.ci[1]:.3f}]' if f.ci else 'n/a')}</td><td>{f.pairs}</td>"
        f"<td>{f.verdict}</td><td>{escape(f.why)}</td></tr>" for f in figures)
    turns = "".join(f"<li>{escape(str(d))}</li>" for d in measured.dirs) or "<li>none</li>"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>ab</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:3px 8px}"
        "table{border-collapse:collapse}.fail{background:#fde2e1}.inconclusive{background:#fff6d5}"
        ".diff{background:#fff6d5}</style></head><body>"
        f"<h1>{escape(labels[0])} (BASE) vs {escape(labels[1])} (NEW): {verdict}</h1><ul>{verdicts}</ul>"
        f"<p>{escape(speed_line(measured.speed))}</p>"
        "<h2>Figures, NEW / BASE</h2><table><tr><th>engine</th><th>figure</th><th>role</th><th>NEW / BASE</th>"
        f"<th>90 %</th><th>pairs</th><th>verdict</th><th>why</th></tr>{rows}</table>"
        f"<p>The rule: {escape(rule(threshold))} (docs/method.md, Nightly).</p>"
        f"<p>The knee turn (each a bench run with its own report):</p><ul>{turns}</ul>"
        f"{memory_html(memory) if memory else '<p>Memory gate: not run</p>'}"
        "</body></html>")
    return out
