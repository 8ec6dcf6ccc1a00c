"""Saturation throughput, beside the headline and never instead of it (docs/method.md, "Saturation throughput
beside the headline"): each headline engine serves one fixed request set offered all at once, as `vllm bench
throughput` does, on `repeats` fresh sets, the engines' order alternating (ABBA); per engine its output tokens/s and
requests/s, and paged / rival as a paired ratio (a t interval over the pairs' log ratios). The rules (set size,
repetitions, the share of `--time`) live here; harness/run/saturation_runs.py measures, this module judges."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from harness.analysis.saturation_summary import SaturationBlock, SaturationEngine, SaturationSet
from harness.analysis.summary_records import Summary
from harness.results import read_journals, read_rows

JOURNAL = "saturation.jsonl"  # one row a set, written by harness/run/saturation_runs.py as each set ends
SHARE_OF_TIME = 0.25  # of --time, held back from the search and the decision for the sets
SET_TARGET_S = 20.0  # a set's size: this long on the slower engine at its calibrated rate
MIN_REQUESTS, MAX_REQUESTS = 8, 256
SET_OVERHEAD_S = 8.0  # a set's load generator start (run/calibration.LOADGEN_STARTUP_S), its tail, its drain
RESTART_S = 12.0  # a server's start and warm-up (ABBA: one start per two sets)
MIN_REPEATS, MAX_REPEATS = 2, 6  # a t interval needs two pairs; six keep the share bounded on a long --time
LEVEL = 0.9  # the paired interval's level, the headline's
DEFINITION = ("saturation throughput (vLLM's `benchmarks/benchmark_throughput.py`): one fixed request set offered "
              "all at once, the completed requests' output tokens (and the completed requests) over the wall time "
              "from the first submission to the last completion; a failed request's tokens reach no user and count "
              "for nothing, so an engine that fails requests to finish sooner gains nothing by it")


def set_cost_s(set_s: float = SET_TARGET_S) -> float:
    """What one set costs the bench: its time flat out, its load generator, half a server start."""
    return set_s + SET_OVERHEAD_S + RESTART_S / 2


def repeats_by_rule(time_s: float) -> int:
    """Pairs of sets that fit SHARE_OF_TIME of the run's time, at most MAX_REPEATS; 0 (none run) under
    MIN_REPEATS."""
    fit = int(SHARE_OF_TIME * time_s // (2 * set_cost_s()))
    return min(fit, MAX_REPEATS) if fit >= MIN_REPEATS else 0


def reserve_s(repeats: int) -> float:
    """The bench's time held back for `repeats` pairs of sets (and the last server start)."""
    return repeats * 2 * set_cost_s() + RESTART_S if repeats else 0.0


def set_size(calibrated_rps: list[float]) -> int:
    """Requests in a set: SET_TARGET_S at the slower engine's calibrated rate, within [MIN_REQUESTS,
    MAX_REQUESTS]."""
    slowest = min((r for r in calibrated_rps if r and r > 0), default=0.0)
    return int(min(MAX_REQUESTS, max(MIN_REQUESTS, round(SET_TARGET_S * slowest))))


def set_order(repeats: int, engine: str, against: str) -> list[tuple[int, str]]:
    """(repetition, engine) in the order served: pair r runs engine first when r is even, `against` first when
    odd (A B B A A B ...: consecutive sets of one engine share its server)."""
    return [(r, e) for r in range(repeats) for e in ((engine, against) if r % 2 == 0 else (against, engine))]


def set_key(repetition: int) -> str:
    """The stream of repetition r (workloads/streams.py: its own seed), read by both engines."""
    return f"sat{repetition}"


def set_figures(rows: pd.DataFrame) -> dict:
    """A set's figures from its request rows: vLLM's throughput, total output tokens over first send to last
    end, of the completed requests alone (a failed request's tokens reach no user: an engine that OOMs half a set
    finishes it sooner, and would otherwise read as faster)."""
    done = rows[rows.end_s.notna()]
    wall_s = float(done.end_s.max() - rows.sent_s.min()) if len(done) else None
    ok = rows.status == "ok"
    tokens = int(pd.to_numeric(rows.output_tokens[ok], errors="coerce").fillna(0).sum())
    completed = int(ok.sum())
    fast = wall_s is not None and wall_s > 0
    return {"completed": completed, "output_tokens": tokens, "wall_s": round(wall_s, 3) if fast else None,
            "output_tokens_per_s": round(tokens / wall_s, 3) if fast else None,
            "requests_per_s": round(completed / wall_s, 4) if fast else None}


