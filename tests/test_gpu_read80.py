"""The GPU box read a fourth time (issue 80): each defect reproduced on a CPU, with torch.cuda faked or the
project's caching-allocator emulator standing in for PyTorch's, failing on be5c217 and passing since."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import engines.memory.cuda as cuda
from engines.memory.caching import CachingAllocator
from engines.memory.snapshot import snapshot
from engines.shapes import load_shape
from tests.test_gpu_paths import fake_cuda  # noqa: F401 (a CUDA device as torch.cuda describes it, a fixture)

MiB, GiB = 2**20, 2**30


# -- 2: fusing the weights left their originals in PyTorch's cache, and the cuda cap counted them as in use
class EmulatedH100:
    """torch.cuda answered by the allocator emulator on an H100's 80 GiB: what CudaMemory reads and sets."""

    def __init__(self, monkeypatch, total: int = 80 * GiB):
        self.total, self.fraction = total, 1.0
        self.allocator = CachingAllocator(total, device_bytes=total)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=total))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: self.fraction)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: self.allocator.reserved)
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot(self.allocator)["segments"])
        monkeypatch.setattr(torch.cuda, "empty_cache", self.allocator.empty_cache)

    def set_fraction(self, fraction: float, device=None) -> None:
        self.fraction = fraction
        self.allocator.capacity_bytes = int(fraction * self.total)


def load_and_fuse(allocator: CachingAllocator, model: str = "llama-3-8b", dtype_bytes: int = 2) -> None:
    """The allocator's calls of `model.to("cuda")` (a block per parameter) and then of fused_weights
    (engines/scheduled/model.laid_out: each group's fused matrix allocated, then each original freed as its weight
    becomes a view of it), in their order."""
    s = load_shape(model)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    h, i, v = s.hidden_size, s.intermediate_size, s.vocab_size
    groups = [[q * h, kv * h, kv * h], [h * q], [i * h, i * h], [h * i]]
    blocks = [allocator.malloc(v * h * dtype_bytes)]  # the embeddings
    layers = []
    for _ in range(s.num_layers):
        layers.append([[allocator.malloc(n * dtype_bytes) for n in g] for g in groups])
        blocks += [allocator.malloc(h * dtype_bytes) for _ in range(2)]  # the two norms
    blocks.append(allocator.malloc(h * dtype_bytes))
    head = None if s.tied_embeddings else allocator.malloc(v * h * dtype_bytes)
    for layer in layers:
        for group in layer:
            blocks.append(allocator.malloc(sum(b.size for b in group)))
            for original in group:
                allocator.free(original)
    if head is not None:
        blocks.append(allocator.malloc(head.size))
        allocator.free(head)


def test_2_the_cuda_cap_counts_the_fused_weights_in_use_not_their_originals_cached(monkeypatch, capsys):
    """Llama-3-8B bf16 on an H100, replayed through the emulator: after fusing, about 8 GiB of the originals is
    cached free beside 15 GiB in use. CudaMemory's cap is what is in use + the budget + a segment's slack + the
    headroom and cuBLAS's workspace; what is in use is what stays reserved once the cache is emptied."""
    dev = EmulatedH100(monkeypatch)
    load_and_fuse(dev.allocator)
    allocated, reserved = dev.allocator.allocated, dev.allocator.reserved
    assert reserved - allocated > 7 * GiB, "the originals fused away stay cached"
    budget, headroom = 2 * GiB, 3 * GiB
    memory = cuda.CudaMemory(budget, "cuda:0", headroom_bytes=headroom)
    assert reserved - dev.allocator.reserved > 7 * GiB, "the cache gave its free segments back"
    beside = budget + cuda.SEGMENT_SLACK_BYTES + headroom + cuda.CUBLAS_WORKSPACE_BYTES
    assert memory._cap_bytes() == pytest.approx(dev.allocator.reserved + beside, abs=4096)
    with capsys.disabled():
        print(f"\nLlama-3-8B bf16 fused: {allocated / GiB:.2f} GiB allocated, {reserved / GiB:.2f} GiB reserved "
              f"before empty_cache, {dev.allocator.reserved / GiB:.2f} after; cap {memory._cap_bytes() / GiB:.2f} "
              f"GiB")


