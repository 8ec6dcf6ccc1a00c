"""Capacity at an SLO, as the vLLM paper measures it (Figure 12): offered request rate against latency,
and the highest rate each engine sustains. One definition for bench and simulate.

A request meets the SLO when it completes with TTFT <= ttft_s and TPOT <= tpot_s; a rejected, OOM'd,
crashed or failed request misses it; a request the client itself cancelled (the workload's churn) is left
out. A request still in flight when the load generator's window closed is judged on what it showed: within
both limits so far, it meets the SLO; already past one (no first token after ttft_s, say), it misses; too
young to tell, it is left out. Without that, one slow reader sent near a window's end fails a rate for the
harness's cut-off, not the engine's speed. A rate is sustained when at least `attainment` of its requests
meet the SLO; between two measured rates the crossing is interpolated linearly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from engines.percentile import percentile
from workloads.outcome import UNFINISHED


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.25
    attainment: float = 0.9

    def to_json(self) -> dict:
        return asdict(self)


def _numeric(column: pd.Series) -> pd.Series:
    return pd.to_numeric(column, errors="coerce")


def _stream_within(rows: pd.DataFrame, slo: SLO) -> pd.Series:
    """A stream's first token and pace within both limits (a single token has no pace)."""
    return (_numeric(rows.ttft_s) <= slo.ttft_s) & (_numeric(rows.tpot_s).fillna(0.0) <= slo.tpot_s)


def _whole_allowed_s(tokens: pd.Series, slo: SLO) -> pd.Series:
    """When a stream of `tokens` within both limits would have ended: TTFT + TPOT x (tokens - 1)."""
    return slo.ttft_s + slo.tpot_s * (_numeric(tokens).fillna(1).clip(lower=1) - 1)


def meets_slo(ok: pd.DataFrame, slo: SLO) -> pd.Series:
    """Of completed requests: within both limits. A whole (non-streamed) answer shows neither TTFT nor TPOT,
    only when it ended: it meets the SLO if it ended no later than a stream within both limits would have."""
    whole = _numeric(ok.e2e_s) <= _whole_allowed_s(ok.output_tokens, slo)
    return _stream_within(ok, slo).where(_numeric(ok.ttft_s).notna(), whole)


def cut_off_verdicts(cut: pd.DataFrame, slo: SLO) -> pd.Series:
    """Requests in flight when the window closed: True (within both limits so far), False (already past
    one), NA (too young to tell). A stream is judged by its first token and pace; a whole answer by how
    long it has waited against what the SLO allows its target length."""
    target = cut.get("output_tokens_target", cut.output_tokens)
    allowed = np.where(cut.get("stream", True).astype(bool), slo.ttft_s, _whole_allowed_s(target, slo))
    by_wait = (_numeric(cut.e2e_s) <= allowed).map({True: pd.NA, False: False})  # past its allowance: missed
    return _stream_within(cut, slo).astype(object).where(_numeric(cut.ttft_s).notna(), by_wait)


def judged_verdicts(req: pd.DataFrame, slo: SLO) -> pd.Series:
    """Of the requests a point judges, each one's verdict (True met the SLO), in the rows' order: cancellations
    left out, a request cut off by the window judged on what it showed (too young to tell: left out), every
    other failure a miss."""
    judged = req[req.status != "cancelled"]
    verdict = pd.Series(False, index=judged.index, dtype=object)
    if "error" in judged:
        cut = (judged.status == "error") & (judged.error == UNFINISHED)
        verdict[cut] = cut_off_verdicts(judged[cut], slo)
    ok = judged.status == "ok"
    verdict[ok] = meets_slo(judged[ok], slo)
    return verdict[verdict.notna()].astype(bool)


