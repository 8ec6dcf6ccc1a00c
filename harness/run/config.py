"""A bench run's configuration: what it runs, on what, for how long (`fragbench bench`'s flags, typed)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.analysis.records import RecordedTarget
from harness.run.loadargs import Traffic
from harness.units import KvBudget


@dataclass(kw_only=True)
class BenchConfig(Traffic):
    """A bench run: the traffic every engine is given (`Traffic`'s fields), and what it runs it on."""

    engines: list[str]
    model: str
    kv_budget: KvBudget  # the run's own: its files and run.json carry its label, its servers its bytes
    out_dir: Path
    threads: int = 2
    run_id: str = ""
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    slo_attainment: float = 0.9
    device: str = "cpu"  # resolved: cpu or cuda[:N]
    memory: str = "arena"  # arena: one buffer carved exactly; cuda: PyTorch's caching allocator; caching: emulated
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF for the servers (the emulator's, or the real one's)
    compare_alloc_confs: list[str] = field(default_factory=list)  # settings compared: a run each (alloc_settings)
    # capacity sweep: the workload offered at several rates, one server per engine (and budget) for all of them
    sweep: bool = False
    rates: list[float] | None = None  # the same given rates for every engine; else each engine's knee search
    points: int = 8  # the knee search's most points per engine and budget
    point_s: float | None = None  # seconds of judged arrivals per point, at least (--rates: per point)
    point_requests: int | None = None  # judged requests per point, at least (default: the design's rule)
    search_s: float | None = None  # seconds one engine's knee search may spend (per budget), at most
    knee_tolerance: float | None = None  # bisect until hi <= lo x (1 + this) (default: the design's rule)
    time_s: float = 900.0  # the whole bench's time: set-up, every search and the decision
    precision: float = 1.5  # the headline ratio's interval asked: hi / lo at most this
    calibrate_s: float = 12.0  # seconds of one saturating calibration window
    throughput_repeats: int | None = None  # saturation sets' pairs (None: analysis/saturation.repeats_by_rule)
    kv_budgets: list[KvBudget] = field(default_factory=list)  # every budget searched (kv_budget first), by bytes
    warmup_s: float | None = None  # churn seconds left out of the memory shares (default: a tenth)
    kill_after_s: float | None = None  # fault injection: SIGKILL each engine's server this far into its churn
    engine_args: dict[str, list[str]] = field(default_factory=dict)  # extra serve flags per engine
    targets: dict[str, RecordedTarget] = field(default_factory=dict)  # name -> Target.describe(): servers not ours
    api_key: str | None = None  # the targets'; never written to run.json

    def record(self) -> dict:
        """The fields as run.json's `config` writes them: each budget as the label the user wrote (asdict alone
        would spell a KvBudget as its bytes and label), each target as `describe` wrote it."""
        return {**asdict(self), "kv_budget": str(self.kv_budget), "kv_budgets": [str(b) for b in self.kv_budgets],
                "targets": {name: t.written() for name, t in self.targets.items()}}
