"""The run's knee fits as summary.json reads them: every engine of one budget on its points, under the priors
and the headline pair's correlation run.json records (harness/sim/spread_prior.py, computed before the decision),
and the same fit with the stream spread held at 0."""

from __future__ import annotations

import numpy as np

from harness.analysis.knee import Judged
from harness.analysis.kneefit import KneeFit, fit
from harness.analysis.kneejoint import joint_fit
from harness.analysis.records import RunRecord
from harness.analysis.stream_priors import SpreadPrior


def fits_of(blocks: dict[str, tuple[dict, list[Judged]]], meta: RunRecord) -> tuple[KneeFit | None, KneeFit | None]:
    """The run's knee fit over every engine of one budget (kneefit.py; the headline pair jointly, kneejoint.py), and
    the same fit with the
    stream-to-stream spread held at 0 (these streams' sampling alone: what the run-to-run share is read against)."""
    target, pts, priors = meta.config.slo.attainment, {e: j for e, (_, j) in blocks.items()}, spread_priors(meta)
    return (joint_fit(pts, target, correlations(meta), priors=priors),
            fit(pts, target, spreads=np.zeros(1), priors=priors))


def correlations(meta: RunRecord) -> dict[tuple[str, str], float]:
    """The residual correlation run.json records for the headline pair (kneejoint.py: the twins' lower bound),
    the one the joint fit uses; none: each engine fitted alone."""
    c = (meta.spread_prior or {}).get("correlation")
    return {tuple(c["engines"]): float(c["used"])} if c else {}


def spread_priors(meta: RunRecord) -> dict[str, SpreadPrior]:
    """The engines' spread priors run.json records (harness/sim/spread_prior.py); none: the half-t for each."""
    block = meta.spread_prior or {}
    return {e: SpreadPrior.of(d) for e, d in (block.get("engines") or {}).items()}
