"""`fragbench simulate --grid GRID.yaml`: capacity planning over a product of configurations.

A grid file is a mapping; each axis key (`model`, `gpu`, `dtype`, `kv_budget` or `gpu_util`, `policy`,
`block_size`, `alloc_conf`, `workload`) takes a value or a list, and the grid is their product. Each point is
one knee search at the SLO: a calibration (every request at once: what the configuration completes per
simulated second with its queue never empty, the most it can sustain), then the knee search bench runs
(harness/analysis/knee.KneeSearch, on the streams' rate grid), each rate a simulation of the same `requests`
requests re-timed to it; a rate above the calibration's misses whatever its requests' latencies (a finite burst
is absorbed, a steady stream is not). A point's row holds the rate it sustains, the bracket that rate lies in,
the Figure-2 shares and the OOMs (by layer) at its knee, and requests per GPU-hour. Rows are a pure function of
the point: where a point ran (serially, a local pool, a Ray worker) never changes its row, which is what lets a
grid resume from rows already written (harness/sim/gridrun.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from engines.kv_categories import CATEGORIES
from engines.memory.allocconf import AllocConfError, parse_alloc_conf
from engines.registry import entry, policies
from engines.shapes import DTYPE_BYTES, ModelNotFound, load_shape
from harness.analysis.capacity import SLO, capacity_block, request_metrics
from harness.analysis.knee import KneeSearch, knee_point
from harness.analysis.summary_records import PolicyFigures
from harness.gpus import GPUS, USD_PER_GPU_HOUR, gpu_preset
from harness.plan import headroom_at, make_plan
from harness.sim.roofline import StepModel
from harness.sim.simulator import SimJob, calibrated_rps, run_job
from harness.units import parse_size
from workloads.generate import has_shared_prefixes
from workloads.spec import SpecError, load_spec
from workloads.traces import TraceError, resolve

# Axes in the order of the table's columns. None: the axis' default when the file leaves it out (kv_budget
# and gpu_util are one axis spelled two ways: a fixed KV budget, or the share of the GPU the server takes).
AXES = {"model": None, "gpu": None, "dtype": "float16", "kv_budget": None, "gpu_util": 0.9, "policy": None,
        "block_size": 16, "alloc_conf": "arena", "workload": None}
REQUIRED = ("model", "gpu", "policy", "workload")
# Scalars shared by every point, with their defaults.
SCALARS = {"requests": 1000, "seed": 0, "slo_ttft": 2.0, "slo_tpot": 0.25, "slo_attainment": 0.9,
           "max_seq_len": None, "max_num_seqs": 256, "price_per_gpu_hour": None}
ARENA = "arena"  # the alloc_conf axis' value for the bookkeeping arena (no caching allocator emulated)
MAX_POINTS = 8  # rates per knee search, the calibration aside
KNEE_TOLERANCE = 0.15  # stop once the failing rate is within 15 % of the passing one (bench's default)


class GridError(ValueError):
    """A grid file the simulator cannot run, named by its key."""


@dataclass(frozen=True)
class GridPoint:
    """One configuration: every axis' value and the scalars, as the grid file gave them."""

    model: str
    gpu: str
    dtype: str
    kv_budget: str | None
    gpu_util: float | None
    policy: str
    block_size: int
    alloc_conf: str
    workload: str
    requests: int
    seed: int
    slo_ttft: float
    slo_tpot: float
    slo_attainment: float
    max_seq_len: int | None
    max_num_seqs: int

    def key(self) -> str:
        """What a row written for this point is found by when a grid resumes: any change of it is a new point."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]

    def slo(self) -> SLO:
        return SLO(self.slo_ttft, self.slo_tpot, self.slo_attainment)


@dataclass(frozen=True)
class Grid:
    points: list[GridPoint]
    prices: dict[str, float]  # USD per GPU-hour by GPU preset, the file's overrides applied


def load_grid(path: str | Path) -> Grid:
    """The grid file's points, every value checked as the CLI checks it; GridError names the key at fault."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise GridError(f"grid file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise GridError(f"grid file {path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise GridError(f"grid file {path}: a mapping of keys {', '.join(AXES)} is needed, not "
                        f"{type(doc).__name__}")
    known = set(AXES) | set(SCALARS)
    for key in doc:
        if key not in known:
            raise GridError(f"grid file {path}: unknown key {key!r} (keys: {', '.join([*AXES, *SCALARS])})")
    for key in REQUIRED:
        if doc.get(key) in (None, []):
            raise GridError(f"grid file {path}: key {key!r} is missing (a value or a list)")
    if doc.get("kv_budget") is not None and doc.get("gpu_util") is not None:
        raise GridError(f"grid file {path}: keys 'kv_budget' and 'gpu_util' both given: the KV budget is one or "
                        "the other")
    axes = {}
    for key, default in AXES.items():
        values = doc.get(key, default)
        if key == "gpu_util" and doc.get("kv_budget") is not None:
            values = None
        values = values if isinstance(values, list) else [values]
        if not values:
            raise GridError(f"grid file {path}: key {key!r} is an empty list")
        checked = [_checked(key, v, path) for v in values]
        if len(set(checked)) != len(checked):
            raise GridError(f"grid file {path}: key {key!r} repeats a value: {values}")
        axes[key] = checked
    scalars = {k: _scalar(k, doc.get(k, d), path) for k, d in SCALARS.items()}
    prices = _prices(scalars.pop("price_per_gpu_hour"), path)
    points = [GridPoint(**dict(zip(axes, combo, strict=True)), **scalars)
              for combo in itertools.product(*axes.values())]
    return Grid(points, prices)


