"""`make gpu-check`: the release check of every GPU path, each item PASS or FAIL, in under ten minutes on one GPU.

    .venv/bin/python scripts/gpu_check.py [--model DIR] [--out DIR] [--json FILE] [--item NAME] [--keep-fixture]

Each item runs in a process of its own under its own time limit: the CUDA allocator's cap is process-wide, and an
item that fails, hangs or crashes the interpreter leaves the next one a fresh device. One line per item, then
FILE (default OUT/gpu-check.json): each item's verdict, what it found, its figures and its seconds. Exit 0 only
when every item that ran passed (vllm is `absent`, and not counted, where vLLM is not installed), 1 otherwise, 2
without a CUDA device (one line: none of these paths can run on a CPU) or on bad input. Nothing is written into
the repository unless asked: --keep-fixture keeps the churn recording as tests/fixtures/gpu_hf_churn_snapshot.pickle
(the CPU suite replays it); otherwise it stays in OUT.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository's root on the path, as `-m` would have it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.procs import kill_tree, spawn  # noqa: E402
from scripts import gpu_items as items  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Item:
    name: str
    check: Callable
    limit_s: int  # its process is ended past this: a hang is a FAIL, not a stalled check


# The limits, by what each item does on one GPU (the whole well under ten minutes when each takes its usual time;
# the limits are the ceilings a stuck item may take before it is failed)
ITEMS: dict[str, Item] = {
    "device": Item("device and driver", items.check_device, 60),
    "arena": Item("arena on the device", items.check_arena_on_device, 60),
    "allocator": Item("cuda caching allocator, forced OOM, snapshot, cap restored", items.check_cuda_allocator, 60),
    "real-oom": Item("torch's own OOM within the budget, its cause judged", items.check_real_oom, 60),
    "nvml": Item("NVML sampling", items.check_nvml, 60),
    "greedy": Item("greedy outputs on the GPU, near-ties allowed", items.check_greedy_equal, 120),
    "kernel": Item("paged decode attention on the GPU", items.check_kernel, 60),
    "decode-rate": Item("paged decode tokens/s against static's on the GPU", items.check_decode_rate, 120),
    "real-shape": Item("a bf16 model of a real shape, random weights", items.check_real_shape_bf16, 240),
    "bench": Item("two-engine bench, cuda memory mode", items.check_bench, 240),
    "churn": Item("hf serving churn recorded on CUDA, replayed by the emulator", items.check_churn_replay, 240),
    "churn-expandable": Item("the churn under expandable_segments:True, replayed", items.check_churn_expandable,
                             240),
    "vllm": Item("vLLM beside paged on the GPU, where installed", items.check_vllm, 300),
}


@dataclass
class Result:
    item: str
    verdict: str  # pass, fail, or absent (what the item checks is not installed: not run, not counted)
    detail: str
    seconds: float
    figures: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        """The item's line, and a failure's further lines (the churn item's mismatches) indented below it."""
        first, *rest = self.detail.splitlines() or [""]
        mark = {"pass": "PASS", "fail": "FAIL", "absent": "ABSENT"}[self.verdict]
        return [f"{mark:4}  {ITEMS[self.item].name}: {first} ({self.seconds:.1f} s)", *(f"      {x}" for x in rest)]


def run_here(key: str, args) -> Result:
    """One item in this process."""
    started = time.perf_counter()
    try:
        detail, figures = ITEMS[key].check(args)
        verdict = "pass"
    except items.Absent as e:
        detail, figures, verdict = str(e), {}, "absent"
    except Exception as e:
        detail, figures, verdict = f"{type(e).__name__}: {e}", {}, "fail"
        traceback.print_exc(limit=3, file=sys.stderr)
    return Result(key, verdict, detail, time.perf_counter() - started, json.loads(json.dumps(figures, default=str)))


def child_command(key: str, args, result: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", key, "--result", str(result), "--model",
           args.model, "--out", args.out, "--limit-s", str(ITEMS[key].limit_s)]
    return cmd + (["--keep-fixture"] if args.keep_fixture else [])


def run_child(key: str, args) -> Result:
    """One item in a child of its own under its limit; a child that dies or hangs without its result is a FAIL
    with its last words. The child starts a session of its own, and one past its limit is ended with its whole
    group and every process below it (a bench and the servers it started): none runs on into the next item."""
    result = Path(args.out) / f"{key}.result.json"
    result.unlink(missing_ok=True)
    started, limit = time.perf_counter(), ITEMS[key].limit_s
    proc = spawn(child_command(key, args, result), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 cwd=ROOT)
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return Result(key, "fail", f"no answer in {limit} s (its limit)", time.perf_counter() - started)
    kill_tree(proc)  # what an item left running in its group past its answer goes with it
    if not result.exists():
        last = (err.strip().splitlines() or [""])[-1]
        return Result(key, "fail", f"exited {proc.returncode} without a result: {last}",
                      time.perf_counter() - started)
    return Result(**json.loads(result.read_text()))


def run(keys: list[str], args) -> int:
    """The items, one line each as they end, then the JSON: exit 0 when none failed and at least one passed."""
    results = []
    for key in keys:
        results.append(run_child(key, args))
        print("\n".join(results[-1].lines()), flush=True)
    failed = [r.item for r in results if r.verdict == "fail"]
    passed = sum(r.verdict == "pass" for r in results)
    out = Path(args.json) if args.json else Path(args.out) / "gpu-check.json"
    absent = len(results) - passed - len(failed)
    out.write_text(json.dumps({"passed": passed, "failed": failed, "absent": absent,
                               "items": [asdict(r) for r in results]}, indent=1) + "\n")
    print(f"gpu-check: {passed} passed, {len(failed)} failed, {absent} absent; {out}", flush=True)
    return 0 if not failed and passed else 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="every GPU path once, PASS or FAIL per item")
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"),
                    help="the small model most items serve (default: models/tiny-llama)")
    ap.add_argument("--out", default=None, help="where items write what they make (default: a fresh temp folder)")
    ap.add_argument("--json", default=None, help="the verdicts' file (default: OUT/gpu-check.json)")
    ap.add_argument("--item", default=None, help=f"run this item alone, in its own process (default: every one: "
                    f"{', '.join(ITEMS)})")
    ap.add_argument("--keep-fixture", action="store_true",
                    help="keep the churn recording as tests/fixtures/gpu_hf_churn_snapshot.pickle (default: off)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the item a child runs here
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)  # where the child writes its Result
    ap.add_argument("--limit-s", type=float, default=None, help=argparse.SUPPRESS)  # the child's item's limit
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if (args.item or args.child or "device") not in ITEMS:
        print(f"gpu-check: error: no item {args.item or args.child!r}; items: {', '.join(ITEMS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu-check: error: no CUDA device on this machine; these checks need one", file=sys.stderr)
        return 2
    args.out = args.out or tempfile.mkdtemp(prefix="gpu-check-")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.child:
        result = run_here(args.child, args)
        Path(args.result).write_text(json.dumps(asdict(result)))
        return 0 if result.verdict != "fail" else 1
    return run([args.item] if args.item else list(ITEMS), args)


if __name__ == "__main__":
    sys.exit(main())
