"""Prometheus rules for the seeds' alerts, as records: thresholds in, a rules file Prometheus loads out.

The seeds' useful alert "is not simply GPU memory above 90 %": usable KV running out while much of it is held
by no token, in reservations and holes (fragmentation suspected), reserved memory growing after requests complete (the
allocator keeping blocks), allocation failures with memory free concentrated after churn, preemption storms,
and KV full with a waiting queue (capacity, the honest kind). Each family's expressions are in
`families.py`; a rule whose signal the family does not export is left out, and the file says why.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")  # Prometheus' duration, one unit (what promtool accepts)


class BlockDumper(yaml.SafeDumper):
    """Multi-line expressions as YAML literal blocks: the file reads as PromQL, not as quoted escapes."""


BlockDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


class RulesRefused(ValueError):
    """Bad thresholds or a check report without an envelope: one line, exit 2."""


@dataclass(frozen=True)
class Thresholds:
    """What the rules compare against; `envelope_tokens` None means the KV capacity in tokens, where the
    family exports it."""

    envelope_tokens: int | None = None  # live tokens the server held before its first OOM or preemption
    envelope_source: str = "none given: the KV capacity in tokens stands for it"
    envelope_share: float = 0.75  # live tokens under this share of the envelope count as "below" it
    free_below: float = 0.25  # usable free KV (the largest free extent) under this share of capacity: running out
    untokened_above: float = 0.3  # KV held by no token (reservations, rounding, holes) over this share: fragmented
    kv_full: float = 0.95  # KV usage at or above this share counts as full
    fragmentation_ooms: int = 1  # fragmentation failures in the window that make the alert
    churn_rps: float = 0.5  # finished requests per second (aborts included) that make the traffic churn
    preemptions_per_s: float = 0.5
    reserved_growth_bytes: int = 64 * 2**20
    window: str = "5m"  # what the rates and averages look back over
    hold: str = "2m"  # how long a condition holds before the alert fires (`for`)

    def __post_init__(self) -> None:
        for name in ("window", "hold"):
            if not DURATION.match(getattr(self, name)):
                raise RulesRefused(f"--{name}: {getattr(self, name)!r} is not a Prometheus duration (30s, 5m, 1h)")
        for name in ("envelope_share", "free_below", "untokened_above", "kv_full"):
            if not 0 < getattr(self, name) <= 1:
                raise RulesRefused(f"--{name.replace('_', '-')} must be in (0, 1], not {getattr(self, name)}")
        if self.envelope_tokens is not None and self.envelope_tokens < 1:
            raise RulesRefused(f"the envelope must be at least one token, not {self.envelope_tokens}")


@dataclass(frozen=True)
class RecordingRule:
    record: str
    expr: str

    def to_yaml(self) -> dict:
        return {"record": self.record, "expr": self.expr}


@dataclass(frozen=True)
class Alert:
    alert: str
    expr: str
    hold: str
    summary: str  # a template over the alert's labels, in the seeds' terms
    runbook: str  # what to look at first, in the seeds' terms
    severity: str = "warning"
    cause: str | None = None  # "fragmentation" for the fragmentation kind: a route or a silence can match it

    def to_yaml(self) -> dict:
        labels = {"severity": self.severity, **({"cause": self.cause} if self.cause else {})}
        return {"alert": self.alert, "expr": self.expr, "for": self.hold, "labels": labels,
                "annotations": {"summary": self.summary, "runbook": self.runbook}}


@dataclass(frozen=True)
class Omitted:
    """A seeds' alert the family has no signal for: named in the file, not faked."""

    alert: str
    why: str


@dataclass(frozen=True)
class RuleSet:
    family: str
    records: list[RecordingRule]
    alerts: list[Alert]
    omitted: list[Omitted]
    thresholds: Thresholds
    uses_envelope: bool = False  # whether an expression reads the envelope (the header then says which)

    def to_yaml(self) -> str:
        t = self.thresholds
        head = [f"# Prometheus rules for the {self.family} metric family, written by `fragbench rules "
                f"--family {self.family}`."]
        if self.uses_envelope:
            tokens = f"{t.envelope_tokens} live tokens, " if t.envelope_tokens is not None else ""
            head.append(f"# Envelope: {tokens}{t.envelope_source}.")
        head += [
                 f"# Window {t.window}, held for {t.hold}. Load it with `rule_files:` in prometheus.yml; "
                 "check it with `promtool check rules FILE`."]
        if self.omitted:
            head.append("# Left out: the family exports no signal for them (a rule would be a guess):")
            head += [f"#   {o.alert}: {o.why}" for o in self.omitted]
        groups = [{"name": f"{self.family}-kv-records", "rules": [r.to_yaml() for r in self.records]},
                  {"name": f"{self.family}-kv-alerts", "rules": [a.to_yaml() for a in self.alerts]}]
        groups = [g for g in groups if g["rules"]]
        body = yaml.dump({"groups": groups}, Dumper=BlockDumper, sort_keys=False, width=120, allow_unicode=True)
        return "\n".join(head) + "\n" + body


def envelope_from_check(path: Path) -> tuple[int, str]:
    """The envelope a `fragbench check --json` report measured (its `envelope.live_tokens`)."""
    try:
        report = json.loads(path.read_text())
    except OSError as e:
        raise RulesRefused(f"--from-check {path}: {e.strerror or e}") from None
    except ValueError:
        raise RulesRefused(f"--from-check {path}: not a JSON check report") from None
    envelope = report.get("envelope") if isinstance(report, dict) else None
    tokens = envelope.get("live_tokens") if isinstance(envelope, dict) else None
    if not isinstance(tokens, int | float) or tokens < 1:
        raise RulesRefused(f"--from-check {path}: the report holds no envelope (its server exported no live-token "
                           "count, or the check predates it); give --envelope-tokens")
    until = envelope.get("until") or "the end of the churn"
    return int(tokens), f"measured by fragbench check on {report.get('target', '?')}: the most live tokens " \
                        f"before {until}"
