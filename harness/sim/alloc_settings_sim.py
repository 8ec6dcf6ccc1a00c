"""`fragbench simulate --memory caching --alloc-conf A --alloc-conf B ...`: the same simulation (seed, workload,
policies) once per allocator setting, put side by side. Per policy and setting: the sustained rate, the share of the
budget the caching allocator reserved but allocated to nothing, and the OOMs by layer; and per policy a sentence
saying what the second..nth setting changed against the first. The simulation is deterministic, so two figures that
differ at all differ because of the setting: they are compared exactly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engines.memory.allocconf import parse_alloc_conf

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


def sustained_rate(out: dict, policy: str) -> tuple[float | None, str]:
    """The policy's sustained requests/s: the sweep's within the SLO where --sweep or --rates gave one, else the
    requests it completed per simulated second (None for a run that simulated no time)."""
    capacity = (out.get("capacity") or {}).get(policy)
    if capacity is not None:
        return capacity["sustained_rps"], SWEEP
    r = out["policies"][policy]
    return (r["requests_completed"] / r["simulated_s"] if r["simulated_s"] else None), COMPLETED


def side_by_side(outs: list[dict]) -> list[dict]:
    """One row per policy and setting (policies in the first run's order, settings in the order given)."""
    rows = []
    for policy in outs[0]["policies"]:
        for out in outs:
            rate_rps, source = sustained_rate(out, policy)
            a = out["policies"][policy]["allocator"]
            rows.append({"policy": policy, "alloc_conf": out["alloc_conf"], "sustained_rps": rate_rps,
                         "sustained_from": source, "reserved_unallocated_share": a["reserved_unallocated_share"],
                         "oom_policy": a["oom_policy"], "oom_allocator": a["oom_allocator"]})
    return rows


def combined(outs: list[dict]) -> dict:
    """What --json prints with several settings: each setting's whole usual output, then the side-by-side rows."""
    return {"alloc_confs": [{"alloc_conf": out["alloc_conf"], **out} for out in outs],
            "side_by_side": side_by_side(outs)}


def rate_words(rate_rps: float | None, digits: int) -> str:
    return "n/a" if rate_rps is None else f"{rate_rps:.{digits}f} req/s"


def share_words(share: float | None, digits: int) -> str:
    return "n/a" if share is None else f"{100 * share:.{digits}f} %"


def count_words(count: int, digits: int) -> str:
    return str(count)


# the figures a sentence compares: (its words, its row key, how it reads at a number of decimals)
FIGURES: tuple[tuple[str, str, Callable], ...] = (
    ("sustained rate", "sustained_rps", rate_words),
    ("reserved-unallocated share", "reserved_unallocated_share", share_words),
    ("policy-layer OOMs", "oom_policy", count_words),
    ("allocator-layer OOMs", "oom_allocator", count_words),
)


def from_to(before, after, words: Callable) -> str:
    """`before -> after` at the fewest decimals (from 1) that show them apart: two figures the simulation made
    differ for a reason, however little, and must not read alike."""
    for digits in range(1, 7):
        a, b = words(before, digits), words(after, digits)
        if a != b:
            break
    return f"{a} -> {b}"


def change_words(first: dict, row: dict) -> str:
    """What `row`'s setting changed against the first setting's row of the same policy."""
    changed = [f"{name} {from_to(first[key], row[key], words)}" for name, key, words in FIGURES
               if first[key] != row[key]]
    same = [name for name, key, _ in FIGURES if first[key] == row[key]]
    if not changed:
        return f"{row['alloc_conf']}: no difference"
    text = f"{row['alloc_conf']} changed " + ", ".join(changed)
    return text + ("; no difference in " + ", ".join(same) if same else "")


def sentences(rows: list[dict]) -> list[str]:
    """One sentence per policy: what each later setting changed against the first."""
    by_policy: dict[str, list[dict]] = {}
    for row in rows:
        by_policy.setdefault(row["policy"], []).append(row)
    return [f"{policy}, against {first['alloc_conf']}: " + "; ".join(change_words(first, r) for r in rest) + "."
            for policy, (first, *rest) in by_policy.items()]