def request_metrics(req: pd.DataFrame, window_s: float, slo: SLO) -> dict:
    """The client-side figures of one point: `req` has status, ttft_s, tpot_s, e2e_s, output_tokens (and,
    from the load generator, error, stream and output_tokens_target for requests cut off by its window)."""
    verdict = judged_verdicts(req, slo)
    ok = req[req.status == "ok"]
    met = meets_slo(ok, slo)
    per_token = pd.to_numeric(ok.e2e_s, errors="coerce") / pd.to_numeric(ok.output_tokens, errors="coerce")
    per_token = per_token[np.isfinite(per_token)]
    return {
        "requests": int(len(verdict)),
        "achieved_rps": len(ok) / window_s,
        "goodput_rps": float(met.sum()) / window_s,
        "slo_attainment": float(verdict.sum()) / len(verdict) if len(verdict) else None,
        "ttft_p50_s": percentile(ok.ttft_s, 0.5), "ttft_p99_s": percentile(ok.ttft_s, 0.99),
        "tpot_p50_s": percentile(ok.tpot_s, 0.5), "tpot_p99_s": percentile(ok.tpot_s, 0.99),
        "normalized_latency_s_per_token": float(per_token.mean()) if len(per_token) else None,
    }


def sustained_rate(points: list[dict], slo: SLO) -> tuple[float, str]:
    """The highest offered rate meeting the SLO, and where it lies: 'within' the measured rates, 'beyond'
    the last (a lower bound), or 'below' the first (interpolated from an ideal server at rate 0)."""
    pts = sorted((p["offered_rps"], p["slo_attainment"] or 0.0) for p in points)
    prev_rate, prev_att = 0.0, 1.0
    for rate, att in pts:
        if att < slo.attainment:
            frac = (prev_att - slo.attainment) / (prev_att - att) if prev_att > att else 0.0
            where = "below" if prev_rate == 0.0 else "within"
            return prev_rate + frac * (rate - prev_rate), where
        prev_rate, prev_att = rate, att
    return prev_rate, "beyond"


def sweep_rates(calibrated_rps: list[float], points: int) -> list[float]:
    """`points` offered rates, geometric, from under the slowest engine's saturation to past the fastest
    one's, every engine at the same rates (the simulator's sweep; bench searches each engine's knee)."""
    hi = 1.5 * max(calibrated_rps)
    lo = 0.3 * min(calibrated_rps)
    if points == 1:
        return [round(hi, 3)]
    return [round(lo * (hi / lo) ** (i / (points - 1)), 3) for i in range(points)]


def capacity_block(points: list[dict], slo: SLO) -> dict:
    rate, where = sustained_rate(points, slo)
    return {"sustained_rps": rate, "sustained_where": where, "slo": slo.to_json(),
            "points": sorted(points, key=lambda p: p["offered_rps"])}



class SweepRefused(ValueError):
    """Settings that cannot make a capacity sweep, named as the user gave them."""


def check_sweep(slo_ttft_s: float, slo_tpot_s: float, attainment: float, point_s: float | None,
                calibrate_s: float | None, warmup_s: float | None, sweeping: bool, closed_loop: bool,
                workload: str, search_s: float | None = None, tolerance: float | None = None,
                time_s: float | None = None, precision: float | None = None) -> None:
    for flag, value in (("slo-ttft", slo_ttft_s), ("slo-tpot", slo_tpot_s), ("point-duration", point_s),
                        ("calibrate-duration", calibrate_s), ("time", time_s), ("search-time", search_s)):
        if value is not None and not 0 < value < float("inf"):
            raise SweepRefused(f"--{flag} must be a positive number of seconds, not {value}")
    if precision is not None and not 1 < precision < float("inf"):
        raise SweepRefused(f"--precision is the ratio interval's hi / lo asked: a number above 1, not {precision}")
    if not 0 < attainment <= 1:
        raise SweepRefused(f"--slo-attainment must be in (0, 1], not {attainment}")
    if not sweeping:
        return
    if point_s is not None and warmup_s is not None and point_s <= warmup_s:
        raise SweepRefused(f"--point-duration {point_s} s is not longer than the warm-up of {warmup_s} s")
    if closed_loop:
        raise SweepRefused(f"--sweep: workload {workload} is closed-loop; it has no arrival rate to sweep")
    if search_s is not None and point_s is not None and not point_s <= search_s < float("inf"):
        raise SweepRefused(f"--search-time {search_s} s is too short for one point of --point-duration {point_s} s")
    if tolerance is not None and not 0 < tolerance < float("inf"):
        raise SweepRefused(f"--knee-tolerance must be a positive number, not {tolerance}")
