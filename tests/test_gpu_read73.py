"""The GPU box read once more (issue 73): each defect reproduced on a CPU, with torch.cuda faked (or the project's
own sizing functions called), failing on e108c87 and passing since."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import engines.memory.cuda as cuda
import engines.memory.nvml
import scripts.gpu_items as items
from tests.test_cuda_counts import device  # noqa: F401 (the emulated CUDA device, a fixture)
from tests.test_gpu_paths import fake_cuda  # noqa: F401 (a CUDA device as torch.cuda describes it, a fixture)

MiB = 2**20


# -- 1: the nvml item read device_snapshot() as a dict
def test_1_the_nvml_item_reads_the_device_figures_record(fake_cuda, monkeypatch):  # noqa: F811
    lib = SimpleNamespace(nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
                          nvmlDeviceGetUUID=lambda h: "GPU-b",
                          nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=300 * MiB, total=1000 * MiB))
    monkeypatch.setattr(engines.memory.nvml, "nvml", lambda: lib)
    monkeypatch.setattr(cuda, "nvml", lambda: lib)
    stats = {"allocated_bytes.all.current": 90 * MiB, "reserved_bytes.all.current": 100 * MiB,
             **{key: 1 for key in cuda.ALLOCATOR_FIELDS.values()}}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: stats)
    line, figures = items.check_nvml(None)
    assert line == "device used 300 MiB, torch reserved 100 MiB"
    assert figures["device_used_bytes"] == 300 * MiB and figures["torch_segments"] == 1
    monkeypatch.setattr(cuda, "nvml", lambda: (_ for _ in ()).throw(OSError("no NVML")))
    with pytest.raises(AssertionError, match="empty: \\['device_used_bytes'\\]"):
        items.check_nvml(None)


# -- 5: a timed-out item left its bench and servers running
HANGING_ITEM = """
import subprocess, sys, time
same_group = subprocess.Popen(["sleep", "300"])  # a bench the item started
own_session = subprocess.Popen(["sleep", "301"], start_new_session=True)  # a server that bench started
open(sys.argv[1], "w").write(f"{same_group.pid} {own_session.pid}")
time.sleep(300)
"""


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_5_an_item_past_its_limit_leaves_no_process_behind(monkeypatch, tmp_path):
    import sys
    from argparse import Namespace

    import scripts.gpu_check as gpu_check

    pids = tmp_path / "pids"
    monkeypatch.setattr(gpu_check, "ITEMS", {"hang": gpu_check.Item("hanging item", None, 3)})
    monkeypatch.setattr(gpu_check, "child_command",
                        lambda key, args, result: [sys.executable, "-c", HANGING_ITEM, str(pids)])
    result = gpu_check.run_child("hang", Namespace(out=str(tmp_path)))
    assert result.verdict == "fail" and "no answer in 3 s" in result.detail
    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 2 and not [p for p in left if alive(p)], "processes of the item still running"


class Refusing:
    """subprocess.Popen for the items' inner runs: records the timeout it is waited with, and the run fails."""

    waited: list[float] = []

    def __init__(self, cmd, **kw):
        self.args, self.returncode, self.pid = cmd, 1, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def communicate(self, input=None, timeout=None):
        Refusing.waited.append(timeout)
        return "", "refused"

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        pass


@pytest.mark.parametrize("key", ["bench", "vllm"])
def test_5_an_items_inner_run_ends_before_the_item_does(key, monkeypatch, tmp_path):
    """The bench's and vLLM's inner runs were waited 420 s under items limited to 240 s and 300 s: the item was
    ended first, its answer lost and the bench left running."""
    import subprocess
    from argparse import Namespace

    import engines.procs
    import scripts.gpu_check as gpu_check

    Refusing.waited = []
    monkeypatch.setattr(subprocess, "Popen", Refusing)
    monkeypatch.setattr(engines.procs.subprocess, "Popen", Refusing)
    monkeypatch.setattr(items, "kill_tree", lambda proc: None, raising=False)
    monkeypatch.setattr(items, "vllm_installed", lambda: True)
    monkeypatch.setattr(items, "bf16_tiny_model", lambda args: "m")  # the model it serves: not built here
    limit = gpu_check.ITEMS[key].limit_s
    args = Namespace(out=str(tmp_path), model="m", limit_s=limit, keep_fixture=False)
    with pytest.raises(AssertionError, match="refused"):
        gpu_check.ITEMS[key].check(args)
    assert Refusing.waited and all(t < limit for t in Refusing.waited), (Refusing.waited, limit)


