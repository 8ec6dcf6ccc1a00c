"""`fragbench simulate --memory caching --alloc-conf A --alloc-conf B ...`: the same simulation (seed, workload,
policies) once per allocator setting, put side by side. Per policy and setting: the sustained rate, the share of the
budget the caching allocator reserved but allocated to nothing, and the OOMs by layer; and per policy a sentence
saying what the second..nth setting changed against the first. The simulation is deterministic, so two figures that
differ at all differ because of the setting: they are compared exactly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from engines.memory.allocconf import parse_alloc_conf
from harness.analysis.alloc_settings_summary import figure_change
from harness.analysis.summary_records import CapacityBlock, PolicyFigures, SimulationOut
from harness.sim.simulator import Simulation

SWEEP, COMPLETED = "sweep", "completed"  # where a row's sustained rate comes from


class SettingsRefused(ValueError):
    """Allocator settings that cannot be put side by side, named as the user gave them."""


def check_settings(confs: list[str]) -> None:
    """Two spellings of one setting would run the same simulation twice and name two report pages alike."""
    seen: dict = {}
    for conf in confs:
        key = replace(parse_alloc_conf(conf), text="")  # what the allocator does, not how it was spelled
        if key in seen:
            raise SettingsRefused(f"--alloc-conf {conf!r} is the same setting as {seen[key]!r}: give each once")
        seen[key] = conf


@dataclass(frozen=True)
class SettingRow:
    """One policy under one allocator setting: a row of the side-by-side table (--json prints its fields in this
    order)."""

    policy: str
    alloc_conf: str | None
    sustained_rps: float | None
    sustained_from: str  # SWEEP or COMPLETED
    reserved_unallocated_share: float | None
    oom_policy: int | None
    oom_allocator: int | None

    def to_json(self) -> dict:
        return asdict(self)


def sustained_rate(capacity: CapacityBlock | None, figures: PolicyFigures) -> tuple[float | None, str]:
    """The policy's sustained requests/s: the sweep's within the SLO where --sweep or --rates gave one (its
    `capacity`), else the requests it completed per simulated second (None for a run that simulated no time)."""
    if capacity is not None:
        return capacity.sustained_rps, SWEEP
    return figures.completed_rps, COMPLETED


def side_by_side(outs: list[SimulationOut]) -> list[SettingRow]:
    """One row per policy and setting (policies in the first run's order, settings in the order given)."""
    rows = []
    for policy in outs[0].policies:
        for out in outs:
            figures = out.policies[policy]
            rate_rps, source = sustained_rate(out.capacity.get(policy), figures)
            a = figures.allocator
            rows.append(SettingRow(policy, out.alloc_conf, rate_rps, source, a.reserved_unallocated_share,
                                   a.oom_policy, a.oom_allocator))
    return rows


def combined(sims: list[Simulation]) -> dict:
    """What --json prints with several settings: each setting's whole usual output (its `out`, as it is), then
    the side-by-side rows."""
    rows = side_by_side([sim.record for sim in sims])
    return {"alloc_confs": [{"alloc_conf": sim.out["alloc_conf"], **sim.out} for sim in sims],
            "side_by_side": [row.to_json() for row in rows]}


def rate_words(rate_rps: float | None, digits: int) -> str:
    return "n/a" if rate_rps is None else f"{rate_rps:.{digits}f} req/s"


def share_words(share: float | None, digits: int) -> str:
    return "n/a" if share is None else f"{100 * share:.{digits}f} %"


def count_words(count: int, digits: int) -> str:
    return str(count)


# the figures a sentence compares: (its words, its row field, how it reads at a number of decimals)
FIGURES: tuple[tuple[str, str, Callable], ...] = (
    ("sustained rate", "sustained_rps", rate_words),
    ("reserved-unallocated share", "reserved_unallocated_share", share_words),
    ("policy-layer OOMs", "oom_policy", count_words),
    ("allocator-layer OOMs", "oom_allocator", count_words),
)


def apart(before, after, words: Callable) -> tuple[str, str]:
    """Both figures at the fewest decimals (from 1) that show them apart: two figures the simulation made differ
    for a reason, however little, and must not read alike."""
    for digits in range(1, 7):
        a, b = words(before, digits), words(after, digits)
        if a != b:
            break
    return a, b


def change_words(first: SettingRow, row: SettingRow) -> str:
    """What `row`'s setting changed against the first setting's row of the same policy."""
    changed = [figure_change(name, *apart(getattr(first, key), getattr(row, key), words))
               for name, key, words in FIGURES if getattr(first, key) != getattr(row, key)]
    same = [name for name, key, _ in FIGURES if getattr(first, key) == getattr(row, key)]
    if not changed:
        return f"{row.alloc_conf}: no difference"
    text = f"{row.alloc_conf} changed " + ", ".join(changed)
    return text + ("; no difference in " + ", ".join(same) if same else "")


def sentences(rows: list[SettingRow]) -> list[str]:
    """One sentence per policy: what each later setting changed against the first."""
    by_policy: dict[str, list[SettingRow]] = {}
    for row in rows:
        by_policy.setdefault(row.policy, []).append(row)
    return [f"{policy}, against {first.alloc_conf}: " + "; ".join(change_words(first, r) for r in rest) + "."
            for policy, (first, *rest) in by_policy.items()]
