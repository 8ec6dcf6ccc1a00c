"""One self-contained HTML report per run: plotly.js inlined (opens offline), every string escaped.
What the reader came for comes first: the verdict table, then where the memory went and why."""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.colors
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from engines.kv.base import CATEGORIES
from engines.percentile import percentile
from harness.results import token_times
from harness.summary import SHARE_COLUMNS, load_frames, load_meta, point_warmup_s, summarize, warmup_s

SECTIONS = ("verdict", "capacity", "memory-breakdown", "figure2", "scheduler", "oom-events", "memory-map", "debug-pass",
            "latency", "throughput", "workload", "config")
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


def section(sid: str, title: str, how: str, body: str) -> str:
    return (f'<section id="{sid}"><h2>{ESC(title)}</h2><p class="how">{ESC(how)}</p>{body}</section>')


# -- the verdict in words: every sentence computed from this run, each linking to its evidence
PAGED = ("paged", "hf-cb", "vllm")
RUNBOOK = {
    "capacity": "capacity: the live tokens did not fit; reduce max_num_seqs or max_seq_len, quantize the KV cache, "
                "or add memory",
    "reservation": "reservation and internal fragmentation: contiguous max-length reservations hold memory no token "
                   "uses; use blocks",
    "fragmentation": "external fragmentation: variable-size contiguous extents strand free memory; use blocks "
                     "(more memory only delays it)",
    "caching": "allocator caching: PyTorch reserved far more than it allocated; empty the cache or cap its fraction",
}
WASTE = {"reservation_share": "reservation", "internal_fragmentation_share": "internal fragmentation",
         "external_fragmentation_share": "external fragmentation", "free_share": "free"}


def link(sid: str, text: str) -> str:
    return f'<a href="#{sid}">{ESC(text)}</a>'


def mib(v) -> str:
    return "n/a" if v is None or pd.isna(v) else f"{float(v) / 2**20:.1f} MiB"


def diagnosis(s: dict, ooms: pd.DataFrame) -> str | None:
    """The OOM runbook's line for one engine, from its own failures and where its memory went."""
    if not len(ooms) and not s["crashes"]:
        return None
    if s["oom_fragmentation"] > s["oom_capacity"]:
        return RUNBOOK["fragmentation"]
    if (s["reservation_share"] or 0) + (s["internal_fragmentation_share"] or 0) > (s["token_states_share"] or 0):
        return RUNBOOK["reservation"]
    return RUNBOOK["capacity"]


def goodput_sentence(engines: dict) -> str:
    ranked = sorted(engines, key=lambda e: -(engines[e]["goodput_requests_per_s"] or 0))
    best = ranked[0]
    contiguous = [e for e in engines if e not in PAGED]
    rates = ", ".join(f"{e} {engines[e]['goodput_requests_per_s']:.2f}" for e in ranked)
    line = f"Goodput at the workload's own rate (requests per second within the SLO): {rates}; {best} served the most"
    if best in PAGED and contiguous:
        rival = max(contiguous, key=lambda e: engines[e]["goodput_requests_per_s"] or 0)
        theirs = engines[rival]["goodput_requests_per_s"] or 0
        line += (f", {engines[best]['goodput_requests_per_s'] / theirs:.1f}x the best contiguous engine ({rival})"
                 if theirs else ", and no contiguous engine served any request within the SLO")
    return line + "."


