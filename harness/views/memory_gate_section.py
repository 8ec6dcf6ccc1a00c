"""The memory gate as text (the console's and `fragbench memory-gate`'s) and as a section of an HTML page: each
policy's verdict, its figures on both sides and every difference, the one that FAILs marked."""

from __future__ import annotations

from html import escape
from pathlib import Path

from harness.analysis.memory_gate import GROWING_FAILS, SHARE_GATED, MemoryGate, PolicyGate

SHOWN = ("requests_completed", "requests_oom", "requests_unfinished", "preemptions", "oom_capacity",
         "oom_fragmentation", "token_states_share", "peak_blocks", "held_blocks_end")


def rule_text(gate: MemoryGate) -> str:
    return (f"FAIL where NEW has more {', '.join(GROWING_FAILS)} than BASE, or its {SHARE_GATED} falls by more than "
            f"{100 * gate.margin:g} percentage points")


def policy_lines(row: PolicyGate) -> list[str]:
    if row.crash is not None:
        return [f"  {row.policy}: FAIL: {row.crash.line()}"]
    if row.base is None or row.new is None:
        return [f"  {row.policy}: measured in {'NEW' if row.new else 'BASE'} alone, not gated"]
    head = f"  {row.policy}: {row.verdict}"
    if not row.differences:
        return [head + ": no difference"]
    return [head + f": {len(row.differences)} difference(s)", *(f"    {d.line()}" for d in row.differences)]


def render_text(gate: MemoryGate) -> str:
    trace = gate.trace
    lines = [f"memory gate: {gate.verdict} ({trace.get('workload')}, {trace.get('requests')} requests, seed "
             f"{trace.get('seed')}, KV budget {trace.get('kv_budget_bytes', 0) / 2**20:g} MiB, virtual time)",
             f"  rule: {rule_text(gate)}"]
    if gate.new_engine_args:
        lines.append(f"  NEW's engine args: {'; '.join(gate.new_engine_args)}")
    for row in gate.policies:
        lines += policy_lines(row)
    return "\n".join(lines)


def render_html(gate: MemoryGate) -> str:
    """A section: one table per policy, BASE and NEW side by side, differing figures marked."""
    parts = [f"<h2>Memory gate: {gate.verdict}</h2>", f"<p>{escape(rule_text(gate))}. Virtual time: the same figures "
             "on any machine, so a difference is the code's.</p>"]
    for row in gate.policies:
        parts.append(f"<h3>{escape(row.policy)}: {row.verdict}</h3>")
        if row.crash is not None:
            parts.append(f"<p class=\"fail\">{escape(row.crash.line())}</p>")
            continue
        if row.base is None or row.new is None:
            parts.append("<p>measured on one side alone, not gated</p>")
            continue
        failing = {d.figure for d in row.differences if d.worse}
        differing = {d.figure for d in row.differences}
        cells = []
        for name in SHOWN:
            b, n = row.base.figure(name), row.new.figure(name)
            mark = ' class="fail"' if name in failing else (' class="diff"' if name in differing else "")
            cells.append(f"<tr{mark}><td>{name}</td><td>{b}</td><td>{n}</td></tr>")
        parts.append("<table><tr><th>figure</th><th>BASE</th><th>NEW</th></tr>" + "".join(cells) + "</table>")
    return "\n".join(parts)


def write_page(gate: MemoryGate, base_label: str, new_label: str, out: Path) -> Path:
    """The gate as a page of its own."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>memory gate</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:3px 8px}"
        "table{border-collapse:collapse}.fail{background:#fde2e1}.diff{background:#fff6d5}</style></head><body>"
        f"<h1>{escape(base_label)} (BASE) vs {escape(new_label)} (NEW)</h1>"
        f"<pre>{escape(render_text(gate))}</pre>{render_html(gate)}</body></html>")
    return out
