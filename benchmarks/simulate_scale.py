"""How fast the simulator goes: N requests of azure-conv through paged for llama-3-70b on one H200.

Run by hand:  .venv/bin/python benchmarks/simulate_scale.py [--requests 1000000]
Llama-3-70B needs fp8 weights to fit one H200 (fp16 weights alone are 131 GiB). Prints wall time on one
core and peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import time

from engines.shapes import load_shape
from harness.gpus import gpu_preset
from harness.plan import make_plan
from harness.sim.simulate import run_simulation
from workloads.spec import load_spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1_000_000)
    args = ap.parse_args()
    shape, gpu, spec = load_shape("llama-3-70b"), gpu_preset("h200-141gb"), load_spec("azure-conv")
    plan = make_plan(shape, gpu.memory_bytes, "float8", max_seq_len=8192)
    start = time.perf_counter()
    out = run_simulation(shape, gpu, plan, spec, ["paged"], 16, None, args.requests, dtype="float8").out
    wall = time.perf_counter() - start
    r = out["policies"]["paged"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(f"{args.requests} requests, {r['simulated_s']:.0f} s simulated: wall {wall:.1f} s "
          f"({args.requests / wall:.0f} requests/s), peak RSS {rss:.0f} MiB, token states "
          f"{100 * r['token_states_share']:.1f} %, mean running {r['mean_running']:.1f}")


if __name__ == "__main__":
    main()