# -- 6: torch>=2.4 was below what the code needs
@pytest.mark.parametrize("image_torch", ["2.4.1+cu121", "2.5.1+cu124"])
def test_6_an_images_cuda_torch_below_the_floor_is_not_kept(image_torch, monkeypatch):
    """get_per_process_memory_fraction (2.6), transformers 5's own floor (2.6): an image's
    CUDA torch 2.4 or 2.5 was kept, and every engine failed at model load. The tested torch goes into the venv."""
    import scripts.setup_missing as setup

    calls = []
    monkeypatch.setattr(setup, "pip", lambda args, wheels: calls.append(args))
    answers = [(image_torch, "12.4", True, "/usr/lib/python3/dist-packages/torch/__init__.py"),
               ("2.13.0+cu130", "13.0", True, "/venv/torch/__init__.py")]
    monkeypatch.setattr(setup, "torch_seen", lambda: answers.pop(0))
    assert setup.ensure_cuda_torch("2.13.0", None) == "torch 2.13.0+cu130 (CUDA 13.0) installed"
    [call] = calls
    assert "torch==2.13.0" in call and "--ignore-installed" in call  # the system's torch shadowed, not touched
    assert torch.cuda.get_per_process_memory_fraction  # what the floor is for, in the torch the suite runs


def test_6_the_readme_states_pyprojects_torch_floor():
    import re

    import scripts.setup_missing as setup
    from tests.conftest import ROOT

    torch_req = next(r for r in setup.needs(ROOT / "pyproject.toml", []) if r.name == "torch")
    floor = str(torch_req.specifier).removeprefix(">=")
    assert floor == "2.6"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert re.findall(r"torch >= ([\d.]+)", readme) == [floor]