def test_2_the_factory_gives_the_fused_originals_back_before_it_builds_the_memory(tiny_model, monkeypatch):
    """The reserved figures every sample, the debug pass and NVML carry are without the cached originals whatever
    the memory: the cache is emptied after fusing, before the memory (and its cap) is made."""
    from engines.factory import EngineSpec, make_engine
    from engines.memory.arena import Arena
    from engines.scheduled import model

    events, real_laid_out, real_load = [], model.laid_out, model.load_hf_model

    def laid_out(linears):
        events.append("laid_out")
        return real_laid_out(linears)

    def memory(kind, capacity, on, placement="best-fit", headroom_bytes=0, alloc_conf=None):
        events.append("memory")
        return Arena(capacity, backing_device="cpu")

    monkeypatch.setattr(model, "laid_out", laid_out)
    monkeypatch.setattr(model, "load_hf_model", lambda d, device="cpu": real_load(d, "cpu"))  # no GPU here
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr("engines.factory.make_memory", memory)
    make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512, memory="arena", device="cuda:0"))
    last_layout = max(i for i, e in enumerate(events) if e == "laid_out")
    assert "empty_cache" in events[last_layout:events.index("memory")], events


# -- 3: the plan and the engine sized one model on one GPU differently
def factory_headroom(tiny_model, monkeypatch, **spec) -> tuple[int, object]:
    """The headroom the factory asks of a cuda memory for a paged engine of the tiny model (memory faked)."""
    from engines.factory import EngineSpec, make_engine
    from engines.memory.arena import Arena

    seen = {}

    def fake_memory(kind, capacity, device, placement="best-fit", headroom_bytes=0, alloc_conf=None):
        seen["headroom"] = headroom_bytes
        return Arena(capacity, backing_device="cpu")

    monkeypatch.setattr("engines.factory.make_memory", fake_memory)
    made = EngineSpec("paged", str(tiny_model), memory="cuda", **spec)
    make_engine(made)
    return seen["headroom"], made


def test_3_the_factorys_live_decodes_are_at_most_max_num_seqs_sequences_and_the_plan_asks_the_same(tiny_model,
                                                                                                   monkeypatch):
    """A 16 MiB pool holds 16,384 tokens of the tiny model; two sequences of 512 are all that can decode at once.
    The factory sized the decode gathers for the whole pool; the plan's rule is the factory's call."""
    from engines.shapes import BUCKET_RATIO, attention_temporaries_bytes, batched_tokens, load_shape
    from harness.plan import headroom_at

    shape = load_shape(str(tiny_model))
    headroom, spec = factory_headroom(tiny_model, monkeypatch, kv_budget_bytes=16 * MiB, max_seq_len=512,
                                      max_num_seqs=2)
    live = 2 * 512
    assert spec.kv_budget_bytes // shape.kv_bytes_per_token("float32") > BUCKET_RATIO * live
    expected = shape.activation_bytes(4, batched_tokens(512), 2) + attention_temporaries_bytes(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, 4, live, 512, batched_tokens(512))
    assert headroom == expected
    assert headroom_at(shape, "float32", 512, 16 * MiB, 2) == headroom


def test_3_the_gpu_presets_give_the_memory_cuda_sees():
    """torch's total_memory (cudaGetDeviceProperties), which the cap is a fraction of: below nvidia-smi's."""
    from harness.gpus import gpu_preset

    assert gpu_preset("h100-80gb").memory_bytes == 81090 * MiB  # 79.19 GiB; nvidia-smi says 81,559 MiB
    assert gpu_preset("h200-141gb").memory_bytes == 143156 * MiB


