"""How fast the simulator goes: N requests of azure-conv through paged for llama-3-70b on one H200.

Run by hand:  .venv/bin/python benchmarks/simulate_scale.py [--requests 1000000] [--memory caching]
              [--workload mooncake-prefix] [--kv-share 0.03] [--json result.json]
Llama-3-70B needs fp8 weights to fit one H200 (fp16 weights alone are 131 GiB). Prints wall time, the CPU time of
this process (the simulation is one core's: on a machine others share, CPU time is the figure to compare), the
requests simulated per CPU-second and peak RSS. `--kv-share` simulates a fraction of the plan's KV budget (a tight
one preempts); `--json` writes the whole result and the timeline, wall time aside, to compare two versions' output
sample for sample. Another version's code runs this same script from its tree:
  PYTHONPATH=<old tree> .venv/bin/python benchmarks/simulate_scale.py ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time

from engines.shapes import load_shape
from harness.gpus import gpu_preset
from harness.plan import make_plan
from harness.sim.simulator import run_simulation
from workloads.spec import load_spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1_000_000, help="requests simulated (default: a million)")
    ap.add_argument("--memory", choices=["arena", "caching"], default="arena",
                    help="the KV on the bookkeeping arena, or on PyTorch's caching allocator emulated (default: arena)")
    ap.add_argument("--workload", default="azure-conv", help="a workload preset (default: azure-conv)")
    ap.add_argument("--kv-share", type=float, default=1.0,
                    help="the share of the plan's KV budget simulated (default: 1, all of it)")
    ap.add_argument("--json", metavar="PATH", help="write the result and timeline, wall time aside, here")
    args = ap.parse_args()
    shape, gpu, spec = load_shape("llama-3-70b"), gpu_preset("h200-141gb"), load_spec(args.workload)
    plan = make_plan(shape, gpu.memory_bytes, "float8", max_seq_len=8192)
    plan = dataclasses.replace(plan, kv_budget_bytes=int(plan.kv_budget_bytes * args.kv_share))
    start, cpu_start = time.perf_counter(), time.process_time()
    sim = run_simulation(shape, gpu, plan, spec, ["paged"], 16, None, args.requests, dtype="float8",
                         memory=args.memory)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    r = sim.out["policies"]["paged"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(f"{args.requests} requests of {args.workload} ({args.memory}, KV share {args.kv_share:g}), "
          f"{r['simulated_s']:.0f} s simulated: wall {wall:.1f} s ({args.requests / wall:.0f} requests/s), "
          f"CPU {cpu:.1f} s ({args.requests / cpu:.0f} requests per CPU-second), peak RSS {rss:.0f} MiB, "
          f"token states {100 * r['token_states_share']:.1f} %, mean running {r['mean_running']:.1f}, "
          f"preemptions {r['preemptions']}")
    if args.json:
        r.pop("wall_s")
        with open(args.json, "w") as f:
            json.dump({"out": sim.out, "timelines": sim.timelines}, f, sort_keys=True)


if __name__ == "__main__":
    main()
