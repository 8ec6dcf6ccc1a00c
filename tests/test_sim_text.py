"""simulate's console: the verdict first, every figure with its unit, no line over 120 characters."""

import re

from engines.shapes import load_shape
from harness.analysis.capacity import SLO
from harness.gpus import gpu_preset
from harness.plan import make_plan
from harness.sim.simulator import run_simulation
from harness.views.sim_report import WIDTH, render_text
from workloads.spec import load_spec


def simulated(sweep_points: int, memory: str = "arena") -> str:
    shape, gpu = load_shape("llama-2-13b"), gpu_preset("a100-40gb")
    plan = make_plan(shape, gpu.memory_bytes, "float16", max_seq_len=4096)
    sim = run_simulation(shape, gpu, plan, load_spec("mixed-churn"), ["static-max", "static-oracle", "paged"], 16,
                         None, 120, 0, n_jobs=1, sweep_points=sweep_points, slo=SLO(), memory=memory)
    return render_text(sim.record)


def test_the_sweeps_text_opens_with_its_verdict_and_every_figure_has_a_unit():
    text = simulated(sweep_points=4)
    lines = text.splitlines()
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    assert lines[0].startswith("verdict: sustained within the SLO: ")
    assert re.search(r"paged \d+\.\d\d req/s", lines[0])
    verdict = " ".join(line.strip() for line in lines[:lines.index(next(x for x in lines if "SLO: TTFT" in x))])
    assert re.search(r"paged sustains [\d.]+x the rate of the best contiguous \(static-oracle\)\.$", verdict)
    assert "static-max" in verdict and "static-oracle" in verdict
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["policy", "placement"])
    units = lines[head + 1].split()
    assert units == ["%", "%", "%", "%", "%", "seqs", "seqs", "(frag)", "count", "tok/s", "s", "ms", "s"]
    assert "TTFT p50" in lines[head] and "TPOT p50" in lines[head]
    paged = next(line for line in lines[head:] if line.strip().startswith("paged "))
    assert "ms" not in paged  # the units are in the header, not in some cells
    assert "SLO: TTFT <= 2 s and TPOT <= 0.25 s for 90 % of requests" in text
    rates = text[text.index("SLO attainment per offered rate"):]
    assert all(re.fullmatch(r"[\d.]+: [\d.]+ %", pair) for pair in re.findall(r"[\d.]+: [\d.]+ %", rates))


def test_a_single_run_says_what_each_policy_served_first_and_its_allocator_lines_fit():
    text = simulated(sweep_points=0, memory="caching")
    lines = text.splitlines()
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    assert lines[0].startswith("verdict: output tokens/s paged ") or lines[0].startswith("verdict: output tokens/s")
    assert "needs --sweep" in " ".join(lines[:2])
    assert any(line.startswith("  static-oracle: caching allocator (default)") for line in lines)