# -- also: the allocator's settings read in the order the installed torch reads them, in one place
@pytest.mark.parametrize("torch_version, rounded_kib", [("2.13.0", 1280), ("2.8.0", 1200)])
def test_also_cuda_memory_rounds_by_the_settings_the_installed_torch_reads(torch_version, rounded_kib, monkeypatch,
                                                                          environ):
    """From 2.9 torch reads PYTORCH_ALLOC_CONF first (PYTORCH_CUDA_ALLOC_CONF is its deprecated fallback); before
    2.9 only PYTORCH_CUDA_ALLOC_CONF. CudaMemory read PYTORCH_CUDA_ALLOC_CONF alone, whatever torch ran."""
    from engines.memory import allocconf
    from tests.test_cuda_counts import EmulatedDevice

    monkeypatch.setattr(allocconf, "installed_torch_version",
                        lambda: tuple(int(x) for x in torch_version.split(".")[:2]))
    environ["PYTORCH_ALLOC_CONF"] = "roundup_power2_divisions:4"  # 1200 KiB -> the next quarter, 1280 KiB
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:100"  # 1200 KiB stays 1200 KiB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=1000 * MiB))
    dev = EmulatedDevice()
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: dev.fraction)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", dev.set_fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    assert cuda.CudaMemory(64 * MiB, "cuda:0").rounded(1200 * 1024) == rounded_kib * 1024
    assert allocconf.torch_alloc_conf({"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "x"}, (2, 9)) == ""
    assert allocconf.torch_alloc_conf({}, (2, 9)) is None


def test_also_a_servers_allocator_reads_the_setting_bench_gives_it_over_the_users(monkeypatch, tmp_path, environ):
    """bench set PYTORCH_CUDA_ALLOC_CONF alone in the server's environment: a user's PYTORCH_ALLOC_CONF went along
    and, read first from torch 2.9, won. The recording of a memory history notes the setting the server ran."""
    from harness.run import servers

    seen = {}

    class Exited:
        returncode = 2

        def poll(self):
            return 2

    def spawn(cmd, **kw):
        seen.update(env=kw["env"])
        return Exited()

    environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:False"
    monkeypatch.setattr(servers, "spawn", spawn)
    with pytest.raises(servers.ServerFailed):
        servers.start_server("hf", "m", "16MiB", tmp_path / "hf.log", extra=["--memory", "cuda"],
                             alloc_conf="expandable_segments:True")
    from engines.memory.allocconf import torch_alloc_conf

    for version in ((2, 6), (2, 9), (2, 13)):
        assert torch_alloc_conf(seen["env"], version) == "expandable_segments:True"


# -- 3: a forward's OOM was judged on the segment torch asked for, read as the request
def test_3_a_small_activation_refused_with_its_bytes_in_holes_is_fragmentation(device):  # noqa: F811
    """A 3 MiB activation, 10 MiB free in 2 MiB holes and 8 MiB under the cap: torch says "Tried to allocate
    20.00 MiB" (the segment a 1-10 MiB request carves), and 18 MiB free read as capacity against 20 MiB."""
    from engines.oom import segment_asked

    memory = cuda.CudaMemory(64 * MiB, "cuda:0")
    pieces = [device.empty(2 * MiB) for _ in range(10)]  # one 20 MiB segment, split ten ways
    del pieces[::2]  # five 2 MiB holes: the segment stays, split
    room = device.allocator.capacity_bytes - device.allocator.reserved
    others = device.empty(room - 8 * MiB)  # noqa: F841 (held: the rest of the forward)
    with pytest.raises(torch.OutOfMemoryError) as refused:
        device.empty(3 * MiB)
    assert "Tried to allocate 20.00 MiB" in str(refused.value)
    assert segment_asked(refused.value) == 20 * MiB
    event = memory.device_oom(segment_asked(refused.value), "activations")
    assert (event.cached_free_bytes, event.device_free_bytes) == (10 * MiB, 8 * MiB)
    assert event.cause == "fragmentation" and event.requested_bytes <= 3 * MiB
    # a request the bytes free cannot hold is still capacity: 262 MiB with 18 MiB free
    assert memory.device_oom(262 * MiB, "activations").cause == "capacity"


@pytest.mark.parametrize("message, segment", [
    ("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0", 2 * MiB),
    ("CUDA out of memory. Tried to allocate 262.00 MiB. GPU 0", 262 * MiB),
    ("CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0", 2002 * MiB),  # 1.955 GiB up to whole 2 MiB
    ("something else", 0),
])
def test_3_the_segment_asked_is_read_as_torch_prints_it(message, segment):
    from engines.memory.blocks import segment_size, smallest_request_for_segment
    from engines.oom import segment_asked

    assert segment_asked(RuntimeError(message)) == segment
    for request in (512, MiB, MiB + 512, 3 * MiB, 10 * MiB - 512, 10 * MiB, 19 * MiB, 261 * MiB):
        low = smallest_request_for_segment(segment_size(request))
        assert low <= request and segment_size(low) == segment_size(request)


# -- 4: the allocator item's budget refused before torch's own allocator did
def test_4_the_allocator_item_reaches_torchs_own_refusal(device):  # noqa: F811
    line, figures = items.check_cuda_allocator(None)
    assert device.allocator.stats().ooms >= 1, "PyTorch's allocator (emulated) never refused"
    assert figures["layer"] == "allocator" and figures["kv_bytes_at_oom"] < items.ALLOCATOR_ITEM_BUDGET_BYTES
    assert line.startswith("torch's own OOM")


# -- 2: under --memory cuda the cap was set before the runner re-laid the weights
def recording_build(tiny_model, monkeypatch, fail_layout: bool = False):
    """make_engine of a paged engine under --memory cuda, its memory faked as an arena: the order in which the
    weights were laid out and the memory (the cap) made, and the memories made."""
    from engines.factory import EngineSpec, make_engine
    from engines.memory.arena import Arena
    from engines.scheduled import model

    events, memories, real_laid_out = [], [], model.laid_out

    def laid_out(linears):
        events.append("laid_out")
        if fail_layout:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total "
                                         "capacity of 79.19 GiB of which 1.02 GiB is free.")
        return real_laid_out(linears)

    def memory(kind, capacity, on, placement="best-fit", headroom_bytes=0, alloc_conf=None):
        events.append("cap")
        memories.append(Arena(capacity, backing_device="cpu"))
        memories[-1].close = lambda: events.append("closed")
        return memories[-1]

    monkeypatch.setattr(model, "laid_out", laid_out)
    monkeypatch.setattr("engines.factory.make_memory", memory)
    engine = make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512, memory="cuda"))
    return engine, events


