"""How long a bench will take, said before it starts: from its flags alone, an estimate (a server's start and the
probes between phases are not flags; a knee search stops when the time budget is spent)."""

from __future__ import annotations

from harness.run.config import BenchConfig

START_S = 20.0  # per engine and budget: a server's start (torch, the model), its probes, its stop: a CPU's typical
RATE_POINT_S = 20.0  # --rates' seconds per point where --point-duration is not given


def duration_estimate(cfg: BenchConfig) -> str:
    """One line: the estimate in seconds and how it was computed."""
    runs = len(cfg.engines) * (len(cfg.kv_budgets) or 1) + len(cfg.targets)  # a target: one more engine
    alloc = f" (and again for each of {len(cfg.compare_alloc_confs)} --compare-alloc-conf)" \
        if cfg.compare_alloc_confs else ""
    if cfg.sweep and not cfg.rates:
        return (f"estimate: about {cfg.time_s:.0f} s{alloc}: a knee search spends --time ({cfg.time_s:g} s) across "
                f"{runs} engine-budget run(s), then the run's twin is simulated (seconds to minutes)")
    if cfg.rates:
        point = cfg.point_s or RATE_POINT_S
        total = runs * (START_S + len(cfg.rates) * point + cfg.grace_s)
        return (f"estimate: about {total:.0f} s{alloc} = {runs} engine-budget run(s) x (~{START_S:g} s start and "
                f"probes + {len(cfg.rates)} rates x {point:g} s a point + up to {cfg.grace_s:g} s --grace)")
    total = runs * (START_S + cfg.duration_s + cfg.grace_s)
    return (f"estimate: about {total:.0f} s{alloc} = {runs} engine(s) x (~{START_S:g} s start and probes + "
            f"{cfg.duration_s:g} s --duration + up to {cfg.grace_s:g} s --grace); --duration is each engine's churn, "
            "not the run's length")
