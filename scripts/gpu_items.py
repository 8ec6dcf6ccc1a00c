"""gpu-check's items (scripts/gpu_check.py runs each in a process of its own): every GPU path once, each a function
of the run's arguments that returns what it found and its figures, or raises with why it failed. Written for a CUDA
device; the rules each applies (the greedy comparison, the churn verdict, the OOM causes) are functions of their
own that the CPU suite checks with torch.cuda faked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from engines.factory import EngineSpec, make_engine
from engines.memory.arena import Arena, OOMEvent, OutOfMemory
from engines.memory.cuda import CudaMemory, device_info, device_snapshot
from engines.memory.snapshot import load_data, write_state
from engines.memory.snapshot_replay import RECORDING_KEY, ReplayResult, load_trace, replay_recorded
from engines.offline import generate
from engines.procs import kill_tree, spawn
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
# Greedy agreement: where an engine's token differs from transformers', the reference's own logits must put the two
# within this of each other (a near-tie that float order decides: 2e-5 apart on a CPU), else it is a wrong token.
# fp32 on a GPU (TF32 off): differences in summation order move logits by ~1e-5 to 1e-4.
GREEDY_TIE_LOGITS = 1e-3
BF16_TIE_LOGITS = 0.125  # bf16 keeps 8 bits of mantissa: logits of ~10 are 0.06 apart at its resolution
# A real shape: Llama-3-8B's layer (hidden 4096, 32 heads of 128, 8 KV heads, 14,336 MLP, 128K vocabulary) in bf16,
# with 4 of its 32 layers so that building its random weights takes seconds; its KV a token is a real model's
REAL_SHAPE = {"preset": "llama-3-8b", "layers": 4, "dtype": "bfloat16"}
# The kernel item's bf16 case, against a dense reference in fp32 of the same bf16 inputs: the output's own rounding
# (8 bits of mantissa: 0.008 of a value near 1) and the fused kernels' bf16 arithmetic, well below a wrong row or
# mask (whose errors are of the values' own size, ~1)
BF16_ATTENTION_TOLERANCE = 3e-2
# The tiny model in bf16, the GPU's default dtype (make bench runs Llama-3-8B's shape in bf16): the path the kernel
# item's second case and vLLM (whose CUDA attention backends take no fp32) run
BF16_TINY = ("tiny-llama", "bfloat16")
# paged decode against static on the GPU: the paged gather may cost, not halve the rate
PAGED_DECODE_FLOOR = 0.5
# An item's inner run (a bench, a server's start) ends this long before the item's own limit (gpu_check's
# --limit-s): the item then fails with the run's last words, where past its limit it is ended without them
ANSWER_MARGIN_S = 20


def inner_limit_s(args) -> float:
    """What one inner run of an item may take: the item's limit less the margin in which it says why it failed."""
    return args.limit_s - ANSWER_MARGIN_S


