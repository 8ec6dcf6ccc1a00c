"""The GPU dry run (`make gpu-dryrun`; issue 85): every in-house engine built by the factory on a fake CUDA device
(tests/fake_cuda.py) in bf16 and fp16, driven through prefill, decode, prefix-cache hits, forks, preemption and a
forward OOM on the tiny model, and through built worst cases at real model shapes at the capacity plan's budget:
no device or dtype mismatch, host reads only where a token must reach the host, and each forward's peak of live
bytes within the headroom the plan and the factory left beside the weights and the KV. docs/architecture.md says
what it cannot show."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from engines.engine import Request
from engines.factory import EngineSpec, make_engine
from engines.offline import generate
from engines.sequence import SamplingParams
from engines.shapes import batched_tokens, forward_headroom_bytes, load_shape
from harness.gpus import GPUS
from harness.plan import make_plan
from tests import fake_cuda

pytestmark = pytest.mark.gpu_dryrun
if err := fake_cuda.guard_error():
    pytest.skip(f"GPU dry run: {err}", allow_module_level=True)

MiB = 1 << 20
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# the only lines whose values reach the host in a step: the sampled tokens, their logprobs (engines/token_sampling.py)
HOST_READS_ALLOWED = ("engines/token_sampling.py",)
# every feature a request can ask of the sampler
FULL = SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, presence_penalty=0.3,
                      frequency_penalty=0.2, repetition_penalty=1.1, logit_bias=((7, 1.5),), logprobs=3,
                      prompt_logprobs=2, seed=11)


def model_dir(tmp_path, preset: str, dtype: str):
    """A folder with the preset's config.json (the factory's check); the weights come from fake_model."""
    cfg = load_shape(preset).config | {"torch_dtype": dtype}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path), cfg


@pytest.fixture
def device(monkeypatch):
    """Yields (enter, forward peaks): enter(total_bytes, config, dtype) opens the fake device for the test."""
    import engines.scheduled.model as runner_module

    peaks: list[tuple[int, int]] = []  # (forward's peak above what lived before it, chunks)
    with contextlib.ExitStack() as opened:

        def enter(total_bytes: int, config: dict, dtype: torch.dtype):
            monkeypatch.setattr(runner_module, "load_hf_model", fake_cuda.patched_loader(config, dtype))
            return opened.enter_context(fake_cuda.fake_cuda(total_bytes))

        yield enter, peaks


def measured(engine, tally, peaks) -> None:
    """Each forward of the engine records its peak of live fake bytes above what lived when it began."""
    forward = engine.runner.forward

    def peaked(chunks, *rest):
        base = tally.reset_peak()
        try:
            return forward(chunks, *rest)
        finally:
            peaks.append((tally.peak_bytes - base, len(chunks)))

    engine.runner.forward = peaked


def headroom_of(spec: EngineSpec, cfg: dict, dtype: str) -> int:
    """The headroom the factory gives this engine's forward (engines/shapes.forward_headroom_bytes)."""
    shape = load_shape(spec.model_dir)
    max_seq_len = spec.max_seq_len or cfg["max_position_embeddings"]
    return forward_headroom_bytes(shape, torch.empty((), dtype=DTYPES[dtype]).element_size(),
                                  batched_tokens(max_seq_len, spec.max_num_batched_tokens), spec.max_num_seqs,
                                  spec.kv_budget_bytes // shape.kv_bytes_per_token(dtype), max_seq_len)


def within_headroom(peaks, headroom: int, what: str) -> bool:
    """Every forward's peak within the headroom; the largest printed (make gpu-dryrun shows it)."""
    top = max(p for p, _ in peaks)
    print(f"dry run: {what}: {len(peaks)} forward(s), peak {top / 2**30:.3f} GiB, headroom {headroom / 2**30:.3f} GiB")
    return top <= headroom


def host_reads_outside_the_allowlist(tally) -> dict[str, int]:
    return {site: n for site, n in tally.host_reads.items() if not site.startswith(HOST_READS_ALLOWED)}


# -- the tiny model: every engine and memory kind, every feature, a forced forward OOM
TINY_ENGINES = [("paged", "arena"), ("paged", "cuda"), ("static-max", "arena"), ("static-oracle", "arena"),
                ("static-pow2", "arena"), ("growth", "arena")]


def tiny_spec(tmp_path, name: str, memory: str, dtype: str):
    path, cfg = model_dir(tmp_path, "tiny-llama", dtype)
    engine, reserve = ("static", name.split("-")[1]) if name.startswith("static-") else (name, "max")
    spec = EngineSpec(engine, path, 4 * MiB, max_seq_len=256, reserve=reserve, memory=memory, device="cuda",
                      max_num_seqs=8, max_num_batched_tokens=256)
    return spec, cfg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "memory"), TINY_ENGINES)