def verdict_sentences(summary: dict, events: pd.DataFrame, meta: dict) -> list[str]:
    engines = summary["engines"]
    if not engines:
        return ["No engine produced a result in this run."]
    budget = meta.get("config", {}).get("kv_budget", "the same budget")
    out = []
    if summary.get("capacity"):
        out.append(link("capacity", capacity_sentence(summary["capacity"])))
    else:  # one offered rate: goodput at it is the measure of what memory bought
        out.append(link("verdict-table", goodput_sentence(engines)))
    held = ", ".join(f"{e} {fmt(engines[e]['mean_running'])} (max {fmt(engines[e]['max_running'])})"
                     for e in sorted(engines, key=lambda e: -(engines[e]["mean_running"] or 0)))
    out.append(link("scheduler", f"Requests held at once in {budget} of KV, mean over the churn: {held}."))
    where = []
    for e, s in engines.items():
        if s["token_states_share"] is None:
            where.append(f"{e} exports usage only ({fmt(s['allocated_share'], '%')} allocated)")
            continue
        worst = max(WASTE, key=lambda k: s[k] or 0)
        where.append(f"{e} {fmt(s['token_states_share'], '%')} token states, largest other share {WASTE[worst]} "
                     f"{fmt(s[worst], '%')}")
    out.append(link("figure2", "Where the memory went: " + "; ".join(where) + "."))
    oom = events[events.kind == "oom"] if len(events) else events
    failures = []
    for e, s in engines.items():
        mine = oom[oom.engine == e] if len(oom) else oom
        if not s["oom_total"] and not s["crashes"]:
            continue
        part = f"{e}: {s['oom_capacity']} capacity and {s['oom_fragmentation']} fragmentation OOMs"
        frag = mine[mine.cause == "fragmentation"] if len(mine) else mine
        if len(frag):
            part += (f" (the fragmentation ones failed with {mib(frag.free_bytes.median())} free, median, for "
                     f"{mib(frag.requested_bytes.median())} requested, the largest free extent "
                     f"{mib(frag.largest_free_bytes.median())})")
        part += f", {s['crashes']} crashes"
        failures.append(part)
    out.append(link("oom-events", ("Failures: " + "; ".join(failures) + ".") if failures
                    else "No engine failed an allocation or crashed."))
    for e, s in engines.items():
        mine = oom[oom.engine == e] if len(oom) else oom
        line = diagnosis(s, mine)
        if line:
            out.append(link("memory-map", f"{e}, diagnosis: {line}."))
    return out


def where_words(c: dict) -> str:
    return {"beyond": " or more (every rate met the SLO)", "below": " (under the lowest rate swept)"}.get(
        c["sustained_where"], "")


def capacity_sentence(capacity: dict) -> str:
    slo = next(iter(capacity.values()))["slo"]
    order = sorted(capacity, key=lambda e: -capacity[e]["sustained_rps"])
    rates = ", ".join(f"{e} {capacity[e]['sustained_rps']:.2f} req/s{where_words(capacity[e])}" for e in order)
    line = (f"Sustained request rate within the SLO (TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s']:g} s for "
            f"{100 * slo['attainment']:.0f} % of requests): {rates}")
    rival = best_contiguous(capacity)
    if rival is not None:
        for e in (e for e in capacity if e in PAGED):
            mine, theirs = capacity[e]["sustained_rps"], capacity[rival]["sustained_rps"]
            line += (f"; {e} sustains {mine / theirs:.1f}x the best contiguous engine ({rival})" if theirs > 0
                     else f"; no contiguous engine sustained any rate, {e} {mine:.2f} req/s")
    return line + "."


def best_contiguous(capacity: dict) -> str | None:
    """The contiguous engine that sustains the highest rate: what the paged ones are measured against."""
    return max((e for e in capacity if e not in PAGED), key=lambda e: capacity[e]["sustained_rps"], default=None)


