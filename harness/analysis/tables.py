"""The tables `fragbench report --format csv|json` writes, each of one schema (column -> pandas' nullable dtype)
whatever the run held: a partial run's and an empty column are typed as a whole run's. A list is a table of its own
(tokens: each streamed token's gap a row). docs/architecture.md, Result files."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from harness.analysis import engine_rows
from harness.analysis.records import RunRecord
from harness.analysis.run_state import run_mark
from harness.analysis.summary_records import Summary
from harness.results import whole_file, write_whole

F, N, S = "Float64", "Int64", "string"  # a float, an integer (N), a string; each may be missing
REQUESTS = {  # requests.parquet's columns, inter_token_s apart (tokens.csv)
    "engine": S, "request_id": S, "class": S, "arrival_s": F, "sent_s": F, "first_token_s": F, "end_s": F,
    "prompt_tokens": N, "output_tokens_target": N, "output_tokens": N, "n": N, "stream": "boolean", "status": S,
    "error": S, "ttft_s": F, "tpot_s": F, "e2e_s": F, "late_s": F, "finish_reason": S, "http_status": N,
    "cancel_after_tokens": N, "read_delay_s": F, "offered_rps": F, "point": N, "stream_key": S, "stream_index": N,
}
# one row per gap between a streamed request's tokens: request_row indexes requests.csv, token_index the later token
TOKENS = {"request_row": N, "engine": S, "request_id": S, "token_index": N, "inter_token_s": F}
SCHEMAS = {"requests": REQUESTS, "tokens": TOKENS, "engines": engine_rows.SCHEMA}
MANIFEST = "tables.json"  # the run's state and mark, and each table's dtypes: pd.read_csv(path, dtype=...)


def typed(frame: pd.DataFrame, schema: dict[str, str]) -> pd.DataFrame:
    """`frame`'s columns in `schema`'s order and dtypes; one it lacks is all missing, of its dtype."""
    return pd.DataFrame({col: as_dtype(frame[col] if col in frame else pd.Series(None, index=frame.index,
                                                                                   dtype=object), dtype)
                         for col, dtype in schema.items()}, index=frame.index)


def as_dtype(values: pd.Series, dtype: str) -> pd.Series:
    if dtype in (F, N):
        return pd.to_numeric(values, errors="coerce").astype(dtype)
    return values.astype(object).where(values.notna(), None).astype(dtype)


def gaps_of(value) -> list[float]:
    """A row's inter_token_s (a JSON list in requests.parquet) as floats; none where absent or unreadable."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return []
    return [float(g) for g in value] if isinstance(value, list) else []


def tokens_frame(requests: pd.DataFrame) -> pd.DataFrame:
    """The long table of inter-token gaps: one row per gap, keyed by its request's row in requests.csv."""
    gaps = requests["inter_token_s"] if "inter_token_s" in requests else pd.Series(None, index=requests.index)
    long = pd.DataFrame({"request_row": range(len(requests)), "engine": requests.engine.to_numpy(),
                         "request_id": requests.request_id.to_numpy(), "inter_token_s": gaps.map(gaps_of).to_numpy()})
    long = long.explode("inter_token_s").dropna(subset=["inter_token_s"])
    long["token_index"] = long.groupby("request_row").cumcount() + 1
    return typed(long.reset_index(drop=True), TOKENS)


def export_tables(run_dir: Path, summary: Summary, out: Path, kind: str) -> list[Path]:
    """requests, tokens and engines as CSV or JSON (a list of records each) under `out`, each of its schema, and
    tables.json beside them: the run's status, its PARTIAL or FAILED mark (None: complete) and the dtypes."""
    out.mkdir(parents=True, exist_ok=True)
    raw = pd.read_parquet(run_dir / "requests.parquet").reset_index(drop=True)
    frames = {"requests": typed(raw, REQUESTS), "tokens": tokens_frame(raw),
              "engines": engine_rows.engines_frame(summary)}
    paths = []
    for name, frame in frames.items():
        paths.append(path := out / f"{name}.{kind}")
        with whole_file(path) as tmp:
            if kind == "csv":
                frame.to_csv(tmp, index=False)
            else:
                frame.to_json(tmp, orient="records", indent=1)
    manifest = {"run_status": summary.status, "mark": run_mark(RunRecord.read(run_dir), raw),
                "dtypes": {f"{name}.{kind}": schema for name, schema in SCHEMAS.items()}}
    write_whole(out / MANIFEST, json.dumps(manifest, indent=1))
    return [out / MANIFEST, *paths]
