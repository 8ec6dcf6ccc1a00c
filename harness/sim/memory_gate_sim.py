"""The memory gate's measurement: each KV policy's memory behaviour on one fixed trace, in virtual time, through
the engines' own policy and scheduler code (the simulator's `simulate_policy`), printed as one JSON object.

`fragbench memory-gate` runs this file once in each tree it compares (harness/run/memory_gate_runs.py): BASE's
side as a child whose import path starts at BASE's work tree, so every policy, scheduler and simulator it imports is
BASE's own. That is why this module imports only what every revision since the simulator's counted pool has
(`harness.sim.simulator`, `engines.kv`, `engines.shapes`, `harness.gpus`, `workloads.generate`) and writes plain
JSON: harness/analysis/memory_gate.py, which BASE may lack, reads it. A policy whose code raises is a crash of that
tree, printed as such (`crashed`: the policy and the exception's last line) beside the others' figures; what cannot
run at all (an import the tree lacks, a bad flag) exits nonzero. Run it as a script:

    python harness/sim/memory_gate_sim.py [--engine-args 'paged=--inject-kv-fault leak-block'] ...

The trace: the workload's first `--requests` requests at their own arrival times (mixed-churn: 5 req/s, bursty),
on a fixed roofline of this machine's order (STEP_DEVICE_SPEED: a tiny-model decode step of about 20 ms), so that the
engines are overloaded as on the CPU bench and memory binds. Virtual time: no clock is read, the figures are the
same on any machine and any night, and a difference between two trees is their code's."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import traceback

from engines.kv.faults import inject
from engines.scheduled.scheduler import SchedulerConfig
from engines.shapes import batched_tokens, load_shape
from harness.gpus import GPU
from workloads.spec import load_spec

# bench's CPU defaults (Makefile): the tiny model's KV in float32 (4,096 B a token), a 16 MiB budget, the scheduled
# engines' 64 sequences and their token budget; static-max admits as a naive server does (--no-preflight)
DEFAULTS = {"model": "tiny-llama", "dtype": "float32", "kv_budget_bytes": 16 * 2**20, "block_size": 16,
            "max_num_seqs": 64, "workload": "mixed-churn", "requests": 600, "seed": 0,
            "policies": "static-max,static-oracle,growth,paged", "no_preflight": "static-max"}
# the step model's device: 1 GB/s and 50 GFLOP/s put a tiny-model step near this 2-core machine's (some 20 ms), so the
# workload's own rate overloads every engine as the CPU bench does (a GPU preset's microsecond steps would not)
STEP_DEVICE_SPEED = {"hbm_bytes_per_s": 1e9, "peak_bf16_flops": 5e10}
# what an engine flag of `serve` changes in the memory behaviour; every other flag (--slow-step, --threads...)
# changes time alone and is left out here
MEMORY_FLAGS = ("--inject-kv-fault", "--block-size", "--no-preflight", "--max-num-seqs", "--no-prefix-caching")


def engine_flags(text: str) -> tuple[dict, list[str]]:
    """One engine's serve flags: the memory-relevant ones as options, and the rest (named, not applied)."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument("--inject-kv-fault")
    p.add_argument("--block-size", type=int)
    p.add_argument("--no-preflight", action="store_true")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--no-prefix-caching", action="store_true")
    known, rest = p.parse_known_args(shlex.split(text))
    return {k: v for k, v in vars(known).items() if v not in (None, False)}, rest


def step_device():
    return GPU("memory-gate-cpu", 0, **STEP_DEVICE_SPEED)


