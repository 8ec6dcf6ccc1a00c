"""Sizes with units, as users type them: 64MiB, 80GiB, 80GB, 12e9."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in `text`; ValueError naming the text otherwise."""
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"not a size: {text!r} (expected e.g. 64MiB, 80GiB, 80GB)")
    value = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True, order=True)
class KvBudget:
    """A KV-cache budget as the user gave it: its bytes, and the text they wrote (`16MiB`), which names its files
    and labels it in run.json and the reports. Equal, hashed and ordered by bytes alone, so that `16MiB` and
    `16777216` are one budget wherever budgets are keys or de-duplicated."""

    bytes: int
    label: str = field(compare=False)

    @classmethod
    def parse(cls, text: str | int | KvBudget) -> KvBudget:
        """From a flag's text (or bytes, or a budget); ValueError naming the text otherwise (parse_size's)."""
        if isinstance(text, KvBudget):
            return text
        return cls(parse_size(str(text)), str(text).strip())

    def __str__(self) -> str:
        return self.label