def _checked(key: str, value, path) -> object:
    """One axis value as the point keeps it, or GridError naming the key."""
    def bad(why: str) -> GridError:
        return GridError(f"grid file {path}: key {key!r}: {why}")

    if value is None:
        if key == "kv_budget" or key == "gpu_util":
            return None
        raise bad("needs a value")
    try:
        if key == "model":
            load_shape(str(value))
            if Path(str(value)).is_dir():  # a model directory, found from any worker's directory
                return str(Path(str(value)).resolve())
        elif key == "gpu":
            if value not in GPUS:
                raise bad(f"unknown GPU {value!r} (presets: {', '.join(GPUS)})")
        elif key == "dtype":
            if value not in DTYPE_BYTES:
                raise bad(f"unknown dtype {value!r} ({', '.join(DTYPE_BYTES)})")
        elif key == "policy":
            if value not in policies() or entry(value).placement is None:
                simulated = [p for p in policies() if entry(p).placement is not None]
                raise bad(f"{value!r} is not a simulated policy ({', '.join(simulated)})")
        elif key == "workload":
            spec = load_spec(str(value))
            if spec.trace is not None:
                resolve(spec.trace.path)
            if Path(str(value)).is_file():  # a Ray worker runs in a directory of its own: the file, wherever from
                return str(Path(str(value)).resolve())
        elif key == "kv_budget":
            if parse_size(str(value)) <= 0:
                raise bad(f"a KV budget must be a positive size, not {value!r}")
            return str(value)
        elif key == "gpu_util":
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                raise bad(f"a share of GPU memory in (0, 1], not {value!r}")
            return float(value)
        elif key == "block_size":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(f"a positive number of tokens, not {value!r}")
        elif key == "alloc_conf" and value != ARENA:
            try:
                parse_alloc_conf(str(value))
            except AllocConfError as e:
                raise bad(str(e)) from None
    except (ModelNotFound, SpecError, TraceError, ValueError) as e:
        if isinstance(e, GridError):
            raise
        raise bad(str(e).splitlines()[0]) from None
    return value if key == "block_size" else str(value)


