"""The bench's twin: every scheduled engine of a run simulated on its own measured steps, point by point,
beside what bench measured; then the curves bench cannot afford to measure.

- Each engine's step model is fitted on that engine's steps in the run (`stepfit.fit`); its policy and
  scheduler are configured as the engine reported itself (`engine_config` in run.json): the same code the
  engine ran, on a bookkeeping-only arena.
- Each measured point is replayed as the load generator sent it: the same trace, seed and rate, the
  arrivals of its window, a client that cancels after as many tokens, reads slowly, and stops waiting at the
  window's end plus the grace (harness/run/loadgen.py). Its figures come from the same functions as the
  measured ones (`capacity.request_metrics`, `capacity_block`); memory and running over the same window.
- The errors are signed: twin / measured - 1, the median over the points for the per-point figures, and for
  Figure-2 shares the median difference of the shares (0.03 = 3 points).
- The curves: sustained rate against KV budget (1/4x to 4x the run's), each point a knee search of its own
  in simulation (`knee.KneeSearch`, to a tight tolerance: a simulation costs milliseconds), on more
  requests than a measured point holds.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from engines.scheduled.scheduler import SchedulerConfig
from harness.analysis.capacity import SLO, capacity_block, request_metrics
from harness.analysis.knee import KneeSearch
from harness.analysis.summary import SHARE_COLUMNS, load_meta, point_warmup_s, slo_of
from harness.sim.simulate import make_sim_policy, pool_map, simulate_policy
from harness.sim.stepfit import MIN_ROWS, FittedStepModel, StepModelError, fit, run_steps
from harness.units import parse_size
from workloads.generate import TraceRequest, at_rate, has_shared_prefixes, trace
from workloads.outcome import UNFINISHED
from workloads.spec import load_spec

BUDGET_MULTIPLES = (0.25, 0.35, 0.5, 0.71, 1.0, 1.41, 2.0, 2.83, 4.0)
CURVE_REQUESTS = 300  # arrivals of each simulated curve point (a measured point has a few dozen)
CURVE_TOLERANCE = 0.03  # the curves' knee searches stop at a bracket this narrow
SHARES = tuple(SHARE_COLUMNS)  # the Figure-2 shares, as the summary names them
RELATIVE = ("mean_running", "ttft_p50_s", "tpot_p50_s")  # the errors reported as twin / measured - 1


@dataclass(frozen=True)
class TwinEngine:
    """What a twin simulates as: the engine's configuration as it reported it, its fitted step model."""

    engine: str
    config: dict  # ScheduledEngine.config(): policy, placement, block size, preflight, scheduler limits
    model: FittedStepModel
    shared: bool  # the workload shares prefixes: the ids matter

    def scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(c["max_num_seqs"], c["max_num_batched_tokens"], c["on_oom"])

    def can_serve(self, budget_bytes: int) -> bool:
        """What the engine checks at start: one max-length sequence fits as the policy allocates it."""
        try:
            kv = self.policy(budget_bytes)
        except ValueError:
            return False
        return kv.longest_sequence_tokens() >= self.config["max_seq_len"]

    def policy(self, budget_bytes: int):
        c = self.config
        return make_sim_policy(c["policy"], budget_bytes, c["kv_bytes_per_token"], c["max_seq_len"],
                               c.get("block_size") or 16, c.get("placement") or "best-fit", c.get("preflight", True))


@dataclass(frozen=True)
class PointJob:
    """One simulated rate. A measured point's twin holds the requests its window sent, already at its rate;
    a curve point holds the trace's first requests and offers them at whatever rate its search asks."""

    twin: TwinEngine
    rate_rps: float
    requests: tuple[TraceRequest, ...]
    slo: SLO
    budget_bytes: int
    window_s: float = 0.0  # a measured point's: arrivals, warm-up and grace as the load generator had them
    warmup_s: float = 0.0
    grace_s: float = 0.0
    curve: bool = False


def offered(job: PointJob) -> list[TraceRequest]:
    """The arrivals as the load generator sends them, a cancel after k tokens being a request of k tokens
    that the client then leaves."""
    reqs = at_rate(list(job.requests), job.rate_rps) if job.curve else list(job.requests)
    return [replace(r, max_tokens=min(r.max_tokens, r.cancel_after_tokens)) if r.cancel_after_tokens else r
            for r in reqs]


