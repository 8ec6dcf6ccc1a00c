"""The instruction-count probe's measured side: one in-house scheduled engine on a model, stepped through a few fixed
batch shapes (a prefill, decodes at several contexts, a mix of both), each shape's steps run inside one call of
`operator.call`, the function callgrind's collection is toggled on and dumped after
(harness/run/ab_instr_probes.py starts this file under valgrind and reads the counts).

`ab` runs this checkout's copy of this file in each tree it compares, as the memory gate runs its measurement: a
child whose import path starts at the tree, so the engine, its scheduler, policy and runner are that tree's own. So
it imports only what every tree since the step faults has (engines.factory, engines.engine, engines.sequence), and
writes plain JSON. Run it as a script (without valgrind it steps the shapes and prints what it ran; the counts are
callgrind's alone):

    python harness/run/ab_instr_shapes.py --engine paged --model models/tiny-llama [--engine-args '--burn-step 1.2']

Protocol with the parent: the setup (imports, the model, the engine, one warm-up pass over every shape, uncounted:
callgrind instruments nothing yet) ends with one JSON line {"ready": ...} on stdout; the parent switches
callgrind's instrumentation on (callgrind_control -i on) and writes a line to stdin; the engine then runs every
shape again, one `operator.call` each, in SHAPES' order, and the child prints {"shapes": [...]} and exits."""

from __future__ import annotations

import argparse
import gc
import json
import operator
import random
import shlex
import sys
from dataclasses import dataclass

# every shape runs this many steps: a --burn-step of F repeats exactly STEPS x (F - 1) forwards inside a shape
# where that is whole (F = 1.2: one), so each shape's count carries the burn exactly, not on average
STEPS = 5
KV_BUDGET_BYTES = 64 * 2**20  # holds every shape's sequences at once (the tiny model: 4 KiB a token in float32)


@dataclass(frozen=True)
class BatchShape:
    """`decodes` sequences at `context` tokens each decoding one token a step, beside a fresh `prefill`-token
    prompt every step (0: none), for STEPS steps."""

    name: str
    decodes: int
    context: int
    prefill: int


SHAPES = (
    BatchShape("prefill-32", 0, 0, 32),
    BatchShape("decode-4x16", 4, 16, 0),
    BatchShape("decode-4x128", 4, 128, 0),
    BatchShape("decode-1x512", 1, 512, 0),
    BatchShape("mix-4x32+16", 4, 32, 16),
)


