"""How much of a stream's effect do two engines share (issue 71, "Where the width comes from")? From one recorded
run's twins (harness/sim/twin.py), paged and static-oracle are each offered the same fresh streams at their own
knees, and at 0.85x and 1.15x of them; each point judged as a decision point is: the warm-up rule, then the first
`--judged` requests past it.

Run by hand:  .venv/bin/python benchmarks/pairing_study.py RUN_DIR [--streams 200] [--judged 25] [--json]

The fit's model (harness/analysis/kneefit.py) gives a point's requests p = sigmoid(logit(t) - b (log r + u - log
knee)), u ~ N(0, s^2) per stream. Paired streams narrow a ratio of knees by how far the two engines' u correlate
(rho). Printed, per engine: the attainment at each rate, the spread of per-stream logit attainment, b and s fitted
by that model (u integrated out by Gauss-Hermite; the three rates of a stream share its u), and how much of the
stream effect the stream's token demand x explains; between the engines: rho of the per-stream effects (clipped
logits, each stream's mean over its three rates less the rates' means) with a 90 % bootstrap interval over
streams, the same at the knee alone, rho of what x leaves, and rho on the model's scale (the bivariate random
effect, the binomial draw taken out).

Demand x: log of the mean of prompt_tokens + max_tokens * n (as the requests state it, before any cancellation)
over the point's judged requests ("judged"), or over every request of the point up to its last judged one, warm-up
included ("window"), less the log of the workload's mean; and "load": the tokens asked a second over that window
per request a second offered (the window's demand times how much faster its requests came than the rate: a burst
counts), less the same log. A stream's x is its mean over its rates.

The knee each engine is offered: its twin's own knee at the run's budget (`twin.curve_point`, a knee search on the
grid's streams judged on 400 requests), or with `--knee measured` the run's summary.json `sustained_rps`.

Found (run 20261206-194613-mixed-churn: tiny-llama, 16MiB, `bench --sweep --time 240`; 200 streams, 25 judged,
96 s on one busy core): rho on the model's scale 0.64 [0.53, 0.74] (0.62 [0.54, 0.69] at 0.7/1/1.4x), of the
clipped-logit effects 0.40 [0.33, 0.48], at the knee alone 0.28 [0.20, 0.36]. Token demand alone explains little
(R^2 <= 0.08); the offered token load, which carries the window's bursts, 0.34 (paged) and 0.42 (static-oracle),
and the effects' correlation left after it is 0.11 [0.00, 0.20]: what the engines share is mostly the load a
stream's window offers. At the twin's knee a 25-request point from a cold start meets 95 % (paged), not 90 %:
the knee search judged 400 requests, the queue by then longer. Static-oracle's attainment hardly moves with rate
(0.92/0.90/0.87 over 0.85-1.15x; b about 1.8): its misses are fragmentation OOMs at every load, so its s in log
rate (0.4) is large where its logit spread (0.85) is not.

On one scale (issue 79): the model fitted with the offered token load as a covariate (`fit_load`, `explained_model`,
`rho_model_residual_load`). On the twins of a fresh-clone run of be5c217 (120 streams, 25 judged, `--boot-model 50`)
the load explained 68 % (paged) and 58 % (static-oracle) of the shift on the model's scale and what it left
correlated 0.76 [0.63, 0.90], beside 0.57 [0.48, 0.67] without the covariate: figures that do not add up where
static-oracle's curve is this flat (docs/method.md, "Pairing").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
from scipy.optimize import minimize, minimize_scalar
from scipy.special import log_expit, logsumexp

from harness.analysis.capacity import SLO
from harness.analysis.records import RunRecord
from harness.sim.simulator import pool_map
from harness.sim.stepfit import FittedStepModel, run_steps
from harness.sim.twin import CurveJob, TwinEngine, curve_point, stream_verdicts, twins_of
from workloads.generate import TraceRequest, has_shared_prefixes
from workloads.spec import load_spec
from workloads.streams import stream

ENGINES = ("paged", "static-oracle")
MULTIPLES = (0.85, 1.0, 1.15)  # the rates each stream is offered, as multiples of the engine's knee
SEED = 20261206
BOOT = 2000  # bootstrap resamples of the empirical correlations
BOOT_MODEL = 200  # of the model-scale rho (each one an optimization)
NODES = 40  # Gauss-Hermite nodes for one stream effect; the bivariate one uses NODES_2D squared
NODES_2D = 24
DEMAND_SAMPLE = 20_000  # requests of a stream of its own that give the workload's mean demand
MAX_SENT = 4000  # a stream's requests simulated at most for one point (an overloaded engine's warm-up grows)


@dataclass(frozen=True)
class StreamJob:
    """One engine offered one stream at its rates: what a process simulates."""

    twin: TwinEngine
    key: str
    rates: tuple[float, ...]
    judged: int
    slo: SLO
    budget_bytes: int
    workload: str
    seed: int
    max_seq_len: int


@dataclass(frozen=True)
class Judgement:
    """One point: its met and judged counts and its demand (mean tokens asked) over two spans of requests."""

    met: int
    judged: int
    demand_judged: float
    demand_window: float
    load_window: float  # tokens asked a second over the window, per request a second offered: demand x burst


def demand(r: TraceRequest) -> int:
    return len(r.prompt_ids) + r.max_tokens * r.n


def judge(job: StreamJob, rate: float) -> Judgement:
    """The stream from its first request at `rate`, the warm-up rule of the twin's curve points (one p90 E2E
    latency of its finished requests), then the first `judged` verdicts past it; the stream is simulated on past
    its last judged request (a point's tail keeps arriving while its judged requests run), more of it where the
    warm-up took too much."""
    tail = max(10, job.judged // 2)
    reqs, verdict = stream_verdicts(job.twin, job.workload, job.seed, job.max_seq_len, job.key, rate,
                                    job.budget_bytes, job.slo, job.judged + tail, MAX_SENT)
    mine = verdict.iloc[: job.judged]
    last = int(mine.index.max()) if len(mine) else 0
    window = [demand(r) for r in reqs[: last + 1]]
    span = max(reqs[last].arrival_s, 1e-9)  # the stream's first request arrives at 0
    return Judgement(int(mine.sum()), len(mine), float(np.mean([demand(reqs[i]) for i in mine.index] or [0])),
                     float(np.mean(window)), float(sum(window[1:]) / span / rate))


def run_stream(job: StreamJob) -> list[Judgement]:
    return [judge(job, rate) for rate in job.rates]


def mean_demand(workload: str, seed: int, max_seq_len: int) -> float:
    """The workload's mean tokens asked a request, from a stream no point is offered."""
    reqs = islice(stream(load_spec(workload), seed, "pairing-demand", max_seq_len, token_ids=False), DEMAND_SAMPLE)
    return float(np.mean([demand(r) for r in reqs]))


# -- the figures ------------------------------------------------------------------------------------------------


def clipped_logit(met: np.ndarray, n: np.ndarray) -> np.ndarray:
    """logit of (met + 0.5) / (n + 1): finite at 0 and at n met."""
    return np.log((met + 0.5) / (n - met + 0.5))


def stream_effects(met: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per stream (rows), its clipped logits' mean over the rates (columns), less the rates' means: what the
    stream adds at every rate, with three points' draws behind it."""
    lg = clipped_logit(met, n)
    return (lg - lg.mean(axis=0)).mean(axis=1)


def corr(a: np.ndarray, b: np.ndarray) -> float:
    if a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def boot_interval(stat, n: int, rng: np.random.Generator, draws: int = BOOT) -> tuple[float, float]:
    """The central 90 % of `stat(index)` over resamples of the streams."""
    values = np.array([stat(rng.integers(0, n, n)) for _ in range(draws)])
    values = values[np.isfinite(values)]
    if not len(values):
        return (float("nan"), float("nan"))
    return float(np.quantile(values, 0.05)), float(np.quantile(values, 0.95))


def residuals(y: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, float]:
    """y less its least-squares line on x, and the line's R^2."""
    X = np.column_stack([np.ones_like(x), x])
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    res = y - X @ coef
    ss = float(((y - y.mean()) ** 2).sum())
    return res, (1 - float((res ** 2).sum()) / ss) if ss > 0 else float("nan")


def point_loglik(met: np.ndarray, n: np.ndarray, eta: np.ndarray) -> np.ndarray:
    """Binomial log-likelihood (no constant) of counts at linear predictor eta; broadcasts over trailing nodes."""
    return met * log_expit(eta) + (n - met) * log_expit(-eta)


@dataclass(frozen=True)
class Marginal:
    """One engine's fit of the kneefit model to its streams: logit attainment a at its knee rate, slope b, spread s
    and, where the stream's offered token load x is given, its gain g (the stream's shift in log load is g x + u)."""

    a: float
    b: float
    s: float
    g: float = 0.0


def fit_marginal(met: np.ndarray, n: np.ndarray, z: np.ndarray, x: np.ndarray | None = None) -> Marginal:
    """Maximum likelihood of (a, b, s) and, with the streams' loads x, g: streams x rates counts at log(rate /
    knee) z, u integrated out."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(NODES)
    log_w = np.log(weights / weights.sum())
    load = np.zeros(len(met)) if x is None else np.asarray(x, dtype=float)

    def nll(theta: np.ndarray) -> float:
        a, b, s = theta[0], math.exp(theta[1]), math.exp(theta[2])
        g = theta[3] if x is not None else 0.0
        eta = a - b * (z[None, :, None] + g * load[:, None, None] + s * nodes[None, None, :])
        ll = point_loglik(met[:, :, None], n[:, :, None], eta).sum(axis=1)
        return -float(logsumexp(ll + log_w, axis=1).sum())

    starts = [np.array([2.0, math.log(b0), math.log(0.1), *([0.5] if x is not None else [])]) for b0 in (5.0, 25.0)]
    best = min((minimize(nll, t0, method="Nelder-Mead", options={"xatol": 1e-4, "fatol": 1e-6, "maxiter": 6000})
                for t0 in starts), key=lambda r: r.fun)
    return Marginal(float(best.x[0]), math.exp(best.x[1]), math.exp(best.x[2]),
                    float(best.x[3]) if x is not None else 0.0)


def model_rho(fits: tuple[Marginal, Marginal], counts: tuple[tuple[np.ndarray, np.ndarray], ...],
              zs: tuple[np.ndarray, np.ndarray], xs: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """rho of the two engines' stream effects on the model's scale: each engine's (a, b, s, g) as fitted alone, the
    pair (u1, u2) bivariate normal, integrated on a product Gauss-Hermite grid, rho by maximum likelihood. With
    the streams' loads `xs` (and gains fitted on them) u is what the load leaves: the residual correlation the
    knee fit's pairing rests on (issue 79)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(NODES_2D)
    log_w = np.log(weights / weights.sum())
    lw2 = log_w[:, None] + log_w[None, :]

    def per_engine(i: int, u: np.ndarray) -> np.ndarray:  # streams x u's shape
        f, (met, n), z = fits[i], counts[i], zs[i]
        shift = z[None, :] + (f.g * xs[i][:, None] if xs is not None else 0.0)  # streams x rates
        eta = f.a - f.b * (np.broadcast_to(shift, met.shape).reshape(met.shape + (1,) * u.ndim) + u[None, None])
        return point_loglik(met.reshape(met.shape + (1,) * u.ndim), n.reshape(n.shape + (1,) * u.ndim),
                            eta).sum(axis=1)

    ll1 = per_engine(0, fits[0].s * nodes)[:, :, None]  # streams x node1 x 1

    def nll(rho: float) -> float:
        u2 = fits[1].s * (rho * nodes[:, None] + math.sqrt(1 - rho * rho) * nodes[None, :])
        total = ll1 + per_engine(1, u2) + lw2
        return -float(logsumexp(total.reshape(total.shape[0], -1), axis=1).sum())

    return float(minimize_scalar(nll, bounds=(-0.99, 0.99), method="bounded", options={"xatol": 1e-3}).x)


@dataclass(frozen=True)
class EngineData:
    """One engine's points: streams x rates."""

    knee_rps: float
    rates: np.ndarray
    met: np.ndarray
    n: np.ndarray
    x_judged: np.ndarray  # per stream: its demand over the judged requests, log relative to the workload's
    x_window: np.ndarray
    x_load: np.ndarray  # its offered token load over the window, log relative to the workload's at that rate

    @property
    def z(self) -> np.ndarray:
        return np.log(self.rates / self.knee_rps)


def engine_figures(d: EngineData) -> tuple[dict, Marginal, Marginal]:
    lg = clipped_logit(d.met, d.n)
    effect = stream_effects(d.met, d.n)
    knee = int(np.argmin(np.abs(d.z)))
    fit = fit_marginal(d.met, d.n, d.z)
    with_load = fit_marginal(d.met, d.n, d.z, d.x_load)
    out = {"knee_rps": d.knee_rps, "rates_rps": [round(float(r), 4) for r in d.rates],
           "attainment": [round(float(d.met[:, j].sum() / d.n[:, j].sum()), 4) for j in range(len(d.rates))],
           "sd_logit": [round(float(lg[:, j].std(ddof=1)), 4) for j in range(len(d.rates))],
           "sd_effect": round(float(effect.std(ddof=1)), 4),
           "all_met_share": [round(float((d.met[:, j] == d.n[:, j]).mean()), 4) for j in range(len(d.rates))],
           "fit": {"a": round(fit.a, 4), "b": round(fit.b, 3), "s": round(fit.s, 4)},
           "s_from_sd": round(float(lg[:, knee].std(ddof=1)) / fit.b, 4),
           # the model with the offered token load as a covariate: the stream's shift is g x + u, u what it leaves
           "fit_load": {"a": round(with_load.a, 4), "b": round(with_load.b, 3), "s": round(with_load.s, 4),
                        "g": round(with_load.g, 4)},
           "explained_model": round(explained(with_load, float(d.x_load.var())), 4)}
    for name, x in (("judged", d.x_judged), ("window", d.x_window), ("load", d.x_load)):
        out[f"r2_x_{name}"] = round(residuals(effect, x)[1], 4)
        out[f"sd_x_{name}"] = round(float(x.std(ddof=1)), 4)
    return out, fit, with_load


def explained(f: Marginal, var_x: float) -> float:
    """The share of the stream's shift in log load that its offered token load explains, on the model's scale."""
    shown = f.g ** 2 * var_x
    return shown / (shown + f.s ** 2) if shown + f.s ** 2 > 0 else 0.0


def pair_figures(a: EngineData, b: EngineData, fits: tuple[Marginal, Marginal], seed: int,
                 load_fits: tuple[Marginal, Marginal] | None = None, boot_draws: int = BOOT_MODEL) -> dict:
    ea, eb = stream_effects(a.met, a.n), stream_effects(b.met, b.n)
    ka, kb = int(np.argmin(np.abs(a.z))), int(np.argmin(np.abs(b.z)))
    la, lb = clipped_logit(a.met[:, ka], a.n[:, ka]), clipped_logit(b.met[:, kb], b.n[:, kb])
    ra, rb = residuals(ea, a.x_window)[0], residuals(eb, b.x_window)[0]
    qa, qb = residuals(ea, a.x_load)[0], residuals(eb, b.x_load)[0]
    rng = np.random.default_rng(seed)
    n = len(ea)
    out = {}
    for name, (u, v) in (("rho_effect", (ea, eb)), ("rho_at_knee", (la, lb)), ("rho_residual_x_window", (ra, rb)),
                         ("rho_residual_x_load", (qa, qb))):
        out[name] = {"rho": round(corr(u, v), 4),
                     "ci90": [round(x, 4) for x in boot_interval(lambda i, u=u, v=v: corr(u[i], v[i]), n, rng)]}
    counts = ((a.met, a.n), (b.met, b.n))
    rho = model_rho(fits, counts, (a.z, b.z))

    def boot_model(i: np.ndarray) -> float:
        return model_rho(fits, ((a.met[i], a.n[i]), (b.met[i], b.n[i])), (a.z, b.z))

    out["rho_model"] = {"rho": round(rho, 4), "ci90": [round(x, 4) for x in boot_interval(boot_model, n, rng,
                                                                                            boot_draws)],
                        "note": "marginals (a, b, s) held at their full-sample fits in the bootstrap"}
    if load_fits is not None:  # one scale: the model's, with the load covariate (what kneefit's pairing rests on)
        xs = (a.x_load, b.x_load)
        left = model_rho(load_fits, counts, (a.z, b.z), xs)

        def boot_left(i: np.ndarray) -> float:
            return model_rho(load_fits, ((a.met[i], a.n[i]), (b.met[i], b.n[i])), (a.z, b.z), (xs[0][i], xs[1][i]))

        out["rho_model_residual_load"] = {
            "rho": round(left, 4), "ci90": [round(x, 4) for x in boot_interval(boot_left, n, rng, boot_draws)],
            "note": "what the offered token load leaves (each engine's shift g x + u, u bivariate normal); "
                    "marginals (a, b, s, g) held at their full-sample fits in the bootstrap"}
    out["corr_x_window"] = round(corr(a.x_window, b.x_window), 4)
    out["corr_x_load"] = round(corr(a.x_load, b.x_load), 4)
    return out


# -- the run ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Study:
    """What one study simulates: the two twins, the knee each is offered, the workload's streams."""

    twins: dict[str, TwinEngine]
    knees: dict[str, float]
    slo: SLO
    budget_bytes: int
    workload: str
    seed: int
    max_seq_len: int


def run_knees(study_twins: dict[str, TwinEngine], meta: RunRecord, measured: dict[str, float], which: str,
              jobs: int) -> dict[str, float]:
    """Each engine's knee: its twin's own search at the run's budget (from the measured rate), or the measured."""
    if which == "measured":
        return dict(measured)
    cfg = meta.config
    max_seq_len = cfg.max_seq_len if cfg.has("max_seq_len") else 2048
    curve_jobs = [CurveJob(t, max(measured.get(e, 1.0), 0.05), cfg.slo, cfg.budget.bytes, cfg.workload, cfg.seed,
                           max_seq_len) for e, t in study_twins.items()]
    return {e: float(p["sustained_rps"]) for e, p in zip(study_twins, pool_map(curve_point, curve_jobs, jobs),
                                                          strict=True)}


def simulate(study: Study, streams: int, judged: int, jobs: int,
             multiples: tuple[float, ...] = MULTIPLES) -> dict[str, EngineData]:
    """Every engine on streams p0 .. p{streams-1} at its knee's multiples: the same requests for both."""
    mean = mean_demand(study.workload, study.seed, study.max_seq_len)
    work = [StreamJob(twin, f"p{i}", tuple(study.knees[e] * m for m in multiples), judged, study.slo,
                      study.budget_bytes, study.workload, study.seed, study.max_seq_len)
            for e, twin in study.twins.items() for i in range(streams)]
    results = iter(pool_map(run_stream, work, jobs))
    out = {}
    for e in study.twins:
        rows = [next(results) for _ in range(streams)]
        out[e] = EngineData(study.knees[e], np.array([study.knees[e] * m for m in multiples]),
                            np.array([[j.met for j in r] for r in rows], dtype=float),
                            np.array([[j.judged for j in r] for r in rows], dtype=float),
                            np.log(np.array([[j.demand_judged for j in r] for r in rows]).mean(axis=1) / mean),
                            np.log(np.array([[j.demand_window for j in r] for r in rows]).mean(axis=1) / mean),
                            np.log(np.array([[j.load_window for j in r] for r in rows]).mean(axis=1) / mean))
    return out


def figures(data: dict[str, EngineData], seed: int = SEED, boot_draws: int = BOOT_MODEL) -> dict:
    """The study's one object: per engine its spreads and fit, and the pair's correlations."""
    engines, fits, load_fits = {}, [], []
    for e, d in data.items():
        figs, fit, with_load = engine_figures(d)
        engines[e] = figs
        fits.append(fit)
        load_fits.append(with_load)
    a, b = data.values()
    return {"engines": engines, "pair": pair_figures(a, b, (fits[0], fits[1]), seed, (load_fits[0], load_fits[1]),
                                                     boot_draws)}


def study_of(run_dir: Path, knee: str, jobs: int) -> Study:
    meta = RunRecord.read(run_dir)
    cfg = meta.config
    summary = json.loads((run_dir / "summary.json").read_text())
    measured = {e: float(c["sustained_rps"]) for e, c in summary.get("capacity", {}).items()
                if c.get("sustained_rps")}
    shared = has_shared_prefixes(load_spec(cfg.workload))
    twins = twins_of(meta, run_steps(run_dir), shared) or summary_twins(summary, shared)
    missing = [e for e in ENGINES if e not in twins]
    if missing:
        raise SystemExit(f"{run_dir}: no twin for {', '.join(missing)} (no steps or no engine_config)")
    twins = {e: twins[e] for e in ENGINES}
    max_seq_len = cfg.max_seq_len if cfg.has("max_seq_len") else 2048
    return Study(twins, run_knees(twins, meta, measured, knee, jobs), cfg.slo, cfg.budget.bytes, cfg.workload,
                 cfg.seed, max_seq_len)


def summary_twins(summary: dict, shared: bool) -> dict[str, TwinEngine]:
    """The twins summary.json recorded (each engine's step model and configuration): a run kept without its
    steps (a fresh clone's, its summary and run.json copied) is still studied on the same twins."""
    return {e: TwinEngine(e, t["config"], FittedStepModel(t["step_model"]["coefficients"],
                                                          t["step_model"].get("fit_r2"), t["step_model"].get("rows", 0),
                                                          t["step_model"].get("source", "summary.json")), shared)
            for e, t in (summary.get("twin") or {}).items() if t.get("config") and t.get("step_model")}


def print_table(out: dict) -> None:
    print(f"{out['streams']} streams, {out['judged']} judged a point, at {'/'.join(map(str, out['multiples']))} x "
          f"each engine's knee ({out['knee_from']}'s)")
    print(f"{'engine':<14} {'knee':>6}  {'attainment':<15} {'all met':<15} {'sd logit':<15} {'b':>5} {'s':>6} "
          f"{'sd/b':>6}  R2 on x: judged window load")
    for e, f in out["engines"].items():
        att, full, sd = ("/".join(f"{v:.2f}" for v in f[k]) for k in ("attainment", "all_met_share", "sd_logit"))
        print(f"{e:<14} {f['knee_rps']:6.3f}  {att:<15} {full:<15} {sd:<15} {f['fit']['b']:5.1f} {f['fit']['s']:6.3f} "
              f"{f['s_from_sd']:6.3f}  {f['r2_x_judged']:.3f} {f['r2_x_window']:.3f} {f['r2_x_load']:.3f}")
    for e, f in out["engines"].items():
        fl = f["fit_load"]
        print(f"{e:<14} with the load covariate: b {fl['b']:.1f}, s {fl['s']:.3f}, g {fl['g']:.2f}; the load explains "
              f"{100 * f['explained_model']:.0f} % of the stream's shift on the model's scale")
    for name, r in out["pair"].items():
        if isinstance(r, dict):
            print(f"{name:<24} {r['rho']:+.3f} [{r['ci90'][0]:+.3f}, {r['ci90'][1]:+.3f}]")
        else:
            print(f"{name:<24} {r:+.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--judged", type=int, default=25, help="judged requests a point (a decision point's)")
    ap.add_argument("--knee", choices=("twin", "measured"), default="twin")
    ap.add_argument("--multiples", default=",".join(map(str, MULTIPLES)), help="rates offered, x each knee")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=SEED, help="the bootstraps' seed")
    ap.add_argument("--boot-model", type=int, default=BOOT_MODEL,
                    help="bootstrap resamples of each model-scale rho (each one an optimization)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    study = study_of(args.run_dir, args.knee, args.jobs)
    multiples = tuple(float(m) for m in args.multiples.split(","))
    out = {"run": str(args.run_dir), "streams": args.streams, "judged": args.judged, "knee_from": args.knee,
           "multiples": multiples,
           **figures(simulate(study, args.streams, args.judged, args.jobs, multiples), args.seed,
                      args.boot_model)}
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
