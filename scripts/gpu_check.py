"""`make gpu-check`: every GPU path once, PASS or FAIL per item, in well under ten minutes on one GPU.

    .venv/bin/python scripts/gpu_check.py [--model DIR] [--out DIR] [--item NAME]

Each item runs in a process of its own (`--item`): the CUDA allocator's cap is process-wide, and an item that
fails (or crashes the interpreter) leaves the next one a fresh device. Without a CUDA device it says so on
one line and exits 2: none of these paths can run on a CPU.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engines.factory import EngineSpec, make_engine
from engines.memory.arena import Arena, OutOfMemory
from engines.memory.cuda import CudaMemory, device_info, device_snapshot
from engines.memory.replay import RECORDING_KEY, ReplayResult, load_trace, replay_recorded
from engines.memory.snapshot import load_data, write_state
from engines.offline import generate
from engines.sequence import SamplingParams
from harness.fetch import request
from harness.run.servers import start_server, tail

ROOT = Path(__file__).resolve().parents[1]

MIB = 2**20
PROMPTS = [[5 + (7 * i + 3 * n) % 4000 for i in range(n)] for n in (3, 17, 40, 8, 100)]
CHURN_REQUESTS = 36
CHURN_CONCURRENCY = 6  # hf batches whoever waits (up to 8): its batches differ in width as requests end
CHURN_FIXTURE = ROOT / "tests" / "fixtures" / "gpu_hf_churn_snapshot.pickle"
MISMATCHES_SHOWN = 40  # on the FAIL line's detail; every one is in the item's mismatches file
FIXTURE_FIELDS = ("action", "addr", "size", "stream")  # what the replay reads of a trace entry


def check_device(args) -> str:
    info = device_info("cuda")
    assert info["name"], "no device name"
    return f"{info['name']}, driver {info['driver']}, CUDA {info['cuda']}"


def check_arena_on_device(args) -> str:
    """One device buffer carved by the arena: both OOM causes, exactly as on the CPU."""
    arena = Arena(4 * MIB, "best-fit", backing_device="cuda")
    assert arena.backing is not None and arena.backing.is_cuda, "the arena's buffer is not on the GPU"
    blocks = [arena.allocate(MIB, f"a{i}") for i in range(4)]
    causes = []
    try:
        arena.allocate(MIB, "over")
    except OutOfMemory as e:
        causes.append(e.event.cause)
    arena.free(blocks[0])
    arena.free(blocks[2])  # two free MiB, not adjacent
    try:
        arena.allocate(2 * MIB, "split")
    except OutOfMemory as e:
        causes.append(e.event.cause)
    assert causes == ["capacity", "fragmentation"], causes
    return "capacity and fragmentation OOMs on a device buffer"


def check_cuda_allocator(args) -> str:
    """Real tensors from PyTorch's caching allocator inside a cap: a real OutOfMemoryError, its snapshot."""
    memory = CudaMemory(64 * MIB)
    capped = torch.cuda.get_per_process_memory_fraction(memory.device)
    held = []
    try:
        for i in range(1000):
            held.append(memory.allocate(3 * MIB + 4096 * i, f"s{i}"))
        raise AssertionError("the cap never refused an allocation")
    except OutOfMemory as e:
        cause = e.event.cause
    stats = memory.stats()
    assert memory.first_oom_snapshot, "no memory_snapshot at the first OOM"
    assert stats.reserved_bytes >= stats.allocated_bytes > 0, stats
    for i in range(0, len(held), 2):  # every other one: the cache keeps the holes
        memory.free(held[i])
    after = memory.stats()
    memory.close()
    restored = torch.cuda.get_per_process_memory_fraction(memory.device)
    assert restored > capped, f"the cap stayed at {capped:.4f} after close"
    return (f"OOM ({cause}) after {len(held)} allocations; {len(memory.first_oom_snapshot)} segments in the "
            f"snapshot; reserved {after.reserved_bytes / MIB:.0f} MiB vs allocated {after.allocated_bytes / MIB:.0f}")


