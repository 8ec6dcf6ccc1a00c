"""summary.json (and `fragbench simulate`'s output, which shares its capacity blocks) as typed records: what every
page reads of a run, read once where the page starts (harness/analysis/records.py says how the records are made)."""

from __future__ import annotations

from typing import Any

from harness.analysis.capacity import SLO
from harness.analysis.records import Num
from harness.analysis.saturation_summary import SaturationBlock
from harness.analysis.summary_block import SummaryBlock


class Divergence(SummaryBlock):
    """A probe that diverged from its idle answer: its row (integrity.jsonl) and what the engine was doing."""

    probe: str = ""
    kind: str = ""
    diverged_at: Num | None = None
    why: str | None = None
    doing: str = ""


class Integrity(SummaryBlock):
    """An engine's KV-integrity probes, judged (analysis/integrity.py), with the idle phase they rest on."""

    probes: Num = 0
    diverged: Num = 0
    max_abs_logprob_diff: Num | None = None
    tolerance: Num = 0.0
    idle_max_abs_logprob_diff: Num | None = None
    reference_probes: Num = 0
    of_probes: Num = 0
    preempted_probes: Num = 0
    prefix_hit_probes: Num = 0
    failed: Num = 0
    ties: Num = 0
    ended_early: Num = 0
    divergences: list[Divergence] = []


class SizeClasses(SummaryBlock):
    """Allocations by PyTorch's size class (small <= 1 MiB, large under 10 MiB, huge)."""

    small: Num = 0
    large: Num = 0
    huge: Num = 0


class AllocatorFigures(SummaryBlock):
    """The caching allocator's figures under --memory caching (analysis/allocator_summary.py; simulate's per policy)."""

    alloc_conf: str | None = None
    reserved_unallocated_share: Num | None = None
    peak_reserved_unallocated_bytes: Num | None = None
    peak_reserved_bytes: Num | None = None
    peak_allocated_bytes: Num | None = None
    allocated_bytes: Num | None = None
    reserved_bytes: Num | None = None
    inactive_split_bytes: Num | None = None
    segments: Num | None = None
    peak_segments: Num | None = None
    alloc_retries: Num | None = None
    oom_policy: Num | None = None
    oom_allocator: Num | None = None
    size_classes: SizeClasses | None = None


class EngineFigures(SummaryBlock):
    """summary.json's `engines.<engine>`: one engine's figures over the run (summary.engine_summary)."""

    source: str = "fragbench"
    token_states_share: Num | None = None
    reservation_share: Num | None = None
    internal_fragmentation_share: Num | None = None
    external_fragmentation_share: Num | None = None
    free_share: Num | None = None
    allocated_share: Num | None = None
    mean_running: Num | None = None
    max_running: Num | None = None
    oom_total: Num | None = None
    oom_fragmentation: Num | None = None
    oom_capacity: Num | None = None
    preemptions: Num | None = None
    output_tokens_per_s: Num | None = None
    requests_per_s: Num | None = None
    goodput_requests_per_s: Num | None = None
    ttft_p50_s: Num | None = None
    ttft_p99_s: Num | None = None
    tpot_p50_s: Num | None = None
    tpot_p99_s: Num | None = None
    ttft_p90_s: Num | None = None  # absent in a summary.json written before they were (read as n/a)
    tpot_p90_s: Num | None = None
    late_p99_s: Num | None = None
    crashes: Num = 0
    cancelled: Num = 0
    cancel_release_p99_s: Num | None = None
    requests_ok: Num = 0
    requests_oom: Num = 0
    requests_rejected: Num = 0
    requests_error: Num = 0
    requests_crashed: Num = 0
    requests_unfinished: Num = 0
    kv_bytes_per_token: Num | None = None
    integrity: Integrity | None = None
    allocator: AllocatorFigures | None = None