def client_rows(frame: pd.DataFrame, reqs: list[TraceRequest], cut_s: float) -> pd.DataFrame:
    """The simulated requests as the load generator records them: a whole answer shows no first token, a
    slow reader's pace is its reading's, a cancelled stream is left out, and whatever is still running at
    `cut_s` (window end plus grace) is cut off with what it showed by then."""
    rows = frame.copy()
    rows["stream"] = [r.stream for r in reqs]
    rows["output_tokens_target"] = rows.output_tokens
    delay = np.array([r.read_delay_s for r in reqs])
    tpot = np.maximum(rows.tpot_s.to_numpy(), delay)
    rows["tpot_s"] = np.where(rows.output_tokens > 1, tpot, np.nan)
    done = rows.status == "ok"
    rows.loc[done, "e2e_s"] = rows.ttft_s + rows.tpot_s.fillna(0) * (rows.output_tokens - 1)
    rows["status"] = rows.status.astype(str)
    rows["error"] = None
    end = rows.arrival_s + rows.e2e_s
    cut = (rows.status != "oom") & ~(end <= cut_s)
    rows.loc[cut, "status"], rows.loc[cut, "error"] = "error", UNFINISHED
    rows.loc[cut, "e2e_s"] = cut_s - rows.arrival_s
    rows.loc[cut & (rows.arrival_s + rows.ttft_s > cut_s), "ttft_s"] = np.nan
    rows.loc[~rows.stream, ["ttft_s", "tpot_s"]] = np.nan
    cancelled = np.array([r.cancel_after_tokens is not None for r in reqs])
    rows.loc[cancelled & (rows.status == "ok"), "status"] = "cancelled"
    return rows


def simulate_point(job: PointJob) -> dict:
    """One offered rate on the twin: the figures a measured point has, from the same functions."""
    twin, reqs = job.twin, offered(job)
    kv = twin.policy(job.budget_bytes)
    # a measured point's memory and running count over its window past the warm-up, idle time included
    window = (0.0, float("inf")) if job.curve else (job.warmup_s, job.window_s)
    res, frame, _ = simulate_policy(kv, twin.scheduler_config(), iter(reqs), twin.config["max_seq_len"],
                                    twin.model, twin.shared and twin.config.get("prefix_caching", False),
                                    sample_every_s=1.0, window=window)
    span = max((r.arrival_s for r in reqs), default=1.0) if job.curve else job.window_s
    cut = float("inf") if job.curve else job.window_s + job.grace_s
    metrics = request_metrics(client_rows(frame, reqs, cut), max(span, 1e-9), job.slo)
    return {"offered_rps": job.rate_rps, **metrics, "mean_running": res["mean_running"],
            **{s: res[s] for s in SHARES}, "preemptions": res["preemptions"], "oom_total": res["oom_total"],
            "oom_fragmentation": res["oom_fragmentation"], "crashes": 0}


def curve_point(job: PointJob) -> dict:
    """The rate the twin sustains at one budget: a knee search of its own, from the run's measured rate."""
    if not job.twin.can_serve(job.budget_bytes):
        return {"kv_budget_bytes": job.budget_bytes, "sustained_rps": 0.0, "sustained_where": "cannot start",
                "points": []}
    search = KneeSearch(job.rate_rps, job.slo.attainment, CURVE_TOLERANCE, max_points=16)
    points = []
    while (rate := search.next_rate()) is not None:
        point = simulate_point(replace(job, rate_rps=rate))
        search.record(rate, point["slo_attainment"])
        points.append(point)
    block = capacity_block(points, job.slo)
    return {"kv_budget_bytes": job.budget_bytes, "sustained_rps": block["sustained_rps"],
            "sustained_where": block["sustained_where"], "points": len(points)}


def errors(twin_points: list[dict], measured_points: list[dict], twin_rps: float, measured_rps: float) -> dict:
    pairs = list(zip(twin_points, sorted(measured_points, key=lambda p: p["offered_rps"]), strict=True))

    def median(values: list[float]) -> float | None:
        values = [v for v in values if v is not None and math.isfinite(v)]
        return float(np.median(values)) if values else None

    out = {"sustained_rps": twin_rps / measured_rps - 1 if measured_rps else None}
    for key in RELATIVE:
        out[key] = median([t[key] / m[key] - 1 for t, m in pairs if t.get(key) is not None and m.get(key)])
    for key in SHARES:
        out[key] = median([t[key] - m[key] for t, m in pairs if t.get(key) is not None and m.get(key) is not None])
    return out


def needed_budget(curve: list[dict], rate: float) -> float | None:
    """The smallest KV budget on the curve that sustains `rate`, interpolated in log budget; None beyond it."""
    prev = None
    for p in curve:
        if p["sustained_rps"] >= rate:
            if prev is None:
                return float(p["kv_budget_bytes"])
            frac = (rate - prev["sustained_rps"]) / (p["sustained_rps"] - prev["sustained_rps"])
            lo, hi = math.log(prev["kv_budget_bytes"]), math.log(p["kv_budget_bytes"])
            return float(math.exp(lo + frac * (hi - lo)))
        prev = p
    return None


