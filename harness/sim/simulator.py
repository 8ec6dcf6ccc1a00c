"""`fragbench simulate`: the engines' KV policies and scheduler, unchanged, driven by a roofline step-time
model instead of a model runner, at real-model scale.

Event-driven: after each scheduling decision the running sequences decode together for as many steps as
the policy guarantees no allocation can fail (`decode_headroom`), up to the next arrival or finish; the
step times of that stretch are summed in closed form. Memory accounting is time-weighted.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from engines.kv import Breakdown, KVPolicy, PagedKV, make_policy
from engines.kv_categories import CATEGORIES
from engines.percentile import percentile
from engines.registry import entry, policies
from engines.scheduled.scheduler import Scheduler, SchedulerConfig
from engines.sequence import FinishReason
from engines.shapes import DTYPE_BYTES, ModelShape
from harness.analysis.capacity import SLO, capacity_block, request_metrics, sweep_rates
from harness.analysis.operating import point_intervals
from harness.analysis.summary_records import PolicyFigures, SimulationOut
from harness.gpus import GPU
from harness.plan import Plan
from harness.sim.allocator_sim import AllocatorTrack, placement_of, sim_memory
from harness.sim.roofline import StepModel
from harness.sim.state import Accumulator, DecodeClock, SimSequence, Tracks, stale
from harness.sim.stepfit import FittedStepModel
from workloads.generate import TraceRequest, at_rate, has_shared_prefixes, iter_requests
from workloads.spec import WorkloadSpec

DEFAULT_SLO = SLO()


def make_sim_policy(name: str, budget_bytes: int, kvb: int, max_seq_len: int, block_size: int,
                    placement: str | None, preflight: bool = True, memory: str = "arena",
                    alloc_conf: str | None = None) -> KVPolicy:
    """The engines' own policy on a bookkeeping-only arena, placed as the paper places it (its registry entry,
    engines/registry.py) unless `placement` says otherwise; or, `memory` "caching", on PyTorch's caching allocator
    emulated under a cap of the budget (harness/sim/allocator_sim.py)."""
    store = sim_memory(memory, budget_bytes, placement or paper_placement(name), alloc_conf)
    return make_policy(name, store, kvb, max_seq_len, block_size, preflight)


def sim_config(plan: Plan, max_num_seqs: int, preflight: bool) -> SchedulerConfig:
    """The simulator's own scheduler at real-model scale (a twin takes its engine's instead)."""
    return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(8192, plan.max_seq_len),
                           on_oom="wait" if preflight else "reject")


def simulate_policy(kv: KVPolicy, config: SchedulerConfig, requests: Iterator[TraceRequest], max_seq_len: int,
                    model: StepModel | FittedStepModel, prefix_caching: bool, sample_every_s: float,
                    window: tuple[float, float] | None = None, spans: list[tuple[float, float]] | None = None,
                    memory: bool = True) -> tuple[dict, pd.DataFrame, list[tuple]]:
    """The policy's result, every request's row (for a sweep's per-request SLO figures), and the breakdown
    sampled over simulated time (for the report). Each event costs its admissions, finishes and block
    crossings, not the size of the running set: the sums come from the decode clock and the policy's totals.
    With `spans`, the result's "spans" holds the shares and mean running count over each of them. With
    `memory=False` the breakdown is not taken (the result's shares read 0): a caller that reads the requests
    alone saves what a contiguous policy's breakdown costs at every event (a free-hole scan and a median)."""
    if isinstance(kv, PagedKV):
        kv.prefix_caching = prefix_caching
        if not prefix_caching and not kv.memory.backed:  # no block is found again nor indexed: count them
            kv.count_blocks()
    capacity = kv.stats().kv_capacity_bytes
    breakdown_of = kv.breakdown_of if memory else unmeasured
    sched = Scheduler(kv, config)
    clock = DecodeClock()
    finishing: list[tuple[int, int, SimSequence]] = []  # (finish step, admission number, seq) of running ones
    admissions = itertools.count()
    tracks = Tracks()
    acc = Accumulator(capacity, window, spans=list(spans or []))
    track = AllocatorTrack(kv.memory)  # the caching allocator over time, where it holds the KV
    failures: list[tuple[float, str]] = []
    preempted: list[float] = []
    t, started = 0.0, time.perf_counter()
    pending = next(requests, None)
    while True:
        while pending is not None and pending.arrival_s <= t:
            seq = SimSequence(pending, max_seq_len, clock, tracks.add(pending.arrival_s, pending.max_tokens),
                              keep_ids=prefix_caching)
            sched.add(seq)
            pending = next(requests, None)
        if not sched.has_work():
            if pending is None:
                break
            t_idle = acc.idle(breakdown_of(0), t, pending.arrival_s, sample_every_s)
            track.add(t_idle - t)
            t = t_idle
            continue
        seen_ooms, seen_preempted = len(sched.oom_events), sched.preempted_total
        step = sched.schedule()
        if spans:  # when each failure and preemption happened, on the simulated clock
            failures += [(t, e.cause) for _, e, _ in sched.oom_events[seen_ooms:]]
            preempted += [t] * (sched.preempted_total - seen_preempted)
        before = breakdown_of(clock.live_tokens())  # the interval starts with this step's admissions
        for seq in step.rejected:
            tracks.end(seq.track, t, "oom")
        if not (step.decodes or step.prefills):  # nothing fits and nothing runs: wait for the world to change
            if pending is None:
                break
            t_idle = acc.idle(before, t, max(t, pending.arrival_s), sample_every_s)
            track.add(t_idle - t)
            t = t_idle
            continue
        # the first step: prefills and decodes as scheduled
        live = clock.live_tokens()
        prefill_tokens = sum(c.end - c.start for c in step.prefills)
        prefill_ctx = sum(c.end for c in step.prefills)
        prefill_pairs = sum((c.end - c.start) * (c.start + c.end + 1) / 2 for c in step.prefills)
        dt = float(model.step_s(len(step.decodes), len(step.prefills), len(step.decodes) + prefill_tokens, live,
                                live - prefill_ctx + prefill_pairs))
        t += dt
        clock.steps += 1
        for c in step.prefills:
            if math.isnan(tracks.first_s[c.seq.track]):
                tracks.first_s[c.seq.track] = t
            heapq.heappush(finishing, (c.seq.finish_step, next(admissions), c.seq))
        # then the running sequences decode together until something must be decided again
        while finishing and stale(finishing[0]):
            heapq.heappop(finishing)
        if finishing:
            # one step short of the headroom and of the first finish, as an engine's scheduler would see them:
            # that last step is the next event's first, where a waiting request retries
            k = min(max(1, sched.decode_headroom()), finishing[0][0] - clock.steps) - 1
            if k > 0:
                batch, ctx0 = clock.running, clock.live_tokens()
                steps = model.step_s(batch, 0, batch, ctx0 + batch * np.arange(k), ctx0 + batch * np.arange(k))
                ends = t + np.cumsum(steps)
                # stop at the next arrival only if it could be admitted: not behind a queue, not over the cap
                admissible = not sched.waiting and len(sched.running) < sched.config.max_num_seqs
                if pending is not None and admissible:
                    k = min(k, int(np.searchsorted(ends, pending.arrival_s)) + 1)
                dt_more = float(ends[k - 1] - t)
                t += dt_more
                dt += dt_more
                clock.steps += k
                sched.advance(k)  # the slots an engine would have taken on the way
        # the interval ends with every sequence still holding its memory: retire the finished after
        acc.add(before, breakdown_of(clock.live_tokens()), len(step.decodes) + len(step.prefills), dt, t,
                sample_every_s)
        track.add(dt)
        while finishing and finishing[0][0] <= clock.steps:
            entry = heapq.heappop(finishing)
            if not stale(entry):
                sched.finish(entry[2], FinishReason.LENGTH)
                tracks.end(entry[2].track, t, "ok")
    wall_s = time.perf_counter() - started
    frame = tracks.frame()
    res = result(kv.name, sched, frame, acc, t, wall_s, placement_of(kv.memory))
    res["allocator"] = track.block([e.layer for _, e, _ in sched.oom_events])
    if spans:
        res["spans"] = span_figures(acc, failures, preempted)
    return res, frame, acc.timeline


UNMEASURED = Breakdown(0, 0, 0, 0, 0)


def unmeasured(live_tokens: int) -> Breakdown:
    """The breakdown where memory is not measured (simulate_policy's memory=False)."""
    return UNMEASURED


def span_figures(acc: Accumulator, failures: list[tuple[float, str]], preempted: list[float]) -> list[dict]:
    """Each span's shares and mean running count (time averages), and the OOMs and preemptions inside it."""
    seconds = np.maximum(acc.span_seconds, 1e-12)
    shares = acc.span_bytes_s / seconds[:, None] / acc.capacity
    out = []
    for (lo, hi), row, r, sec in zip(acc.spans, shares, acc.span_running_s, seconds, strict=True):
        ooms = [cause for t, cause in failures if lo <= t <= hi]
        out.append({**{f"{c}_share": float(v) for c, v in zip(CATEGORIES, row, strict=True)},
                    "mean_running": float(r / sec), "oom_total": len(ooms),
                    "oom_fragmentation": sum(c == "fragmentation" for c in ooms),
                    "preemptions": sum(lo <= t <= hi for t in preempted), "seconds": float(acc.span_seconds[len(out)])})
    return out


def result(name: str, sched: Scheduler, requests: pd.DataFrame, acc: Accumulator, t: float,
           wall_s: float, placement: str) -> dict:
    seconds = acc.seconds or 1e-12
    shares = np.array(acc.bytes_s) / seconds / acc.capacity
    done = requests[requests.status == "ok"]
    ttft, e2e, tpot = done.ttft_s.to_numpy(), done.e2e_s.to_numpy(), done.tpot_s[done.output_tokens > 1].to_numpy()

    ooms = [e for _, e, _ in sched.oom_events]
    return {
        "policy": name, "placement": placement,
        **{f"{c}_share": float(v) for c, v in zip(CATEGORIES, shares, strict=True)},
        "mean_running": acc.running_s / seconds, "max_running": acc.max_running,
        "oom_total": len(ooms), "oom_fragmentation": sum(e.cause == "fragmentation" for e in ooms),
        "preemptions": sched.preempted_total,
        "output_tokens_per_s": int(done.output_tokens.sum()) / (t or 1e-12),
        "requests_completed": len(done), "requests_oom": int((requests.status == "oom").sum()),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        "e2e_p50_s": percentile(e2e, 0.5), "e2e_p99_s": percentile(e2e, 0.99),
        "simulated_s": t, "wall_s": wall_s, "kv_capacity_bytes": acc.capacity,
        "first_oom_running": first_oom_running(sched),
    }


def first_oom_running(sched: Scheduler) -> int | None:
    return sched.oom_events[0][2]["running"] if sched.oom_events else None


def run_simulation(shape: ModelShape, gpu: GPU, plan: Plan, spec: WorkloadSpec, policies: list[str],
                   block_size: int, placement: str | None, num_requests: int, seed: int = 0,
                   max_num_seqs: int = 256, dtype: str = "float16", preflight: bool = True, n_jobs: int = 1,
                   sweep_points: int = 0, slo: SLO = DEFAULT_SLO, rates: list[float] | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   step_model: FittedStepModel | None = None, memory: str = "arena",
                   alloc_conf: str | None = None) -> Simulation:
    """Each policy at the workload's own rate; with sweep_points, also a capacity sweep. Independent
    simulations run in a pool of n_jobs processes; the result does not depend on n_jobs. Steps take the
    roofline's time on `gpu`, or `step_model`'s (fitted on a bench run's steps). The KV lives in `memory`: the
    arena, or the caching allocator under `alloc_conf`."""
    model = step_model or StepModel.of(shape, dtype, gpu)
    shared = has_shared_prefixes(spec)
    out = {"model": shape.name, "gpu": gpu.name, "dtype": dtype, "dtype_bytes": DTYPE_BYTES[dtype],
           "kv_budget_bytes": plan.kv_budget_bytes, "max_seq_len": plan.max_seq_len, "block_size": block_size,
           "requests": num_requests, "workload": spec.name, "seed": seed, "prefix_caching": shared,
           "static_preflight": preflight, "memory": memory,
           "alloc_conf": (alloc_conf or "default") if memory == "caching" else None,
           "step_model": model.to_json() if step_model else model.constants(), "policies": {}}
    jobs = [SimJob(name, plan, model, spec, seed, num_requests, shape.vocab_size, shared, block_size, placement,
                   max_num_seqs, preflight, memory=memory, alloc_conf=alloc_conf) for name in policies]
    timelines = {}
    for job, (res, _, timeline) in zip(jobs, pool_map(run_job, jobs, n_jobs, progress), strict=True):
        out["policies"][job.policy], timelines[job.policy] = res, timeline
    if sweep_points:
        out["capacity"] = sweep(jobs, sweep_points, slo, n_jobs, progress, rates)
    return Simulation(out, timelines)


@dataclass
class Simulation:
    out: dict  # what --json prints
    timelines: dict[str, list[tuple]]  # policy -> (t, five shares, running) over simulated time, for the report

    @property
    def record(self) -> SimulationOut:
        """`out` typed, for the pages and the text (--json prints `out` itself, its bytes as they are)."""
        return SimulationOut.model_validate(self.out)


@dataclass(frozen=True)
class SimJob:
    """One independent simulation: a policy on a workload, at the workload's own rate or at `rate_rps`."""

    policy: str
    plan: Plan
    model: StepModel | FittedStepModel
    spec: WorkloadSpec
    seed: int
    num_requests: int
    vocab_size: int
    shared: bool
    block_size: int
    placement: str | None
    max_num_seqs: int
    preflight: bool
    rate_rps: float | None = None
    memory: str = "arena"  # or "caching": PyTorch's caching allocator emulated, configured by alloc_conf
    alloc_conf: str | None = None


def run_job(job: SimJob) -> tuple[dict, pd.DataFrame, list[tuple]]:
    requests = iter_requests(job.spec, job.seed, job.plan.max_seq_len, job.vocab_size, job.num_requests,
                             token_ids=job.shared)
    if job.rate_rps is not None:
        requests = iter(at_rate(list(requests), job.rate_rps))
    kv = make_sim_policy(job.policy, job.plan.kv_budget_bytes, job.plan.kv_bytes_per_token, job.plan.max_seq_len,
                         job.block_size, job.placement, job.preflight, job.memory, job.alloc_conf)
    return simulate_policy(kv, sim_config(job.plan, job.max_num_seqs, job.preflight), requests, job.plan.max_seq_len,
                           job.model, job.shared, sample_every_s=1.0)


def pool_map(fn, jobs: list, n_jobs: int, progress: Callable[[int, int], None] | None = None) -> list:
    """fn over jobs in a process pool of n_jobs (serially for 1), results in the jobs' order."""
    if progress:
        progress(0, len(jobs))
    if n_jobs <= 1 or len(jobs) <= 1:
        out = []
        for i, job in enumerate(jobs):
            out.append(fn(job))
            if progress:
                progress(i + 1, len(jobs))
        return out
    with ProcessPoolExecutor(max_workers=min(n_jobs, len(jobs))) as pool:
        futures = [pool.submit(fn, job) for job in jobs]
        for i, _ in enumerate(as_completed(futures)):
            if progress:
                progress(i + 1, len(jobs))
        return [f.result() for f in futures]


def calibrated_rps(res: PolicyFigures) -> float:
    """What a saturated run completed per simulated second."""
    return res.completed_rps or 0.0


def sweep(jobs: list[SimJob], points: int, slo: SLO, n_jobs: int, progress, rates: list[float] | None) -> dict:
    """Calibrate each policy with every request arriving at once, then offer the union's rates to all."""
    if rates is None:
        calibration = pool_map(run_job, [replace(j, rate_rps=1e9) for j in jobs], n_jobs, progress)
        usable = [r for r in (calibrated_rps(PolicyFigures.model_validate(res)) for res, _, _ in calibration) if r > 0]
        if not usable:
            return {}
        rates = sweep_rates(usable, points)
    grid = [replace(j, rate_rps=r) for j in jobs for r in rates]
    results = pool_map(run_job, grid, n_jobs, progress)
    per_policy: dict[str, list[dict]] = {}
    for job, (res, frame, _) in zip(grid, results, strict=True):
        window = frame.arrival_s.max() if len(frame) else 1.0
        per_policy.setdefault(job.policy, []).append({
            "offered_rps": job.rate_rps, **request_metrics(frame, max(window, 1e-9), slo),
            "mean_running": res["mean_running"], "token_states_share": res["token_states_share"],
            "oom_total": res["oom_total"], "oom_fragmentation": res["oom_fragmentation"], "crashes": 0,
            # the operating point's figures as a bench point carries them; no engine samples: kv_usage_ci None
            **point_intervals(frame, pd.DataFrame(), max(window, 1e-9), f"{job.rate_rps:g}")})
    return {policy: capacity_block(pts, slo) for policy, pts in per_policy.items()}


def paper_placement(policy: str) -> str:
    """The arena placement the vLLM paper's baselines use for a policy (buddy for static-max and pow2)."""
    placement = entry(policy).placement
    if placement is None:
        raise ValueError(f"{policy} is not simulated; policies: {', '.join(policies())}")
    return placement


__all__ = ["StepModel", "paper_placement", "run_simulation"]