class CapacityPoint(SummaryBlock):
    """One offered rate's figures in a capacity block (summary.point_figures; simulate's, with fewer)."""

    offered_rps: Num
    key: str | None = None
    slo_attainment: Num | None = None
    judged: Num | None = None
    requests: Num | None = None
    steady: bool | None = None  # absent in a simulation's sweep: every point taken as it is
    knee_use: str | None = None
    halves: list[Num | None] | None = None
    running_halves: list[Num | None] | None = None
    mean_running: Num | None = None
    normalized_latency_s_per_token: Num | None = None
    ttft_p50_s: Num | None = None
    tpot_p50_s: Num | None = None
    oom_total: Num = 0
    oom_fragmentation: Num = 0
    preemptions: Num = 0
    token_states_share: Num | None = None
    reservation_share: Num | None = None
    internal_fragmentation_share: Num | None = None
    external_fragmentation_share: Num | None = None
    free_share: Num | None = None


class KneePoint(SummaryBlock):
    """The figures at the lowest rate that missed the SLO (knee.knee_block writes them, in this order)."""

    kv_usage: Num | None = None
    waiting_for_memory_share: Num | None = None
    running: Num | None = None
    step_s: Num | None = None
    oom_total: Num = 0
    preemptions: Num = 0
    offered_rps: Num
    crashes: Num = 0


class Knee(SummaryBlock):
    points: Num | None = None
    streams: Num | None = None
    bracketed: bool | None = None


class OperatingPoint(SummaryBlock):
    """The fixed rate an engine is measured at first, on keys no search reaches (analysis/operating.py)."""

    offered_rps: Num | None = None
    keys: list[str] = []


class RulingBlock(SummaryBlock):
    """`capacity.<contiguous engine>.ruling`: ruled out or not (analysis/ruled_out.py), against whom, on what."""

    ruled_out: bool = False
    leader: str | None = None
    leader_rps: Num | None = None
    offered_rps: Num | None = None
    met: Num | None = None
    judged: Num | None = None
    wilson_90: list[Num] | None = None
    target: Num | None = None
    met_above_rps: Num | None = None
    words: str = ""


class LoadIndependentMisses(SummaryBlock):
    """`capacity.<engine>.load_independent_misses`: the share of judged requests missed at rates at most
    `at_most_rps` (analysis/knee.LIGHT_LOAD), its 90 % interval, and the failures and OOMs at those rates."""

    share: Num
    share_ci: list[Num]
    judged: Num
    missed: Num
    failed: Num = 0
    oom_total: Num = 0
    oom_fragmentation: Num = 0
    at_most_rps: Num
    rates: list[Num] = []


class CapacityBlock(SummaryBlock):
    """summary.json's `capacity.<engine>`: the sustained rate at the SLO, its interval and the points."""

    sustained_rps: Num
    sustained_where: str = "within"
    slo: SLO = SLO()
    points: list[CapacityPoint] = []
    sustained_rps_ci: list[Num] | None = None
    rests_on_unsteady: bool | None = None
    judged_total: Num | None = None
    distinct_requests: Num | None = None
    bound: str | None = None
    bound_evidence: str | None = None
    knee_point: KneePoint | None = None
    knee: Knee | None = None
    sustained_bound: dict[str, Any] | None = None  # a knee not bracketed: the bound it is (analysis/knee.bound_of)
    role: str | None = None
    operating_point: OperatingPoint | None = None
    ruling: RulingBlock | None = None  # contiguous engines where the run has a paged one (analysis/ruled_out.py)
    load_independent_misses: LoadIndependentMisses | None = None  # analysis/knee.load_independent_misses


class Ratio(SummaryBlock):
    ratio: Num
    ratio_ci: list[Num]


