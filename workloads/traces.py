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
    except (OSError, EOFError, UnicodeDecodeError) as e:  # unreadable, or a .gz that is not gzip
        raise TraceError(f"{p}: not a readable {fmt} trace: {e}") from None
    if not rows:
        raise TraceError(f"{p} holds no requests")
    return rows


AZURE_FIELDS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _azure_time(stamp: str) -> datetime:
    """TIMESTAMP has 7 fractional digits; strptime's %f takes at most 6."""
    whole, _, frac = stamp.partition(".")
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(microsecond=int((frac + "000000")[:6]))


def _field(path: Path, line: int, record: dict, name: str, read):
    """One field of one row, read; a refusal names the file, the line and the field."""
    if not isinstance(record, dict) or record.get(name) is None:
        azure = _stem_suffix(path) == ".csv"
        raise TraceError(f"{path}: line {line}: no {name!r} field (a row of {'an Azure' if azure else 'a Mooncake'} "
                         f"trace has {', '.join(AZURE_FIELDS if azure else MOONCAKE_FIELDS)})")
    try:
        return read(record[name])
    except (TypeError, ValueError):
        raise TraceError(f"{path}: line {line}: field {name!r}: {str(record[name])[:40]!r} is not {read.__doc__}") \
            from None


def _count(value) -> int:
    """a whole number of tokens, 0 or more"""
    number = int(value)
    if number < 0 or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(value)
    return number


def _stamp(value) -> datetime:
    """a time as 2023-11-16 18:15:46.6805900"""
    return _azure_time(value)


def _seconds_ms(value) -> float:
    """a time in milliseconds"""
    return float(value) / 1000


def _ids(value) -> tuple[int, ...]:
    """a list of integer block ids"""
    return tuple(int(x) for x in value)


def read_azure(path: Path) -> list[TraceRow]:
    with _open_text(path) as f:
        reader = csv.DictReader(f)
        if missing := [name for name in AZURE_FIELDS if name not in (reader.fieldnames or [])]:
            raise TraceError(f"{path}: line 1: the header has no {', '.join(map(repr, missing))} (an Azure trace's "
                             f"columns: {', '.join(AZURE_FIELDS)})")
        records = list(reader)
    out = []
    for i, r in enumerate(records):
        line = i + 2  # the header is line 1
        out.append((_field(path, line, r, "TIMESTAMP", _stamp), _field(path, line, r, "ContextTokens", _count),
                    _field(path, line, r, "GeneratedTokens", _count)))
    if not out:
        return []
    t0 = out[0][0]
    return [TraceRow((t - t0).total_seconds(), i, o) for t, i, o in out]


def read_mooncake(path: Path) -> list[TraceRow]:
    rows = []
    with _open_text(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                r = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}: line {line}: not a JSON object: {e.msg}") from None
            rows.append((_field(path, line, r, "timestamp", _seconds_ms), _field(path, line, r, "input_length", _count),
                         _field(path, line, r, "output_length", _count), _field(path, line, r, "hash_ids", _ids)))
    if not rows:
        return []
    t0 = rows[0][0]
    return [TraceRow(t - t0, i, o, h) for t, i, o, h in rows]


ATTRIBUTION = {
    "azure": 'Microsoft Azure, Azure Public Dataset (github.com/Azure/AzurePublicDataset), CC BY 4.0. '
             'Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024.',
    "mooncake": 'Mooncake trace (kvcache-ai/Mooncake), Apache-2.0. Qin et al., "Mooncake: A KVCache-centric '
                'Architecture for Serving LLM Chatbot", USENIX FAST 2025.',
}
