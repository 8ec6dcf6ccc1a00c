"""make bench's defaults per device kind (harness/plan.py's BENCH_REGIMES): the Makefile runs them, the cuda rule
gives its constant, and the report says the rule of the device the run measured."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from engines.shapes import load_shape
from harness.analysis.records import RunRecord
from harness.analysis.summary_records import Summary
from harness.plan import BENCH_REGIMES, gpu_sequences, workload_mix
from harness.units import parse_size
from harness.views.regime import gpu_of_name, regime_words
from workloads.generate import trace
from workloads.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]


def bench_lines(*args: str) -> list[str]:
    out = subprocess.run(["make", "--no-print-directory", "-n", "-o", "setup", "bench", *args], cwd=ROOT,
                         capture_output=True, text=True).stdout
    return out.replace("\\\n", " ").splitlines()


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_make_bench_runs_the_regime_of_its_device_kind(kind):
    regime = BENCH_REGIMES[kind]
    [bench] = [x for x in bench_lines(f"DEVICE_KIND={kind}") if "fragbench bench" in x]
    budget = re.search(r"--kv-budget (\S+)", bench).group(1)
    assert f"--model {regime.model_dir} " in bench
    assert parse_size(budget) == regime.kv_budget_bytes(load_shape(regime.preset))


def test_on_a_gpu_box_the_real_shape_is_built_here_in_bf16():
    builds = [x for x in bench_lines("DEVICE_KIND=cuda") if "model build" in x]
    assert builds == [".venv/bin/fragbench model build --preset llama-3-8b --dtype bfloat16 --out "
                      "models/llama-3-8b-bf16"]
    assert not any("llama-3-8b" in x for x in bench_lines("DEVICE_KIND=cpu"))


def test_the_cuda_rule_gives_the_regimes_sequences_on_the_default_workload():
    regime = BENCH_REGIMES["cuda"]
    shape = load_shape(regime.preset)
    reqs = trace(load_spec("mixed-churn"), 0, regime.max_seq_len, shape.vocab_size).requests
    mix = workload_mix(reqs, "mixed-churn", regime.max_seq_len)
    assert gpu_sequences(shape, regime.dtype, mix, regime.max_seq_len) == regime.sequences == 8
    assert regime.kv_budget_bytes(shape) == 2 * 2**30  # 8 x 2048 tokens x 128 KiB


def run_of(device: str, name: str | None, kvb: int, model: str) -> tuple[Summary, RunRecord]:
    summary = {"max_seq_len": 2048, "engines": {"paged": {"kv_bytes_per_token": kvb}},
               "capacity": {"paged": {"sustained_rps": 1.0, "slo": {"tpot_s": 0.25}}}}
    meta = {"config": {"model": model, "workload": "mixed-churn", "seed": 0},
            "hardware": {"device_device": device, "device_name": name}}
    return Summary.model_validate(summary), RunRecord.of(meta)


def test_the_report_says_the_cpu_rule_on_a_cpu_run():
    words = regime_words(*run_of("cpu", None, 4096, "tiny-llama"), 16 * 2**20)
    assert "is 2.0 max-length sequences" in words and "default on a CPU is 2" in words and "GPU is" not in words


def test_the_report_gives_the_gpu_rule_and_its_roofline_on_an_h200_run():
    words = regime_words(*run_of("cuda:0", "NVIDIA H200", 131072, "llama-3-8b"), 2 * 2**30)
    assert "is 8.0 max-length sequences" in words and "default on a GPU is 8" in words
    assert "about 33 of them" in words  # 16,384 tokens / 503 live tokens a request
    # 16 GB of weights over 4.8 TB/s, plus 32 requests' KV reads: memory-bound, far under 250 ms
    assert re.search(r"decode step of this model on an h200-141gb is 3\.8 ms \(3\.3 ms of it reading", words)
    assert "66x under the TPOT limit" in words


def test_an_unknown_gpu_gets_the_rule_without_a_roofline():
    assert gpu_of_name("NVIDIA H100 80GB HBM3").name == "h100-80gb" and gpu_of_name("Tesla T4") is None
    words = regime_words(*run_of("cuda", "Tesla T4", 131072, "llama-3-8b"), 2 * 2**30)
    assert "default on a GPU is 8" in words and "roofline" not in words


@pytest.mark.parametrize("name, preset", [
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb"), ("NVIDIA H200", "h200-141gb"),
    ("NVIDIA A100 80GB PCIe", None), ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None),
    ("NVIDIA GH200 480GB", None), ("NVIDIA H200 NVL", None),
])
def test_the_roofline_takes_a_presets_figures_for_that_exact_board_alone(name, preset):
    """By prefix an A100 80GB PCIe read as an a100-40gb, an H100 PCIe or NVL as the SXM board, a GH200 as an H200."""
    gpu = gpu_of_name(name)
    assert (gpu.name if gpu else None) == preset
