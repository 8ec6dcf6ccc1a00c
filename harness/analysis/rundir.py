"""A run directory as the analysis reads it: run.json, the journals as frames (times on each engine's clock,
requests that failed while their engine was down labelled `crashed`), the scheduled engines' step rows, and
where each sweep point's load ran and which of its arrivals it judged. The summary, the twin and the report
share these, so that one window means one thing everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from harness.analysis.capacity import SLO
from harness.results import read_journals
from harness.units import KvBudget


def warmup_s(cfg: dict) -> float:
    """Seconds of churn before memory is sampled into the shares: the given warm-up, else a tenth."""
    if cfg.get("warmup_s") is not None:
        return float(cfg["warmup_s"])
    return 0.1 * float(cfg.get("duration_s") or 0.0)


def load_meta(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no run.json)")
    return json.loads(path.read_text())


def budgets_of(meta: dict) -> dict[str, KvBudget]:
    """The run's KV budgets by the label its records carry (config's kv_budget, then kv_budgets'), each label
    read into its bytes here once; a label that is no size (`own`: a bench of targets alone, which serve from
    their own memory) has none."""
    cfg, out = meta.get("config", {}), {}
    for label in [cfg.get("kv_budget"), *(cfg.get("kv_budgets") or [])]:
        try:
            out.setdefault(label, KvBudget.parse(label))
        except ValueError:
            continue
    return out


def own_budget(meta: dict) -> KvBudget | None:
    """The run's own KV budget (its first); None where it is no size (budgets_of)."""
    return budgets_of(meta).get(meta.get("config", {}).get("kv_budget"))


def rebase(df: pd.DataFrame, engine_t0: dict) -> pd.DataFrame:
    """Times relative to each engine's churn start (rows written before it come out negative)."""
    if "t_wall" in df and len(df):
        t0 = df.engine.map(engine_t0)
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


def load_frames(run_dir: Path) -> dict[str, pd.DataFrame]:
    meta = load_meta(run_dir)
    t0 = meta.get("engine_t0", {})
    requests = read_journals(sorted(run_dir.glob("engines/*/requests*.jsonl")), "requests")
    samples = rebase(read_journals([run_dir / "samples.jsonl"], "samples"), t0)
    events = rebase(read_journals([run_dir / "events.jsonl"], "events"), t0)
    debug = pd.DataFrame([json.loads(x) for x in (run_dir / "debug.jsonl").read_text().splitlines() if x.strip()]
                         ) if (run_dir / "debug.jsonl").exists() else pd.DataFrame()
    requests = label_crashed(requests, events)
    return {"requests": requests, "samples": samples, "events": events, "debug": debug}


def load_steps(run_dir: Path, meta: dict) -> pd.DataFrame:
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
        df["t_s"] = df.t_wall - meta.get("engine_t0", {}).get(engine, df.t_wall.iloc[0])
        df["point"] = -1
        df["offered_rps"] = np.nan
        grace = meta.get("config", {}).get("grace_s", 0.0)
        for i, w in enumerate((meta.get("sweep") or {}).get("points", {}).get(engine, [])):
            if w.get("kv_budget", budget) != budget:
                continue
            for lo, hi in spans(w, grace):
                inside = (df.t_s >= lo) & (df.t_s <= hi)
                df.loc[inside, "point"], df.loc[inside, "offered_rps"] = i, w["offered_rps"]
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def slo_of(cfg: dict) -> SLO:
    """The run's SLO; the defaults for a run.json written before it recorded one."""
    default = SLO()
    return SLO(cfg.get("slo_ttft_s", default.ttft_s), cfg.get("slo_tpot_s", default.tpot_s),
               cfg.get("slo_attainment", default.attainment))


def point_warmup_s(meta: dict) -> float:
    """A point's warm-up where run.json does not record one per point (runs made before it did)."""
    cfg = meta.get("config", {})
    return float(cfg["warmup_s"]) if cfg.get("warmup_s") is not None else 0.1 * (meta["sweep"].get("point_s") or 0)


def segments(point: dict, meta: dict | None = None) -> list[dict]:
    """A point's segments (workloads/streams.Segment, with its warm-up and judged end); a run that recorded
    windows alone gives one, judged from its warm-up to its end."""
    if point.get("segments"):
        return point["segments"]
    warm = point_warmup_s(meta) if meta else 0.0
    return [{"start_s": point["start_s"], "end_s": point["end_s"], "warmup_s": warm, "judged_end_s": point["end_s"]}]


def judged_spans(point: dict, meta: dict | None = None) -> list[tuple[float, float]]:
    """Where a point's judged requests arrived: each segment past its warm-up, up to its judged end."""
    return [(s["start_s"] + s["warmup_s"], s["judged_end_s"]) for s in segments(point, meta)]


def spans(point: dict, grace: float = 0.0) -> list[tuple[float, float]]:
    """Where a point's load ran: each segment from its start to its end (plus `grace` after the last, for a
    run whose points were separate windows)."""
    segs = segments(point)
    return [(s["start_s"], s["end_s"] + (0.0 if point.get("segments") else grace)) for s in segs]


def arrived_in(req: pd.DataFrame, window: dict, meta: dict | None = None) -> pd.DataFrame:
    """The requests one sweep point judged: its own (tagged with it, where the rows say) arriving in its judged
    spans."""
    arrival = pd.to_numeric(req.arrival_s, errors="coerce")
    mine = (pd.to_numeric(req["point"], errors="coerce") == window["point"]) \
        if "point" in req and "point" in window and window.get("segments") else pd.Series(True, index=req.index)
    inside = pd.Series(False, index=req.index)
    for lo, hi in judged_spans(window, meta):
        inside |= (arrival >= lo - 1e-6) & (arrival < hi + (1e-6 if not window.get("segments") else 0))
    return req[mine & inside]


def in_point(smp: pd.DataFrame, window: dict, meta: dict | None = None) -> pd.Series:
    """Samples of one sweep point's judged spans."""
    inside = pd.Series(False, index=smp.index)
    for lo, hi in judged_spans(window, meta):
        inside |= (smp.t_s >= lo) & (smp.t_s <= hi)
    return inside


def time_spent(meta: dict) -> dict:
    """How the run's time went, per engine: its set-up (server, debugging pass, calibration), its operating
    point, its search (its first visit's other points) and the decision (points measured on later visits), in
    seconds of load; the run's whole time beside them."""
    op = meta.get("operating_point") or {}
    out = {}
    for engine, points in ((meta.get("sweep") or {}).get("points") or {}).items():
        keys = set((op.get(engine) or {}).get("keys") or [])
        spent = {"setup_s": float((meta.get("setup_s") or {}).get(engine, 0.0)), "operating_point_s": 0.0,
                 "search_s": 0.0, "decision_s": 0.0}
        for p in points:
            for s in p.get("segments") or []:
                phase = "operating_point_s" if p.get("key") in keys else "decision_s" if s.get("visit") else \
                    "search_s"
                spent[phase] += s["end_s"] - s["start_s"]
        out[engine] = {k: round(v, 1) for k, v in spent.items()}
    return {"bench_s": meta.get("bench_s"), "engines": out}