def test_2_the_weights_are_laid_out_before_the_cap_is_set(tiny_model, monkeypatch):
    engine, events = recording_build(tiny_model, monkeypatch)
    assert "cap" in events and "laid_out" in events
    assert events.index("cap") > max(i for i, e in enumerate(events) if e == "laid_out"), events
    assert engine.runner.layers[0].qkv.data_ptr() == engine.runner.hf.model.layers[0].self_attn.q_proj.weight \
        .data_ptr()  # the runner reads the weights laid out before the cap, not a second copy


def test_2_an_engine_the_device_cannot_hold_is_refused_in_one_line(tiny_model, monkeypatch):
    from engines.factory import EngineConfigError

    with pytest.raises(EngineConfigError) as refused:
        recording_build(tiny_model, monkeypatch, fail_layout=True)
    said = str(refused.value)
    assert "\n" not in said and "does not fit on cpu" in said and "Tried to allocate 1.96 GiB" in said


def test_2_a_kv_pool_the_device_refuses_restores_the_cap(tiny_model, monkeypatch):
    from engines.factory import EngineConfigError

    def refusing(*args, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has ...")

    monkeypatch.setattr("engines.factory.make_policy", refusing)
    events = []
    with pytest.raises(EngineConfigError, match="does not fit"):
        from engines.memory.arena import Arena

        def memory(kind, capacity, on, placement="best-fit", headroom_bytes=0, alloc_conf=None):
            made = Arena(capacity, backing_device="cpu")
            made.close = lambda: events.append("closed")
            return made

        monkeypatch.setattr("engines.factory.make_memory", memory)
        from engines.factory import EngineSpec, make_engine

        make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512, memory="cuda"))
    assert events == ["closed"]


