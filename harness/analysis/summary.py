"""From journals to parquet, and from parquet to the per-engine headline numbers (summary.json).
Works on a partial run as well: whatever rows were written are what it summarizes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from engines.percentile import percentile
from harness.analysis.alloc_settings_summary import settings_block
from harness.analysis.allocator_summary import allocator_block
from harness.analysis.capacity import SLO, judged_verdicts, meets_slo, request_metrics
from harness.analysis.engine_rows import write_engines_csv
from harness.analysis.headline import (
    bracket_ends,
    headline,
    reference_of,
    resolvable,
    roles,
    rulings_of,
    run_to_run_share,
    time_to_resolve,
)
from harness.analysis.integrity import IdleFigures, integrity
from harness.analysis.knee import (
    Judged,
    bound_of,
    design_effect,
    knee_block,
    load_independent_misses,
    rests_on_unsteady,
)
from harness.analysis.kneefit import KneeFit
from harness.analysis.operating import point_intervals
from harness.analysis.records import RunRecord, SearchSettings, SweepPoint
from harness.analysis.ruled_out import evidence_of
from harness.analysis.run_fits import fits_of
from harness.analysis.rundir import (
    arrived_in,
    in_point,
    judged_spans,
    load_frames,
    load_steps,
    segments,
    spans,
    time_spent,
)
from harness.analysis.sample_figures import (
    SHARE_COLUMNS,
    counter_rise,
    known,
    memory_figures,
    step_seconds,
    waiting_for_memory,
)
from harness.analysis.saturation import add_saturation
from harness.analysis.size_classes import run_rule
from harness.analysis.steady import halves, knee_use
from harness.analysis.summary_records import (
    AllocSetting,
    CapacityBlock,
    EngineFigures,
    HeadlineBlock,
    Ratio,
    SizeRule,
    Summary,
    TimeSpent,
    TwinBlock,
)
from harness.analysis.token_load import log_token_load, mean_tokens_asked
from harness.results import read_rows, whole_file, write_whole
from workloads.outcome import UNFINISHED
from workloads.streams import replication_of


def pct(series: pd.Series, q: float) -> float | None:
    return percentile(pd.to_numeric(series, errors="coerce"), q)


def steady(smp: pd.DataFrame, meta: RunRecord, engine: str) -> pd.DataFrame:
    """Samples of the steady part of the time requests arrive: not the warm-up ramp from empty memory, not
    the drain after the last arrival (in a sweep: of every point's judged windows)."""
    cfg = meta.config
    windows = meta.points_of(engine)
    if not windows:
        return smp[(smp.t_s >= cfg.warmup) & (smp.t_s <= (cfg.duration_s if cfg.has("duration_s") else np.inf))]
    inside = np.zeros(len(smp), dtype=bool)
    for w in windows:
        inside |= in_point(smp, w, meta).to_numpy()
    return smp[inside]


def judged_of(engine: str, req: pd.DataFrame, meta: RunRecord) -> tuple[pd.DataFrame, float] | None:
    """A sweep's judged requests of one engine and the seconds they arrived in (its points' judged spans), or
    None for a run without points. The engine's clock runs on while other engines are measured (the decision
    revisits it minutes later), so the time to its last request is no denominator."""
    points = meta.points_of(engine)
    if not points:
        return None
    judged = pd.concat([arrived_in(req, w, meta) for w in points]) if len(req) else req
    seconds = sum(hi - lo for w in points for lo, hi in judged_spans(w, meta))
    return judged[~judged.index.duplicated()], max(seconds, 1e-9)


def engine_summary(engine: str, req: pd.DataFrame, smp: pd.DataFrame, ev: pd.DataFrame, meta: RunRecord,
                   integrity: dict | None = None) -> EngineFigures:
    """summary.json's `engines.<engine>`: the engine's figures over the run, its KV-integrity probes judged."""
    cfg = meta.config
    churn = steady(smp, meta, engine)
    window = max(float(req.end_s.max()) if len(req) and req.end_s.notna().any() else 0.0, 1e-9)
    sent = req
    if (judged := judged_of(engine, req, meta)) is not None:  # rates and latency over what the sweep judged
        req, window = judged
    ok = req[req.status == "ok"]
    out: dict = {"source": "target" if engine in cfg.targets else "fragbench", **memory_figures(churn)}
    ooms = ev[ev.kind == "oom"]
    out["oom_total"] = int(len(ooms))
    out["oom_fragmentation"] = int((ooms.cause == "fragmentation").sum())
    out["oom_capacity"] = int((ooms.cause == "capacity").sum())
    pre = smp.preempted_total.dropna().astype(float).diff().clip(lower=0).sum() if len(smp) else 0
    out["preemptions"] = int(pre)
    if out["source"] == "target":  # what its metrics do not export is unknown, not 0
        out["preemptions"] = out["preemptions"] if known(smp, "preempted_total") else None
        out["oom_total"] = out["oom_fragmentation"] = out["oom_capacity"] = None
    out["output_tokens_per_s"] = float(req.output_tokens.fillna(0).sum() / window)
    out["requests_per_s"] = float(len(ok) / window)
    out["goodput_requests_per_s"] = float(meets_slo(ok, cfg.slo).sum() / window)
    out["ttft_p50_s"], out["ttft_p99_s"] = pct(ok.ttft_s, 0.5), pct(ok.ttft_s, 0.99)
    out["tpot_p50_s"], out["tpot_p99_s"] = pct(ok.tpot_s, 0.5), pct(ok.tpot_s, 0.99)
    out["ttft_p90_s"], out["tpot_p90_s"] = pct(ok.ttft_s, 0.9), pct(ok.tpot_s, 0.9)  # the console's table
    out["e2e_p50_s"], out["e2e_p99_s"] = pct(ok.e2e_s, 0.5), pct(ok.e2e_s, 0.99)
    # the load generator's lateness (send after due time): latency counts from the due time, so this is the
    # part of each wait that the client, not the engine, added
    late = sent["late_s"] if "late_s" in sent else pd.Series(dtype=float)  # the whole schedule's
    out["late_p99_s"], out["late_max_s"] = pct(late, 0.99), pct(late, 1.0)
    out["crashes"] = int((ev.kind == "crash").sum())
    out["cancelled"] = int((sent.status == "cancelled").sum())
    releases = ev[ev.kind == "cancel_release"]
    release_s = pd.to_numeric(releases.get("release_s", pd.Series(dtype=float)), errors="coerce")
    out["cancel_release_p99_s"] = pct(release_s, 0.99)
    req = sent  # the counts are of every request sent (calibration and warm-ups included)
    out["requests"] = int(len(req))
    for status in ("ok", "oom", "rejected", "error", "crashed"):
        out[f"requests_{status}"] = int((req.status == status).sum())
    unfinished = (req.status == "error") & (req.error == UNFINISHED)
    out["requests_unfinished"] = int(unfinished.sum())
    out["requests_error"] -= out["requests_unfinished"]
    out["window_s"] = window
    kvb = pd.to_numeric(smp.get("kv_bytes_per_token", pd.Series(dtype=float)), errors="coerce").dropna()
    out["kv_bytes_per_token"] = int(kvb.iloc[0]) if len(kvb) else None
    out["allocator"] = allocator_block(smp, churn, ooms)  # analysis/allocator_summary.py: --memory caching's figures
    out["integrity"] = integrity
    return EngineFigures.model_validate(out)


def point_figures(rows: pd.DataFrame, smp: pd.DataFrame, ev: pd.DataFrame, window: SweepPoint, slo: SLO,
                  meta: RunRecord | None = None, mean_tokens: float | None = None) -> tuple[dict, Judged]:
    """One sweep point: the client's figures over its judged requests, the engine's state over its judged
    spans (what bound it), whether its two halves agree (steady), and its verdicts for the intervals."""
    in_window = smp[in_point(smp, window, meta)]
    ooms = ev[ev.kind == "oom"]
    mem = memory_figures(in_window)
    judged_s = sum(hi - lo for lo, hi in judged_spans(window, meta))
    metrics = request_metrics(rows, max(judged_s, 1e-9), slo)
    unfinished = (rows.status == "error") & (rows.error == UNFINISHED)
    verdict = judged_verdicts(rows, slo)
    kept = rows.loc[verdict.index]
    order = np.argsort(pd.to_numeric(kept.arrival_s, errors="coerce").to_numpy(), kind="stable")
    met = verdict.to_numpy(dtype=float)[order]
    index = pd.to_numeric(kept.get("stream_index", pd.Series(range(len(kept)), index=kept.index)),
                          errors="coerce").fillna(-1).to_numpy(dtype=int)[order]
    index = np.where(index >= 0, index, np.arange(len(index)))
    arrivals = pd.to_numeric(kept.arrival_s, errors="coerce").to_numpy()[order]
    split = arrivals[len(arrivals) // 2] if len(arrivals) else 0.0
    # the queue: requests the engine holds, running or waiting (a queue that grows while attainment falls is a miss)
    waiting = pd.to_numeric(in_window.get("waiting", pd.Series(0, index=in_window.index)), errors="coerce").fillna(0)
    queue = pd.to_numeric(in_window.running, errors="coerce") + waiting
    first, second = queue[in_window.t_s < split].dropna(), queue[in_window.t_s >= split].dropna()
    split_halves = halves(met, first.to_numpy(), second.to_numpy())
    halves_of, use = split_halves.to_json(), knee_use(split_halves, slo.attainment)
    segs = segments(window, meta)
    point = {"offered_rps": window.offered_rps, "key": window.key, **metrics, "judged": metrics["requests"],
             "warmup_s": segs[0].warmup_s, **halves_of, "knee_use": use, "steady": use == "steady",
             "replication": replication_of(window.key),
             "mean_running": mem["mean_running"], **{share: mem[share] for share in SHARE_COLUMNS},
             "kv_usage": mem["allocated_share"], "waiting_for_memory_share": waiting_for_memory(in_window),
             "step_s": step_seconds(in_window), "preemptions": counter_rise(in_window, "preempted_total"),
             "oom_total": int(len(ooms)), "oom_fragmentation": int((ooms.cause == "fragmentation").sum()),
             "crashes": int((ev.kind == "crash").sum()),
             "failed": int((rows.status.isin(["error", "crashed"]) & ~unfinished).sum()),
             "missed": round(metrics["requests"] * (1 - (metrics["slo_attainment"] or 0.0))),
             # the operating-point gate's figures with their intervals (compare: where two runs judged this key)
             **point_intervals(rows, in_window, judged_s, window.key or f"{window.offered_rps:g}")}
    load = log_token_load(rows, judged_s, window.offered_rps, mean_tokens)
    point["log_token_load"] = round(load, 4)
    return point, Judged(window.offered_rps, window.key or f"{window.offered_rps:g}", met, index, use, load)


def budget_of(point: SweepPoint, default: str | None) -> str | None:
    """The KV budget a point ran at (run.json's label); a run before budgets were recorded per point ran at one."""
    return point.kv_budget if point.has("kv_budget") else default


def capacity(engine: str, req: pd.DataFrame, smp: pd.DataFrame, ev: pd.DataFrame, meta: RunRecord,
             budget: str | None = None) -> tuple[dict, list[Judged]] | None:
    """The sweep's points for one engine at one KV budget (the run's own by default), each over its judged
    requests, and what the intervals resample; the sustained rate's interval comes from `intervals`."""
    cfg = meta.config
    budget = budget or cfg.kv_budget
    windows = [w for w in meta.points_of(engine)
               if budget_of(w, budget) == budget and (w.segments or w.segments is None)]
    if not windows or "offered_rps" not in req:
        return None
    slo, grace = cfg.slo, cfg.grace_s
    mean_tokens = mean_tokens_asked(cfg.workload, int(cfg.seed or 0), int(cfg.max_seq_len or 2048)) \
        if cfg.workload else None
    points, judged, ids = [], [], []
    for w in windows:
        rows = arrived_in(req, w, meta)
        inside = pd.Series(False, index=ev.index)
        for lo, hi in spans(w, grace):
            inside |= (ev.t_s >= lo) & (ev.t_s <= hi)
        point, j = point_figures(rows, smp, ev[inside], w, slo, meta, mean_tokens)
        points.append(point)
        judged.append(j)
        ids += rows.loc[judged_verdicts(rows, slo).index, "request_id"].tolist()
    order = np.argsort([p.offered_rps for p in judged], kind="stable")
    judged = [judged[i] for i in order]
    # its sustained rate is the joint fit's knee, set once by `intervals` (knee.knee_block)
    block = {"slo": slo.to_json(), "points": sorted(points, key=lambda p: p["offered_rps"])}
    block["rests_on_unsteady"] = rests_on_unsteady(judged)
    block["judged_total"] = int(sum(p["judged"] for p in points))
    block["distinct_requests"] = len(set(ids))
    block["steady_points"] = int(sum(bool(p["steady"]) for p in points))
    return block, judged


def intervals(blocks: dict[str, tuple[dict, list[Judged]]], meta: RunRecord,
              fits: tuple[KneeFit | None, KneeFit | None] | None = None
              ) -> tuple[dict[str, CapacityBlock], dict[str, Ratio]]:
    """Every engine's capacity block with its knee (the joint fit's estimate, interval and what it rests on),
    its role and the constraint that bound it; and every pair's ratio with its interval."""
    slo = meta.config.slo
    knees, within = fits or fits_of(blocks, meta)
    # the one rule for "ruled out" (analysis/ruled_out.py), read by the roles and written beside each knee
    evidence_by = evidence_of({e: j for e, (_, j) in blocks.items()}, slo.attainment)
    role = roles(knees, evidence_by) if knees is not None else {}
    ruling = rulings_of(knees, evidence_by) if knees is not None and reference_of(knees.estimates) else {}
    out = {}
    for e, (b, j) in blocks.items():
        est = knees.estimates.get(e) if knees is not None else None
        out[e] = knee_block(b, slo, est)
        out[e]["role"] = role.get(e, "screened")
        if est is not None and not est.bracketed:  # a bound, not a knee: which side, and what the points reached
            out[e]["sustained_bound"] = bound_of(j, slo.attainment)
        if est is not None and within is not None and e in within.estimates:
            out[e]["sustained_rps_ci_within_runs"] = list(within.estimates[e].ci)
            out[e]["run_to_run_share"] = round(run_to_run_share(est.ci, within.estimates[e].ci), 3)
        d = design_effect(j)
        out[e]["design_effect"] = round(d, 2)
        # beside the knee: the misses that lighter load does not remove (an engine whose attainment is flat)
        if est is not None:
            out[e]["load_independent_misses"] = load_independent_misses(b["points"], est.rps, d)
        out[e]["effective_judged"] = round(b["judged_total"] / d, 1)
        out[e]["replications"] = est.streams if est is not None else 0  # independent streams under the estimate
        # measured first, on fixed keys (none where the repository's table has no rate for this engine)
        out[e]["operating_point"] = (meta.operating_point or {}).get(e) or {"offered_rps": None, "keys": []}
        if e in ruling:
            out[e]["ruling"] = ruling[e].written()
    ratios = {}
    for a in (knees.estimates if knees is not None else {}):
        for b in knees.estimates:
            if a != b:
                ratio, ci = knees.ratio(a, b)
                ratios[f"{a}/{b}"] = Ratio(ratio=round(ratio, 4), ratio_ci=list(ci))
    return {e: CapacityBlock.model_validate(b) for e, b in out.items()}, ratios


def headline_with(blocks: dict[str, tuple[dict, list[Judged]]], meta: RunRecord,
                  fits: tuple[KneeFit | None, KneeFit | None] | None = None) -> HeadlineBlock | None:
    """summary.json's headline: the paged engine against the best contiguous one, decided or not, what it
    rests on and (when undecided) how much longer a run would need."""
    cfg, search = meta.config, (meta.sweep.search if meta.sweep else None) or SearchSettings()
    precision = float(search.precision or cfg.precision or 1.5)
    slo, pts = cfg.slo, {e: j for e, (_, j) in blocks.items()}
    fits = fits or fits_of(blocks, meta)
    h, knee_fit = headline(*fits, precision, pts, slo.attainment), fits[0]
    if h is None:
        return None
    more_s = time_to_resolve(h, pts, precision)
    ends = {e: [{"offered_rps": p.offered_rps, "judged": judged_at(pts[e], p.offered_rps), "steady": p.use == "steady",
                 "use": p.use} for p in bracket_ends(pts[e], slo)] for e in (h.engine, h.against)}
    # what the knees do not rest on (their halves disagree): the report says so, and whether time ran out first
    left_out = {e: [p.offered_rps for p in pts[e] if p.use == "unsteady"] for e in (h.engine, h.against)}
    spent = float(meta.bench_s or cfg.time_s or 0.0)
    factor_20min = 1 + 1200.0 / max(spent, 1.0)
    h.bracket_ends, h.unsteady_rates, h.time_s = ends, left_out, search.time_s
    h.spread_prior = meta.spread_prior  # the priors the fit used, where they came from (None: the half-t)
    joint = knee_fit.joint.get((h.engine, h.against)) or knee_fit.joint.get((h.against, h.engine)) \
        if knee_fit is not None else None
    h.residual_correlation = joint.rho if joint else 0.0  # 0: fitted alone (no twins' correlation, or none shown)
    h.joint_effective_draws = round(joint.effective_draws) if joint else None
    h.more_arrival_s_to_precision = None if more_s is None else round(more_s, 1)
    h.resolvable_ratio = round(resolvable(h, 1.0), 3)
    h.resolvable_ratio_with_20_more_minutes = round(resolvable(h, factor_20min), 3)
    return h


def judged_at(points: list[Judged], rate: float) -> int:
    """The requests a point judged (all of them: one over its knee rests on its second half alone)."""
    return int(sum(len(p.met) for p in points if p.offered_rps == rate))


def integrity_of(engine_dir: Path) -> dict | None:
    """The KV-integrity probes of one engine (harness/run/integrity_probes.py wrote them), judged; None: not run."""
    idle = engine_dir / "integrity.json"
    if not idle.is_file():
        return None
    rows = read_rows(engine_dir / "integrity.jsonl")
    return integrity(IdleFigures.model_validate(json.loads(idle.read_text())), rows)


def engines_of(req: pd.DataFrame, meta: RunRecord) -> list[str]:
    return list(dict.fromkeys([*meta.config.engines, *req.engine.dropna().unique()]))


def blocks_of(frames: dict[str, pd.DataFrame], meta: RunRecord,
              engines: list[str] | None = None) -> dict[str, dict[str, tuple[dict, list[Judged]]]]:
    """Every engine's capacity block and judged points, by KV budget: what the intervals, the ratios and the
    headline are computed from (the bench's decision phase computes them from the same, while it runs)."""
    req, smp, ev = frames["requests"], frames["samples"], frames["events"]
    cfg, by_budget = meta.config, {}
    for engine in engines or engines_of(req, meta):
        r, s, e = req[req.engine == engine], smp[smp.engine == engine], ev[ev.engine == engine]
        if not (len(r) or len(s)):
            continue
        for budget in dict.fromkeys(budget_of(w, cfg.kv_budget) for w in meta.points_of(engine)):
            block = capacity(engine, r, s, e, meta, budget)
            if block is not None:
                by_budget.setdefault(budget, {})[engine] = block
    return by_budget


def summarize(run_dir: Path, frames: dict[str, pd.DataFrame] | None = None) -> Summary:
    """summary.json as one typed record: every block as the function that computes it returns it."""
    meta = RunRecord.read(run_dir)
    frames = frames or load_frames(run_dir)
    req, smp, ev = frames["requests"], frames["samples"], frames["events"]
    cfg, engines = meta.config, {}
    for engine in engines_of(req, meta):
        r, s, e = req[req.engine == engine], smp[smp.engine == engine], ev[ev.engine == engine]
        if len(r) or len(s):
            engines[engine] = engine_summary(engine, r, s, e, meta, integrity_of(run_dir / "engines" / engine))
    summary = Summary(run_id=meta.run_id if meta.has("run_id") else run_dir.name,
                      status=meta.status if meta.has("status") else "partial", max_seq_len=cfg.max_seq_len,
                      engines=engines)
    by_budget = blocks_of(frames, meta)
    own = cfg.kv_budget
    if own in by_budget:
        fits = fits_of(by_budget[own], meta)
        summary.capacity, summary.capacity_ratios = intervals(by_budget[own], meta, fits)
        summary.headline = headline_with(by_budget[own], meta, fits)
        summary.time_spent = TimeSpent.model_validate(time_spent(meta))
    add_saturation(summary, run_dir)  # beside the headline, never instead of it
    if len(cfg.budgets) > 1:
        budgets = {b.label: b for b in cfg.budgets}  # each label parsed once, in the run's config record
        summary.capacity_by_budget = {str(budgets[budget].bytes): intervals(blocks, meta)[0]
                                      for budget, blocks in by_budget.items()}
    if cfg.compare_alloc_confs:  # --compare-alloc-conf: each setting's own run beside this one
        summary.alloc_settings = [AllocSetting.model_validate(s) for s in settings_block(run_dir, summary, cfg,
                                                                                          finalize)]
    if rule := run_rule(req, cfg):  # --memory caching: do its allocations fall in a real model's size classes?
        summary.size_classes_rule = SizeRule.model_validate(rule)
    return summary


def finalize(run_dir: Path, twin: Callable[[Summary], dict | None] | None = None) -> Summary:
    """Parquet files and summary.json from the journals, written once, whole; safe to repeat. `twin` computes
    the twin's block from the summary (the simulator lives above this room: the caller hands it in); without
    it, a twin an earlier finalize wrote is kept."""
    frames = load_frames(run_dir)
    for kind in ("requests", "samples", "events"):  # whole files: a report may read them while a rerun rewrites
        with whole_file(run_dir / f"{kind}.parquet") as tmp:
            frames[kind].to_parquet(tmp, index=False)
    steps = load_steps(run_dir, RunRecord.read(run_dir))
    if len(steps):
        with whole_file(run_dir / "steps.parquet") as tmp:
            steps.to_parquet(tmp, index=False)
    summary = summarize(run_dir, frames)
    path = run_dir / "summary.json"
    block = twin(summary) if twin is not None else None
    if block is not None:
        summary.twin = {e: TwinBlock.model_validate(b) for e, b in block.items()}
    elif path.is_file() and "twin" in (before := json.loads(path.read_text())):
        summary.twin = Summary.model_validate({"twin": before["twin"]}).twin  # simulated once the rows were written
    write_summary(path, summary)
    write_engines_csv(run_dir, summary)  # the per-engine table beside it, units in its header
    return summary


def write_summary(path: Path, summary: Summary) -> None:
    """summary.json's one writer: the record as it was built, whole (a reader never sees half a summary)."""
    write_whole(path, json.dumps(summary.written(), indent=2))


def read_summary_record(run_dir: Path) -> Summary:
    """summary.json read once into the record every page takes (a run never finalized is finalized first)."""
    path = run_dir / "summary.json"
    return Summary.model_validate(json.loads(path.read_text())) if path.is_file() else finalize(run_dir)
