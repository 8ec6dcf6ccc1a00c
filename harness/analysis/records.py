"""run.json as a typed record (and the base of summary.json's, summary_records.py): read once, at the boundary,
then passed whole. What the views and the analysis read is a field here; what they do not read rides along
(`extra="allow"`), so a record holds its file's every key and adding a figure needs no change here until something
reads it.

bench writes run.json from dicts: these records are its reading side alone, so the file keeps its fields, values and
bytes. summary.json is written from its record (summary_records.py's records keep the order their keys were given)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import PrivateAttr

from engines.json_record import Num, Record
from harness.analysis.capacity import SLO
from harness.analysis.speed_probe import SpeedProbe
from harness.units import KvBudget


# -- run.json
class RecordedSegment(Record):
    """A sweep point's stretch of load (workloads/streams.Segment as run.json records it)."""

    start_s: Num
    end_s: Num
    warmup_s: Num = 0.0
    judged_end_s: Num
    first: Num | None = None  # the stream's index of its first request
    visit: Num | None = None


class SweepPoint(Record):
    """One offered rate of one engine, where its load ran (a run before segments recorded start_s/end_s)."""

    offered_rps: Num
    point: Num | None = None  # its index, which the request rows carry
    key: str | None = None
    kv_budget: str | None = None
    start_s: Num | None = None
    end_s: Num | None = None
    segments: list[RecordedSegment] | None = None  # [] before it is measured; None in a run that recorded windows


class RecordedDesign(Record):
    rules: list[str] = []


class SearchSettings(Record):
    """run.json's `sweep.search`: the rules the knee searches ran by (in the order bench writes them)."""

    max_points: Num | None = None
    tolerance: Num | None = None
    step: Num | None = None
    start_share_of_calibration: Num | None = None
    min_judged: Num | None = None
    max_judged: Num | None = None
    search_s: Num | None = None
    time_s: Num | None = None
    precision: Num | None = None
    target: Num | None = None


class Sweep(Record):
    points: dict[str, list[SweepPoint]] = {}
    point_s: Num | None = None
    search: SearchSettings | None = None
    design: RecordedDesign | None = None


class RecordedTarget(Record):
    """A server fragbench did not start (run.json's `targets`)."""

    url: str = ""
    model: str = ""
    metrics_url: str | None = None  # in the order Target.describe writes them (run.json keeps it)
    family: str | None = None
    sees: list[str] = []
    cannot_see: list[str] = []
    network_rtt_s: float | None = None  # median GET of its /health (or /v1/models) before the run: the network


class Hardware(Record):
    device_name: str | None = None
    device_device: str | None = None


class RunConfig(Record):
    """run.json's `config`: the flags as bench resolved them."""

    engines: list[str] = []
    workload: str | None = None
    model: str | None = None
    seed: Num = 0
    max_seq_len: Num | None = None
    kv_budget: str | None = None
    kv_budgets: list[str] | None = None
    duration_s: Num | None = None
    warmup_s: Num | None = None
    grace_s: Num = 0.0
    slo_ttft_s: Num | None = None
    slo_tpot_s: Num | None = None
    slo_attainment: Num | None = None
    precision: Num | None = None
    time_s: Num | None = None
    memory: str | None = None
    alloc_conf: str | None = None
    compare_alloc_confs: list[str] = []
    targets: dict[str, Any] = {}  # name -> URL as given; run.json's top-level `targets` says what each showed

    @property
    def slo(self) -> SLO:
        """The run's SLO; the defaults for a run.json written before it recorded one."""
        default = SLO()
        return SLO(default.ttft_s if self.slo_ttft_s is None else self.slo_ttft_s,
                   default.tpot_s if self.slo_tpot_s is None else self.slo_tpot_s,
                   default.attainment if self.slo_attainment is None else self.slo_attainment)

    @property
    def budget(self) -> KvBudget | None:
        """The run's own KV budget, parsed once; None where it is absent or no size."""
        try:
            return KvBudget.parse(self.kv_budget) if self.kv_budget is not None else None
        except ValueError:
            return None

    @property
    def budgets(self) -> list[KvBudget]:
        """--kv-budgets, parsed (the first is the run's own)."""
        return [KvBudget.parse(b) for b in self.kv_budgets or []]

    @property
    def warmup(self) -> float:
        """Seconds of churn before memory is sampled into the shares: the given warm-up, else a tenth."""
        return float(self.warmup_s) if self.warmup_s is not None else 0.1 * float(self.duration_s or 0.0)


class RunRecord(Record):
    """run.json: the run's configuration, state and where its load ran."""

    run_id: str | None = None
    status: str | None = None  # partial (until the end, or where it stopped), complete or failed
    failure: str | None = None  # a failed run's cause (measured nothing)
    stopped: str | None = None  # why a partial run stopped, where it knew (Ctrl-C, SIGTERM, an error)
    started: str | None = None
    git_sha: str | None = None
    config: RunConfig = RunConfig()
    engine_t0: dict[str, Num] = {}
    engines_done: list[str] = []
    sweep: Sweep | None = None
    operating_point: dict[str, Any] | None = None  # copied into summary.json as written: kept as it was
    setup_s: dict[str, Num] | None = None
    bench_s: Num | None = None
    targets: dict[str, RecordedTarget] | None = None
    hardware: Hardware | None = None
    engine_config: dict[str, dict[str, dict]] | None = None  # engine -> budget -> its server's settings, free-form
    speed_probe: SpeedProbe | None = None  # the machine's speed at start, middle and end (None: an older run)
    # the knee fits' informative priors on the headline engines' stream spread and load gain, from their twins,
    # computed before the decision (harness/sim/spread_prior.prior_block; None: the half-t, as before)
    spread_prior: dict[str, Any] | None = None
    _raw: dict = PrivateAttr(default_factory=dict)

    @classmethod
    def of(cls, meta: dict) -> RunRecord:  # the parse edge: run.json's object, as json.loads gave it, typed once
        record = cls.model_validate(meta)
        record._raw = meta
        return record

    @classmethod
    def read(cls, run_dir: Path) -> RunRecord:
        path = Path(run_dir) / "run.json"
        if not path.is_file():
            raise FileNotFoundError(f"{run_dir} is not a run directory (no run.json)")
        return cls.of(json.loads(path.read_text()))

    @property
    def raw(self) -> dict:
        """run.json as written, for the report's configuration section, which prints it whole."""
        return self._raw

    def points_of(self, engine: str) -> list[SweepPoint]:
        return self.sweep.points.get(engine, []) if self.sweep else []

    @property
    def swept(self) -> dict[str, list[SweepPoint]]:
        return self.sweep.points if self.sweep else {}