def test_every_engine_serves_every_feature_on_fake_cuda(tmp_path, device, name, memory, dtype):
    enter, peaks = device
    spec, cfg = tiny_spec(tmp_path, name, memory, dtype)
    tally = enter(8 << 30, cfg, DTYPES[dtype])
    engine = make_engine(spec)
    measured(engine, tally, peaks)
    shared = list(range(100, 164))  # four blocks of prefix: the second request's prefill continues from the cache
    outs = generate(engine, [shared + [5, 6], shared + [9], [11] * 40, [12] * 3], FULL, n=2)
    assert all(len(s.token_ids) == FULL.max_tokens for o in outs for s in o), "every sample ran to max_tokens"
    assert not host_reads_outside_the_allowlist(tally)
    headroom = headroom_of(spec, cfg, dtype)
    assert peaks and max(p for p, _ in peaks) <= headroom, (peaks, headroom)


def test_a_forward_oom_on_fake_cuda_is_survived(tmp_path, device):
    """The cap lowered under a step's activations: torch raises inside the forward, the engine records the OOM,
    retries smaller, and every request finishes."""
    enter, peaks = device
    spec, cfg = tiny_spec(tmp_path, "paged", "cuda", "bfloat16")
    tally = enter(8 << 30, cfg, torch.bfloat16)
    engine = make_engine(spec)
    forward, fraction = engine.runner.forward, torch.cuda.get_per_process_memory_fraction()

    def tight(chunks, *rest):  # the first decode-only step of more than two chunks finds no room under the cap
        decoding = len(chunks) > 2 and all(c.end - c.start == 1 for c in chunks)
        torch.cuda.set_per_process_memory_fraction(
            tally.live_bytes / (8 << 30) if decoding and not engine.oom_events else fraction)
        return forward(chunks, *rest)  # the cap stays until the next step: the engine judges the OOM under it

    engine.runner.forward = tight
    # prompts of 12 to 15 tokens: each crosses into its second block of 16 a few steps after the OOM (defect 2)
    outs = generate(engine, [[5 + i] * (12 + i) for i in range(4)], SamplingParams(max_tokens=10))
    (_, event, _), = engine.oom_events
    # no byte was free under the cap as it failed: capacity, not fragmentation
    assert (event.owner, event.cause) == ("activations", "capacity")
    assert all(len(o[0].token_ids) == 10 for o in outs)


# -- real shapes at the plan's budget: worst cases built by allocating KV through the policy
def placed(engine, prompts: list[list[int]]):
    """Sequences whose prompts' KV the policy holds (allocated, never computed): the next step decodes each."""
    seqs = []
    for i, ids in enumerate(prompts):
        seq = engine._new_seq(Request(f"w{i}", ids, SamplingParams(max_tokens=4)), 0)
        engine.kv.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
        engine.scheduler._run(seq)
        seqs.append(seq)
    return seqs


def forked(engine, parent, n: int) -> None:
    """n samples of parent sharing every block of its context (its tail copied on the next step's write)."""
    request = Request(parent.request_id, parent.prompt_ids, parent.params, n + 1)
    for i in range(1, n + 1):
        child = engine._new_seq(request, i, parent.token_ids)
        engine.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        engine.scheduler.add_running(child, parent)