def paired_ratio(ours: list[float], theirs: list[float], level: float = LEVEL
                 ) -> tuple[float, list[float] | None] | None:
    """The geometric mean of ours[i] / theirs[i] and its t interval at `level` over the pairs' log ratios (df =
    pairs - 1; None under two pairs). None without a pair of positive figures."""
    d = np.array([math.log(a / b) for a, b in zip(ours, theirs, strict=True) if a and b and a > 0 and b > 0])
    if not len(d):
        return None
    mean = float(d.mean())
    if len(d) < 2:
        return round(math.exp(mean), 4), None
    half = float(stats.t.ppf((1 + level) / 2, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))
    return round(math.exp(mean), 4), [round(math.exp(mean - half), 4), round(math.exp(mean + half), 4)]


def measured_sets(run_dir: Path) -> list[SaturationSet]:
    """Every set the journal names, its figures from its own request rows."""
    out = []
    for row in read_rows(run_dir / JOURNAL):
        rows = read_journals([run_dir / row["out"] / "requests.jsonl"], "requests")
        figures = set_figures(rows) if len(rows) else {"completed": 0, "output_tokens": 0}
        out.append(SaturationSet(engine=row["engine"], repetition=row["repetition"], position=row["position"],
                                 requests=row["requests"], **figures, oom_total=row.get("oom_total", 0),
                                 preemptions=row.get("preemptions", 0)))
    return out


def engine_figures(sets: list[SaturationSet]) -> SaturationEngine:
    def mean(name: str) -> float | None:
        values = [getattr(s, name) for s in sets if getattr(s, name) is not None]
        return round(float(np.mean(values)), 4) if values else None

    return SaturationEngine(output_tokens_per_s=mean("output_tokens_per_s"), requests_per_s=mean("requests_per_s"),
                            sets=len(sets), failed_requests=sum(s.requests - s.completed for s in sets),
                            oom_total=sum(s.oom_total for s in sets), preemptions=sum(s.preemptions for s in sets))


def add_saturation(summary: Summary, run_dir: Path) -> None:
    """summary.json's `saturation_throughput`, set where the run served a set (absent otherwise)."""
    if (block := saturation_block(run_dir)) is not None:
        summary.saturation_throughput = block


def saturation_block(run_dir: Path) -> SaturationBlock | None:
    """summary.json's `saturation_throughput`, or None where no set was served."""
    rows = read_rows(run_dir / JOURNAL)
    if not rows:
        return None
    engine, against = rows[0]["pair"]
    sets = measured_sets(run_dir)
    by = {(s.engine, s.repetition): s.output_tokens_per_s for s in sets}
    reps = sorted({s.repetition for s in sets if (engine, s.repetition) in by and (against, s.repetition) in by})
    got = paired_ratio([by[(engine, r)] for r in reps], [by[(against, r)] for r in reps])
    return SaturationBlock(definition=DEFINITION, engine=engine, against=against, requests=rows[0]["requests"],
                           repeats=rows[0]["repeats"], ratio=got[0] if got else None, ratio_ci=got[1] if got else None,
                           level=LEVEL, pairs=len(reps),
                           engines={e: engine_figures([s for s in sets if s.engine == e]) for e in (engine, against)},
                           sets=sets)


def saturation_words(b: SaturationBlock) -> str:
    """The console's line (the report's sentence reads the same figures)."""
    e = b.engines
    each = "; ".join(f"{n} {f.output_tokens_per_s or 0:.1f} output tok/s, {f.requests_per_s or 0:.2f} req/s "
                     f"({f.oom_total:g} OOMs, {f.preemptions:g} preemptions)" for n, f in e.items())
    ratio = "no ratio" if b.ratio is None else f"{b.engine}/{b.against} {b.ratio:.2f}x" + (
        f" [{b.ratio_ci[0]:.2f}, {b.ratio_ci[1]:.2f}] ({100 * b.level:.0f} % paired t, {b.pairs} pairs)"
        if b.ratio_ci else f" ({b.pairs} pair, no interval)")
    return f"saturation throughput ({b.requests:g} requests at once, {b.repeats:g} pairs): {each}; {ratio}"
