"""One self-contained HTML report per run: plotly.js inlined (opens offline), every string escaped.
What the reader came for comes first: the verdict table, then where the memory went and why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from engines.memory.snapshot import read_snapshot
from engines.percentile import percentile
from harness.analysis.integrity import sentence
from harness.analysis.records import RunRecord
from harness.analysis.run_state import run_mark
from harness.analysis.rundir import load_frames
from harness.analysis.summary import SHARE_COLUMNS, read_summary_record
from harness.analysis.summary_records import Summary
from harness.results import token_times
from harness.views.alloc_settings_section import settings_section, size_rule
from harness.views.allocator_section import layer_cell, oom_layers, reserved_unallocated
from harness.views.capacity_section import capacity_section
from harness.views.html import (
    CATEGORY_COLORS,
    CATEGORY_LABELS,
    ESC,
    PAPER_FIGURE2,
    STYLE,
    fig_html,
    fmt,
    mib,
    section,
    table,
)
from harness.views.regime import regime_words
from harness.views.saturation_section import saturation_section
from harness.views.twin_section import twin_section
from harness.views.verdict import verdict
from workloads.spec import SpecError, load_spec

SECTIONS = ("verdict", "capacity", "twin", "integrity", "memory-breakdown", "figure2", "scheduler", "oom-events",
            "memory-map", "debug-pass", "latency", "throughput", "workload", "config")
MAX_POINTS = 1200  # per engine and time series: a one-hour run draws as fast as a one-minute one


def downsample(s: pd.DataFrame, by: str = "allocated_bytes", max_points: int = MAX_POINTS) -> pd.DataFrame:
    """At most max_points rows, keeping each time bucket's lowest and highest `by` row: peaks survive."""
    if len(s) <= max_points:
        return s
    bucket = pd.Series(np.arange(len(s)) * (max_points // 2) // len(s), index=s.index)
    value = pd.to_numeric(s[by], errors="coerce").fillna(0)
    keep = pd.concat([value.groupby(bucket).idxmin(), value.groupby(bucket).idxmax()]).unique()
    return s.loc[sorted(keep)]


def memory_breakdown(samples: pd.DataFrame) -> str:
    engines = list(samples.engine.unique())
    if not engines:
        return section("memory-breakdown", "Where the KV memory went", "No samples were recorded.", "")
    fig = make_subplots(rows=len(engines), cols=1, shared_xaxes=True, subplot_titles=engines,
                        vertical_spacing=0.06)
    for i, engine in enumerate(engines, start=1):
        s = downsample(samples[(samples.engine == engine) & (samples.t_s >= 0)].sort_values("t_s"))
        cap = s.kv_capacity_bytes.astype(float)
        if s.token_states_bytes.isna().all():  # usage only (vLLM): allocated, then free
            fig.add_trace(go.Scatter(x=s.t_s, y=100 * s.allocated_bytes.astype(float) / cap, stackgroup=f"e{i}",
                                     name="allocated (split not exported)", line=dict(width=0),
                                     fillcolor="#8d99ae", legendgroup="allocated"), row=i, col=1)
        for label, col, color in zip(CATEGORY_LABELS, SHARE_COLUMNS.values(), CATEGORY_COLORS, strict=True):
            if s[col].isna().all():
                continue
            fig.add_trace(go.Scatter(x=s.t_s, y=100 * s[col].astype(float) / cap, name=label, stackgroup=f"e{i}",
                                     line=dict(width=0), fillcolor=color, legendgroup=label, showlegend=i == 1),
                          row=i, col=1)
    fig.update_layout(height=230 * len(engines), yaxis_title="% of KV capacity")
    return section("memory-breakdown", "Where the KV memory went, over time",
                   "Stacked Figure-2 categories from each engine's /stats, sampled at 10 Hz; reservation and "
                   "internal fragmentation use each request's final length (prompt + max_tokens under ignore_eos). "
                   "vLLM exports usage only, so only its allocated share is known.", fig_html(fig))


def figure2(summary: Summary) -> str:
    fig = go.Figure()
    names = list(summary.engines) + list(PAPER_FIGURE2)
    values = [[100 * (s.figure(c) or 0) for c in SHARE_COLUMNS] for s in summary.engines.values()]
    # the paper folds free memory into its last bar: so do we for the paper's bars
    values += [[t, r, i, e, 0.0] for t, r, i, e in PAPER_FIGURE2.values()]
    for k, (label, color) in enumerate(zip(CATEGORY_LABELS, CATEGORY_COLORS, strict=True)):
        fig.add_trace(go.Bar(x=names, y=[v[k] for v in values], name=label, marker_color=color))
    unknown = [100 * s.allocated_share if s.token_states_share is None and s.allocated_share else 0
               for s in summary.engines.values()]
    if any(unknown):
        fig.add_trace(go.Bar(x=names, y=unknown + [0] * len(PAPER_FIGURE2), name="allocated (split not exported)",
                             marker_color="#8d99ae"))
    fig.update_layout(barmode="stack", yaxis_title="% of KV capacity", height=420)
    return section("figure2", "Mean breakdown beside the vLLM paper's Figure 2",
                   "This run's time-averaged shares (left) and the paper's (right: Kwon et al., SOSP 2023, LLaMA-13B "
                   "on A100-40GB, ShareGPT). External fragmentation here: free bytes in extents too small for the "
                   "allocation the engine would make next (the queued head's reservation, else the median of its "
                   "recent ones); a hole that holds the next request is free. (Free bytes outside the largest extent, "
                   "the older index, are /stats' free_outside_largest_bytes.) The paper's last bar is 'external "
                   "fragmentation & others' and includes free memory: compare it with external fragmentation + free "
                   "here.", fig_html(fig) + reserved_unallocated(summary) + size_rule(summary))


def integrity_section(summary: Summary) -> str:
    """A line per engine: did the KV cache give back what was put in it, under this run's churn?"""
    rows = []
    for name, s in summary.engines.items():
        r = s.integrity
        rows.append([name, *(["n/a"] * 5 if not r else [
            r.probes, r.diverged,
            "n/a" if r.max_abs_logprob_diff is None else f"{r.max_abs_logprob_diff:.2g}", f"{r.tolerance:g}",
            f"{r.preempted_probes} / {r.prefix_hit_probes} / {r.failed}"]),
            sentence(r)])
    return section("integrity", "KV integrity under churn",
                   "Six fixed probe prompts (short, two sharing a long head, a long prompt, a long answer), greedy "
                   "with logprobs, served alone on the idle engine before any load (twice: the second answer says "
                   "how repeatable the engine is, served from its prefix cache where it has one), then sent one at a "
                   "time into the engine's saturating calibration windows (a fixed-rate or churn run: beside its "
                   "load). Each answer is compared with its idle one token by token: a divergence is a logprob "
                   "further than the tolerance from the idle one, or another token where the idle answer's margin "
                   "between the two was wider than the tolerance (a flip between near-tied tokens is arithmetic: the "
                   "comparison stops there). What the engine did during a probe is its counters' rise between the "
                   "probe's start and end.",
                   table(["engine", "probes compared", "diverged", "largest |logprob diff|", "tolerance",
                          "through preemptions / prefix hits / failed", "in words"], rows))


def scheduler(samples: pd.DataFrame) -> str:
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, subplot_titles=("running", "waiting", "preempted (total)"))
    for engine, s in samples[samples.t_s >= 0].groupby("engine", sort=False):
        s = downsample(s.sort_values("t_s"), by="running")
        for row, col in enumerate(("running", "waiting", "preempted_total"), start=1):
            fig.add_trace(go.Scatter(x=s.t_s, y=s[col], name=engine, legendgroup=engine, showlegend=row == 1),
                          row=row, col=1)
    fig.update_layout(height=600)
    return section("scheduler", "Running, waiting and preempted over time",
                   "From each engine's /stats at 10 Hz (sequences, not requests: a request with n samples counts n).",
                   fig_html(fig))


OOM_ROWS = 20  # events listed one by one; the rest are in events.parquet
MAX_MARKERS = 2000  # OOM markers drawn per engine and measure


def span(values: pd.Series, unit: str = "") -> str:
    v = pd.to_numeric(values, errors="coerce").dropna()
    if not len(v):
        return "n/a"
    lo, hi = (mib(v.min()), mib(v.max())) if unit == "MiB" else (fmt(float(v.min())), fmt(float(v.max())))
    return lo if lo == hi else f"{lo} - {hi}"


def oom_summary(ooms: pd.DataFrame) -> str:
    rows = []
    for (engine, cause), e in ooms.groupby(["engine", "cause"], sort=False):
        state = {c: e[c] if c in e else pd.Series(dtype=float) for c in ("running", "live_tokens")}
        rows.append([engine, cause, len(e), fmt(float(e.t_s.min())), fmt(float(e.t_s.max())),
                     span(e.requested_bytes, "MiB"), span(e.free_bytes, "MiB"), span(e.largest_free_bytes, "MiB"),
                     span(state["running"]), span(state["live_tokens"])])
    return table(["engine", "cause", "count", "first (s)", "last (s)", "requested", "free", "largest free",
                  "running then", "live tokens then"], rows)


def oom_events(events: pd.DataFrame, run_dir: Path) -> str:
    ooms = events[events.kind == "oom"]
    # the timeline is the measured churn's (t >= 0); the debugging pass and calibration ran before its clock
    before = events[(events.t_s < 0) & events.kind.isin(["oom", "crash"])]
    crashes = events[events.kind.isin(["crash", "restart"]) & (events.t_s >= 0)]
    fig = go.Figure()
    for col, symbol in (("requested_bytes", "x"), ("free_bytes", "circle"), ("largest_free_bytes", "diamond")):
        for engine, e in ooms[ooms.t_s >= 0].groupby("engine", sort=False):
            e = e.iloc[:: max(1, len(e) // MAX_MARKERS)]  # every k-th: a long run draws as fast as a short one
            fig.add_trace(go.Scatter(x=e.t_s, y=e[col].astype(float) / 2**20, mode="markers", marker_symbol=symbol,
                                     name=f"{engine}: {col.removesuffix('_bytes').replace('_', ' ')}",
                                     text=e.cause, hovertemplate="%{y:.2f} MiB, %{text}"))
    for _, c in crashes.head(200).iterrows():
        fig.add_vline(x=c.t_s, line_dash="dot", line_color="red" if c.kind == "crash" else "green")
    fig.update_layout(height=380, xaxis_title="s", yaxis_title="MiB")
    earlier = "".join(f"<p class='how'>{ESC(engine)}: {len(e[e.kind == 'oom'])} OOMs and {len(e[e.kind == 'crash'])} "
                      "crashes before the churn's clock started (debugging pass, calibration): in the tables below, "
                      "not on the timeline.</p>" for engine, e in before.groupby("engine", sort=False))
    if not len(ooms):
        return section("oom-events", "OOM events", "Each failed KV allocation.", fig_html(fig) + earlier
                       + "<p>No OOM in this run.</p>")
    rows = [[e.engine, fmt(e.t_s), e.cause, mib(e.requested_bytes), mib(e.free_bytes), mib(e.largest_free_bytes),
             *(fmt(getattr(e, c, None)) for c in ("running", "waiting", "live_tokens")),
             fmt(getattr(e, "kv_usage", None), "%"), layer_cell(e)] for e in ooms.head(OOM_ROWS).itertuples()]
    rest = len(ooms) - len(rows)
    more = (f"<p class='how'>The other {rest} events are rows of kind 'oom' in "
            f"<code>{ESC(str(run_dir / 'events.parquet'))}</code>.</p>") if rest > 0 else ""
    body = (fig_html(fig) + earlier + "<h3>By engine and cause</h3>" + oom_summary(ooms) + oom_layers(ooms)
            + f"<h3>The first {len(rows)} of {len(ooms)}</h3>"
            + table(["engine", "t (s)", "cause", "requested", "free", "largest free", "running", "waiting",
                     "live tokens", "KV usage", "layer"], rows) + more)
    return section("oom-events", "OOM events",
                   "Each failed KV allocation: requested vs free vs largest free extent, and the engine at that "
                   "moment. Cause 'fragmentation' means enough free bytes existed but no single extent fit. Red lines: "
                   "crashes; green: restarts.", body)


def draw_map(mm: list[dict]) -> tuple[go.Figure, str]:
    """A block pool as a grid of blocks coloured by owner; an arena as extents along its addresses."""
    fig = go.Figure()
    if mm and "block" in mm[0]:
        mm = [b for run in mm for b in [run] * run.get("blocks", 1)]  # runs of blocks alike, one cell a block
        width = 64
        owners = sorted({o for b in mm for o in b["owners"]})
        index = {o: i + 1 for i, o in enumerate(owners)}
        z = [(-1 if b["cached"] else 0) if not b["owners"] else
             (len(owners) + 2 if len(b["owners"]) > 1 else index[b["owners"][0]]) for b in mm]
        z += [None] * (-len(z) % width)
        text = [", ".join(b["owners"]) or ("cached, free" if b["cached"] else "free") for b in mm]
        text += [""] * (-len(text) % width)
        fig.add_trace(go.Heatmap(z=np.array(z, dtype=float).reshape(-1, width),
                                 text=np.array(text, dtype=object).reshape(-1, width),
                                 hovertemplate="%{text}<extra></extra>", colorscale="Turbo", showscale=False))
        fig.update_layout(height=120 + 12 * (len(z) // width), yaxis_autorange="reversed")
        return fig, f"{len(mm)} blocks, {width} per row; shared blocks in the top colour, free ones dark"
    for ext in mm:
        free = ext["owner"] is None
        fig.add_trace(go.Bar(y=["arena"], x=[ext["size"] / 2**20], base=[ext["offset"] / 2**20], orientation="h",
                             marker_color="#d9d9d9" if free else None, marker_line_color="#c0392b" if free else None,
                             marker_line_width=2 if free else 0, name=ext["owner"] or "free", showlegend=False,
                             hovertemplate=f"{ESC(str(ext['owner'] or 'free'))}: %{{x:.2f}} MiB<extra></extra>"))
    fig.update_layout(barmode="overlay", height=200, xaxis_title="address (MiB)")
    holes = [e["size"] for e in mm if e["owner"] is None]
    return fig, (f"{len(mm)} extents along the arena; {len(holes)} free extents (grey, outlined red) of "
                 f"{mib(sum(holes))} in all, the largest {mib(max(holes, default=0))}")


SEGMENT_COLOURS = {"active_allocated": "#2c7fb8", "active_pending_free": "#fdae61", "inactive": "#d9d9d9"}


def draw_segments(segments: list[dict]) -> tuple[go.Figure, str]:
    """The CUDA caching allocator's segments (torch.cuda.memory_snapshot), one row each, its blocks along it:
    inactive blocks inside reserved segments are memory PyTorch holds and no request of that size could use."""
    fig = go.Figure()
    for i, seg in enumerate(segments):
        at = 0
        for block in seg["blocks"]:
            fig.add_trace(go.Bar(y=[f"segment {i}"], x=[block["size"] / 2**20], base=[at / 2**20], orientation="h",
                                 marker_color=SEGMENT_COLOURS.get(block["state"], "#999"), showlegend=False,
                                 hovertemplate=f"{ESC(block['state'])}: %{{x:.2f}} MiB<extra></extra>"))
            at += block["size"]
    fig.update_layout(barmode="overlay", height=120 + 22 * len(segments), xaxis_title="offset in segment (MiB)")
    sizes = {state: sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == state)
             for state in SEGMENT_COLOURS}
    largest = max((b["size"] for s in segments for b in s["blocks"] if b["state"] == "inactive"), default=0)
    return fig, (f"{len(segments)} segments reserved, {mib(sum(s['total_size'] for s in segments))} in all: "
                 f"{mib(sizes['active_allocated'])} allocated (blue), {mib(sizes['inactive'])} cached but free "
                 f"(grey; the largest block {mib(largest)})")


def cuda_snapshots(run_dir: Path) -> list[str]:
    parts = []  # the real allocator's (--memory cuda, JSON) and the emulator's (--memory caching, PyTorch's pickle)
    for path in sorted([*run_dir.glob("cuda_snapshot-*.json"), *run_dir.glob("caching_snapshot-*.pickle")]):
        snap = json.loads(path.read_text()) if path.suffix == ".json" else read_snapshot(path)
        kind, engine = path.stem.split("_snapshot-", 1)
        fig, what = draw_segments(snap["segments"])
        parts.append(f"<h3 class='map' data-engine='{ESC(engine)}'>{ESC(engine)}: the "
                     f"{'CUDA' if kind == 'cuda' else 'emulated caching'} allocator at its first "
                     f"OOM, t = {fmt(snap.get('t_s'))} s</h3><p class='how'>{ESC(what)}</p>" + fig_html(fig))
    return parts


def memory_map(run_dir: Path) -> str:
    parts = cuda_snapshots(run_dir)
    for path in sorted(run_dir.glob("memory_map-*.json")):
        snap = json.loads(path.read_text())
        if "-oom-" in path.stem:
            engine, ev = path.stem.removeprefix("memory_map-").rsplit("-oom-", 1)[0], snap["event"]
            title = (f"{engine} at a fragmentation OOM, t = {fmt(snap['t_s'])} s: {mib(ev['requested_bytes'])} "
                     f"requested, {mib(ev['free_bytes'])} free, largest free extent {mib(ev['largest_free_bytes'])}")
        else:
            engine = path.stem.removeprefix("memory_map-")
            title = f"{engine} at its worst moment, t = {fmt(snap['t_s'])} s"
        fig, what = draw_map(snap["memory_map"])
        parts.append(f"<h3 class='map' data-engine='{ESC(engine)}'>{ESC(title)}</h3><p class='how'>{ESC(what)}</p>"
                     + fig_html(fig))
    return section("memory-map", "Memory maps: the worst moment, and a failed allocation with memory free",
                   "For each engine, the sample with the most allocated-but-idle plus stranded free memory; for an "
                   "engine that failed an allocation while enough bytes were free, the map at that failure: the free "
                   "extents are the holes no single request fitted.",
                   "".join(parts) or "<p>No memory map was captured.</p>")


CAUSE_WORDS = {"fragmentation": "FRAGMENTATION (enough bytes were free, no extent fitted)",
               "capacity": "capacity (not enough bytes free)"}


def debug_pass(debug: pd.DataFrame, events: pd.DataFrame) -> str:
    rows = [[r.engine, r.phase, mib(r.kv_allocated_bytes), mib(r.token_states_bytes), fmt(r.kv_usage, "%"),
             fmt(r.running), fmt(r.live_tokens), mib(r.torch_allocated_bytes), mib(r.torch_reserved_bytes),
             mib(r.device_used_bytes), mib(r.process_rss_bytes)] for r in debug.itertuples()] if len(debug) else []
    ooms = events[events.kind == "oom"]
    for (engine, cause), group in ooms.groupby(["engine", "cause"], sort=False):  # one line each: the OOM
        e = group.iloc[0]  # section lists them
        rows.append([engine, f"{len(group)} failed allocations, {CAUSE_WORDS.get(cause, cause)}; the first at "
                     f"{fmt(e.t_s)} s: {mib(e.requested_bytes)} requested, {mib(e.free_bytes)} free, "
                     f"{mib(e.largest_free_bytes)} largest free", "", "", "", "", "", "", "", "", ""])
    header = ["engine", "phase", "KV allocated", "token states", "KV usage", "running", "live tokens",
              "torch allocated", "torch reserved", "device used", "server RSS"]
    return section("debug-pass", "The debugging pass",
                   "Memory at each step of the seeds' debugging pass: after model load, at the peak of one short and "
                   "one long request alone, after they complete, after the churn mix, and at each failed allocation. "
                   "KV usage growing with live tokens means blocks; a jump of a whole reservation means contiguous "
                   "buffers; free bytes with a small largest-free extent mean fragmentation; allocator reserved far "
                   "above allocated means the caching allocator holds it.", table(header, rows))


def latency(requests: pd.DataFrame) -> str:
    ok = requests[requests.status == "ok"]
    fig = make_subplots(rows=3, cols=1, subplot_titles=("TTFT (s)", "TPOT (s)", "E2E (s)"), vertical_spacing=0.08)
    for engine, r in ok.groupby("engine", sort=False):
        for row, col in enumerate(("ttft_s", "tpot_s", "e2e_s"), start=1):
            # quartiles computed here, not every value shipped: the page stays small for any run length
            per_class = {c: g[col] for c, g in r.groupby("class") if g[col].notna().any()}
            q = {k: [percentile(v, p) for v in per_class.values()]
                 for k, p in (("lowerfence", 0.01), ("q1", 0.25), ("median", 0.5), ("q3", 0.75), ("upperfence", 0.99))}
            fig.add_trace(go.Box(x=list(per_class), name=engine, legendgroup=engine, showlegend=row == 1, **q),
                          row=row, col=1)
    fig.update_layout(boxmode="group", height=800)
    return section("latency", "Latency per request class",
                   "Client-side, per request, exact (not bucketed): TTFT = first streamed token - send; TPOT = mean "
                   "gap between streamed tokens; E2E = end - send. Successful requests only. Boxes: quartiles; "
                   "whiskers: p1 and p99.", fig_html(fig))


def throughput(requests: pd.DataFrame) -> str:
    fig = go.Figure()
    for engine, r in requests.groupby("engine", sort=False):
        times = [t for row in r.itertuples() for t in token_times(row)]
        if times:
            counts = pd.Series(np.floor(times)).value_counts().sort_index()
            fig.add_trace(go.Scatter(x=counts.index, y=counts.values, name=engine, mode="lines"))
    fig.update_layout(height=350, xaxis_title="s", yaxis_title="output tokens / s")
    return section("throughput", "Throughput over time",
                   "Output tokens received by the clients per second (token arrival times from the streams).",
                   fig_html(fig))


def workload(requests: pd.DataFrame, meta: RunRecord) -> str:
    first = requests[requests.engine == requests.engine.iloc[0]] if len(requests) else requests
    fig = make_subplots(rows=1, cols=3, subplot_titles=("prompt tokens", "output tokens (target)", "arrivals / s"))
    fig.add_trace(go.Histogram(x=first.prompt_tokens, showlegend=False), row=1, col=1)
    fig.add_trace(go.Histogram(x=first.output_tokens_target, showlegend=False), row=1, col=2)
    fig.add_trace(go.Histogram(x=first.arrival_s, xbins=dict(size=1), showlegend=False), row=1, col=3)
    fig.update_layout(height=320)
    name = meta.config.workload if meta.config.has("workload") else ""
    try:
        spec = load_spec(name)
        text = f"{spec.name}: {spec.description}"
        attribution = spec.attribution
    except SpecError:
        text, attribution = name, ""
    body = f"<p>{ESC(text)}</p>" + fig_html(fig)
    if attribution:
        body += f"<p class='attribution'>Trace: {ESC(attribution)}</p>"
    return section("workload", "Workload", "The requests as sent to the first engine (every engine got the same).",
                   body)


def config(meta: RunRecord) -> str:
    return section("config", "Configuration, versions, hardware", "run.json of this run.",
                   f"<pre>{ESC(json.dumps(meta.raw, indent=2, default=str))}</pre>")


def budget_bytes(meta: RunRecord) -> int | None:
    budget = meta.config.budget
    return budget.bytes if budget is not None else None


def targets_note(meta: RunRecord) -> str:
    """One line per target: a server fragbench did not start, and what its metrics could and could not show."""
    lines = []
    for name, t in (meta.targets or {}).items():
        read = (f"read from its {t.family} metrics ({t.metrics_url}): {', '.join(t.sees) or 'nothing'}"
                if t.family else "no metrics read")
        lines.append(f"<li><b>{ESC(name)}</b> is a server fragbench did not start ({ESC(t.url)}, model "
                     f"{ESC(t.model)}); {ESC(read)}; it cannot show {ESC(', '.join(t.cannot_see))}, which "
                     "its rows leave unknown (n/a), never 0.</li>")
    return f"<ul class='verdict'>{''.join(lines)}</ul>" if lines else ""


def render(run_dir: Path, out: Path) -> Path:
    meta = RunRecord.read(run_dir)
    frames = load_frames(run_dir)
    summary = read_summary_record(run_dir)  # computed once, by finalize: the report only reads it
    mark = run_mark(meta, frames["requests"])  # a failed run's cause, a partial one's stop and what it kept: on top
    banner = f"<p class='partial' id='partial'>{ESC(mark)}</p>" if mark else ""
    body = "".join([
        verdict(summary, meta, frames["events"]), saturation_section(summary), targets_note(meta),
        capacity_section(summary, regime_words(summary, meta, budget_bytes(meta)),
                         meta.sweep.design if meta.sweep else None),
        twin_section(summary, budget_bytes(meta)), integrity_section(summary),
        memory_breakdown(frames["samples"]), figure2(summary), settings_section(summary),
        scheduler(frames["samples"]), oom_events(frames["events"], run_dir), memory_map(run_dir),
        debug_pass(frames["debug"], frames["events"]), latency(frames["requests"]),
        throughput(frames["requests"]), workload(frames["requests"], meta), config(meta),
    ])
    title = f"fragbench {meta.run_id if meta.has('run_id') else run_dir.name}"
    doc = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{ESC(title)}</title><style>{STYLE}</style>"
           f"<script>{get_plotlyjs()}</script></head><body><h1>{ESC(title)}</h1>{banner}"
           f"<p class='how'>Workload {ESC(str(meta.config.workload))}, model "
           f"{ESC(str(meta.config.model))}, KV budget "
           f"{ESC(str(meta.config.kv_budget))} per engine.</p>{body}</body></html>")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    return out
