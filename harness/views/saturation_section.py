"""The report's saturation throughput, on its first screen beside the headline and never instead of it
(harness/analysis/saturation.py computes it; docs/method.md, "Saturation throughput beside the headline")."""

from __future__ import annotations

from harness.analysis.saturation import SET_TARGET_S, SHARE_OF_TIME
from harness.analysis.summary_records import SaturationBlock, Summary
from harness.views.html import ESC, fmt, section, table

FOOTNOTE = ("Output tokens/s and requests/s as vLLM's throughput benchmark (benchmarks/benchmark_throughput.py, "
            "`vllm bench throughput`) defines them: total output tokens (completed requests) over the wall time from "
            "the first submission to the last completion, every request offered at once.")


def ratio_words(b: SaturationBlock) -> str:
    if b.ratio is None:
        return "no pair of sets served by both engines: no ratio."
    ci = (f" [{b.ratio_ci[0]:.2f}, {b.ratio_ci[1]:.2f}], {100 * b.level:.0f} % paired t interval over {b.pairs} "
          "pairs (the pairs' log ratios)") if b.ratio_ci else f" ({b.pairs} pair: no interval)"
    return f"{b.engine} / {b.against}: {b.ratio:.2f}x{ci}, output tokens/s."


def saturation_section(summary: Summary) -> str:
    """The sets' figures per engine, the paired ratio, the rule; nothing where the run served no set."""
    b = summary.saturation_throughput
    if b is None:
        return ""
    rows = [[e, fmt(f.output_tokens_per_s), fmt(f.requests_per_s), f"{f.sets:g}", f"{f.failed_requests:g}",
             f"{f.oom_total:g}", f"{f.preemptions:g}"] for e, f in b.engines.items()]
    how = (f"Beside the headline, not instead of it: each headline engine served the same {b.requests:g} requests "
           f"offered at once, {b.repeats:g} fresh sets each, the order alternating (ABBA). The rule: a set is "
           f"{SET_TARGET_S:g} s of the slower engine's calibrated rate, the pairs fit {100 * SHARE_OF_TIME:.0f} % of "
           "--time (at most 6, none under 2), the workload's cancels and slow readers left out.")
    body = (f"<p id='saturation-ratio'><b>{ESC(ratio_words(b))}</b></p>"
            + table(["engine", "output tok/s", "req/s", "sets", "failed requests", "OOMs", "preemptions"], rows)
            + f"<p class='how'><small>{ESC(FOOTNOTE)}</small></p>")
    return section("saturation", "Saturation throughput", how, body)