def capacity_section(summary: dict) -> str:
    cap = summary.get("capacity")
    if not cap:
        return section("capacity", "Capacity at the SLO", "This run did not sweep request rates "
                       "(fragbench bench --sweep does): see the verdict's goodput instead.", "")
    fig = make_subplots(rows=1, cols=3, subplot_titles=("normalized latency (s/token)", "goodput (req/s)",
                                                         "mean running requests"), horizontal_spacing=0.07)
    for i, (engine, c) in enumerate(cap.items()):
        x = [p["offered_rps"] for p in c["points"]]
        color = PALETTE[i % len(PALETTE)]
        for col, key in enumerate(("normalized_latency_s_per_token", "goodput_rps", "mean_running"), start=1):
            fig.add_trace(go.Scatter(x=x, y=[p[key] for p in c["points"]], mode="lines+markers", name=engine,
                                     legendgroup=engine, showlegend=col == 1, line_color=color), row=1, col=col)
    fig.update_xaxes(title_text="offered req/s")
    fig.update_layout(height=380)
    rival = best_contiguous(cap)
    best = cap[rival]["sustained_rps"] if rival is not None else 0.0
    rows = [[e, f"{c['sustained_rps']:.2f}{where_words(c)}", f"{c['sustained_rps'] / best:.2f}x" if best else "n/a",
             " / ".join(f"{p['offered_rps']:g}: {fmt(p['slo_attainment'], '%')}" for p in c["points"])]
            for e, c in sorted(cap.items(), key=lambda kv: -kv[1]["sustained_rps"])]
    slo = next(iter(cap.values()))["slo"]
    how = (f"The workload's request mix offered at each rate (its arrival shape kept, its clock rescaled), every "
           f"engine at the same rates, one server per engine for all of them. Normalized latency: the mean over "
           f"completed requests of end-to-end latency / output tokens (the vLLM paper's Figure 12). A request meets "
           f"the SLO with TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s']:g} s; rejected, OOM'd, crashed or "
           f"failed requests miss it; client cancellations are left out; a request still in flight when a rate's "
           f"window closed is judged on what it showed (within both limits so far: met; already past one: missed; "
           f"too young to tell: left out). Sustained: the highest rate at which "
           f"{100 * slo['attainment']:.0f} % meet it, interpolated between the rates measured.")
    body = fig_html(fig) + table(["engine", "sustained req/s", "vs best contiguous", "SLO attainment per rate"],
                                 rows)
    return section("capacity", "Capacity at the SLO: what the memory buys", how, body)


# -- sections
def verdict(summary: dict, meta: dict, events: pd.DataFrame | None = None) -> str:
    cfg = meta.get("config", {})
    rows = []
    for engine, s in summary["engines"].items():
        rows.append([
            engine, fmt(s["output_tokens_per_s"]), fmt(s["requests_per_s"]), fmt(s["goodput_requests_per_s"]),
            f"{fmt(s['ttft_p50_s'], 'ms')} / {fmt(s['ttft_p99_s'], 'ms')}",
            f"{fmt(s['tpot_p50_s'], 'ms')} / {fmt(s['tpot_p99_s'], 'ms')}",
            fmt(s["max_running"]), f"{s['oom_capacity']} / {s['oom_fragmentation']}", s["crashes"],
            f"{s['cancelled']} ({fmt(s['cancel_release_p99_s'], 'ms')})", s["preemptions"],
            " / ".join(fmt(s[c], "%") for c in SHARE_COLUMNS),
            f"{s['requests_ok']} ok, {s['requests_oom']} oom, {s['requests_crashed']} crashed, "
            f"{s['requests_error']} failed, {s['requests_unfinished']} unfinished at the end",
        ])
    header = ["engine", "output tok/s", "req/s", "goodput req/s", "TTFT p50 / p99", "TPOT p50 / p99",
              "max running", "OOMs capacity / fragm.", "crashes", "cancelled (release p99)", "preemptions",
              "token / reserv. / internal / external / free", "requests"]
    window = (f"every sweep point's window, after a warm-up of {point_warmup_s(meta):.1f} s into each"
              if meta.get("sweep") else f"its churn window, after a warm-up of {warmup_s(cfg):.1f} s")
    how = (f"Per engine over {window} (from empty memory); goodput counts requests with TTFT <= "
           f"{cfg.get('slo_ttft_s', 2.0)} s and TPOT <= {cfg.get('slo_tpot_s', 0.25)} s. Memory shares are time "
           "averages of /stats samples at 10 Hz over the KV capacity while requests arrive. Cancel release: "
           "disconnect noticed to KV freed, timed inside the server. Unfinished: still queued or running when the "
           "run's grace period ended.")
    sentences = verdict_sentences(summary, events if events is not None else pd.DataFrame(), meta)
    words = "<ul class='verdict'>" + "".join(f"<li>{x}</li>" for x in sentences) + "</ul>"
    return section("verdict", "Verdict", how, words + f"<div id='verdict-table'>{table(header, rows)}</div>")


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