def _scalar(key: str, value, path):
    def bad(why: str) -> GridError:
        return GridError(f"grid file {path}: key {key!r}: {why}")

    if value is None or key == "price_per_gpu_hour":
        return value
    if isinstance(value, list):
        raise bad("one value for the whole grid, not a list")
    if key in ("requests", "max_seq_len", "max_num_seqs"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(f"a positive integer, not {value!r}")
    elif key == "seed":  # as `--seed` takes it (harness/cli/seeds.py): numpy refuses a negative one
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**63 - 1:
            raise bad(f"a whole number from 0 to 2**63 - 1, not {value!r}")
    else:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise bad(f"a positive finite number, not {value!r}")
        if key == "slo_attainment" and value > 1:
            raise bad(f"a share in (0, 1], not {value!r}")
        value = float(value)
    return value


def _prices(overrides, path) -> dict[str, float]:
    prices = dict(USD_PER_GPU_HOUR)
    if overrides is None:
        return prices
    if not isinstance(overrides, dict):
        raise GridError(f"grid file {path}: key 'price_per_gpu_hour': a mapping of GPU preset to USD per hour")
    for gpu, usd in overrides.items():
        if gpu not in GPUS:
            raise GridError(f"grid file {path}: key 'price_per_gpu_hour': unknown GPU {gpu!r}")
        if isinstance(usd, bool) or not isinstance(usd, int | float) or not 0 < usd < math.inf:
            raise GridError(f"grid file {path}: key 'price_per_gpu_hour': {gpu}: a positive price, not {usd!r}")
        prices[gpu] = float(usd)
    return prices


def point_plan(p: GridPoint):
    """The point's model, GPU, workload and plan; the plan's `fits` and `reason` say whether it can serve."""
    shape, gpu, spec = load_shape(p.model), gpu_preset(p.gpu), load_spec(p.workload)
    max_seq_len = p.max_seq_len or spec.max_seq_len or shape.max_seq_len
    if p.block_size > max_seq_len:  # never filled, its bytes past any budget (as the CLI's bounds.block_fits says)
        plan = make_plan(shape, gpu.memory_bytes, p.dtype, p.gpu_util or 1.0, max_seq_len, p.block_size)
        return shape, gpu, spec, replace(plan, fits=False, reason=f"a KV block of {p.block_size} tokens is longer "
                                         f"than one {max_seq_len}-token sequence")
    if p.kv_budget is None:
        return shape, gpu, spec, make_plan(shape, gpu.memory_bytes, p.dtype, p.gpu_util, max_seq_len, p.block_size)
    budget = parse_size(p.kv_budget)
    whole = make_plan(shape, gpu.memory_bytes, p.dtype, 1.0, max_seq_len, p.block_size)  # the most a GPU leaves
    kvb = whole.kv_bytes_per_token
    fits, reason = whole.fits and budget <= whole.kv_budget_bytes and budget >= max_seq_len * kvb, "fits"
    if budget > whole.kv_budget_bytes:
        reason = f"a KV budget of {p.kv_budget} exceeds the {whole.kv_budget_bytes} B the GPU leaves beside the weights"
    elif budget < max_seq_len * kvb:
        reason = f"a KV budget of {p.kv_budget} cannot hold one {max_seq_len}-token sequence"
    headroom = headroom_at(shape, p.dtype, max_seq_len, budget, whole.max_num_seqs)  # the engine's, at this budget
    plan = replace(whole, gpu_util=(budget + whole.weights_bytes + headroom) / gpu.memory_bytes,
                   activation_headroom_bytes=headroom, kv_budget_bytes=budget, max_live_tokens=budget // kvb,
                   static_max_concurrency=budget // (max_seq_len * kvb), fits=fits, reason=reason)
    return shape, gpu, spec, plan


def evaluate(p: GridPoint) -> dict:
    """The point's row: a calibration, then a knee search at the SLO. Pure: the same point, the same row."""
    shape, gpu, spec, plan = point_plan(p)
    row = {**{k: getattr(p, k) for k in (*AXES, "requests", "seed", "slo_ttft", "slo_tpot")}, "key": p.key(),
           "kv_budget_bytes": int(plan.kv_budget_bytes),
           "fits": bool(plan.fits), "reason": plan.reason}
    if not plan.fits:
        return {**row, **_empty_capacity()}
    memory = "arena" if p.alloc_conf == ARENA else "caching"
    job = SimJob(p.policy, plan, StepModel.of(shape, p.dtype, gpu), spec, p.seed, p.requests, shape.vocab_size,
                 has_shared_prefixes(spec), p.block_size, None, p.max_num_seqs, True, memory=memory,
                 alloc_conf=None if memory == "arena" else p.alloc_conf)
    slo = p.slo()
    calibration, _, _ = run_job(replace(job, rate_rps=1e9))
    start = calibrated_rps(PolicyFigures.model_validate(calibration))
    if start <= 0:
        return {**row, **_empty_capacity(), "calibrated_rps": 0.0}
    search = KneeSearch(start, slo.attainment, KNEE_TOLERANCE, max_points=MAX_POINTS)
    points = []
    while (rate := search.next_rate()) is not None:
        res, frame, _ = run_job(replace(job, rate_rps=rate))
        window = frame.arrival_s.max() if len(frame) else 1.0
        ooms = res["allocator"] or {}
        point = {"offered_rps": rate, **request_metrics(frame, max(window, 1e-9), slo),
                 **{k: res[k] for k in res if k.endswith("_share")}, "mean_running": res["mean_running"],
                 "oom_total": res["oom_total"], "oom_fragmentation": res["oom_fragmentation"],
                 # the arena has one layer: every OOM there is the policy's (the live KV did not fit)
                 "oom_policy": ooms.get("oom_policy", res["oom_total"]), "oom_allocator": ooms.get("oom_allocator", 0),
                 "preemptions": res["preemptions"], "crashes": 0}
        if rate > start:
            # past the rate it completes with a queue that never empties, a queue grows without bound however
            # well the `requests` offered fared (a short burst is absorbed): no steady state, so not sustained
            point["burst_attainment"], point["slo_attainment"] = point["slo_attainment"], 0.0
        search.record(rate, point["slo_attainment"])
        points.append(point)
    block = capacity_block(points, slo)
    sustained, where = float(block["sustained_rps"]), block["sustained_where"]
    if sustained > start:  # interpolated towards a rate that missed for being past saturation, not for latency
        sustained, where = float(start), "saturation"
    knee = knee_point(points, slo)
    lo, hi = search.bracket()
    return {**row, "calibrated_rps": float(start), "sustained_rps": sustained,
            "sustained_where": where, "sustained_lo_rps": lo, "sustained_hi_rps": hi,
            "knee_offered_rps": float(knee["offered_rps"]), "knee_slo_attainment": knee["slo_attainment"],
            **{k: float(v) for k, v in knee.items() if k.endswith("_share")},
            "knee_mean_running": float(knee["mean_running"]), "oom_policy": int(knee["oom_policy"]),
            "oom_allocator": int(knee["oom_allocator"]), "oom_fragmentation": int(knee["oom_fragmentation"]),
            "preemptions": int(knee["preemptions"]), "search_points": len(points),
            "requests_per_gpu_hour": 3600.0 * sustained}


def _empty_capacity() -> dict:
    """A point that cannot serve (or completed nothing): no capacity, the columns present all the same."""
    return {"calibrated_rps": None, "sustained_rps": 0.0, "sustained_where": "cannot serve", "sustained_lo_rps": None,
            "sustained_hi_rps": None, "knee_offered_rps": None, "knee_slo_attainment": None,
            **{f"{c}_share": None for c in CATEGORIES}, "knee_mean_running": None, "oom_policy": 0,
            "oom_allocator": 0, "oom_fragmentation": 0, "preemptions": 0, "search_points": 0,
            "requests_per_gpu_hour": 0.0}


__all__ = ["AXES", "Grid", "GridError", "GridPoint", "evaluate", "load_grid"]
