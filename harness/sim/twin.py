"""The bench's twin: every scheduled engine of a run simulated on its own measured steps, point by point,
beside what bench measured; then the curves bench cannot afford to measure.

- Each engine's step model is fitted on that engine's steps in the run (`stepfit.fit`); its policy and
  scheduler are configured as the engine reported itself (`engine_config` in run.json): the same code the
  engine ran, on a bookkeeping-only arena.
- Each visit of the bench to an engine (one server, one load generator, its points one after another) is
  replayed as the load generator sent it: every segment's requests (workloads/streams.py) at their arrival
  times, warm-ups and guards included, a client that cancels after as many tokens, reads slowly, and stops
  waiting at the visit's end plus the grace (harness/run/loadgen.py). Each point is judged on the requests
  the measurement judged (those arriving in its judged spans, past the warm-up it recorded), by the same
  functions as the measured ones (`capacity.request_metrics`, `capacity_block`); memory and running over
  the same spans.
- The errors are signed: twin / measured - 1, the median over the points for the per-point figures, and for
  Figure-2 shares the median difference of the shares (0.03 = 3 points).
- The curves: sustained rate against KV budget (1/4x to 4x the run's), each a knee search of its own in
  simulation (`knee.KneeSearch`, bisected to one grid step: a simulation costs milliseconds), each rate
  judged as a measured point is (its stream's requests, the same warm-up rule) on `CURVE_JUDGED` requests,
  more than a measured point holds: at the run's own budget it reads the same knee as the replay.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import islice
from pathlib import Path

import numpy as np
import pandas as pd

from engines.scheduled.scheduler import SchedulerConfig
from harness.analysis.capacity import SLO, capacity_block, judged_verdicts, request_metrics
from harness.analysis.knee import KneeSearch
from harness.analysis.records import RecordedSegment, RunRecord, SweepPoint
from harness.analysis.rundir import judged_spans, segments
from harness.analysis.steady import warmup_s
from harness.analysis.summary import SHARE_COLUMNS, finalize
from harness.analysis.summary_records import CapacityPoint, Summary
from harness.sim.simulator import make_sim_policy, pool_map, simulate_policy
from harness.sim.stepfit import MIN_ROWS, FittedStepModel, StepModelError, fit, run_steps
from harness.units import KvBudget
from workloads.generate import TraceRequest, has_shared_prefixes
from workloads.outcome import UNFINISHED
from workloads.spec import load_spec
from workloads.streams import Segment, Streams, key_of

BUDGET_MULTIPLES = (0.25, 0.35, 0.5, 0.71, 1.0, 1.41, 2.0, 2.83, 4.0)
CURVE_JUDGED = 400  # judged requests of each simulated curve point (a measured point has tens)
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
        kv = make_sim_policy(c["policy"], budget_bytes, c["kv_bytes_per_token"], c["max_seq_len"],
                             c.get("block_size") or 16, c.get("placement") or "best-fit", c.get("preflight", True))
        if hasattr(kv, "pad_bytes"):  # the engine's buffers start on whole rows of its arena: so do the twin's
            kv.pad_bytes = c.get("row_pad_bytes", 0)
        return kv


@dataclass(frozen=True)
class VisitJob:
    """One visit of the bench to an engine, to replay: every request its load generator sent (engine clock),
    which point each belongs to, and where each point's judged requests arrived."""

    twin: TwinEngine
    requests: tuple[TraceRequest, ...]
    point_of: tuple[int, ...]  # per request, the point it belongs to
    judged: tuple[tuple[int, tuple[tuple[float, float], ...]], ...]  # (point, its judged spans in this visit)
    slo: SLO
    budget_bytes: int
    cut_s: float  # the visit's last arrival window's end plus the grace: what is still running is cut off


@dataclass(frozen=True)
class CurveJob:
    """The rate the twin sustains at one KV budget, searched as the bench searches, judged as it judges."""

    twin: TwinEngine
    start_rps: float
    slo: SLO
    budget_bytes: int
    workload: str
    seed: int
    max_seq_len: int


def cancel_as_sent(reqs: list[TraceRequest]) -> list[TraceRequest]:
    """A cancel after k tokens is a request of k tokens that the client then leaves."""
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


