"""summary.json's `saturation_throughput` as typed records: each set served flat out, each engine's figures, the
paired ratio (harness/analysis/saturation.py computes them; Summary carries the block)."""

from __future__ import annotations

from harness.analysis.records import Num
from harness.analysis.summary_block import SummaryBlock


class SaturationSet(SummaryBlock):
    """One fixed request set served flat out by one engine (harness/run/saturation_runs.py)."""

    engine: str
    repetition: Num
    position: Num  # 0: the pair's first set, 1: its second (the order alternates: ABBA)
    requests: Num
    completed: Num
    output_tokens: Num
    wall_s: Num | None = None
    output_tokens_per_s: Num | None = None
    requests_per_s: Num | None = None
    oom_total: Num = 0
    preemptions: Num = 0


class SaturationEngine(SummaryBlock):
    """An engine's saturation throughput: the mean of its sets' figures, its OOMs and preemptions summed."""

    output_tokens_per_s: Num | None = None
    requests_per_s: Num | None = None
    sets: Num = 0
    failed_requests: Num = 0
    oom_total: Num = 0
    preemptions: Num = 0


class SaturationBlock(SummaryBlock):
    """summary.json's `saturation_throughput` (harness/analysis/saturation.py): beside the headline, never it."""

    definition: str = ""
    engine: str = ""
    against: str = ""
    requests: Num = 0
    repeats: Num = 0
    ratio: Num | None = None
    ratio_ci: list[Num] | None = None
    level: Num = 0.9
    pairs: Num = 0
    engines: dict[str, SaturationEngine] = {}
    sets: list[SaturationSet] = []