class HeadlineBlock(SummaryBlock):
    """summary.json's `headline`: analysis/headline.headline builds it from the knee fit (decided, precise, stop
    and the run-to-run share computed there once), summary.headline_with adds what the run's points say."""

    engine: str
    against: str
    ratio: Num
    ratio_ci: list[Num]
    definition: str | None = None  # what the ratio is a ratio of (kneefit.DEFINITION: the long-run sustained rate)
    method: str = ""
    decided: bool = False
    precise: bool = False
    precision: Num | None = None
    stop: str | None = None
    min_points: Num | None = None
    points: dict[str, Num] = {}  # the points each engine's knee rests on
    judged: dict[str, Num] = {}
    run_to_run_share: Num | None = None
    ratio_ci_within_runs: list[Num] | None = None
    replications: dict[str, Num] | None = None  # independent streams under each knee
    bracketed: dict[str, bool] | None = None
    stream_spread: dict[str, Num] | None = None
    unsteady_rates: dict[str, list[Num]] | None = None
    time_s: Num | None = None
    more_arrival_s_to_precision: Num | None = None
    resolvable_ratio: Num | None = None
    resolvable_ratio_with_20_more_minutes: Num | None = None
    paired_streams: Num | None = None  # streams both engines judged (kneefit.py: what the pairing rests on)
    # the stream effects' correlation the shared load alone implies (kneefit.KneeFit.paired_correlation)
    paired_correlation: Num | None = None
    # the joint fit's correlation of what the load leaves of the pair's stream effects (analysis/kneejoint.py) and
    residual_correlation: Num | None = None  # its draws' effective number (Kish); 0 and None: each fitted alone
    joint_effective_draws: Num | None = None
    load_explained_share: dict[str, Num] | None = None  # each engine's stream variance its offered token load explains
    load_gain: dict[str, list[Num]] | None = None  # each engine's fitted gain on its offered token load, its interval
    # the informative priors on the engines' stream spread and load gain the fit used: their source ("twin"), its
    # settings and per engine its values (harness/sim/spread_prior.prior_block); None: the half-t on every spread
    spread_prior: dict[str, Any] | None = None
    # per engine whose knee is not bracketed, the bound its sustained rate is (knee.bound_of), and the one-sided
    # bound on the ratio they give (headline.ratio_bound: {"side": "at least" or "at most", "value"}); None: none
    bounds: dict[str, dict[str, Any]] | None = None
    ratio_bound: dict[str, Any] | None = None


class PhaseTimes(SummaryBlock):
    setup_s: Num = 0.0
    operating_point_s: Num = 0.0
    search_s: Num = 0.0
    decision_s: Num = 0.0


class TimeSpent(SummaryBlock):
    bench_s: Num | None = None
    engines: dict[str, PhaseTimes] = {}


class TwinErrors(SummaryBlock):
    """The twin against the measurement: twin / measured - 1, the token-state share as a difference in points."""

    sustained_rps: Num | None = None
    mean_running: Num | None = None
    ttft_p50_s: Num | None = None
    tpot_p50_s: Num | None = None
    token_states_share: Num | None = None


class StepModelInfo(SummaryBlock):
    """A step-time model as it describes itself (sim/stepfit.FittedStepModel, or the roofline's constants)."""

    rows: Num | None = None
    fit_r2: Num | None = None
    source: str | None = None
    coefficients: dict[str, Num] | None = None  # term -> seconds per unit (stepfit.TERMS' names)
    weights_bytes: Num | None = None  # the roofline's constants, where no fitted model stands
    kv_bytes_per_token: Num | None = None
    params: Num | None = None
    attn_flops_per_query_key: Num | None = None
    hbm_bytes_per_s: Num | None = None
    peak_flops: Num | None = None


class BudgetPoint(SummaryBlock):
    kv_budget_bytes: Num
    sustained_rps: Num
    sustained_where: str


class BudgetNeed(SummaryBlock):
    rate_rps: Num | None = None
    kv_budget_bytes: Num | None = None


class TwinBlock(SummaryBlock):
    """summary.json's `twin.<engine>` (sim/twin.run_twin)."""

    sustained_rps: Num
    sustained_where: str | None = None
    points: list[CapacityPoint] = []
    error: TwinErrors = TwinErrors()
    step_model: StepModelInfo = StepModelInfo()
    budget_curve: list[BudgetPoint] = []
    budget_for_best_rps: BudgetNeed = BudgetNeed()


