"""`fragbench simulate` with several --alloc-conf, as text and pages: each setting's usual output under a heading,
then one table with a column group per setting (harness/sim/alloc_settings_sim.py computes its rows and sentences)."""

from __future__ import annotations

import re
from pathlib import Path

from harness.analysis.summary_records import SimulationOut
from harness.sim.alloc_settings_sim import COMPLETED, SWEEP, SettingRow, sentences
from harness.views.sim_report import render_simulation, render_text

CELL_WIDTHS = (10, 10, 8, 8)  # req/s, reserved-unallocated %, OOMs policy, OOMs allocator
POLICY_WIDTH = 16
SOURCE_WORDS = {SWEEP: "the sweep's sustained rate within the SLO",
                COMPLETED: "requests completed per simulated second (no --sweep or --rates)"}


def settings_text(outs: list[SimulationOut], rows: list[SettingRow], pages: list[Path] | None = None) -> str:
    """Every setting's usual text under its heading, the side-by-side table, a sentence per policy, the pages."""
    parts = [f"== --alloc-conf {out.alloc_conf} ==\n{render_text(out)}" for out in outs]
    lines = [f"== side by side: {len(outs)} allocator settings, the same seed, workload and policies =="]
    lines += side_by_side_table([out.alloc_conf for out in outs], rows)
    lines += ["  " + s for s in sentences(rows)]
    if pages:
        lines.append("  report: one page per setting: " + ", ".join(str(p) for p in pages))
    return "\n\n".join(parts + ["\n".join(lines)])


def group_width(label: str) -> int:
    """A setting's column group: its four cells, wider where its name is longer."""
    return max(sum(CELL_WIDTHS), len(label) + 2)


def side_by_side_table(labels: list[str], rows: list[SettingRow]) -> list[str]:
    """A row per policy, a column group per setting; then what the rate column measured."""
    widths = [group_width(label) for label in labels]
    head = " " * POLICY_WIDTH + "".join(f"{label:>{w}}" for label, w in zip(labels, widths, strict=True))
    cells = "".join(f"{h:>{c}}" for h, c in zip(("req/s", "res-unal", "OOM pol", "OOM alc"), CELL_WIDTHS,
                                                 strict=True))
    sub = f"{'policy':<{POLICY_WIDTH}}" + "".join(f"{cells:>{w}}" for w in widths)
    sources = {row.sustained_from for row in rows}
    lines = ["  " + head, "  " + sub]
    for start in range(0, len(rows), len(labels)):
        group = rows[start:start + len(labels)]
        line = f"{group[0].policy:<{POLICY_WIDTH}}" + "".join(
            f"{row_cells(row, len(sources) > 1):>{w}}" for row, w in zip(group, widths, strict=True))
        lines.append("  " + line)
    lines.append("  req/s: " + rate_note(sources))
    lines.append("  res-unal: reserved by the caching allocator but allocated to nothing, % of the KV budget "
                 "(time-weighted); OOM pol / alc: OOMs at the KV policy's layer / the allocator's; both from the "
                 "run at the workload's own rate")
    return lines


def rate_note(sources: set[str]) -> str:
    """What the rate column measured; where a sweep found no rate for some, which cells are completions."""
    if len(sources) == 1:
        return SOURCE_WORDS[next(iter(sources))]
    return f"{SOURCE_WORDS[SWEEP]}, or where it found none (marked *) {SOURCE_WORDS[COMPLETED]}"


def row_cells(row: SettingRow, mark_completed: bool) -> str:
    """One setting's four cells for one policy; a rate that is not the sweep's is marked where the table mixes."""
    rate = "n/a" if row.sustained_rps is None else f"{row.sustained_rps:.3f}"
    if mark_completed and row.sustained_from == COMPLETED:
        rate += "*"
    share = row.reserved_unallocated_share
    share_text = "n/a" if share is None else f"{100 * share:.1f}%"
    return "".join(f"{v:>{c}}" for v, c in zip((rate, share_text, str(row.oom_policy), str(row.oom_allocator)),
                                               CELL_WIDTHS, strict=True))


def slug(label: str) -> str:
    """A setting's name as a file name's part: `expandable_segments:True` -> `expandable-segments-true`."""
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") or "default"


def setting_pages(sims: list, path: Path) -> list[Path]:
    """One page per setting (each a harness.sim.simulator.Simulation), the setting's slug before FILE's suffix."""
    pages: list[Path] = []
    for sim in sims:
        name = f"{path.stem}-{slug(sim.record.alloc_conf)}"
        if any(p.stem == name for p in pages):  # two settings spelled alike once slugged: neither page lost
            name += f"-{len(pages) + 1}"
        pages.append(render_simulation(sim, path.with_name(name + path.suffix)))
    return pages