def simulate_visit(job: VisitJob) -> dict[int, dict]:
    """Each point's judged figures in one visit's replay: its client rows (judged ones) and the memory over
    its judged spans, to be joined with the same point's other visits."""
    twin, reqs = job.twin, list(job.requests)
    spans = [span for _, point_spans in job.judged for span in point_spans]
    res, frame, _ = simulate_policy(twin.policy(job.budget_bytes), twin.scheduler_config(), iter(cancel_as_sent(reqs)),
                                    twin.config["max_seq_len"], twin.model,
                                    twin.shared and twin.config.get("prefix_caching", False), sample_every_s=1.0,
                                    window=(min((a for a, _ in spans), default=0.0), job.cut_s), spans=spans)
    rows = client_rows(frame, reqs, job.cut_s)
    rows["point"] = list(job.point_of)
    out, at = {}, 0
    for point, point_spans in job.judged:
        mine = rows[rows.point == point]
        inside = np.zeros(len(mine), dtype=bool)
        for lo, hi in point_spans:
            inside |= (mine.arrival_s >= lo).to_numpy() & (mine.arrival_s < hi).to_numpy()
        out[point] = {"rows": mine[inside], "spans": res["spans"][at: at + len(point_spans)],
                      "judged_s": sum(hi - lo for lo, hi in point_spans)}
        at += len(point_spans)
    return out


def point_of_parts(rate: float, parts: list[dict], slo: SLO) -> dict:
    """A point's figures from its visits' parts: the client's over every judged row, memory and counts over
    every judged span (time-weighted)."""
    rows = pd.concat([p["rows"] for p in parts], ignore_index=True)
    spans = [s for p in parts for s in p["spans"]]
    seconds = sum(s["seconds"] for s in spans) or 1e-12
    metrics = request_metrics(rows, max(sum(p["judged_s"] for p in parts), 1e-9), slo)
    return {"offered_rps": rate, **metrics, "judged": metrics["requests"],
            "mean_running": sum(s["mean_running"] * s["seconds"] for s in spans) / seconds,
            **{k: sum(s[k] * s["seconds"] for s in spans) / seconds for k in SHARES},
            **{k: int(sum(s[k] for s in spans)) for k in ("preemptions", "oom_total", "oom_fragmentation")},
            "crashes": 0}


def curve_rate(job: CurveJob, streams: Streams, rate: float) -> dict:
    """One rate of a curve's search: its stream from the start, judged past the warm-up rule on
    `CURVE_JUDGED` requests (each one run to its end)."""
    twin = job.twin
    n = CURVE_JUDGED
    seg = Segment(0, key_of(rate), rate, 0.0, 0, float("inf"))
    reqs = []
    for r in streams.arrivals(seg):
        reqs.append(r)
        if len(reqs) >= 2 * n:
            break
    _, frame, _ = simulate_policy(twin.policy(job.budget_bytes), twin.scheduler_config(), iter(cancel_as_sent(reqs)),
                                  twin.config["max_seq_len"], twin.model,
                                  twin.shared and twin.config.get("prefix_caching", False), sample_every_s=1.0,
                                  memory=False)  # a curve point is judged on its requests alone
    rows = client_rows(frame, reqs, float("inf"))
    warm = warmup_s(rows.loc[rows.status == "ok", "e2e_s"].tolist())
    judged = rows[(rows.arrival_s >= warm)].iloc[:n]
    span = float(judged.arrival_s.max() - warm) if len(judged) else 1.0
    return {"offered_rps": rate, **request_metrics(judged, max(span, 1e-9), job.slo)}


@lru_cache(maxsize=4)
def curve_streams(workload: str, seed: int, max_seq_len: int, token_ids: bool) -> Streams:
    """The workload's streams, shared by the curve jobs a process runs: each budget's search offers mostly the
    rates the others offered, and a stream read once is not generated again (the same requests either way)."""
    return Streams(load_spec(workload), seed, max_seq_len, token_ids=token_ids)