def test_2_the_gpu_defaults_engine_builds_within_its_cap_by_the_sizing_functions(monkeypatch, capsys):
    """`make bench MEMORY=cuda` on a GPU box: Llama-3-8B's shape whole, bf16, a 2 GiB KV budget, max_seq_len 2048,
    the paged engine's defaults, on an H100. CudaMemory sets the cap (torch.cuda faked: the weights in use when it
    is set) at what is in use + the KV budget + a large segment's slack + cuBLAS's workspace + a forward's
    headroom. Laid out before the cap, the weights' one copy at a time (the lm_head, the largest) is the device's,
    and what the build allocates under the cap is the KV pool, within the budget, beside a forward's headroom.
    The old layout, after the cap, held 1.96 GiB of lm_head copies under it."""
    from engines.factory import EngineSpec, forward_headroom_bytes
    from engines.memory.cuda import CUBLAS_WORKSPACE_BYTES
    from engines.shapes import batched_tokens, load_shape
    from harness.gpus import gpu_preset

    shape, dtype_bytes, budget, max_seq_len = load_shape("llama-3-8b"), 2, 2 * 2**30, 2048
    spec = EngineSpec("paged", "models/llama-3-8b-bf16", budget, max_seq_len=max_seq_len, memory="cuda")
    kvb = shape.kv_bytes_per_token("bfloat16")
    headroom = forward_headroom_bytes(shape, dtype_bytes, batched_tokens(max_seq_len), spec.max_num_seqs, budget // kvb,
                                      max_seq_len)
    weights = shape.weights_bytes("bfloat16")
    lm_head = shape.vocab_size * shape.hidden_size * dtype_bytes
    peak_layout = max(lm_head, shape.hidden_size * 2 * shape.intermediate_size * dtype_bytes)
    total = gpu_preset("h100-80gb").memory_bytes
    fraction = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: weights)  # laid out: the weights, once
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [])
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: fraction.get("set", 1.0))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: fraction.update(set=f))
    memory = cuda.CudaMemory(budget, "cuda:0", headroom_bytes=headroom)
    cap = memory._cap_bytes()
    block_bytes = kvb * spec.block_size
    kv_pool = memory.max_units(block_bytes) * block_bytes  # the paged pool, as PagedKV sizes it
    assert weights + peak_layout < total  # the layout's copy, before the cap
    assert kv_pool <= budget and weights + kv_pool + headroom + CUBLAS_WORKSPACE_BYTES <= cap < total
    left_beside_kv = cap - weights - kv_pool
    assert 2 * lm_head > left_beside_kv - headroom  # the old layout's copies would not have fit beside a forward
    with capsys.disabled():
        print(f"\nweights {weights / 2**30:.2f} GiB (+{peak_layout / 2**30:.2f} GiB while one group is laid out, "
              f"before the cap); cap {cap / 2**30:.2f} GiB of {total / 2**30:.2f}: KV pool {kv_pool / 2**30:.2f} "
              f"GiB, forward headroom {headroom / 2**30:.2f} GiB, {left_beside_kv / 2**30:.2f} GiB beside the KV; "
              f"the old layout's copies {2 * lm_head / 2**30:.2f} GiB")


# -- 7: attention off the CPU kernel took SDPA's math kernel, and the headroom under-counted it
def sdpa_calls(tiny_model, monkeypatch) -> list[dict]:
    """Every scaled_dot_product_attention call of the paged engine's torch path (the compiled CPU kernel refused,
    as off the CPU) over a mixed batch: its tensors and keyword arguments."""
    from engines.factory import EngineSpec, make_engine
    from engines.offline import generate
    from engines.scheduled import model
    from engines.sequence import SamplingParams

    calls, real = [], model.F.scaled_dot_product_attention

    def recording(q, k, v, **kw):
        calls.append({"q": q, "k": k, "v": v, **kw})
        return real(q, k, v, **kw)

    monkeypatch.setattr(model, "usable", lambda store: False)
    monkeypatch.setattr(model.F, "scaled_dot_product_attention", recording)
    engine = make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512))
    prompts = [[5 + (7 * i + 3 * n) % 4000 for i in range(n)] for n in (3, 17, 40, 8, 100)]
    generate(engine, prompts, SamplingParams(4))
    return calls


def test_7_the_runner_passes_sdpa_what_a_gpu_runs_fused(tiny_model, monkeypatch):
    """Flash takes no mask and the memory-efficient kernel no grouped heads: a mask beside enable_gqa fell to the
    math kernel (K/V repeated to every head, fp32 scores). Every call now has K/V of every query head, no
    enable_gqa, a boolean mask or none (causal), and the model's dtype."""
    calls = sdpa_calls(tiny_model, monkeypatch)
    decodes = [c for c in calls if c["q"].shape[-2] == 1 and c.get("attn_mask") is not None]
    assert decodes and len(decodes) < len(calls)  # decode buckets, and prefill chunks beside them
    for c in calls:
        assert not c.get("enable_gqa"), "grouped heads: no fused kernel beside a mask"
        assert c["k"].shape[-3] == c["v"].shape[-3] == c["q"].shape[-3] == 4  # tiny-llama: 4 heads, 2 of K/V
        assert c["k"].dtype == c["q"].dtype == torch.float32
        assert c.get("attn_mask") is None or c["attn_mask"].dtype == torch.bool
        assert (c.get("attn_mask") is None) == bool(c.get("is_causal"))