def engine_spec(engine: str, model: str, args: list[str]):
    """The tree's EngineSpec for `engine` with the serve flags in `args` that change what a step computes, and the
    step faults; flags that change time or the server alone (--threads: the probe runs one thread) are left out."""
    # the tree's own factory: imported when the child runs, not when the parent imports this file for SHAPES
    from engines.factory import EngineSpec

    p = argparse.ArgumentParser(prog="engine args", add_help=False, exit_on_error=False)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reserve", choices=["max", "pow2", "oracle"], default="max")
    p.add_argument("--no-preflight", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--memory", choices=["arena", "caching"], default="arena")
    p.add_argument("--alloc-conf")
    p.add_argument("--inject-kv-fault")
    p.add_argument("--slow-step", type=float, default=1.0)
    p.add_argument("--burn-step", type=float, default=1.0)
    # time, threads and the server's own: no change to what a step computes
    for flag in ("--threads", "--step-log", "--oom-snapshot", "--fail-at-step", "--on-oom", "--max-batch"):
        p.add_argument(flag)
    known, rest = p.parse_known_args(args)
    if rest:
        raise ValueError(f"engine args this probe does not know: {' '.join(rest)}")
    spec = EngineSpec(engine, model, KV_BUDGET_BYTES, block_size=known.block_size, reserve=known.reserve,
                      preflight=not known.no_preflight, max_num_seqs=known.max_num_seqs,
                      prefix_caching=not known.no_prefix_caching, memory=known.memory, alloc_conf=known.alloc_conf,
                      device="cpu", kv_fault=known.inject_kv_fault)
    return spec, known.slow_step, known.burn_step


class ShapeDriver:
    """One engine stepped through the shapes: its token events counted per request."""

    def __init__(self, spec, slow: float, burn: float):
        # the tree's own engine code: imported when the child runs (see engine_spec)
        from engines.factory import make_engine

        self.engine = make_engine(spec)
        if slow != 1.0 or burn != 1.0:
            if not hasattr(self.engine, "step_fault"):
                raise ValueError(f"the {spec.engine} engine of this tree takes no --slow-step / --burn-step")
            # the tree's step faults, which only a tree with step_fault has
            from engines.step_faults import StepFault

            self.engine.step_fault = StepFault(slow=slow, burn=burn)
        self.tokens: dict[str, int] = {}
        self.engine.sink = self._event
        self.rng = random.Random(0)
        self.vocab = self.engine.vocab_size
        self.count = 0

    def _event(self, event) -> None:
        if event.token_id is not None:
            self.tokens[event.seq.request_id] = self.tokens.get(event.seq.request_id, 0) + 1

    def add(self, prompt: int, max_tokens: int) -> str:
        # the tree's own request types (see engine_spec)
        from engines.engine import Request
        from engines.sequence import SamplingParams

        self.count += 1
        rid = f"r{self.count}"
        # fresh random ids: no prompt shares a prefix with another, so the prefix cache hits nothing
        ids = [self.rng.randrange(3, self.vocab) for _ in range(prompt)]
        self.engine.add_request(Request(rid, ids, SamplingParams(max_tokens, ignore_eos=True)))
        return rid

    def prepare(self, shape: BatchShape) -> list[str]:
        """The shape's decoding sequences, prefilled (steps outside the count) up to their context."""
        ids = [self.add(shape.context, STEPS + 8) for _ in range(shape.decodes)]
        while any(self.tokens.get(r, 0) == 0 for r in ids):
            self.engine.step()
        return ids

    def measure(self, shape: BatchShape) -> None:
        """The counted part: STEPS steps, each with a fresh prompt of `prefill` tokens where the shape has one."""
        for _ in range(STEPS):
            if shape.prefill:
                self.add(shape.prefill, 1)  # its one token comes from this step's prefill: it ends in this step
            self.engine.step()

    def end(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.abort(rid)
        while self.engine.has_work():
            self.engine.step()

    def run(self, counted: bool) -> list[dict]:
        out = []
        for shape in SHAPES:
            ids = self.prepare(shape)
            if counted:  # a collection GC pass would land in one shape and not another: none while counting
                gc.collect()
                gc.disable()
            operator.call(self.measure, shape)  # callgrind counts (and dumps) this call alone
            gc.enable()
            out.append({"name": shape.name, "decodes": shape.decodes, "context": shape.context,
                        "prefill": shape.prefill, "steps": STEPS})
            self.end(ids)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--engine-args", default="", help="the engine's serve flags, as one string")
    cfg = p.parse_args(argv)
    try:  # what cannot run in this tree (exit 2); an error once the engine steps is a crash (a traceback)
        spec, slow, burn = engine_spec(cfg.engine, cfg.model, shlex.split(cfg.engine_args))
        # torch loads once the flags are read (a bad one is refused before valgrind runs its import): one thread
        import torch

        torch.set_num_threads(1)
        driver = ShapeDriver(spec, slow, burn)
    except (ValueError, TypeError, argparse.ArgumentError) as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 2
    # first calls (lazy set-ups, caches, the kernel's load) uncounted: no instrumentation yet. The counted pass runs
    # on the same engine after it (its pool and caches as the warm-up left them: the same state every run)
    driver.run(counted=False)
    print(json.dumps({"ready": True, "shapes": [s.name for s in SHAPES]}), flush=True)
    sys.stdin.readline()  # the parent has switched callgrind's instrumentation on
    shapes = driver.run(counted=True)
    print(json.dumps({"shapes": shapes, "engine": cfg.engine, "torch": torch.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
