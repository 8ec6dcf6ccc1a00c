"""A step-time model fitted on an engine's own steps (`steps.parquet` of a bench run, or a server's
`--step-log`): a fixed cost per step, one per decode, one per prefill chunk, one per computed token and one
per key read, by least squares with every coefficient kept non-negative (a term the rows cannot tell from
the others is dropped, at 0, rather than given a negative cost that would make a bigger batch cheaper).

The simulator calls `step_s` as it calls the roofline's, with the same quantities the engine recorded."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness.analysis.records import RunRecord
from harness.analysis.rundir import load_steps

# coefficient -> the step row's column it multiplies (None: the constant)
TERMS = {"fixed_s": None, "per_decode_s": "decodes", "per_prefill_s": "prefills", "per_token_s": "tokens",
         "per_context_token_s": "context_tokens"}
MIN_ROWS = 10 * len(TERMS)  # ten steps a coefficient, at the least


class StepModelError(ValueError):
    """Rows or a file that give no usable step model: one line, exit 2."""


@dataclass(frozen=True)
class FittedStepModel:
    coefficients: dict[str, float]  # seconds per unit of each term
    fit_r2: float | None  # of the step durations it was fitted on; None when loaded without them
    rows: int  # steps it was fitted on
    source: str  # where the rows came from

    def step_s(self, decodes, prefills, tokens, context_read, attn_pairs):
        c = self.coefficients
        return (c["fixed_s"] + c["per_decode_s"] * decodes + c["per_prefill_s"] * prefills
                + c["per_token_s"] * tokens + c["per_context_token_s"] * context_read)

    def to_json(self) -> dict:
        return {"coefficients": self.coefficients, "fit_r2": self.fit_r2, "rows": self.rows, "source": self.source}


def fit(steps: pd.DataFrame, source: str) -> FittedStepModel:
    if len(steps) < MIN_ROWS:
        raise StepModelError(f"{source}: {len(steps)} step rows, too few to fit {len(TERMS)} coefficients "
                             f"(at least {MIN_ROWS})")
    X = np.column_stack([np.ones(len(steps)) if col is None else steps[col].to_numpy(float)
                         for col in TERMS.values()])
    y = steps.duration_s.to_numpy(float)
    if not (np.isfinite(X).all() and np.isfinite(y).all()):
        raise StepModelError(f"{source}: step rows with non-finite values")
    coef = nonnegative_lstsq(X, y)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - X @ coef) ** 2).sum()) / ss_tot if ss_tot > 0 else None
    return checked(FittedStepModel(dict(zip(TERMS, coef.tolist(), strict=True)), r2, len(steps), source))


def nonnegative_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares over the terms still in; the most negative one out, until none is negative. Each
    round drops a term, so it ends within len(TERMS) rounds."""
    active = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        coef[active] = np.linalg.lstsq(X[:, active], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        active.remove(int(np.argmin(coef)))


def checked(model: FittedStepModel) -> FittedStepModel:
    missing = [t for t in TERMS if t not in model.coefficients]
    if missing:
        raise StepModelError(f"{model.source}: the step model has no {', '.join(missing)}")
    for name, value in model.coefficients.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise StepModelError(f"{model.source}: coefficient {name} is {value}, not a finite number")
        if value < 0:
            raise StepModelError(f"{model.source}: coefficient {name} is negative ({value}): a step cannot get "
                                 "cheaper with more work")
    if all(v == 0 for v in model.coefficients.values()):
        raise StepModelError(f"{model.source}: every coefficient is 0: steps would take no time")
    return model


def run_steps(run_dir: Path) -> pd.DataFrame:
    """A run's step rows: steps.parquet, or the servers' logs of a run that was stopped before its end (read
    as finalize reads them)."""
    if (run_dir / "steps.parquet").is_file():
        return pd.read_parquet(run_dir / "steps.parquet")
    try:
        return load_steps(run_dir, RunRecord.read(run_dir))
    except FileNotFoundError:  # not a run directory: no rows
        return pd.DataFrame()


def load(source: str, engine: str | None = None) -> FittedStepModel:
    """RUN_DIR (its engines' steps, or `engine`'s alone), a steps file (.parquet, .csv) to fit, or a model
    (.json: what `simulate --json` printed, or its step_model object) to use as it is."""
    path = Path(source)
    if path.is_dir():
        steps = run_steps(path)
        if not len(steps):
            raise StepModelError(f"{source}: no step rows (a bench run of a scheduled engine writes steps.parquet)")
    elif path.suffix == ".json" and path.is_file():
        return from_json(path)
    elif path.suffix in (".parquet", ".csv") and path.is_file():
        try:
            steps = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
        except (OSError, ValueError) as e:
            raise StepModelError(f"{source}: not a steps file ({type(e).__name__})") from None
    else:
        raise StepModelError(f"{source}: neither a run directory nor a .parquet, .csv or .json file")
    columns = [c for c in TERMS.values() if c]
    if "duration_s" not in steps or any(c not in steps for c in columns):
        raise StepModelError(f"{source}: not step rows (needs duration_s and {', '.join(columns)})")
    if engine is not None:
        if "engine" not in steps or engine not in set(steps.engine):
            raise StepModelError(f"{source}: no step rows of engine {engine}")
        steps = steps[steps.engine == engine]
    return fit(steps, f"{source}" + (f" ({engine})" if engine else ""))


def from_json(path: Path) -> FittedStepModel:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StepModelError(f"{path}: not JSON ({type(e).__name__})") from None
    data = data.get("step_model", data) if isinstance(data, dict) else data
    if not isinstance(data, dict) or not isinstance(data.get("coefficients"), dict):
        raise StepModelError(f"{path}: no step model in it (an object with 'coefficients')")
    return checked(FittedStepModel(data["coefficients"], data.get("fit_r2"), int(data.get("rows") or 0), str(path)))