def check_nvml(args) -> str:
    snap = device_snapshot()
    missing = [k for k, v in snap.items() if v is None]
    assert not missing, f"empty: {missing}"
    used, reserved = snap["device_used_bytes"] / MIB, snap["torch_reserved_bytes"] / MIB
    return f"device used {used:.0f} MiB, torch reserved {reserved:.0f} MiB"


def check_greedy_equal(args) -> str:
    """The in-house engines on the GPU give transformers' greedy tokens on the same GPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model).to("cuda")
    want = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]
    del model
    # contiguous reservations index one arena: static runs with arena memory only (the factory refuses cuda)
    for name, memory in (("paged", "arena"), ("paged", "cuda"), ("static", "arena")):
        engine = make_engine(EngineSpec(name, args.model, 64 * MIB, max_seq_len=512, memory=memory, device="cuda"))
        got = [o[0].token_ids for o in generate(engine, PROMPTS, SamplingParams(16))]
        engine.close()
        assert got == want, f"{name} with {memory} memory differs from transformers"
    return "paged (arena and cuda memory) and static (arena): equal to transformers' generate"


def check_kernel(args) -> str:
    """The paged engine's decode attention on the GPU (the torch path: gathered rows, SDPA with grouped heads
    and a padding mask) against a dense reference computed one sequence at a time: equal within 1e-3."""
    import importlib.util

    worst, path = decode_attention_error(args.model, "cuda")
    assert worst < 1e-3, f"decode attention differs from the dense reference by {worst:.2e}"
    installed = [m for m in ("flashinfer", "flash_attn") if importlib.util.find_spec(m)]
    return (f"{path}: equal to a dense reference within {worst:.1e}"
            + (f" ({', '.join(installed)} installed, not used)" if installed else ""))


def decode_attention_error(model: str, device: str) -> tuple[float, str]:
    """The largest difference between the runner's decode attention over scattered rows and SDPA over each
    sequence's dense context, on random K/V; and the attention path the runner took there."""
    import torch.nn.functional as F

    from engines.scheduled.model import Bucket

    engine = make_engine(EngineSpec("paged", model, 64 * MIB, max_seq_len=512, device=device))
    runner = engine.runner
    assert device == "cpu" or runner.kernel is None, "a CPU kernel picked for a GPU store"
    store = runner.kv_planes[0]
    store.normal_()
    lengths = torch.tensor([300, 17, 1, 129, 64], device=device)
    rows = torch.stack([torch.randperm(store.shape[0], device=device)[:300] for _ in lengths])
    mask = (torch.arange(300, device=device)[None, :] < lengths[:, None])[:, None, None, :]
    q = torch.randn(len(lengths), runner.num_heads, runner.head_dim, device=device)
    got = runner._decode_attention(q, store, Bucket(torch.arange(len(lengths)), rows, lengths, mask))
    worst = 0.0
    for b, n in enumerate(lengths.tolist()):
        ctx = store[rows[b, :n]]  # [n, 2, KVH, D]
        keys, values = (ctx[:, i].transpose(0, 1).repeat_interleave(runner.num_heads // runner.num_kv_heads, 0)
                        for i in (0, 1))
        want = F.scaled_dot_product_attention(q[b][:, None], keys, values)[:, 0]
        worst = max(worst, float((got[b] - want).abs().max()))
    engine.close()
    return worst, runner.attention_path


def check_bench(args) -> str:
    """A two-engine bench on the GPU with the cuda memory mode and a budget small enough to OOM."""
    import pandas as pd

    out = Path(args.out) / "bench"
    cmd = [sys.executable, "-m", "harness.cli", "bench", "--engines", "hf,paged", "--model", args.model,
           "--device", "cuda", "--memory", "cuda", "--kv-budget", "8MiB", "--duration", "20", "--grace", "5",
           "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stderr[-2000:]
    run = sorted(p for p in out.iterdir() if p.is_dir())[-1] if any(p.is_dir() for p in out.iterdir()) else out
    samples = pd.read_parquet(next(run.rglob("samples.parquet")))
    for column in ("torch_allocated_bytes", "torch_reserved_bytes", "device_used_bytes", "torch_inactive_split_bytes"):
        assert samples[column].notna().any(), f"samples.{column} is empty"
    requests = pd.read_parquet(next(run.rglob("requests.parquet")))
    for engine in ("hf", "paged"):
        ok = requests[(requests.engine == engine) & (requests.status == "ok")]
        assert len(ok) and (ok.output_tokens > 0).all(), f"{engine}: no request completed with its tokens"
    events = pd.read_parquet(next(run.rglob("events.parquet")))
    snapshots = list(run.rglob("cuda_snapshot-*.json"))
    assert (events.kind == "oom").any(), "no OOM event at an 8 MiB budget in cuda mode"
    assert snapshots, "an OOM in cuda mode without the allocator's snapshot"
    return (f"{len(samples)} samples with allocator and NVML columns; {len(requests)} requests "
            f"({int((requests.status == 'ok').sum())} ok); {int((events.kind == 'oom').sum())} OOM events, "
            f"{len(snapshots)} snapshot(s) in {run}")


def churn_bodies(count: int) -> list[dict]:
    """Prompts of 3 to 200 tokens and answers of 1 to 48 (EOS ignored, so each runs its length), interleaved
    so that hf's static batches differ in width and length and its caches grow and free at many sizes."""
    bodies = []
    for k in range(count):
        prompt = [5 + (7 * i + 3 * k) % 4000 for i in range(3 + (k * 37) % 198)]
        bodies.append({"prompt": prompt, "max_tokens": 1 + (k * 13) % 48, "temperature": 0, "ignore_eos": True})
    return bodies


def drive_churn(url: str, bodies: list[dict]) -> int:
    """Every body to /v1/completions, CHURN_CONCURRENCY at a time: the answers that ran their full length. A
    failed request is counted, not raised: the server's recording is still worth keeping and replaying."""
    def one(body: dict) -> bool:
        try:
            answer = json.loads(request(f"{url}/v1/completions", body, timeout_s=300))
        except OSError:
            return False
        return answer["usage"]["completion_tokens"] == body["max_tokens"]

    with ThreadPoolExecutor(CHURN_CONCURRENCY) as pool:
        return sum(pool.map(one, bodies))


def churn_verdict(result: ReplayResult, every_mismatch: Path) -> str:
    """PASS's text when every segment event of the trace is the emulator's, one for one; otherwise an
    AssertionError whose lines are the mismatches (the first is the likeliest root cause), each with its rule."""
    total, matched = result.segment_events_trace, result.segment_events_matched
    assert total > 0, "the recorded trace has no segment event: nothing was compared"
    if not result.mismatches and matched == total and not result.unknown_frees:
        return f"all {total} segment events reproduced one for one (peak reserved {result.peak_reserved_bytes} B)"
    lines = [m.describe() for m in result.mismatches]
    every_mismatch.parent.mkdir(parents=True, exist_ok=True)
    every_mismatch.write_text("".join(f"{line}\n" for line in lines))
    shown = lines[:MISMATCHES_SHOWN]
    if len(lines) > len(shown):
        shown.append(f"... {len(lines) - len(shown)} more in {every_mismatch}")
    unknown = f"; {result.unknown_frees} frees of blocks the trace never allocated" if result.unknown_frees else ""
    raise AssertionError("\n".join([f"{matched} of {total} segment events reproduced, {len(lines)} mismatches"
                                     f"{unknown} (the first is the likeliest root cause):", *shown]))


def keep_as_fixture(recorded: Path, fixture: Path) -> Path:
    """The recording cut to what the replay reads, small enough to commit: each trace entry's action, address,
    size and stream (free_requested left out where completions are recorded: the replay frees at completion),
    and the cap and settings noted beside them; no frames, times or final segments."""
    with recorded.open("rb") as f:
        state = load_data(f)
    traces = []
    for entries in state["device_traces"]:
        completes = any(e["action"] == "free_completed" for e in entries)
        kept = (e for e in entries if not (completes and e["action"] == "free_requested"))
        traces.append([{k: sys.intern(e[k]) if k == "action" else e[k] for k in FIXTURE_FIELDS if k in e}
                       for e in kept])
    return write_state({"segments": [], "device_traces": traces, RECORDING_KEY: state.get(RECORDING_KEY)}, fixture)


def check_churn_replay(args) -> str:
    """hf serving churn on CUDA, recorded by the server's own allocator from before the model loads, replayed
    through the emulator under the cap and settings it ran with: every segment event must be the emulator's.
    The recording is kept as tests/fixtures/gpu_hf_churn_snapshot.pickle, which the CPU suite replays."""
    out = Path(args.out) / "churn"
    recorded, log = out / "hf_churn_snapshot.pickle", out / "server.log"
    server = start_server("hf", args.model, "64MiB", log, timeout_s=300,
                          extra=["--device", "cuda", "--memory", "cuda", "--max-seq-len", "512",
                                 "--record-memory-history", str(recorded)])
    try:
        completed = drive_churn(server.url, churn_bodies(CHURN_REQUESTS))
    finally:
        server.stop(timeout_s=120)  # SIGTERM: the server writes its history once the engine has stopped
    assert recorded.exists(), f"the server wrote no memory history: {tail(log)}"
    keep_as_fixture(recorded, CHURN_FIXTURE)  # kept whatever the verdict: a FAIL is then replayable on a CPU
    assert completed == CHURN_REQUESTS, f"{completed} of {CHURN_REQUESTS} requests ran their full length"
    trace = load_trace(CHURN_FIXTURE)  # what the CPU suite replays: its entry numbers are the fixture's
    verdict = churn_verdict(replay_recorded(trace), out / "mismatches.txt")
    return (f"{CHURN_REQUESTS} requests, {len(trace.events)} allocator events under a cap of "
            f"{trace.capacity_bytes} B: {verdict}; kept as {CHURN_FIXTURE.relative_to(ROOT)} "
            f"({CHURN_FIXTURE.stat().st_size} B)")


CHECKS: dict[str, tuple[str, Callable]] = {
    "device": ("device and driver", check_device), "arena": ("arena on the device", check_arena_on_device),
    "allocator": ("cuda caching allocator, forced OOM, snapshot, cap restored", check_cuda_allocator),
    "nvml": ("NVML sampling", check_nvml), "greedy": ("greedy outputs on the GPU", check_greedy_equal),
    "kernel": ("paged decode attention on the GPU", check_kernel),
    "bench": ("two-engine bench, cuda memory mode", check_bench),
    "churn": ("hf serving churn recorded on CUDA, replayed by the emulator", check_churn_replay),
}
ITEM_TIMEOUT_S = 480


def run_item(key: str, args) -> int:
    """One item in this process: its PASS or FAIL line."""
    name, check = CHECKS[key]
    started = time.perf_counter()
    try:
        what = check(args)
        print(f"PASS  {name}: {what} ({time.perf_counter() - started:.1f} s)", flush=True)
        return 0
    except Exception as e:
        first, *detail = str(e).splitlines() or [""]
        print(f"FAIL  {name}: {type(e).__name__}: {first}", flush=True)
        for line in detail:  # a message of several lines (the churn item's mismatches): indented below
            print(f"      {line}", flush=True)
        traceback.print_exc(limit=3, file=sys.stderr)
        return 1


def run_all(args) -> int:
    """Every item in a child of its own; one that dies without its line is a FAIL with its last words."""
    failed = 0
    for key, (name, _) in CHECKS.items():
        cmd = [sys.executable, __file__, "--item", key, "--model", args.model, "--out", args.out]
        detail: list[str] = []
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=ITEM_TIMEOUT_S, cwd=ROOT)
            lines = r.stdout.splitlines()
            at = next((i for i, x in enumerate(lines) if x.startswith(("PASS", "FAIL"))), None)
            line, detail = (None, []) if at is None else (lines[at], lines[at + 1:])
            if line is None or r.returncode != 0:
                line = line or f"FAIL  {name}: exited {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1]}"
        except subprocess.TimeoutExpired:
            line = f"FAIL  {name}: no answer in {ITEM_TIMEOUT_S} s"
        failed += line.startswith("FAIL")
        print("\n".join([line, *detail]), flush=True)
    print(json.dumps({"checks": len(CHECKS), "failed": failed}))
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="gpu-check-"))
    ap.add_argument("--item", choices=list(CHECKS), help="run one item here (what the full check does per child)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: error: no CUDA device on this machine; these checks need one", file=sys.stderr)
        return 2
    return run_item(args.item, args) if args.item else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