def curve_point(job: CurveJob) -> dict:
    """The rate the twin sustains at one budget: a knee search of its own, from the run's measured rate,
    bisected to one grid step."""
    if not job.twin.can_serve(job.budget_bytes):
        return {"kv_budget_bytes": job.budget_bytes, "sustained_rps": 0.0, "sustained_where": "cannot start",
                "points": []}
    streams = curve_streams(job.workload, job.seed, job.max_seq_len, job.twin.shared)
    search = KneeSearch(job.start_rps, job.slo.attainment, 0.0, max_points=16)
    points = []
    while (rate := search.next_rate()) is not None:
        point = curve_rate(job, streams, rate)
        search.record(rate, point["slo_attainment"])
        points.append(point)
    block = capacity_block(points, job.slo)
    return {"kv_budget_bytes": job.budget_bytes, "sustained_rps": block["sustained_rps"],
            "sustained_where": block["sustained_where"], "points": len(points)}


def errors(twin_points: list[dict], measured_points: list[CapacityPoint], twin_rps: float, measured_rps: float) -> dict:
    pairs = list(zip(twin_points, sorted(measured_points, key=lambda p: p.offered_rps), strict=True))

    def median(values: list[float]) -> float | None:
        values = [v for v in values if v is not None and math.isfinite(v)]
        return float(np.median(values)) if values else None

    out = {"sustained_rps": twin_rps / measured_rps - 1 if measured_rps else None}
    for key in RELATIVE:
        out[key] = median([t[key] / m.figure(key) - 1 for t, m in pairs if t.get(key) is not None and m.figure(key)])
    for key in SHARES:
        out[key] = median([t[key] - m.figure(key) for t, m in pairs
                           if t.get(key) is not None and m.figure(key) is not None])
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


def twins_of(meta: RunRecord, steps: pd.DataFrame, shared: bool) -> dict[str, TwinEngine]:
    """A twin for every engine that recorded steps and its configuration at the run's KV budget."""
    out = {}
    for engine, by_budget in (meta.engine_config or {}).items():
        config = by_budget.get(meta.config.kv_budget)
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


def visit_jobs(twin: TwinEngine, meta: RunRecord, streams: Streams, slo: SLO, budget: KvBudget) -> list[VisitJob]:
    """Every visit of the bench to one engine at one budget, with the requests each of its segments sent."""
    points = [p for p in meta.points_of(twin.engine) if p.kv_budget == budget.label and p.segments]
    visits: dict[int, list[tuple[SweepPoint, RecordedSegment]]] = {}
    for p in points:
        for seg in segments(p):
            visits.setdefault(seg.visit if seg.has("visit") else 0, []).append((p, seg))
    jobs = []
    for _, parts in sorted(visits.items()):
        parts.sort(key=lambda ps: ps[1].start_s)
        reqs, owner, judged = [], [], {}
        for p, seg in parts:
            sent = streams.sent(Segment(p.point, p.key, p.offered_rps, seg.start_s, seg.first, seg.end_s))
            reqs += sent
            owner += [p.point] * len(sent)
            judged.setdefault(p.point, []).extend(judged_spans(p.model_copy(update={"segments": [seg]})))
        cut = max(seg.end_s for _, seg in parts) + float(meta.config.grace_s)
        jobs.append(VisitJob(twin, tuple(reqs), tuple(owner), tuple((k, tuple(v)) for k, v in judged.items()), slo,
                             budget.bytes, cut))
    return jobs


