"""Result rows as they are produced: JSONL journals appended and flushed row by row (a killed run keeps
every row written), turned into parquet at the end or when a partial run is read."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

REQUEST_COLUMNS = [
    "engine", "request_id", "class", "arrival_s", "sent_s", "first_token_s", "end_s", "prompt_tokens",
    "output_tokens_target", "output_tokens", "n", "stream", "status", "error", "ttft_s", "tpot_s", "e2e_s",
]
SAMPLE_COLUMNS = [
    "engine", "t_s", "kv_capacity_bytes", "token_states_bytes", "allocated_bytes", "free_bytes",
    "largest_free_bytes", "running", "waiting", "preempted_total", "device_used_bytes",
    "torch_allocated_bytes", "torch_reserved_bytes", "torch_active_bytes", "torch_inactive_split_bytes",
    "torch_segments", "torch_alloc_retries", "torch_ooms",
    # /stats' `allocator` (the caching allocator's own figures, --memory caching); null where none holds the KV
    "alloc_allocated_bytes", "alloc_reserved_bytes", "alloc_active_bytes", "alloc_inactive_split_bytes",
    "alloc_segments", "alloc_retries", "alloc_small_requests", "alloc_large_requests", "alloc_huge_requests",
]
EVENT_COLUMNS = ["engine", "t_s", "kind", "requested_bytes", "free_bytes", "largest_free_bytes", "cause", "detail"]
COLUMNS = {"requests": REQUEST_COLUMNS, "samples": SAMPLE_COLUMNS, "events": EVENT_COLUMNS}


@contextmanager
def whole_file(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; once the block ends it replaces `path` in one rename, so that a
    reader (or a run killed mid-write) sees the old file or the new one, never half of one. Its name is the
    process's and the thread's: two writers of one file never write into each other's (and, unlike mkstemp's,
    the file gets the user's usual permissions)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # an error mid-write leaves the old file, and no temporary beside it


def write_whole(path: Path, text: str) -> None:
    """`text` as the whole of `path`, atomically (whole_file)."""
    with whole_file(path) as tmp:
        tmp.write_text(text)


class Journal:
    """Append-only JSONL; thread-safe; each row is on disk when `write` returns."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, row: dict) -> None:  # the write edge: a row of COLUMNS' kind, as its maker built it
        line = json.dumps(row, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class JournalTail:
    """The rows appended to a journal since the last read, from where it ended when the tail was made (the
    bench reads a point's outcomes while the load generator writes them)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        with open(self.path) as f:
            f.seek(self.offset)
            while (line := f.readline()).endswith("\n"):
                self.offset = f.tell()
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return rows


def read_rows(path: Path) -> list[dict]:
    """A journal's rows; none when it is absent."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # the last line of a killed writer may be cut short
    return rows


def read_journals(paths: list[Path], kind: str) -> pd.DataFrame:
    df = pd.DataFrame([row for path in paths for row in read_rows(path)])
    for col in COLUMNS[kind]:
        if col not in df.columns:
            df[col] = None
    return df[COLUMNS[kind] + [c for c in df.columns if c not in COLUMNS[kind]]]


FAILED_STATUSES = ("error", "rejected", "crashed")  # no answer, an error status, or lost to a server's crash


def measured_nothing(requests: pd.DataFrame) -> str | None:
    """Why a run's requests measured nothing, in words (none sent, or every one failed, with the first failure's
    error), or None where any was answered (an OOM or a cancel is an answer: what the run measures)."""
    if not len(requests):
        return "no request was sent"
    failed = requests.status.isin(FAILED_STATUSES)
    if not failed.all():
        return None
    errors = requests.loc[failed, "error"].dropna()
    first = f": the first said {errors.iloc[0]}" if len(errors) else ""
    return f"all {len(requests)} requests failed{first}"


def to_parquet(run_dir: Path, kind: str) -> pd.DataFrame:
    """Gather `{kind}*.jsonl` of a run into `{kind}.parquet`."""
    df = read_journals(sorted(run_dir.glob(f"{kind}*.jsonl")), kind)
    with whole_file(run_dir / f"{kind}.parquet") as tmp:  # rewritten when a partial run is read again
        df.to_parquet(tmp, index=False)
    return df


def token_times(r) -> list[float]:
    """When each output token of a requests row reached the client (a whole answer: all at its end)."""
    if r.stream and r.first_token_s is not None and not pd.isna(r.first_token_s):
        gaps = json.loads(r.inter_token_s) if isinstance(r.inter_token_s, str) else []
        return list(r.first_token_s + np.concatenate([[0.0], np.cumsum(gaps)]))
    return [r.end_s] * int(r.output_tokens or 0) if r.end_s is not None and not pd.isna(r.end_s) else []


def request_row(engine: str, outcome) -> dict:
    """One requests.parquet row from a load-generator outcome."""
    req = outcome.request
    due = outcome.due_s  # the schedule's time, not the send's: a late send's wait counts (coordinated omission)
    ttft = outcome.first_token_s - due if outcome.first_token_s is not None else None
    times = outcome.token_times_s
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    gaps = [round(b - a, 6) for a, b in zip(times, times[1:], strict=False)]
    return {
        "engine": engine, "request_id": req.request_id, "class": req.cls, "arrival_s": req.arrival_s,
        "sent_s": outcome.sent_s, "first_token_s": outcome.first_token_s, "end_s": outcome.end_s,
        "prompt_tokens": len(req.prompt_ids), "output_tokens_target": req.max_tokens * req.n,
        "output_tokens": outcome.output_tokens, "n": req.n, "stream": req.stream, "status": outcome.status,
        "error": outcome.error, "ttft_s": ttft, "tpot_s": tpot,
        "e2e_s": outcome.end_s - due if outcome.end_s is not None else None,
        "late_s": outcome.late_s, "finish_reason": outcome.finish_reason, "http_status": outcome.http_status,
        "cancel_after_tokens": req.cancel_after_tokens, "read_delay_s": req.read_delay_s,
        "inter_token_s": json.dumps(gaps),
    }


def write_restarts(path: Path, restarts: dict[str, int]) -> None:
    """`fragbench:engine_restarts_total{engine}` in Prometheus' text format, as node_exporter's textfile
    collector reads it (RUN_DIR/metrics/supervisor.prom): the restarts bench's supervisor made."""
    from prometheus_client import CollectorRegistry, Counter, write_to_textfile

    registry = CollectorRegistry()
    counter = Counter("fragbench:engine_restarts", "Times bench restarted an engine's server after it died",
                      ["engine"], registry=registry)
    for engine, n in restarts.items():
        counter.labels(engine).inc(n)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(path), registry)