def twins_of(meta: dict, steps: pd.DataFrame, shared: bool) -> dict[str, TwinEngine]:
    """A twin for every engine that recorded steps and its configuration at the run's KV budget."""
    cfg = meta.get("config", {})
    out = {}
    for engine, by_budget in meta.get("engine_config", {}).items():
        config = by_budget.get(cfg.get("kv_budget"))
        rows = steps[steps.engine == engine] if "engine" in steps else steps.iloc[:0]
        if config is None or not len(rows):
            continue
        # the steps of the measured windows, taken beside the load generator as the replayed ones were;
        # all of the engine's steps (calibration, debugging pass) when the windows hold too few
        inside = rows[rows.point >= 0] if "point" in rows else rows.iloc[:0]
        use, where = (inside, "in its measured windows") if len(inside) >= MIN_ROWS else (rows, "")
        try:
            model = fit(use, f"{engine}'s steps {where or 'in the run'}")
        except StepModelError:
            continue  # too few steps to fit: no twin, and the report says which engines have none
        out[engine] = TwinEngine(engine, config, model, shared)
    return out


def run_twin(meta: dict, steps: pd.DataFrame, summary: dict, n_jobs: int | None = None) -> dict:
    """summary.json's `twin`: per engine its step model, the measured points' twins, the sustained rate with
    its error against the measured one, and the KV-budget curve. `steps` are the rows each engine's model
    is fitted on: this run's, or another run's (a twin checked on a workload its fit never saw)."""
    cfg = meta.get("config", {})
    slo, grace, warm = slo_of(cfg), float(cfg.get("grace_s", 0.0)), point_warmup_s(meta)
    budget = parse_size(cfg["kv_budget"])
    spec = load_spec(cfg["workload"])
    full = trace(spec, cfg.get("seed", 0), cfg.get("max_seq_len", 2048)).requests
    twins = twins_of(meta, steps, has_shared_prefixes(spec))
    measured = summary.get("capacity", {})
    jobs, curve_jobs = {}, {}
    for engine, twin in twins.items():
        windows = sorted((w for w in (meta.get("sweep") or {}).get("points", {}).get(engine, [])
                          if w.get("kv_budget", cfg["kv_budget"]) == cfg["kv_budget"]), key=lambda w: w["offered_rps"])
        if engine not in measured or not windows:
            continue
        jobs[engine] = []
        for w in windows:
            length = w["end_s"] - w["start_s"]
            sent = tuple(r for r in at_rate(full, w["offered_rps"]) if r.arrival_s < length)
            jobs[engine].append(PointJob(twin, w["offered_rps"], sent, slo, budget, length, warm, grace))
        start = max(measured[engine]["sustained_rps"], 0.05)
        curve_jobs[engine] = [PointJob(twin, start, tuple(full[:CURVE_REQUESTS]), slo, int(budget * m), curve=True)
                              for m in BUDGET_MULTIPLES]
    n = n_jobs or os.cpu_count() or 1
    point_results = iter(pool_map(simulate_point, [j for js in jobs.values() for j in js], n))
    curve_results = iter(pool_map(curve_point, [j for js in curve_jobs.values() for j in js], n))
    out = {}
    for engine, js in jobs.items():
        block = capacity_block([next(point_results) for _ in js], slo)
        curve = [next(curve_results) for _ in curve_jobs[engine]]
        out[engine] = {"sustained_rps": block["sustained_rps"], "sustained_where": block["sustained_where"],
                       "points": block["points"],
                       "error": errors(block["points"], measured[engine]["points"], block["sustained_rps"],
                                       measured[engine]["sustained_rps"]),
                       "step_model": twins[engine].model.to_json(), "config": twins[engine].config,
                       "budget_curve": curve}
    best = max((m["sustained_rps"] for m in measured.values()), default=None)
    for t in out.values():
        t["budget_for_best_rps"] = {"rate_rps": best,
                                    "kv_budget_bytes": needed_budget(t["budget_curve"], best) if best else None}
    return out


def write_twin(run_dir: Path, n_jobs: int | None = None) -> dict:
    """The twin of a finished run into its summary.json (a sweep's runs only: the twin replays points)."""
    run_dir = Path(run_dir)
    meta, summary = load_meta(run_dir), json.loads((run_dir / "summary.json").read_text())
    if not (meta.get("sweep") or {}).get("points") or not meta.get("engine_config"):
        return summary  # no sweep, or no engine fragbench schedules (targets alone)
    summary["twin"] = run_twin(meta, run_steps(run_dir), summary, n_jobs)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
