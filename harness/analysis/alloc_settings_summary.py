"""summary.json's `alloc_settings` (bench --compare-alloc-conf): the caching allocator's settings side by side.
The run's own setting first (its `--alloc-conf`), then each compared one, whose run lies in the run's folder
(`alloc_confs/<n>-<setting>/`, written by harness/run/alloc_settings_runs.py). Per engine whose KV the allocator
places piece by piece: the sustained rate with its 90 % interval (a knee search's), the mean share of the KV
budget reserved but allocated to nothing over the steady churn, the OOMs by layer (the policy's: the live KV
and the request pass the cap; the allocator's: cached and never-reserved bytes would hold it, no block does),
and the peaks; each figure as that setting's own summary.json has it, so every number is measured in its run.
How a figure's change between two settings reads (`figure_change`) is worded here once, for the report's section
(harness/views/alloc_settings_section.py) and simulate's sentences (harness/sim/alloc_settings_sim.py) alike."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from engines.registry import entry
from harness.analysis.records import RunConfig
from harness.analysis.summary_records import Summary

SETTINGS_DIR = "alloc_confs"  # under the run's folder: one run directory per compared setting


def figure_change(name: str, before: str, after: str) -> str:
    """One figure's change from the first setting to another, as both sides word it: `name before -> after`."""
    return f"{name} {before} -> {after}"


def compared_engines(engines: list[str]) -> list[str]:
    """The engines whose KV a caching allocator places piece by piece: in-house, contiguous, taking --memory
    caching (hf's torch.cat buffers, a static engine's buffer per request, growth's re-allocations). Paged is
    not among them: its KV is one pool allocated once, which no allocator setting changes."""
    return [e for e in engines if entry(e).in_house and entry(e).kv == "contiguous" and entry(e).memory is not None
            and entry(e).takes_memory("caching")]


def setting_id(number: int, conf: str) -> str:
    """A compared setting's folder name: its place and its text, in characters a path keeps."""
    return f"{number}-" + (re.sub(r"[^A-Za-z0-9_.-]+", "_", conf.strip()) or "default")


def settings_block(run_dir: Path, summary: Summary, cfg: RunConfig,
                   finalize: Callable[[Path], Summary]) -> list[dict]:
    """One record per setting the run compared (--compare-alloc-conf), the run's own first. `summary`: the run's
    own, as summarize is writing it. `finalize` summarizes a setting's run that never wrote its summary
    (summary.finalize, handed in: that module imports this one)."""
    confs = cfg.compare_alloc_confs
    engines = compared_engines(cfg.engines or [])
    out = [setting_record(cfg.alloc_conf or "default", None, summary, engines)]
    for number, conf in enumerate(confs, start=1):
        rel = f"{SETTINGS_DIR}/{setting_id(number, conf)}"
        out.append(setting_record(conf, rel, setting_summary(run_dir / rel, finalize), engines))
    return out


def setting_summary(sub: Path, finalize: Callable[[Path], Summary]) -> Summary | None:
    """A setting's summary.json; one its run never wrote (the run was killed in it) is computed from the rows it
    left, as any partial run's is; None where the setting's run never began."""
    if (sub / "summary.json").is_file():
        return Summary.model_validate(json.loads((sub / "summary.json").read_text()))
    if not (sub / "run.json").is_file():
        return None
    return finalize(sub)


def setting_record(conf: str, run: str | None, summary: Summary | None, engines: list[str]) -> dict:
    """A setting's figures per engine; `status` says whether its run finished (a killed one: partial, or absent)."""
    status = "absent" if summary is None else summary.status if summary.has("status") else "partial"
    rows = {e: engine_figures(e, summary or Summary()) for e in engines}
    return {"alloc_conf": conf, "run": run, "status": status, "engines": rows}


def engine_figures(engine: str, summary: Summary) -> dict:
    """One engine under one setting (summary.json's `alloc_settings[i].engines.<engine>`, as its run's summary has
    each figure); `served` false where its server never served a request under it (it refused the setting: an
    expandable segment maps 20 MiB pages, which a smaller cap cannot hold)."""
    cap, mine = summary.capacity.get(engine), summary.engines.get(engine)
    alloc = mine.allocator if mine is not None else None

    def of(record, name: str):  # a figure as its summary.json has it, None where that lacks it
        return record.figure(name) if record is not None else None

    return {"served": mine is not None and bool(mine.written()), "sustained_rps": of(cap, "sustained_rps"),
            "sustained_rps_ci": of(cap, "sustained_rps_ci"),
            "sustained_where": of(cap, "sustained_where"), "bound": of(cap, "bound"),
            "reserved_unallocated_share": of(alloc, "reserved_unallocated_share"),
            "peak_reserved_bytes": of(alloc, "peak_reserved_bytes"),
            "peak_allocated_bytes": of(alloc, "peak_allocated_bytes"), "alloc_retries": of(alloc, "alloc_retries"),
            "oom_policy": of(alloc, "oom_policy"), "oom_allocator": of(alloc, "oom_allocator"),
            "size_classes": alloc.size_classes.written() if alloc is not None and alloc.size_classes else None}