def run_bounded(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """A command (a bench, which starts servers of its own) in a group of its own that dies with the item; one
    past timeout_s is ended with every process below it, and the item fails saying so."""
    proc = spawn(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"{' '.join(cmd[2:5])} gave no answer in {timeout_s:.0f} s") from None
    kill_tree(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def check_device(args) -> tuple[str, dict]:
    info = device_info("cuda")
    assert info["name"], "no device name"
    figures = {**info, "torch": torch.__version__, "total_bytes": torch.cuda.get_device_properties(0).total_memory}
    return f"{info['name']}, driver {info['driver']}, CUDA {info['cuda']}, torch {torch.__version__}", figures


def check_arena_on_device(args) -> tuple[str, dict]:
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
    return "capacity and fragmentation OOMs on a device buffer", {"causes": causes}


# The allocator item's KV budget, and the room its held "forward" leaves the KV under the cap: less than the budget,
# so that PyTorch's own allocator refuses before the budget does (with the whole slack free, the budget refused
# first: after 21 allocations on the emulated device, 80 MiB reserved of a 116 MiB cap)
ALLOCATOR_ITEM_BUDGET_BYTES = 64 * MIB
ALLOCATOR_ITEM_KV_ROOM_BYTES = 48 * MIB


def check_cuda_allocator(args) -> tuple[str, dict]:
    """Real tensors from PyTorch's caching allocator inside a cap, the cap's slack held by a forward's tensor: a real
    OutOfMemoryError within the KV budget (the allocator's layer, not the budget's), its snapshot; the cap restored."""
    memory = CudaMemory(ALLOCATOR_ITEM_BUDGET_BYTES)
    capped = torch.cuda.get_per_process_memory_fraction(memory.device)
    room = int(memory._cap_bytes()) - torch.cuda.memory_reserved(memory.device)
    forward = torch.empty(room - ALLOCATOR_ITEM_KV_ROOM_BYTES, dtype=torch.uint8, device=memory.device)
    held = []
    try:
        for i in range(1000):
            held.append(memory.allocate(3 * MIB + 4096 * i, f"s{i}"))
        raise AssertionError("the cap never refused an allocation")
    except OutOfMemory as e:
        event = e.event
    assert event.layer == "allocator", (f"the KV budget refused first ({event.cause}, after {len(held)} "
                                        "allocations): PyTorch's own allocator was never reached")
    stats = memory.stats()
    assert memory.first_oom_snapshot, "no memory_snapshot at the first OOM"
    assert stats.reserved_bytes >= stats.allocated_bytes > 0, stats
    assert stats.allocated_bytes < memory.capacity_bytes, "refused at the budget, not within it"
    for i in range(0, len(held), 2):  # every other one: the cache keeps the holes
        memory.free(held[i])
    after = memory.stats()
    del forward
    memory.close()
    restored = torch.cuda.get_per_process_memory_fraction(memory.device)
    assert restored > capped, f"the cap stayed at {capped:.4f} after close"
    figures = {"cause": event.cause, "layer": event.layer, "allocations": len(held),
               "kv_bytes_at_oom": stats.allocated_bytes, "snapshot_segments": len(memory.first_oom_snapshot),
               "reserved_bytes": after.reserved_bytes, "allocated_bytes": after.allocated_bytes}
    return (f"torch's own OOM ({event.cause}) after {len(held)} allocations, {stats.allocated_bytes / MIB:.0f} MiB "
            f"of KV within its {memory.capacity_bytes / MIB:.0f} MiB budget; {len(memory.first_oom_snapshot)} "
            f"segments in the snapshot; reserved {after.reserved_bytes / MIB:.0f} MiB vs allocated "
            f"{after.allocated_bytes / MIB:.0f}", figures)


def check_nvml(args) -> tuple[str, dict]:
    """What the samples read of the device (DeviceFigures, a frozen record): every figure answered."""
    snap = device_snapshot()
    figures = asdict(snap)
    missing = [k for k, v in figures.items() if v is None]
    assert not missing, f"empty: {missing}"
    used, reserved = snap.device_used_bytes / MIB, snap.torch_reserved_bytes / MIB
    return f"device used {used:.0f} MiB, torch reserved {reserved:.0f} MiB", figures


def check_greedy_equal(args) -> tuple[str, dict]:
    """The in-house engines on the GPU give transformers' greedy tokens on the same GPU, up to near-ties."""
    want = reference_greedy(args.model, "cuda", 16)
    figures = {}
    # contiguous reservations index one arena: static runs with arena memory only (the factory refuses cuda)
    for name, memory in (("paged", "arena"), ("paged", "cuda"), ("static", "arena")):
        engine = make_engine(EngineSpec(name, args.model, 64 * MIB, max_seq_len=512, memory=memory, device="cuda"))
        got = [o[0].token_ids for o in generate(engine, PROMPTS, SamplingParams(16))]
        engine.close()
        ties = [greedy_agreement(w, s, g, GREEDY_TIE_LOGITS) for (w, s), g in zip(want, got, strict=True)]
        figures[f"{name}/{memory}"] = {"near_ties": sum(t is not None for t in ties)}
    return ("paged (arena and cuda memory) and static (arena): transformers' greedy tokens, near-ties within "
            f"{GREEDY_TIE_LOGITS} allowed", figures)


def reference_greedy(model_dir: str, device: str, tokens: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy tokens for each prompt, with the logits of every step they were chosen from."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    out = []
    for p in PROMPTS:
        gen = model.generate(torch.tensor([p], device=device), max_new_tokens=tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        out.append((gen.sequences[0, len(p):].tolist(), [step[0].float().cpu() for step in gen.logits]))
    del model
    return out


def greedy_agreement(want: list[int], logits: list[torch.Tensor], got: list[int], tie: float) -> int | None:
    """None where `got` is `want`; else the first step where they part, when the reference's own logits put the
    two tokens within `tie` of each other (a near-tie that summation order decides: after it, the continuations
    are of different contexts and are not compared). A token the reference put further below is an
    AssertionError: a wrong token, not a tie."""
    for step, (w, g) in enumerate(zip(want, got, strict=False)):
        if w == g:
            continue
        gap = float(logits[step][w] - logits[step][g])
        assert gap <= tie, (f"step {step}: token {g} where transformers chose {w}, {gap:.2e} below it in its own "
                            f"logits (a near-tie is within {tie})")
        return step
    assert len(got) == len(want), f"{len(got)} tokens where transformers gave {len(want)}"
    return None


def check_kernel(args) -> tuple[str, dict]:
    """The paged engine's decode attention on the GPU (the torch path: gathered rows expanded to every head, SDPA
    with a padding mask, held to SDPA's fused kernels) against a dense reference computed one sequence at a time:
    the fp32 model's equal within 1e-3, and the same tiny model in bf16 (the GPU's default: where SDPA may pick
    cuDNN's or another fused kernel than fp32's) within BF16_ATTENTION_TOLERANCE."""
    worst, path = decode_attention_error(args.model, "cuda")
    assert worst < 1e-3, f"fp32 decode attention differs from the dense reference by {worst:.2e}"
    worst_bf16, _ = decode_attention_error(str(bf16_tiny_model(args)), "cuda")
    assert worst_bf16 < BF16_ATTENTION_TOLERANCE, \
        f"bf16 decode attention differs from the dense reference by {worst_bf16:.2e}"
    installed = [m for m in ("flashinfer", "flash_attn") if importlib.util.find_spec(m)]
    return (f"{path}: equal to a dense reference within {worst:.1e} (fp32), {worst_bf16:.1e} (bf16)"
            + (f" ({', '.join(installed)} installed, not used)" if installed else ""),
            {"max_abs_error": worst, "max_abs_error_bf16": worst_bf16, "path": path})


def bf16_tiny_model(args) -> Path:
    """BF16_TINY built into the item's OUT (a few seconds; each item is a process of its own), or found there."""
    from engines.modelbuild import build_model

    preset, dtype = BF16_TINY
    model_dir = Path(args.out) / f"{preset}-{dtype}"
    if not (model_dir / "config.json").is_file():
        build_model(preset, model_dir, dtype)
    return model_dir


def fused_attention_only(device: str):
    """On a GPU, scaled_dot_product_attention limited to its fused kernels (flash, memory-efficient, cuDNN): a call
    none of them takes raises ("No available kernel") instead of falling to the math kernel. Elsewhere, nothing."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not str(device).startswith("cuda"):
        return nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


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
    q = torch.randn(len(lengths), runner.num_heads, runner.head_dim, device=device, dtype=store.dtype)
    with fused_attention_only(device):  # on a GPU: no math kernel to fall to, so the path must run fused
        got = runner._decode_attention(q, store, Bucket(torch.arange(len(lengths)), rows, lengths, mask))
    worst = 0.0
    for b, n in enumerate(lengths.tolist()):
        ctx = store[rows[b, :n]].float()  # [n, 2, KVH, D]: the reference in fp32, whatever the model's dtype
        keys, values = (ctx[:, i].transpose(0, 1).repeat_interleave(runner.num_heads // runner.num_kv_heads, 0)
                        for i in (0, 1))
        want = F.scaled_dot_product_attention(q[b].float()[:, None], keys, values)[:, 0]
        worst = max(worst, float((got[b].float() - want).abs().max()))
    engine.close()
    return worst, runner.attention_path


def check_bench(args) -> tuple[str, dict]:
    """A two-engine bench on the GPU with the cuda memory mode and a budget small enough to OOM."""
    import pandas as pd

    out = Path(args.out) / "bench"
    cmd = [sys.executable, "-m", "harness.cli", "bench", "--engines", "hf,paged", "--model", args.model,
           "--device", "cuda", "--memory", "cuda", "--kv-budget", "8MiB", "--duration", "20", "--grace", "5",
           "--out", str(out), "--reports", str(out / "reports")]  # the report too in OUT, not the checkout
    r = run_bounded(cmd, inner_limit_s(args))
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
    figures = {"samples": len(samples), "requests": len(requests), "ok": int((requests.status == "ok").sum()),
               "ooms": int((events.kind == "oom").sum()), "snapshots": len(snapshots)}
    return (f"{len(samples)} samples with allocator and NVML columns; {len(requests)} requests "
            f"({figures['ok']} ok); {figures['ooms']} OOM events, {len(snapshots)} snapshot(s) in {run}", figures)


def churn_bodies(count: int) -> list[dict]:
    """Prompts of 3 to 200 tokens and answers of 1 to 48 (EOS ignored, so each runs its length), interleaved
    so that hf's static batches differ in width and length and its caches grow and free at many sizes."""
    bodies = []
    for k in range(count):
        prompt = [5 + (7 * i + 3 * k) % 4000 for i in range(3 + (k * 37) % 198)]
        bodies.append({"prompt": prompt, "max_tokens": 1 + (k * 13) % 48, "temperature": 0, "ignore_eos": True})
    return bodies


def drive_churn(url: str, bodies: list[dict], timeout_s: float = 300) -> int:
    """Every body to /v1/completions, CHURN_CONCURRENCY at a time: the answers that ran their full length. A
    failed request is counted, not raised: the server's recording is still worth keeping and replaying."""
    def one(body: dict) -> bool:
        try:
            answer = json.loads(request(f"{url}/v1/completions", body, timeout_s=timeout_s))
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


def check_churn_replay(args, alloc_conf: str | None = None) -> tuple[str, dict]:
    """hf serving churn on CUDA, recorded by the server's own allocator from before the model loads, replayed
    through the emulator under the cap and settings it ran with: every segment event must be the emulator's.
    The recording, cut to what the replay reads, stays in OUT; with --keep-fixture (and the default settings) it
    becomes tests/fixtures/gpu_hf_churn_snapshot.pickle, which the CPU suite replays."""
    out = Path(args.out) / ("churn" if alloc_conf is None else "churn-expandable")
    recorded, log = out / "hf_churn_snapshot.pickle", out / "server.log"
    out.mkdir(parents=True, exist_ok=True)
    server = start_server("hf", args.model, "64MiB", log, timeout_s=inner_limit_s(args), alloc_conf=alloc_conf,
                          extra=["--device", "cuda", "--memory", "cuda", "--max-seq-len", "512",
                                 "--record-memory-history", str(recorded)])
    try:
        completed = drive_churn(server.url, churn_bodies(CHURN_REQUESTS), inner_limit_s(args))
    finally:
        server.stop(timeout_s=inner_limit_s(args))  # SIGTERM: the server writes its history once the engine has stopped
    assert recorded.exists(), f"the server wrote no memory history: {tail(log)}"
    kept = keep_as_fixture(recorded, fixture_path(out, args.keep_fixture and alloc_conf is None))
    assert completed == CHURN_REQUESTS, f"{completed} of {CHURN_REQUESTS} requests ran their full length"
    trace = load_trace(kept)  # what the CPU suite replays: its entry numbers are the fixture's
    verdict = churn_verdict(replay_recorded(trace), out / "mismatches.txt")
    figures = {"requests": CHURN_REQUESTS, "events": len(trace.events), "capacity_bytes": trace.capacity_bytes,
               "alloc_conf": trace.alloc_conf, "kept": str(kept)}
    return (f"{CHURN_REQUESTS} requests, {len(trace.events)} allocator events under a cap of "
            f"{trace.capacity_bytes} B: {verdict}; kept as {kept} ({kept.stat().st_size} B)", figures)


def fixture_path(out: Path, keep_fixture: bool) -> Path:
    """Where the cut recording goes: the repository's fixture only when asked (--keep-fixture), else OUT."""
    return CHURN_FIXTURE if keep_fixture else out / CHURN_FIXTURE.name


def check_churn_expandable(args) -> tuple[str, dict]:
    """The churn item under expandable_segments:True: the emulator's pages mapped and unmapped one for one."""
    return check_churn_replay(args, "expandable_segments:True")


def real_oom_causes(budget_bytes: int = 64 * MIB) -> dict[str, OOMEvent]:
    """Two refusals by PyTorch's own allocator (torch.cuda.OutOfMemoryError) with the KV within its budget: one
    where other tensors (a forward's, here one) hold all but 2 MiB under the cap (capacity), one where every
    other 3 MiB KV tensor is freed and a 9 MiB one fits neither a hole nor the 20 MiB segment it asks for under
    the cap (fragmentation). CudaMemory judges each from the allocator's state."""
    events = {}
    for case, others, kv in (("full", 2 * MIB, [3 * MIB]), ("holes", 76 * MIB, [3 * MIB] * 16 + [9 * MIB])):
        memory = CudaMemory(budget_bytes, "cuda")
        room = int(memory._cap_bytes()) - torch.cuda.memory_reserved(memory.device)
        activations = torch.empty(room - others, dtype=torch.uint8, device=memory.device)
        held = []
        try:
            for i, nbytes in enumerate(kv):
                if i == 16:  # the holes: every other 3 MiB tensor back to the cache
                    for alloc in held[::2]:
                        memory.free(alloc)
                    held = held[1::2]
                held.append(memory.allocate(nbytes, f"kv{i}"))
            raise AssertionError(f"{case}: the allocator never refused")
        except OutOfMemory as e:
            events[case] = e.event
            assert memory.first_oom_snapshot, f"{case}: no snapshot at the OOM"
        finally:  # the next case starts from an empty cache
            for alloc in held:
                memory.free(alloc)
            del activations
            memory.close()
            torch.cuda.empty_cache()
    return events


def check_real_oom(args) -> tuple[str, dict]:
    events = real_oom_causes()
    causes = {case: (e.cause, e.layer) for case, e in events.items()}
    assert causes == {"full": ("capacity", "allocator"), "holes": ("fragmentation", "allocator")}, causes
    figures = {case: {"cause": e.cause, "cached_free_bytes": e.cached_free_bytes,
                      "device_free_bytes": e.device_free_bytes} for case, e in events.items()}
    return "torch's own OOMs within the KV budget: truly full is capacity, free in holes is fragmentation", figures


def check_real_shape_bf16(args) -> tuple[str, dict]:
    """A model of a real shape in bf16 (REAL_SHAPE: random weights built here) served by the paged engine from
    cuda memory: every prompt its full length, the first tokens transformers' up to a bf16 near-tie."""
    from engines.modelbuild import build_model

    model_dir = Path(args.out) / "real-shape-bf16"
    started = time.perf_counter()
    build_model(REAL_SHAPE["preset"], model_dir, REAL_SHAPE["dtype"],
                overrides={"num_hidden_layers": REAL_SHAPE["layers"]})
    built_s = time.perf_counter() - started
    want = reference_greedy(str(model_dir), "cuda", 8)
    engine = make_engine(EngineSpec("paged", str(model_dir), 2 * 2**30, max_seq_len=1024, memory="cuda",
                                    device="cuda"))
    started = time.perf_counter()
    got = [o[0].token_ids for o in generate(engine, PROMPTS, SamplingParams(8))]
    served_s = time.perf_counter() - started
    store = engine.runner.kv_planes[0]
    engine.close()
    assert store.dtype == torch.bfloat16 and store.is_cuda, f"the KV store is {store.dtype} on {store.device}"
    ties = [greedy_agreement(w, s, g, BF16_TIE_LOGITS) for (w, s), g in zip(want, got, strict=True)]
    figures = {**REAL_SHAPE, "build_s": built_s, "tokens_per_s": sum(map(len, got)) / served_s,
               "near_ties": sum(t is not None for t in ties)}
    return (f"{REAL_SHAPE['preset']} shape, {REAL_SHAPE['layers']} layers, bf16: served on the GPU, "
            f"{figures['tokens_per_s']:.0f} tokens/s", figures)


def decode_rates(model: str, device: str, tokens: int = 64) -> dict[str, float]:
    """Decode tokens per second of the paged and the static engine on the same prompts and device (each warmed
    by one run first: the first pays for kernels' loading)."""
    rates = {}
    for name in ("paged", "static"):
        engine = make_engine(EngineSpec(name, model, 64 * MIB, max_seq_len=512, device=device))
        generate(engine, PROMPTS[:2], SamplingParams(4))
        started = time.perf_counter()
        outs = generate(engine, PROMPTS, SamplingParams(tokens, ignore_eos=True))
        rates[name] = sum(len(o[0].token_ids) for o in outs) / (time.perf_counter() - started)
        engine.close()
    return rates


def check_decode_rate(args) -> tuple[str, dict]:
    rates = decode_rates(args.model, "cuda")
    ratio = rates["paged"] / rates["static"]
    assert ratio >= PAGED_DECODE_FLOOR, (f"paged decodes {rates['paged']:.0f} tokens/s, {ratio:.2f}x static's "
                                         f"{rates['static']:.0f} (the floor is {PAGED_DECODE_FLOOR}x)")
    return (f"paged {rates['paged']:.0f} tokens/s, static {rates['static']:.0f}: {ratio:.2f}x",
            {**rates, "ratio": ratio})


def vllm_installed() -> bool:
    return (ROOT / ".venv-vllm" / "bin" / "vllm").exists() or importlib.util.find_spec("vllm") is not None


class Absent(Exception):
    """The item's subject is not installed here: not run, and not counted."""


def check_vllm(args) -> tuple[str, dict]:
    """vLLM, where installed (`make vllm`: .venv-vllm), benched beside paged on the GPU for 20 s."""
    if not vllm_installed():
        raise Absent("vLLM is not installed (make vllm)")
    out = Path(args.out) / "vllm"
    # the tiny model in bf16: vLLM's CUDA attention backends take no fp32 (the peer passes the model's dtype)
    cmd = [sys.executable, "-m", "harness.cli", "bench", "--engines", "paged,vllm", "--model",
           str(bf16_tiny_model(args)), "--device", "cuda", "--kv-budget", "64MiB", "--duration", "20", "--grace", "5",
           "--out", str(out), "--reports", str(out / "reports")]  # the report too in OUT, not the checkout
    r = run_bounded(cmd, inner_limit_s(args))
    assert r.returncode == 0, r.stderr[-2000:]
    import pandas as pd

    requests = pd.read_parquet(next(out.rglob("requests.parquet")))
    ok = requests[(requests.engine == "vllm") & (requests.status == "ok")]
    assert len(ok) and (ok.output_tokens > 0).all(), "vllm: no request completed with its tokens"
    return f"vllm served {len(ok)} requests beside paged", {"vllm_ok": len(ok), "requests": len(requests)}