def run_twin(meta: RunRecord, steps: pd.DataFrame, summary: Summary, n_jobs: int | None = None) -> dict:
    """summary.json's `twin`: per engine its step model, the measured points' twins, the sustained rate with
    its error against the measured one, and the KV-budget curve. `steps` are the rows each engine's model
    is fitted on: this run's, or another run's (a twin checked on a workload its fit never saw)."""
    cfg = meta.config
    slo, budget = cfg.slo, cfg.budget
    spec = load_spec(cfg.workload)
    twins = twins_of(meta, steps, has_shared_prefixes(spec))
    max_seq_len = cfg.max_seq_len if cfg.has("max_seq_len") else 2048
    streams = Streams(spec, cfg.seed, max_seq_len)
    measured = summary.capacity
    jobs, curve_jobs = {}, {}
    for engine, twin in twins.items():
        if engine not in measured:
            continue
        jobs[engine] = visit_jobs(twin, meta, streams, slo, budget)
        if not jobs[engine]:
            del jobs[engine]
            continue
        start = max(measured[engine].sustained_rps, 0.05)
        curve_jobs[engine] = [CurveJob(twin, start, slo, int(budget.bytes * m), cfg.workload, cfg.seed,
                                       max_seq_len) for m in BUDGET_MULTIPLES]
    n = n_jobs or os.cpu_count() or 1
    visit_results = iter(pool_map(simulate_visit, [j for js in jobs.values() for j in js], n))
    curve_results = iter(pool_map(curve_point, [j for js in curve_jobs.values() for j in js], n))
    out = {}
    for engine, js in jobs.items():
        parts: dict[int, list[dict]] = {}
        for _ in js:
            for point, part in next(visit_results).items():
                parts.setdefault(point, []).append(part)
        rates = {p.point: p.offered_rps for p in meta.sweep.points[engine]}
        block = capacity_block([point_of_parts(rates[k], v, slo) for k, v in parts.items()], slo)
        curve = [next(curve_results) for _ in curve_jobs[engine]]
        out[engine] = {"sustained_rps": block["sustained_rps"], "sustained_where": block["sustained_where"],
                       "points": block["points"],
                       "error": errors(block["points"], measured[engine].points, block["sustained_rps"],
                                       measured[engine].sustained_rps),
                       "step_model": twins[engine].model.to_json(), "config": twins[engine].config,
                       "budget_curve": curve}
    best = max((m.sustained_rps for m in measured.values()), default=None)
    for t in out.values():
        t["budget_for_best_rps"] = {"rate_rps": best,
                                    "kv_budget_bytes": needed_budget(t["budget_curve"], best) if best else None}
    return out


def twin_of(run_dir: Path, n_jobs: int | None = None) -> Callable[[Summary], dict | None]:
    """What finalize calls for the twin's block: the run simulated from its own steps and its summary (None: no
    sweep, or no engine fragbench schedules, targets alone)."""
    run_dir = Path(run_dir)

    def block(summary: Summary) -> dict | None:  # finalize's summary, before it is written
        meta = RunRecord.read(run_dir)
        if not meta.swept or not meta.engine_config:
            return None
        return run_twin(meta, run_steps(run_dir), summary, n_jobs)

    return block


def write_twin(run_dir: Path, n_jobs: int | None = None) -> Summary:
    """The run's summary.json written again, its twin included (a run finished before it simulated one)."""
    return finalize(Path(run_dir), twin_of(run_dir, n_jobs))


def stream_verdicts(twin: TwinEngine, workload: str, seed: int, max_seq_len: int, key: str, rate_rps: float,
                    budget_bytes: int, slo: SLO, enough: int, most: int) -> tuple[list[TraceRequest], pd.Series]:
    """Stream `key` offered to the twin from its first request at `rate_rps`, in virtual time: its requests as sent
    and the verdicts past the warm-up rule of the twin's curve points (one p90 E2E latency of its finished
    requests), simulated on (twice as many requests each time) until `enough` verdicts lie past it or `most`
    requests were sent (an overloaded engine's warm-up grows)."""
    streams = curve_streams(workload, seed, max_seq_len, twin.shared)
    seg = Segment(0, key, rate_rps, 0.0, 0, float("inf"))
    sent = 3 * enough
    while True:
        reqs = list(islice(streams.arrivals(seg), sent))
        _, frame, _ = simulate_policy(twin.policy(budget_bytes), twin.scheduler_config(), iter(cancel_as_sent(reqs)),
                                      twin.config["max_seq_len"], twin.model,
                                      twin.shared and twin.config.get("prefix_caching", False), sample_every_s=1.0,
                                      memory=False)
        rows = client_rows(frame, reqs, float("inf"))
        warm = warmup_s(rows.loc[rows.status == "ok", "e2e_s"].tolist())
        verdict = judged_verdicts(rows[rows.arrival_s >= warm], slo)
        if len(verdict) >= enough or sent >= most:
            return reqs, verdict
        sent *= 2