def figure2(summary: dict) -> str:
    fig = go.Figure()
    names = list(summary["engines"]) + list(PAPER_FIGURE2)
    values = [[100 * (s[c] or 0) for c in SHARE_COLUMNS] for s in summary["engines"].values()]
    # the paper folds free memory into its last bar: so do we for the paper's bars
    values += [[t, r, i, e, 0.0] for t, r, i, e in PAPER_FIGURE2.values()]
    for k, (label, color) in enumerate(zip(CATEGORY_LABELS, CATEGORY_COLORS, strict=True)):
        fig.add_trace(go.Bar(x=names, y=[v[k] for v in values], name=label, marker_color=color))
    unknown = [100 * s["allocated_share"] if s["token_states_share"] is None and s["allocated_share"] else 0
               for s in summary["engines"].values()]
    if any(unknown):
        fig.add_trace(go.Bar(x=names, y=unknown + [0] * len(PAPER_FIGURE2), name="allocated (split not exported)",
                             marker_color="#8d99ae"))
    fig.update_layout(barmode="stack", yaxis_title="% of KV capacity", height=420)
    return section("figure2", "Mean breakdown beside the vLLM paper's Figure 2",
                   "This run's time-averaged shares (left) and the paper's (right: Kwon et al., SOSP 2023, LLaMA-13B "
                   "on A100-40GB, ShareGPT). The paper's last bar is 'external fragmentation & others' and includes "
                   "free memory: compare it with external fragmentation + free here.", fig_html(fig))


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
    crashes = events[events.kind.isin(["crash", "restart"])]
    fig = go.Figure()
    for col, symbol in (("requested_bytes", "x"), ("free_bytes", "circle"), ("largest_free_bytes", "diamond")):
        for engine, e in ooms.groupby("engine", sort=False):
            e = e.iloc[:: max(1, len(e) // MAX_MARKERS)]  # every k-th: a long run draws as fast as a short one
            fig.add_trace(go.Scatter(x=e.t_s, y=e[col].astype(float) / 2**20, mode="markers", marker_symbol=symbol,
                                     name=f"{engine}: {col.removesuffix('_bytes').replace('_', ' ')}",
                                     text=e.cause, hovertemplate="%{y:.2f} MiB, %{text}"))
    for _, c in crashes.head(200).iterrows():
        fig.add_vline(x=c.t_s, line_dash="dot", line_color="red" if c.kind == "crash" else "green")
    fig.update_layout(height=380, xaxis_title="s", yaxis_title="MiB")
    if not len(ooms):
        return section("oom-events", "OOM events", "Each failed KV allocation.", fig_html(fig) + "<p>No OOM in this "
                       "run.</p>")
    rows = [[e.engine, fmt(e.t_s), e.cause, fmt(e.requested_bytes), fmt(e.free_bytes), fmt(e.largest_free_bytes),
             *(fmt(getattr(e, c, None)) for c in ("running", "waiting", "live_tokens")),
             fmt(getattr(e, "kv_usage", None), "%")] for e in ooms.head(OOM_ROWS).itertuples()]
    rest = len(ooms) - len(rows)
    more = (f"<p class='how'>The other {rest} events are rows of kind 'oom' in "
            f"<code>{ESC(str(run_dir / 'events.parquet'))}</code>.</p>") if rest > 0 else ""
    body = (fig_html(fig) + "<h3>By engine and cause</h3>" + oom_summary(ooms)
            + f"<h3>The first {len(rows)} of {len(ooms)}</h3>"
            + table(["engine", "t (s)", "cause", "requested B", "free B", "largest free B", "running", "waiting",
                     "live tokens", "KV usage"], rows) + more)
    return section("oom-events", "OOM events",
                   "Each failed KV allocation: requested vs free vs largest free extent, and the engine at that "
                   "moment. Cause 'fragmentation' means enough free bytes existed but no single extent fit. Red lines: "
                   "crashes; green: restarts.", body)


def draw_map(mm: list[dict]) -> tuple[go.Figure, str]:
    """A block pool as a grid of blocks coloured by owner; an arena as extents along its addresses."""
    fig = go.Figure()
    if mm and "block" in mm[0]:
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
    parts = []
    for path in sorted(run_dir.glob("cuda_snapshot-*.json")):
        snap = json.loads(path.read_text())
        engine = path.stem.removeprefix("cuda_snapshot-")
        fig, what = draw_segments(snap["segments"])
        parts.append(f"<h3 class='map' data-engine='{ESC(engine)}'>{ESC(engine)}: the CUDA allocator at its first "
                     f"OOM, t = {fmt(snap['t_s'])} s</h3><p class='how'>{ESC(what)}</p>" + fig_html(fig))
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
    rows = [[r.engine, r.phase, fmt(r.kv_allocated_bytes), fmt(r.token_states_bytes), fmt(r.kv_usage, "%"),
             fmt(r.running), fmt(r.live_tokens), fmt(r.torch_allocated_bytes), fmt(r.torch_reserved_bytes),
             fmt(r.device_used_bytes), fmt(r.process_rss_bytes)] for r in debug.itertuples()] if len(debug) else []
    ooms = events[events.kind == "oom"]
    for (engine, cause), group in ooms.groupby(["engine", "cause"], sort=False):  # one line each: the OOM
        e = group.iloc[0]  # section lists them
        rows.append([engine, f"{len(group)} failed allocations, {CAUSE_WORDS.get(cause, cause)}; the first at "
                     f"{fmt(e.t_s)} s: {fmt(e.requested_bytes)} B requested, {fmt(e.free_bytes)} B free, "
                     f"{fmt(e.largest_free_bytes)} B largest free", "", "", "", "", "", "", "", "", ""])
    header = ["engine", "phase", "KV allocated B", "token states B", "KV usage", "running", "live tokens",
              "torch allocated B", "torch reserved B", "device used B", "server RSS B"]
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


def workload(requests: pd.DataFrame, meta: dict) -> str:
    from workloads.spec import SpecError, load_spec

    first = requests[requests.engine == requests.engine.iloc[0]] if len(requests) else requests
    fig = make_subplots(rows=1, cols=3, subplot_titles=("prompt tokens", "output tokens (target)", "arrivals / s"))
    fig.add_trace(go.Histogram(x=first.prompt_tokens, showlegend=False), row=1, col=1)
    fig.add_trace(go.Histogram(x=first.output_tokens_target, showlegend=False), row=1, col=2)
    fig.add_trace(go.Histogram(x=first.arrival_s, xbins=dict(size=1), showlegend=False), row=1, col=3)
    fig.update_layout(height=320)
    name = meta.get("config", {}).get("workload", "")
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


def config(meta: dict) -> str:
    return section("config", "Configuration, versions, hardware", "run.json of this run.",
                   f"<pre>{ESC(json.dumps(meta, indent=2, default=str))}</pre>")


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 6px}
th{background:#f4f4f4}.how{color:#555;font-size:13px}.partial{background:#fde2e1;border:2px solid #c0392b;
padding:.6em 1em;font-weight:bold}ul.verdict li{margin:.3em 0}ul.verdict a{color:#222}
pre{background:#f8f8f8;padding:1em;overflow:auto;font-size:12px}"""


def render(run_dir: Path, out: Path) -> Path:
    meta = load_meta(run_dir)
    frames = load_frames(run_dir)
    summary = summarize(run_dir, frames)
    partial = meta.get("status") != "complete"
    banner = (f"<p class='partial' id='partial'>PARTIAL RUN: this run did not finish (engines done: "
              f"{ESC(', '.join(meta.get('engines_done', [])) or 'none')}). Every number below comes from the rows "
              "it wrote before it stopped.</p>") if partial else ""
    body = "".join([
        verdict(summary, meta, frames["events"]), capacity_section(summary), memory_breakdown(frames["samples"]),
        figure2(summary),
        scheduler(frames["samples"]), oom_events(frames["events"], run_dir), memory_map(run_dir),
        debug_pass(frames["debug"], frames["events"]), latency(frames["requests"]),
        throughput(frames["requests"]), workload(frames["requests"], meta), config(meta),
    ])
    title = f"fragbench {meta.get('run_id', run_dir.name)}"
    doc = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{ESC(title)}</title><style>{STYLE}</style>"
           f"<script>{get_plotlyjs()}</script></head><body><h1>{ESC(title)}</h1>{banner}"
           f"<p class='how'>Workload {ESC(str(meta.get('config', {}).get('workload')))}, model "
           f"{ESC(str(meta.get('config', {}).get('model')))}, KV budget "
           f"{ESC(str(meta.get('config', {}).get('kv_budget')))} per engine.</p>{body}</body></html>")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    return out