class SettingFigures(SummaryBlock):
    """One engine under one allocator setting (analysis/alloc_settings_summary.engine_figures)."""

    served: bool = True
    sustained_rps: Num | None = None
    sustained_rps_ci: list[Num] | None = None
    reserved_unallocated_share: Num | None = None
    peak_reserved_bytes: Num | None = None
    alloc_retries: Num | None = None
    oom_policy: Num | None = None
    oom_allocator: Num | None = None
    size_classes: SizeClasses | None = None


class AllocSetting(SummaryBlock):
    """summary.json's `alloc_settings[i]`: one PYTORCH_CUDA_ALLOC_CONF setting's run, the run's own first."""

    alloc_conf: str
    run: str | None = None
    status: str
    engines: dict[str, SettingFigures] = {}


class SizeRule(SummaryBlock):
    """summary.json's `size_classes_rule` (analysis/size_classes.comparison): this model's allocation classes
    against a real model's, per allocation pattern and class."""

    model: str
    reference: str
    kv_bytes_per_token: Num
    shares: dict[str, dict[str, Num]]  # pattern -> size class -> share
    reference_shares: dict[str, dict[str, Num]]
    distance: Num
    matches: bool
    rule_picks: str | None = None
    tolerance: Num


class Summary(SummaryBlock):
    """summary.json (summary.summarize), or simulate's sweep (its `policies` beside its capacity blocks): what
    every page reads of a run."""

    run_id: str | None = None
    status: str | None = None
    max_seq_len: Num | None = None
    engines: dict[str, EngineFigures] = {}
    capacity: dict[str, CapacityBlock] = {}
    capacity_ratios: dict[str, Ratio] = {}
    headline: HeadlineBlock | None = None
    time_spent: TimeSpent | None = None
    capacity_by_budget: dict[str, dict[str, CapacityBlock]] | None = None
    alloc_settings: list[AllocSetting] | None = None
    size_classes_rule: SizeRule | None = None
    twin: dict[str, TwinBlock] | None = None
    saturation_throughput: SaturationBlock | None = None  # beside the headline (analysis/saturation.py)

    @property
    def simulated(self) -> bool:
        """fragbench simulate's sweep, not a bench run."""
        return self.has("policies")


class PolicyFigures(SummaryBlock):
    """One policy's figures in `fragbench simulate`'s output (sim/simulator.py)."""

    placement: str = ""
    token_states_share: Num = 0.0
    reservation_share: Num = 0.0
    internal_fragmentation_share: Num = 0.0
    external_fragmentation_share: Num = 0.0
    free_share: Num = 0.0
    mean_running: Num = 0.0
    max_running: Num = 0
    oom_total: Num = 0
    oom_fragmentation: Num = 0
    preemptions: Num = 0
    output_tokens_per_s: Num = 0.0
    ttft_p50_s: Num | None = None
    tpot_p50_s: Num | None = None
    wall_s: Num = 0.0
    first_oom_running: Num | None = None
    allocator: AllocatorFigures | None = None
    requests_completed: Num = 0
    simulated_s: Num = 0.0

    @property
    def completed_rps(self) -> float | None:
        """Requests completed per simulated second; None for a run that simulated no time."""
        return self.requests_completed / self.simulated_s if self.simulated_s else None


class SimulationOut(Summary):
    """`fragbench simulate`'s output (Simulation.out, printed by --json as it is): the setting, a policy's
    figures each, and with a sweep the same capacity blocks a run's summary has."""

    model: str
    gpu: str
    dtype: str
    workload: str
    requests: Num
    seed: Num
    kv_budget_bytes: Num
    max_seq_len: Num
    block_size: Num
    prefix_caching: bool
    static_preflight: bool
    alloc_conf: str | None = None
    step_model: StepModelInfo
    policies: dict[str, PolicyFigures]

