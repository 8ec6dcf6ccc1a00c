"""How fast the simulator goes: N requests of azure-conv through paged for llama-3-70b on one H200.

Run by hand:  .venv/bin/python benchmarks/simulate_scale.py [--requests 1000000] [--memory caching]
Llama-3-70B needs fp8 weights to fit one H200 (fp16 weights alone are 131 GiB). Prints wall time, the CPU time of
this process (the simulation is one core's: on a machine others share, CPU time is the figure to compare) and
peak RSS.
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
    ap.add_argument("--requests", type=int, default=1_000_000, help="requests simulated (default: a million)")
    ap.add_argument("--memory", choices=["arena", "caching"], default="arena",
                    help="the KV on the bookkeeping arena, or on PyTorch's caching allocator emulated (default: arena)")
    args = ap.parse_args()
    shape, gpu, spec = load_shape("llama-3-70b"), gpu_preset("h200-141gb"), load_spec("azure-conv")
    plan = make_plan(shape, gpu.memory_bytes, "float8", max_seq_len=8192)
    start, cpu_start = time.perf_counter(), time.process_time()
    out = run_simulation(shape, gpu, plan, spec, ["paged"], 16, None, args.requests, dtype="float8",
                         memory=args.memory).out
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    r = out["policies"]["paged"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(f"{args.requests} requests ({args.memory}), {r['simulated_s']:.0f} s simulated: wall {wall:.1f} s "
          f"({args.requests / wall:.0f} requests/s), CPU {cpu:.1f} s ({args.requests / cpu:.0f} requests/s), "
          f"peak RSS {rss:.0f} MiB, token states "
          f"{100 * r['token_states_share']:.1f} %, mean running {r['mean_running']:.1f}")


if __name__ == "__main__":
    main()