def test_7_the_headroom_counts_what_the_decode_path_allocates(tiny_model, monkeypatch):
    """A decode bucket's gathered K/V, its copies expanded to every head and its mask (bool, and SDPA's additive
    copy): within what attention_temporaries_bytes counts per context token. At Llama-3-8B's shape in bf16 that
    is 20,483 B a token (the old count, 4,224 B, was the gathered rows and fp32 scores: the math path's)."""
    from engines.shapes import BUCKET_RATIO, attention_temporaries_bytes

    def per_decode_token(heads, kv_heads, head_dim, dtype_bytes):
        pool = 3000
        decode = attention_temporaries_bytes(heads, kv_heads, head_dim, dtype_bytes, pool, 0, 0)
        return decode / int(BUCKET_RATIO * pool)

    calls = sdpa_calls(tiny_model, monkeypatch)
    for c in (c for c in calls if c["q"].shape[-2] == 1 and c.get("attn_mask") is not None):
        B, H, L, D = c["k"].shape
        made = 2 * B * L * 2 * D * 4 + c["k"].nbytes + c["v"].nbytes + c["attn_mask"].numel() * (1 + 4)
        assert made <= per_decode_token(4, 2, 64, 4) * B * L
    assert per_decode_token(32, 8, 128, 2) == 2 * 8 * 128 * 2 + 2 * 32 * 128 * 2 + 1 + 2 == 20483


class LiveBytes:
    """The bytes of every tensor ops make while it is on, live at once at their peak (a tensor counted until it
    dies): what a forward's pieces allocate, measured on a CPU."""

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t._base is None and t.untyped_storage().data_ptr() not in \
                            counter.storages:
                        counter.add(t.untyped_storage().nbytes(), t)
                return out

        self.mode, self.weakref = Mode(), weakref
        self.live = self.peak = 0
        self.storages: set[int] = set()

    def add(self, nbytes: int, tensor: torch.Tensor) -> None:
        ptr = tensor.untyped_storage().data_ptr()
        self.storages.add(ptr)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.weakref.finalize(tensor.untyped_storage(), self.gone, nbytes, ptr)

    def gone(self, nbytes: int, ptr: int) -> None:
        self.live -= nbytes
        self.storages.discard(ptr)


def test_7_the_activation_headroom_counts_the_mlps_peak(tiny_model):
    """The runner's MLP, measured: x @ gate|up (2x the MLP's width), act(gate) and act(gate) * up beside it: about
    4x its width a token at the peak, where shapes.py counted 2x."""
    from engines.factory import EngineSpec, make_engine
    from engines.shapes import MLP_PEAK_WIDTHS, load_shape

    engine = make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512))
    layer, shape = engine.runner.layers[0], load_shape(str(tiny_model))
    tokens = 512
    h = torch.randn(tokens, shape.hidden_size)
    counter = LiveBytes()
    with torch.inference_mode(), counter.mode:
        x = layer.post_norm(h) @ layer.gate_up
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        out = (layer.act(gate) * up) @ layer.down
        del x, gate, up, out
    mlp_width_bytes = tokens * shape.intermediate_size * 4
    assert counter.peak >= 4 * mlp_width_bytes  # measured: gate|up, act(gate), their product
    counted = MLP_PEAK_WIDTHS * mlp_width_bytes + 2 * tokens * shape.hidden_size * 4  # with the normed input
    assert counter.peak <= counted
    assert shape.activation_bytes(4, tokens, 0) >= counted
