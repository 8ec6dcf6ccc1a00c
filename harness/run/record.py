"""The run's record as it is produced: run.json (one dict, written whole and atomically: a kill never leaves half
of it) and the events journal (crashes, restarts, OOMs, releases). Each of the bench's collaborators writes what
it learns here, through a method named for it; a method says whether it writes run.json at once or leaves it to
the next write."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from engines.api.stats import EngineConfigBlock, OomEventRow
from harness.analysis.design import Design
from harness.analysis.records import RecordedTarget, RunRecord, SearchSettings
from harness.results import Journal, write_whole
from harness.run.config import BenchConfig
from harness.run.engine_run import EngineRun
from harness.run.provenance import git_sha, hardware, versions
from harness.run.speed_probes import DESCRIBED, reading
from harness.units import KvBudget

OOM_STATE = ("running", "waiting", "live_tokens", "kv_usage")  # the engine when an allocation failed
OOM_LAYER = ("layer", "cached_free_bytes", "device_free_bytes")  # policy or allocator, and the bytes that tell


class RunFolderRefused(ValueError):
    """A run's folder that cannot be its own (taken by another run, or not makeable): one line, exit 2."""


def claim_run_dir(out_dir: Path, run_id: str, numbered: bool) -> Path:
    """The run's folder, made here and by no one else (mkdir without exist_ok: of two runs that ask for one folder at
    once, one gets it), so that two runs never merge and none overwrites another. A run id the user gave is refused
    when taken; the default one (`numbered`) takes the next free `-2`, `-3`... (two runs started in one second)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # unwritable, or a file
        raise RunFolderRefused(f"--out {out_dir}: cannot make the run's folder in it ({e.strerror or e})") from None
    for n in range(1, 1000 if numbered else 2):
        path = out_dir / (run_id if n == 1 else f"{run_id}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            if not numbered:
                raise RunFolderRefused(f"--run-id {run_id}: {path} already exists (a run is never merged into "
                                       f"another or overwritten): give another --run-id or --out") from None
        except OSError as e:  # unwritable
            raise RunFolderRefused(f"--out {out_dir}: cannot make the run's folder {path.name} "
                                   f"({e.strerror or e})") from None
    raise RunFolderRefused(f"--out {out_dir}: {run_id} and 998 numbered after it are taken: give --run-id")


class RunWriter:
    """run.json's and the events journal's writer (run.json's reader: harness/analysis/records.RunRecord)."""

    def __init__(self, cfg: BenchConfig, run_dir: Path):
        """A partial run's record: the configuration (the targets' API key never), where and on what it runs."""
        self.dir = run_dir
        self.meta = {  # run.json as it is produced: bench adds to it as it runs (readers type it: `typed`)
            "run_id": cfg.run_id, "status": "partial", "started": datetime.now(timezone.utc).isoformat(),
            "config": {**cfg.record(), "out_dir": str(cfg.out_dir), "api_key": "(given)" if cfg.api_key else None},
            "git_sha": git_sha(),
            "versions": versions(), "hardware": hardware(cfg.device), "engines_done": [], "command": sys.argv,
        }
        self.memory = cfg.memory  # --memory: an OOM's layer is recorded where a caching allocator holds the KV
        self.events = Journal(run_dir / "events.jsonl")

    @classmethod
    def start(cls, cfg: BenchConfig, run_dir: Path) -> RunWriter:
        """The record, its run.json written at once."""
        record = cls(cfg, run_dir)
        record.write()
        return record

    def write(self) -> None:
        write_whole(self.dir / "run.json", json.dumps(self.meta, indent=2, default=str))  # a kill never halves it

    # -- events
    def event(self, run: EngineRun, kind: str, t_s: float | None = None, **fields) -> None:
        t = t_s if t_s is not None else time.time() - run.t0
        self.events.write({"engine": run.engine, "t_s": round(t, 4), "t_wall": run.t0 + t, "kind": kind, **fields})

    def oom_event(self, run: EngineRun, t_s: float, row: OomEventRow, outcome: str) -> None:
        """One failed allocation (an OOM event of the engine's /stats, or its crash line) with the engine's state
        then, as columns (and a sentence in `detail`)."""
        ev = row.written()  # the state rides along as the row's extra fields: read by name, absent ones null
        state = {k: ev.get(k) for k in OOM_STATE}
        words = ", ".join(f"{k.replace('_', ' ')} {v:.2f}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
                          for k, v in state.items() if v is not None)
        # which layer failed, where a caching allocator holds the KV (engines/memory/caching_memory.py); null elsewhere
        layer = {k: ev.get(k) if self.memory == "caching" else None for k in OOM_LAYER}
        self.event(run, "oom", t_s, requested_bytes=ev.get("requested_bytes"), free_bytes=ev.get("free_bytes"),
                   largest_free_bytes=ev.get("largest_free_bytes"), cause=ev.get("cause"),
                   detail=f"{outcome}; {words}", **state, **layer)

    # -- run.json, written at once
    def sweep(self, rates: list[float] | None, point_s: float | None, design: Design,
              search: SearchSettings | None) -> None:
        """The sweep's plan: fixed rates, or the design and the rules the knee searches run by."""
        self.meta["sweep"] = {"rates": rates, "point_s": point_s, "points": {}, "design": design.to_json(),
                              "search": None if search is None else search.written()}
        self.write()

    def engine_config(self, engine: str, budget: KvBudget, config: EngineConfigBlock) -> None:
        """The configuration the engine's server reported at a budget, as it said it (the twin configures itself
        from it)."""
        self.meta.setdefault("engine_config", {}).setdefault(engine, {})[str(budget)] = config.written()
        self.write()

    def target(self, engine: str, described: RecordedTarget) -> None:
        self.meta.setdefault("targets", {})[engine] = described.written()
        self.write()

    def calibration(self, engine: str, budget: KvBudget, rate_rps: float) -> None:
        self.meta.setdefault("calibration", {}).setdefault(engine, {})[str(budget)] = rate_rps
        self.write()

    def engine_t0(self, engine: str, t0: float) -> None:
        """The engine's clock (wall): finalize re-bases the rows written before it started."""
        self.meta.setdefault("engine_t0", {})[engine] = t0
        self.write()

    def speed_probe(self, at: str) -> None:
        """The machine's speed now (harness/run/speed_probes.py), appended to run.json's `speed_probe`."""
        probe = self.meta.setdefault("speed_probe", {**DESCRIBED, "readings": []})
        probe["readings"].append(reading(at))
        self.write()

    def engine_done(self, engine: str) -> None:
        self.meta["engines_done"].append(engine)
        self.write()

    def complete(self, started: float, failure: str | None = None) -> None:
        """The run's end: `started` the wall clock it began at; `failure`, why it measured nothing (no engine
        started, every request failed): its status is then "failed", not "complete"."""
        self.meta["status"] = "complete" if failure is None else "failed"
        if failure is not None:
            self.meta["failure"] = failure
        self.meta["finished"] = datetime.now(timezone.utc).isoformat()
        self.meta["bench_s"] = round(time.time() - started, 1)
        self.write()

    def stopped(self, why: str) -> None:
        """A run cut off before its end (Ctrl-C, SIGTERM, an error): its status stays partial, why it stopped
        beside it, written at once (the report's PARTIAL mark names it)."""
        self.meta["stopped"] = why
        self.write()

    # -- run.json, written with the next write
    def setup_s(self, engine: str, seconds: float) -> None:
        self.meta.setdefault("setup_s", {})[engine] = round(seconds, 1)

    def operating_point(self, engine: str, rate_rps: float, keys: list[str]) -> None:
        self.meta.setdefault("operating_point", {})[engine] = {"offered_rps": rate_rps, "keys": keys}

    def spread_prior(self, block: dict) -> None:
        """Each headline engine's stream-spread prior from its twin (harness/sim/spread_prior.py), computed once
        before the decision: every fit from then on (the decision's, summary.json's) reads it here. Written at once."""
        self.meta["spread_prior"] = block
        self.write()

    def screen(self, engine: str, screened: dict) -> None:
        """An engine's screen (harness/run/search.py): the rival and its interval then, the rate, what the point
        judged and whether it ruled the engine out (or why no point fitted)."""
        self.meta.setdefault("screens", {})[engine] = screened

    def points(self, engine: str) -> list[dict]:
        """The engine's sweep points (every budget's), the list run.json holds: a point appended is recorded."""
        return self.meta["sweep"]["points"].setdefault(engine, [])

    def decision_log(self) -> list[dict]:
        """The decision's looks at the headline, the list run.json holds."""
        return self.meta.setdefault("decision", [])

    # -- read
    def typed(self) -> RunRecord:
        """run.json as it stands, typed for the analysis (what summary.json will read of it)."""
        return RunRecord.of(self.meta)

    def setups_s(self) -> list[float]:
        """Each engine's set-up so far, seconds."""
        return list(self.meta.get("setup_s", {}).values())