REAL = {"llama-3-8b on an H100": ("llama-3-8b", "h100-80gb"), "llama-3-70b on an H200": ("llama-3-70b", "h200-141gb")}


def real_engine(tmp_path, device, case: str, engine: str = "paged", memory: str = "cuda"):
    """The engine at the plan's budget for the case's card (bf16, max_num_seqs 256, the model's context); where the
    plan refuses the model on that card (70B's weights alone pass 90 % of an H200), at 2 max-length sequences on a
    device just large enough, so that its shapes still run."""
    preset, gpu = REAL[case]
    shape = load_shape(preset)
    path, cfg = model_dir(tmp_path, preset, "bfloat16")
    plan = make_plan(shape, GPUS[gpu].memory_bytes, "bfloat16")
    total = GPUS[gpu].memory_bytes
    budget = plan.kv_budget_bytes
    if not plan.fits:
        budget = 2 * plan.max_seq_len * plan.kv_bytes_per_token
        total = int((plan.weights_bytes + budget + plan.activation_headroom_bytes + (1 << 30)) / 0.9)
    else:
        assert plan.weights_bytes + plan.kv_budget_bytes + plan.activation_headroom_bytes <= total
    enter, peaks = device
    tally = enter(total, cfg, torch.bfloat16)
    spec = EngineSpec(engine, path, budget, memory=memory, device="cuda", max_num_seqs=plan.max_num_seqs)
    built = make_engine(spec)
    measured(built, tally, peaks)
    return built, tally, peaks, headroom_of(spec, cfg, "bfloat16"), plan


@pytest.mark.parametrize("case", REAL)
def test_a_shared_prefix_at_max_num_seqs_stays_within_the_headroom(tmp_path, device, case):
    """255 samples of one 4,096-token context: every reader gathers the shared blocks, and the runner splits
    its buckets so that the gather stays within what the headroom counts (defect 1)."""
    engine, tally, peaks, headroom, plan = real_engine(tmp_path, device, case)
    (parent,) = placed(engine, [[11 + i % 1000 for i in range(4096 + 35)]])
    forked(engine, parent, plan.max_num_seqs - 1)
    engine.step()
    assert len(engine.scheduler.running) == plan.max_num_seqs and not engine.oom_events
    assert peaks and within_headroom(peaks, headroom, f"{case}, 256 readers of one context"), (peaks, headroom)
    assert not host_reads_outside_the_allowlist(tally)


@pytest.mark.parametrize("case", REAL)
def test_distinct_prompts_at_the_pools_limit_stay_within_the_headroom(tmp_path, device, case):
    engine, tally, peaks, headroom, plan = real_engine(tmp_path, device, case)
    pool_tokens = plan.max_live_tokens if plan.fits else engine.memory.capacity_bytes // plan.kv_bytes_per_token
    n = min(plan.max_num_seqs, pool_tokens // 64)
    each = min(plan.max_seq_len - 8, pool_tokens // n - 2 * 16)  # the pool full but for a tail block each
    placed(engine, [[13 + (i + j) % 1000 for j in range(each)] for i in range(n)])
    engine.step()
    assert not engine.oom_events and peaks
    assert within_headroom(peaks, headroom, f"{case}, {n} distinct prompts of {each} tokens"), (peaks, headroom)
    assert not host_reads_outside_the_allowlist(tally)


def test_a_max_length_prefill_at_real_shape_stays_within_the_headroom(tmp_path, device):
    engine, tally, peaks, headroom, plan = real_engine(tmp_path, device, "llama-3-8b on an H100")
    outs = generate(engine, [[17 + i % 1000 for i in range(plan.max_seq_len - 2)]], SamplingParams(max_tokens=2))
    assert len(outs[0][0].token_ids) == 2
    assert peaks and within_headroom(peaks, headroom, "llama-3-8b on an H100, a max-length prefill"), (peaks, headroom)