def measure(policy: str, flags: dict, cfg: argparse.Namespace) -> dict:
    """One policy's figures on the fixed trace (see the module's docstring)."""
    # numpy and pandas load in the measuring child alone: cli/memory_gate.py imports this module for engine_flags
    from harness.sim.roofline import StepModel
    from harness.sim.simulator import make_sim_policy, simulate_policy
    from workloads.generate import has_shared_prefixes, iter_requests

    shape = load_shape(cfg.model)
    spec = load_spec(cfg.workload)
    max_seq_len = shape.max_seq_len
    kvb = shape.kv_bytes_per_token(cfg.dtype)
    block_size = flags.get("block_size", cfg.block_size)
    preflight = not (flags.get("no_preflight") or policy in cfg.no_preflight.split(","))
    shared = has_shared_prefixes(spec) and not flags.get("no_prefix_caching")
    requests = list(iter_requests(spec, cfg.seed, max_seq_len, shape.vocab_size, cfg.requests, token_ids=shared))
    kv = make_sim_policy(policy, cfg.kv_budget_bytes, kvb, max_seq_len, block_size, None, preflight)
    if flags.get("inject_kv_fault"):
        kv = inject(kv, flags["inject_kv_fault"])
    # the engine's scheduler as the factory configures it (engines/factory.py): an OOM rejects the request
    config = SchedulerConfig(max_num_seqs=flags.get("max_num_seqs", cfg.max_num_seqs),
                             max_num_batched_tokens=batched_tokens(max_seq_len), on_oom="reject")
    peak = PeakHeld(kv)
    model = StepModel.of(shape, cfg.dtype, step_device())
    res, _, _ = simulate_policy(kv, config, iter(requests), max_seq_len, model, shared, sample_every_s=1e9)
    block_bytes = block_size * kvb
    stats = kv.stats()
    return {
        "policy": policy, "flags": flags, "block_size": block_size, "preflight": preflight,
        "requests": len(requests), "requests_completed": res["requests_completed"],
        "requests_oom": res["requests_oom"],
        # neither finished nor turned away: stuck in the queue when the trace ended (memory that never came back)
        "requests_unfinished": len(requests) - res["requests_completed"] - res["requests_oom"],
        "preemptions": res["preemptions"], "oom_total": res["oom_total"],
        "oom_fragmentation": res["oom_fragmentation"], "oom_capacity": res["oom_total"] - res["oom_fragmentation"],
        **{k: v for k, v in res.items() if k.endswith("_share")},
        "max_running": res["max_running"], "kv_capacity_bytes": stats.kv_capacity_bytes,
        "peak_held_bytes": peak.bytes, "peak_blocks": -(-peak.bytes // block_bytes),
        # what the policy still holds when the trace ends: 0 unless memory leaks (or requests are stuck)
        "held_blocks_end": -(-stats.allocated_bytes // block_bytes),
    }


class PeakHeld:
    """The most bytes the policy held at any event: read from the same breakdown the simulator takes at every
    step (the policy's own totals), by standing in front of the policy's `breakdown_of`."""

    def __init__(self, kv):
        self.bytes = 0
        self._of = kv.breakdown_of
        kv.breakdown_of = self  # the simulator reads kv.breakdown_of once, when it starts

    def __call__(self, live_tokens: int):
        b = self._of(live_tokens)
        held = b.token_states_bytes + b.reservation_bytes + b.internal_fragmentation_bytes
        self.bytes = max(self.bytes, held)
        return b


def per_engine(pairs: list[str]) -> dict[str, dict]:
    """--engine-args ENGINE=ARGS, as bench takes them: each engine's memory flags."""
    out = {}
    for pair in pairs:
        engine, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-args {pair!r}: ENGINE=ARGS")
        out[engine], _ = engine_flags(text)
    return out


def crash_line(err: BaseException) -> str:
    """The exception as its traceback's last line says it ("AssertionError: ..."), where it was raised after it."""
    where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    line = traceback.format_exception_only(err)[-1].strip()
    return f"{line} (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})" if where else line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, value in DEFAULTS.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--engine-args", action="append", default=[], metavar="ENGINE=ARGS")
    cfg = p.parse_args(argv)
    flags = per_engine(cfg.engine_args)
    measured, crashed = {}, []
    for name in cfg.policies.split(","):
        try:
            measured[name] = measure(name, flags.get(name, {}), cfg)
        except ImportError:  # the tree lacks what this file needs: it cannot run, it did not crash
            raise
        except Exception as e:  # the tree's policy or scheduler raised: its crash, named, not a run that failed
            crashed.append({"policy": name, "error": crash_line(e)})
    out = {"trace": {k: getattr(cfg, k) for k in DEFAULTS}, "engine_args": cfg.engine_args, "policies": measured,
           "crashed": crashed}
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
