"""What the run says now, computed as summary.json will compute it: the journals as written so far (the
requests still in flight judged by the rule the summary applies to one cut off at the run's end), through the
summary's own functions (`blocks_of`, `intervals`, `headline_with`: the same replicates, the same seed). The
search's early stop, the decision phase and the console's `decision:` lines read this and nothing else, so
none of them can say "decided" where the report does not."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.analysis.headline import verdict_words
from harness.analysis.knee import Judged
from harness.analysis.kneefit import KneeFit
from harness.analysis.records import RunRecord
from harness.analysis.run_fits import fits_of
from harness.analysis.rundir import load_frames
from harness.analysis.summary import blocks_of, headline_with, intervals
from harness.analysis.summary_records import CapacityBlock, HeadlineBlock, Ratio


@dataclass(frozen=True)
class Verdict:
    """The run at one moment, at its own KV budget."""

    points: dict[str, list[Judged]]  # per engine, its judged points (with what a knee may make of each)
    capacity: dict[str, CapacityBlock]  # summary.json's `capacity`
    ratios: dict[str, Ratio]  # summary.json's `capacity_ratios`
    headline: HeadlineBlock | None  # summary.json's `headline`
    fit: KneeFit | None = None  # the knee fit every figure above was read from

    def ratio_ci(self, a: str, b: str) -> list[float] | None:
        r = self.ratios.get(f"{a}/{b}")
        return None if r is None else r.ratio_ci

    def line(self, status: str | None = None) -> str:
        return decision_line(self.headline, status)


def decision_line(h: HeadlineBlock | None, status: str | None = None) -> str:
    """The console's `decision:` line: the headline's ratio, interval and verdict as summary.json has them."""
    if h is None:
        return "decision: no headline (a paged engine and a contiguous one, each with points a knee rests on)"
    lo, hi = h.ratio_ci
    return (f"decision: {h.engine} / {h.against} = {h.ratio:.2f} [{lo:.2f}, {hi:.2f}]: {verdict_words(h)}"
            + (f"; {status}" if status else ""))


def verdict_of(frames: dict[str, pd.DataFrame], run: RunRecord, engines: list[str] | None = None) -> Verdict:
    """The capacity, ratios and headline of the run's own budget, from its frames."""
    blocks = blocks_of(frames, run, engines).get(run.config.kv_budget, {})
    fits = fits_of(blocks, run)
    capacity, ratios = intervals(blocks, run, fits) if blocks else ({}, {})
    head = headline_with(blocks, run, fits) if blocks else None
    return Verdict({e: j for e, (_, j) in blocks.items()}, capacity, ratios, head, fits[0])


def verdict_now(run_dir: Path, run: RunRecord, in_flight: list[dict]) -> Verdict:
    """What the run says now: its journals, and a cut-off row for each request still in flight."""
    frames = load_frames(run_dir)
    req = frames["requests"]
    done = set(zip(req.engine, req.request_id, strict=True)) if len(req) else set()
    in_flight = [r for r in in_flight if (r["engine"], r["request_id"]) not in done]  # ended since it was asked
    if in_flight:
        extra = pd.DataFrame(in_flight)
        frames["requests"] = pd.concat([frames["requests"], extra], ignore_index=True) \
            if len(frames["requests"]) else extra
    return verdict_of(frames, run)


def verdict_final(run_dir: Path) -> Verdict:
    """What summary.json says (run.json as written, every journal final)."""
    return verdict_of(load_frames(run_dir), RunRecord.read(run_dir))