@pytest.mark.parametrize("gpu", ["a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb"])
def test_3_for_every_preset_model_and_gpu_the_engine_at_the_plans_budget_asks_no_more_than_the_plan_left(gpu):
    """`plan` for each preset model on each preset GPU, at its own context and at 2048: an in-house engine built at
    the plan's KV budget with the plan's max_num_seqs (or fewer: the server's default 64) asks, by the engine's
    own rule (engines/factory.py calls forward_headroom_bytes with these arguments), no more headroom than the
    plan left, and the weights, the budget and that headroom fit the usable memory. Before: Llama-3-8B bf16 on
    an H100 at 2048 asked 13.65 GiB (256 sequences) where the plan left 0.40."""
    from engines.factory import forward_headroom_bytes
    from engines.shapes import DTYPE_BYTES, batched_tokens, preset_names
    from harness.gpus import gpu_preset
    from harness.plan import make_plan

    memory = gpu_preset(gpu).memory_bytes
    for name in preset_names():
        shape = load_shape(name)
        dtype = "bfloat16" if shape.dtype == "bfloat16" else "float16"
        for max_seq_len in (None, 2048):
            plan = make_plan(shape, memory, dtype, max_seq_len=max_seq_len)
            if not plan.fits:
                continue
            kvb, length = plan.kv_bytes_per_token, plan.max_seq_len
            for max_num_seqs in (plan.max_num_seqs, 64):
                asked = forward_headroom_bytes(shape, DTYPE_BYTES[dtype], batched_tokens(length), max_num_seqs,
                                               plan.kv_budget_bytes // kvb, length)
                assert asked <= plan.activation_headroom_bytes, (name, gpu, length, max_num_seqs)
            assert plan.weights_bytes + plan.kv_budget_bytes + plan.activation_headroom_bytes <= \
                int(memory * plan.gpu_util), (name, gpu, length)
            assert plan.paged_expected_concurrency <= plan.max_num_seqs


def test_3_the_plans_paged_concurrency_is_capped_by_max_num_seqs():
    from harness.gpus import gpu_preset
    from harness.plan import make_plan

    shape = load_shape("llama-3-8b")
    free = make_plan(shape, gpu_preset("h200-141gb").memory_bytes, "bfloat16", max_seq_len=2048)
    capped = make_plan(shape, gpu_preset("h200-141gb").memory_bytes, "bfloat16", max_seq_len=2048, max_num_seqs=64)
    assert free.paged_expected_concurrency == 256 and capped.paged_expected_concurrency == 64
    assert free.max_live_tokens / free.mean_live_tokens_per_request > 256  # the tokens alone would run more


# -- 4: serve --record-memory-history lost its trace when the engine went down through os._exit
CRASHING_ENGINE = """
import engines.peers.hf as hf
from engines.memory.arena import OOMEvent
from engines.oom import EngineCrash

def crash(self):  # the naive engine's OOM under --on-oom crash, at its first step
    raise EngineCrash(OOMEvent.classify(4 * 2**20, 2**20, 2**20, "seq"))

hf.HFEngine.step = crash
"""


@pytest.mark.parametrize("crash, flags, code", [(True, [], 70), (False, ["--fail-at-step", "1"], 71)])
def test_4_a_server_whose_engine_goes_down_writes_its_memory_history_first(tiny_model, tmp_path, crash, flags,
                                                                           code):
    """The crash on an OOM (exit 70) and an engine error (71) leave through os._exit, which skips serve's
    `finally`: the history (MemoryRecording minus the GPU, as in test_gpu_paths) is written before it."""
    import json
    import subprocess
    import sys
    import urllib.request

    from tests.conftest import ROOT
    from tests.test_gpu_paths import RECORDING_SERVER

    path = tmp_path / "history.txt"
    script = (CRASHING_ENGINE if crash else "") + RECORDING_SERVER
    proc = subprocess.Popen([sys.executable, "-c", script, "serve", "--engine", "hf", "--model", str(tiny_model),
                             "--device", "cpu", "--port", "0", "--record-memory-history", str(path), *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("fragbench serve: hf on http://"):
                url = line.split(" on ")[1].strip()
                break
        body = json.dumps({"model": str(tiny_model), "prompt": "hello there", "max_tokens": 4}).encode()
        try:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", body,
                                                          {"Content-Type": "application/json"}), timeout=60)
        except OSError:  # the server goes down under the request
            pass
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == code, out[-2000:]
    assert path.read_text().startswith("cpu engine threads left:")
    assert f"fragbench serve: memory history in {path}" in out


# -- 5: --memory cuda under backend:cudaMallocAsync was accepted, and every in-house server then failed to start
@pytest.mark.parametrize("verb", [
    ["serve", "--engine", "paged"],
    ["bench", "--engines", "paged", "--duration", "5", "--workload", "chat-short"],
])
def test_5_cuda_memory_under_cuda_malloc_async_is_refused_in_one_line_before_anything_loads(tiny_model, tmp_path,
                                                                                             verb):
    from tests.conftest import run_cli

    r = run_cli(*verb, "--model", str(tiny_model), "--memory", "cuda", "--alloc-conf",
                "expandable_segments:False,backend:cudaMallocAsync", *(["--out", str(tmp_path)] if verb[0] ==
                                                                        "bench" else []))
    assert r.returncode == 2, r.stderr[-2000:]
    [line] = r.stderr.strip().splitlines()
    assert "backend:cudaMallocAsync" in line and "--memory arena" in line


def test_5_cuda_memory_refuses_the_backend_set_in_the_environment(fake_cuda, environ):  # noqa: F811
    """A user's PYTORCH_CUDA_ALLOC_CONF the flags never saw: CudaMemory refuses before it sets the cap (the factory
    says it in one line: --memory cuda: ...)."""
    environ.pop("PYTORCH_ALLOC_CONF", None)
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    with pytest.raises(ValueError, match="backend:cudaMallocAsync"):
        cuda.CudaMemory(8 * MiB, "cuda:0")
    assert fake_cuda["set"] == []


# -- smaller points
def test_a_sampled_row_is_drawn_where_its_logits_lie_and_only_its_token_read_back(monkeypatch):
    """Each sampled row went to the CPU whole before its draw (a synchronous 128k-float copy a row, every step, on
    a GPU): the row's generator is made on the logits' device and the draw stays there."""
    from engines.sequence import SamplingParams
    from engines.token_sampling import make_generator, sample

    params = SamplingParams(4, temperature=0.8, seed=7)
    logits = torch.randn(1000)
    want = [sample(logits, params, make_generator(params, 0)) for _ in range(2)]

    def copied(self, *args, **kw):
        raise AssertionError("a sampled row copied to the CPU")

    monkeypatch.setattr(torch.Tensor, "cpu", copied)
    generator = make_generator(params, 0, logits.device)
    assert generator.device == logits.device
    assert sample(logits, params, generator) == want[0] == want[1]  # seeded: the same draw


def test_after_a_forward_oom_the_cache_is_emptied_once_the_activations_are_let_go(tiny_model, monkeypatch):
    """empty_cache() ran inside the `except`, while the exception's traceback still held the forward's frames and
    their tensors: what it should have given back was still in use."""
    import gc
    import weakref

    from engines.factory import EngineSpec, make_engine
    from engines.offline import generate
    from engines.sequence import SamplingParams

    engine = make_engine(EngineSpec("paged", str(tiny_model), 16 * MiB, max_seq_len=512))
    forward, held, alive_at_empty = engine.runner.forward, [], []

    def refused(chunks, *rest):
        if not held and len(chunks) > 2:
            activations = torch.empty(4 * MiB, dtype=torch.uint8)  # what the forward held when it failed
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 262.00 MiB")
        return forward(chunks, *rest)

    def empty_cache():
        gc.collect(0)  # reference counting frees the frames; a young cycle would be collected soon too
        alive_at_empty.append(held[0]() is not None)

    engine.runner.forward = refused
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    generate(engine, [[5 + (7 * i + 3 * n) % 4000 for i in range(n)] for n in (3, 17, 40, 8)], SamplingParams(4))
    assert alive_at_empty == [False]


def test_the_report_says_the_vllm_peer_runs_eager_wherever_it_compares_with_it():
    from engines.peers.vllm import EAGER_FLAG, EAGER_WORDS
    from harness.analysis.summary_records import CapacityBlock, Summary
    from harness.views.capacity_section import capacity_section

    with_vllm = Summary(capacity={"paged": CapacityBlock(sustained_rps=3.0), "vllm": CapacityBlock(sustained_rps=2.0)})
    alone = Summary(capacity={"paged": CapacityBlock(sustained_rps=3.0)})
    assert EAGER_FLAG in EAGER_WORDS and EAGER_WORDS in capacity_section(with_vllm).replace("&#x27;", "'")
    assert "--enforce-eager" not in capacity_section(alone)


def test_prompt_logprobs_are_made_a_slice_of_positions_at_a_time_and_equal_the_whole(tiny_model, monkeypatch):
    """A prompt's logits were made whole, [positions, vocab] in fp32 and a log-softmax as large again (2.4 to
    3.4 GiB at 2,000 tokens of a 128k vocabulary), outside the cap's headroom: now PROMPT_LOGPROBS_ROWS rows at a
    time, with the same logprobs."""
    import engines.scheduled.engine as scheduled
    from engines.factory import EngineSpec, make_engine
    from engines.sequence import SamplingParams
    from tests.test_logprobs import served

    prompts = [[5 + (7 * i + 3 * n) % 4000 for i in range(n)] for n in (40, 17)]
    params = SamplingParams(2, prompt_logprobs=2)
    whole = served(make_engine(EngineSpec("paged", str(tiny_model), 64 * MiB, max_seq_len=512)), prompts, params)
    monkeypatch.setattr(scheduled, "PROMPT_LOGPROBS_ROWS", 8)
    engine = make_engine(EngineSpec("paged", str(tiny_model), 64 * MiB, max_seq_len=512))
    made, real = [], engine.runner.position_logits
    engine.runner.position_logits = lambda states: made.append(len(states)) or real(states)
    sliced = served(engine, prompts, params)
    assert made and max(made) <= 8 and sum(made) == 39 + 16
    for a, b in zip(whole, sliced, strict=True):
        assert a["tokens"] == b["tokens"] and len(b["prompt"]) == len(a["prompt"])
        for x, y in zip(a["prompt"][1:], b["prompt"][1:], strict=True):
            assert (x.token_id, x.rank, [t for t, _ in x.top]) == (y.token_id, y.rank, [t for t, _ in y.top])
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)


def test_cuda_stats_read_the_segments_without_the_trace_ring(fake_cuda, monkeypatch):  # noqa: F811
    """With serve --record-memory-history on, every stats() (each /stats poll) converted the whole trace ring (up to
    2,000,000 events) into Python: the installed torch's memory_snapshot leaves it out when asked."""
    asked = []

    def memory_snapshot(mempool_id=None, include_traces=True):  # the installed torch's signature
        asked.append(include_traces)
        return [{"address": 0, "total_size": 2 * MiB, "device": 0,
                 "blocks": [{"size": 2 * MiB, "state": "inactive"}]}]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", memory_snapshot)
    memory = cuda.CudaMemory(8 * MiB, "cuda:0")
    assert memory.stats().largest_free_bytes == 8 * MiB and asked and not any(asked)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: memory_snapshot())  # an older torch: no switch
    assert memory.stats().largest_free_bytes == 8 * MiB
