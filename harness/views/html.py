"""What every page fragbench writes is made of: escaped tables, sections with their method line, plotly
figures without their script (each page inlines plotly.js once), number formats and the style sheet."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.colors
import plotly.graph_objects as go

from engines.kv_categories import CATEGORIES

CATEGORY_LABELS = tuple(c.replace("_", " ") for c in CATEGORIES)
CATEGORY_COLORS = ("#2a9d8f", "#e9c46a", "#f4a261", "#e76f51", "#d9d9d9")
# The vLLM paper (Kwon et al., SOSP 2023), Figure 2: % of KV memory. Its last bar, "external
# fragmentation & others", includes free memory.
PAPER_FIGURE2 = {
    "Orca (Max)": (20.4, 13.3, 57.3, 8.9),
    "Orca (Pow2)": (26.8, 17.9, 13.6, 41.6),
    "Orca (Oracle)": (38.2, 25.2, 0.0, 36.6),
    "vLLM": (96.3, 0.0, 3.7, 0.0),
}
ESC = html.escape
PALETTE = plotly.colors.qualitative.Plotly  # one colour per engine across a figure's panels


def fig_html(fig: go.Figure) -> str:
    fig.update_layout(template="plotly_white", margin=dict(l=50, r=20, t=40, b=40))
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def fmt(v, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "n/a"
    if unit == "%":
        return f"{100 * v:.1f} %"
    if unit == "ms":
        return f"{1000 * v:.0f} ms"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{ESC(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{ESC(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


LONG_HOW = 320  # characters: a method longer than this keeps its first sentence on top, the rest folded under


def section(sid: str, title: str, how: str, body: str) -> str:
    """A section: its title, what it shows in a line, its figures; a long method folded under the figures."""
    lead, rest = how, ""
    if len(how) > LONG_HOW and ". " in how:
        lead, rest = how.split(". ", 1)
        lead += "."
    return (f'<section id="{sid}"><h2>{ESC(title)}</h2><p class="how">{ESC(lead)}</p>{body}'
            f'{details("How this was measured", rest)}</section>')


def details(summary: str, *paragraphs: str | None) -> str:
    """How a figure was measured, folded under it: the reader opens it when the figure raises the question."""
    body = "".join(f"<p class='how'>{ESC(p)}</p>" for p in paragraphs if p)
    return f"<details class='how'><summary>{ESC(summary)}</summary>{body}</details>" if body else ""


def link(sid: str, text: str) -> str:
    return f'<a href="#{sid}">{ESC(text)}</a>'


def mib(v) -> str:
    return "n/a" if v is None or pd.isna(v) else f"{float(v) / 2**20:.1f} MiB"


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 6px}
th{background:#f4f4f4}.how{color:#555;font-size:13px}.partial{background:#fde2e1;border:2px solid #c0392b;
padding:.6em 1em;font-weight:bold}ul.verdict li{margin:.3em 0}ul.verdict a{color:#222;text-decoration:none}
ul.verdict a:hover{text-decoration:underline}details.how{margin:.4em 0 1em}details.how summary{cursor:pointer;
color:#1f3b73;font-size:13px}
pre{background:#f8f8f8;padding:1em;overflow:auto;font-size:12px}"""
