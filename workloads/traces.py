"""Readers for the real production traces (Azure conv CSV, Mooncake JSONL), plain or gzipped.

The traces the presets use ship in `workloads/traces/` with their licences and attribution (README there);
`$FRAGBENCH_TRACES` names another folder to look in first.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRow:
    t_s: float  # from the trace's first request
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: 512-token prefix blocks; equal ids = equal content


class TraceError(ValueError):
    """A trace that is missing or not in a known format."""


BUNDLED = Path(__file__).resolve().parent / "traces"


def trace_dirs() -> list[Path]:
    env = os.environ.get("FRAGBENCH_TRACES")
    return [Path(env), BUNDLED] if env else [BUNDLED]


def resolve(path: str) -> Path:
    """The file itself, else NAME or NAME.gz in $FRAGBENCH_TRACES, else in the bundled traces."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_absolute():
        for folder in trace_dirs():
            for candidate in (folder / path, folder / f"{path}.gz"):
                if candidate.is_file():
                    return candidate
    looked = ", ".join(str(d) for d in trace_dirs())
    raise TraceError(f"trace file not found: {path} (looked in {looked})")


def _stem_suffix(path: Path) -> str:
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def detect_format(path: Path) -> str:
    suffix = _stem_suffix(path)
    if suffix == ".csv":
        return "azure"
    if suffix == ".jsonl":
        return "mooncake"
    raise TraceError(f"unknown trace format for {path.name}: expected Azure .csv or Mooncake .jsonl (or .gz)")


def _open_text(path: Path):
    return gzip.open(path, "rt", newline="") if path.suffix == ".gz" else open(path, newline="")


def read_trace(path: str, fmt: str | None = None) -> list[TraceRow]:
    p = resolve(path)
    fmt = fmt or detect_format(p)
    try:
        rows = read_azure(p) if fmt == "azure" else read_mooncake(p)
    except (KeyError, ValueError, json.JSONDecodeError) as e:
        raise TraceError(f"{p.name} is not a valid {fmt} trace: {e}") from None
    if not rows:
        raise TraceError(f"{p.name} holds no requests")
    return rows


def _azure_time(stamp: str) -> datetime:
    """TIMESTAMP has 7 fractional digits; strptime's %f takes at most 6."""
    whole, _, frac = stamp.partition(".")
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(microsecond=int((frac + "000000")[:6]))


def read_azure(path: Path) -> list[TraceRow]:
    with _open_text(path) as f:
        records = [(_azure_time(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                   for r in csv.DictReader(f)]
    t0 = records[0][0]
    return [TraceRow((t - t0).total_seconds(), i, o) for t, i, o in records]


def read_mooncake(path: Path) -> list[TraceRow]:
    rows = []
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append((r["timestamp"] / 1000, r["input_length"], r["output_length"], tuple(r["hash_ids"])))
    t0 = rows[0][0]
    return [TraceRow(t - t0, i, o, h) for t, i, o, h in rows]


ATTRIBUTION = {
    "azure": 'Microsoft Azure, Azure Public Dataset (github.com/Azure/AzurePublicDataset), CC BY 4.0. '
             'Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024.',
    "mooncake": 'Mooncake trace (kvcache-ai/Mooncake), Apache-2.0. Qin et al., "Mooncake: A KVCache-centric '
                'Architecture for Serving LLM Chatbot", USENIX FAST 2025.',
}
