"""A run directory as the analysis reads it: run.json, the journals as frames (times on each engine's clock,
requests that failed while their engine was down labelled `crashed`), the scheduled engines' step rows, and
where each sweep point's load ran and which of its arrivals it judged. The summary, the twin and the report
share these, so that one window means one thing everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from harness.analysis.records import RecordedSegment, RunRecord, SweepPoint
from harness.results import read_journals


def load_meta(run_dir: Path) -> dict:
    """run.json as a dict, for its writers (bench adds to it as it runs); readers take `RunRecord.read`."""
    path = run_dir / "run.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no run.json)")
    return json.loads(path.read_text())


def rebase(df: pd.DataFrame, run: RunRecord) -> pd.DataFrame:
    """Times relative to each engine's churn start (rows written before it come out negative)."""
    if "t_wall" in df and len(df):
        t0 = df.engine.map(run.engine_t0)
        df["t_s"] = np.where(t0.notna(), df.t_wall - t0, df.t_s)
    return df


def label_crashed(requests: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """A request that failed while its engine was down (crashed, restarting) is `crashed`, not `error`."""
    for engine, ev in events[events.kind.isin(["crash", "restart"])].groupby("engine"):
        crashes = ev[ev.kind == "crash"].t_s.tolist()
        restarts = ev[ev.kind == "restart"].t_s.tolist()
        for i, t_crash in enumerate(crashes):
            t_back = restarts[i] if i < len(restarts) else np.inf
            hit = ((requests.engine == engine) & (requests.status == "error")
                   & (requests.sent_s <= t_back) & (requests.end_s >= t_crash - 1.0))
            requests.loc[hit, "status"] = "crashed"
    return requests


def request_rows(run_dir: Path) -> pd.DataFrame:
    """Every engine's request rows as the load generators wrote them (crashes not yet labelled)."""
    return read_journals(sorted(run_dir.glob("engines/*/requests*.jsonl")), "requests")


def load_frames(run_dir: Path) -> dict[str, pd.DataFrame]:
    run = RunRecord.read(run_dir)
    requests = request_rows(run_dir)
    samples = rebase(read_journals([run_dir / "samples.jsonl"], "samples"), run)
    events = rebase(read_journals([run_dir / "events.jsonl"], "events"), run)
    debug = pd.DataFrame([json.loads(x) for x in (run_dir / "debug.jsonl").read_text().splitlines() if x.strip()]
                         ) if (run_dir / "debug.jsonl").exists() else pd.DataFrame()
    requests = label_crashed(requests, events)
    return {"requests": requests, "samples": samples, "events": events, "debug": debug}


def load_steps(run_dir: Path, meta: RunRecord) -> pd.DataFrame:
    """Every scheduled engine's step rows (engines/ENGINE/steps-BUDGET.csv, written by the server), each with
    its engine, budget, engine time, and the sweep point whose window (and grace) it fell in: `point` indexes
    run.json's sweep points of that engine, -1 outside every window (debugging pass, calibration, drain)."""
    frames = []
    for path in sorted(run_dir.glob("engines/*/steps-*.csv")):
        df = pd.read_csv(path)
        if not len(df):
            continue
        engine, budget = path.parent.name, path.stem.removeprefix("steps-")
        df.insert(0, "engine", engine)
        df.insert(1, "kv_budget", budget)
        df["t_s"] = df.t_wall - meta.engine_t0.get(engine, df.t_wall.iloc[0])
        df["point"] = -1
        df["offered_rps"] = np.nan
        grace = meta.config.grace_s
        for i, w in enumerate(meta.points_of(engine)):
            if (w.kv_budget if w.has("kv_budget") else budget) != budget:
                continue
            for lo, hi in spans(w, grace):
                inside = (df.t_s >= lo) & (df.t_s <= hi)
                df.loc[inside, "point"], df.loc[inside, "offered_rps"] = i, w.offered_rps
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def point_warmup_s(meta: RunRecord) -> float:
    """A point's warm-up where run.json does not record one per point (runs made before it did)."""
    cfg = meta.config
    return float(cfg.warmup_s) if cfg.warmup_s is not None else 0.1 * (meta.sweep.point_s or 0)


def segments(point: SweepPoint, meta: RunRecord | None = None) -> list[RecordedSegment]:
    """A point's segments (workloads/streams.Segment, with its warm-up and judged end); a run that recorded
    windows alone gives one, judged from its warm-up to its end."""
    if point.segments:
        return point.segments
    warm = point_warmup_s(meta) if meta else 0.0
    return [RecordedSegment(start_s=point.start_s, end_s=point.end_s, warmup_s=warm, judged_end_s=point.end_s)]


def judged_spans(point: SweepPoint, meta: RunRecord | None = None) -> list[tuple[float, float]]:
    """Where a point's judged requests arrived: each segment past its warm-up, up to its judged end."""
    return [(s.start_s + s.warmup_s, s.judged_end_s) for s in segments(point, meta)]


def spans(point: SweepPoint, grace: float = 0.0) -> list[tuple[float, float]]:
    """Where a point's load ran: each segment from its start to its end (plus `grace` after the last, for a
    run whose points were separate windows)."""
    segs = segments(point)
    return [(s.start_s, s.end_s + (0.0 if point.segments else grace)) for s in segs]


def arrived_in(req: pd.DataFrame, window: SweepPoint, meta: RunRecord | None = None) -> pd.DataFrame:
    """The requests one sweep point judged: its own (tagged with it, where the rows say) arriving in its judged
    spans."""
    arrival = pd.to_numeric(req.arrival_s, errors="coerce")
    mine = (pd.to_numeric(req["point"], errors="coerce") == window.point) \
        if "point" in req and window.has("point") and window.segments else pd.Series(True, index=req.index)
    inside = pd.Series(False, index=req.index)
    for lo, hi in judged_spans(window, meta):
        inside |= (arrival >= lo - 1e-6) & (arrival < hi + (1e-6 if not window.segments else 0))
    return req[mine & inside]


def in_point(smp: pd.DataFrame, window: SweepPoint, meta: RunRecord | None = None) -> pd.Series:
    """Samples of one sweep point's judged spans."""
    inside = pd.Series(False, index=smp.index)
    for lo, hi in judged_spans(window, meta):
        inside |= (smp.t_s >= lo) & (smp.t_s <= hi)
    return inside


def time_spent(meta: RunRecord) -> dict:
    """How the run's time went, per engine: its set-up (server, debugging pass, calibration), its operating
    point, its search (its first visit's other points) and the decision (points measured on later visits), in
    seconds of load; the run's whole time beside them (summary.json's `time_spent`, as written)."""
    op = meta.operating_point or {}
    out = {}
    for engine, points in meta.swept.items():
        keys = set((op.get(engine) or {}).get("keys") or [])
        spent = {"setup_s": float((meta.setup_s or {}).get(engine, 0.0)), "operating_point_s": 0.0,
                 "search_s": 0.0, "decision_s": 0.0}
        for p in points:
            for s in p.segments or []:
                phase = "operating_point_s" if p.key in keys else "decision_s" if s.visit else "search_s"
                spent[phase] += s.end_s - s.start_s
        out[engine] = {k: round(v, 1) for k, v in spent.items()}
    return {"bench_s": meta.bench_s, "engines": out}
