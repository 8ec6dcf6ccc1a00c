"""The engines against transformers' own generate, and their memory behaviour."""

import json

import pytest
import torch

from engines.engine import Request
from engines.factory import EngineSpec, make_engine
from engines.offline import generate
from engines.sequence import SamplingParams
from tests.conftest import run_cli

PROMPTS = [[5 + (7 * i + 3 * n) % 4000 for i in range(n)] for n in (3, 17, 40, 8, 100)]
ENGINES = ("hf", "static", "paged", "hf-cb")


@pytest.fixture(scope="module")
def reference(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def engine(tiny_model, name, budget=64 * 2**20, **kw):
    e = make_engine(EngineSpec(name, str(tiny_model), budget, max_seq_len=kw.pop("max_seq_len", 512), **kw))
    return e


def cli_generate(tiny_model, name, prompts, *extra):
    args = ["generate", "--engine", name, "--model", str(tiny_model), "--max-tokens", "32", "--json", *extra]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("name", ENGINES)
def test_greedy_tokens_equal_transformers_generate(tiny_model, reference, name):
    together = cli_generate(tiny_model, name, PROMPTS)
    assert [o["token_ids"] for o in together["outputs"]] == reference
    assert [o["prompt_ids"] for o in together["outputs"]] == PROMPTS


@pytest.mark.parametrize("name", ("hf", "static", "paged"))
def test_prompts_together_match_prompts_alone(tiny_model, reference, name):
    e = engine(tiny_model, name)
    alone = [generate(e, [p], SamplingParams(32))[0][0].token_ids for p in PROMPTS]
    assert alone == reference


def test_parallel_samples_are_reproducible_and_share_the_prompt_blocks(tiny_model):
    prompt = [list(range(100, 140))]  # 40 tokens: two full blocks of 16 and a partial one
    args = ("--n", "4", "--temperature", "0.8", "--seed", "1")
    a = cli_generate(tiny_model, "paged", prompt, *args)
    b = cli_generate(tiny_model, "paged", prompt, *args)
    samples = [o["token_ids"] for o in a["outputs"]]
    assert [o["sample"] for o in a["outputs"]] == [0, 1, 2, 3]
    assert samples == [o["token_ids"] for o in b["outputs"]]
    assert len({tuple(s) for s in samples}) == 4
    peak = a["peak_stats"]
    assert peak["shared_blocks"] == 2 and peak["max_block_ref_count"] == 4
    # 40 + 32 tokens = 5 blocks a sample: the 2 full prompt blocks once, 3 own blocks each (not 4 x 5)
    assert peak["allocated_bytes"] == (2 + 4 * 3) * 16 * peak["kv_bytes_per_token"]
    assert a["stats"]["allocated_bytes"] == 0


def test_preemption_resumes_to_the_same_greedy_tokens(tiny_model, reference):
    # 12 blocks of 16 tokens cannot hold all five sequences at once: the newest are preempted and recomputed
    budget = 12 * 16 * 4096
    e = engine(tiny_model, "paged", budget=budget, max_seq_len=150, prefix_caching=False)
    outs = generate(e, PROMPTS, SamplingParams(32))
    assert e.scheduler.preempted_total > 0
    assert [o[0].token_ids for o in outs] == reference
    assert e.stats().allocated_bytes == 0


def test_static_engine_with_preflight_waits_and_completes_every_request(tiny_model, reference):
    e = engine(tiny_model, "static", budget=2 * 150 * 4096, max_seq_len=150)
    outs = generate(e, PROMPTS, SamplingParams(32))
    assert [o[0].token_ids for o in outs] == reference
    assert e.stats().allocated_bytes == 0 and e.stats().oom_total == 0


def test_static_engine_without_preflight_rejects_what_does_not_fit(tiny_model):
    e = engine(tiny_model, "static", budget=2 * 150 * 4096, max_seq_len=150, preflight=False)
    outs = generate(e, PROMPTS, SamplingParams(32))
    reasons = [o[0].finish_reason for o in outs]
    assert reasons.count("oom") == 3 and reasons.count("length") == 2  # two reservations fit at once
    assert e.stats().oom_total == 3 and e.stats().oom_fragmentation == 0
    assert e.stats().allocated_bytes == 0


@pytest.mark.parametrize("name", ("hf", "static", "paged"))
def test_abort_frees_everything(tiny_model, name):
    e = engine(tiny_model, name)
    seen = []
    e.sink = seen.append
    for i, p in enumerate(PROMPTS):
        e.add_request(Request(str(i), p, SamplingParams(200, ignore_eos=True)))
    aborted = False

    def abort_after_some_tokens():
        nonlocal aborted
        if not aborted and sum(ev.token_id is not None for ev in seen) >= 12:
            aborted = True
            for i in range(len(PROMPTS)):
                e.abort(str(i))

    e.poll = abort_after_some_tokens
    while e.has_work():
        e.poll()
        e.step()
    assert aborted
    assert e.stats().allocated_bytes == 0 and e.stats().running == 0
    assert {ev.seq.finish_reason.value for ev in seen if ev.finished} == {"abort"}


def test_hf_growth_goes_through_the_arena(tiny_model):
    e = engine(tiny_model, "hf")
    allocated = []
    e.poll = lambda: allocated.append(e.stats().allocated_bytes)
    generate(e, PROMPTS[:2], SamplingParams(8))
    assert max(allocated) > 0 and e.stats().allocated_bytes == 0


def test_hf_oom_crashes_by_default_and_rejects_on_request(tiny_model):
    from engines.oom import EngineCrash

    prompts = [list(range(10, 400))] * 8  # one padded batch of 8 long rows
    crash = engine(tiny_model, "hf", budget=512 * 4096, max_seq_len=512)
    with pytest.raises(EngineCrash):
        generate(crash, prompts, SamplingParams(100))
    assert crash.oom_events and crash.oom_events[0][1].cause in ("capacity", "fragmentation")
    reject = engine(tiny_model, "hf", budget=512 * 4096, max_seq_len=512, on_oom="reject")
    outs = generate(reject, prompts, SamplingParams(100))
    assert {o[0].finish_reason for o in outs} == {"oom"}
    assert reject.stats().allocated_bytes == 0


def test_a_budget_below_one_max_len_sequence_is_refused_at_start(tiny_model):
    r = run_cli("generate", "--engine", "paged", "--model", str(tiny_model), "--kv-budget", "1MiB",
                "--prompt-ids", "1,2,3", "--max-tokens", "4")
    assert r.returncode == 2
    assert "max_seq_len" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["paged", "static-max", "static-oracle", "growth"])
def test_a_mixed_length_batch_gives_each_sequence_its_tokens_alone(tiny_model, name):
    # one long retrieval-like prompt among short chats: different length buckets, one step
    mixed = [[3 + (11 * i + n) % 4000 for i in range(n)] for n in (1200, 7, 130, 64, 2, 400)]
    together = generate(engine(tiny_model, name, max_seq_len=1300), mixed, SamplingParams(12, ignore_eos=True))
    for p, out in zip(mixed, together, strict=True):
        alone = generate(engine(tiny_model, name, max_seq_len=1300), [p], SamplingParams(12, ignore_eos=True))
        assert out[0].token_ids == alone[0][0].token_ids


@pytest.mark.parametrize("name", ["paged", "static-oracle", "growth"])
def test_greedy_tokens_equal_transformers_in_a_mixed_batch_through_every_attention_path(tiny_model, name):
    """The runner's paths against transformers' generate in one batch: fresh prefills (their own K/V),
    a prefill continuing a context (paged: a prefix-cache hit gathers the shared blocks), and decodes of
    different lengths in different buckets."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    shared = [9 + (5 * i) % 4000 for i in range(48)]  # three full blocks of 16
    prompts = [shared + [7, 8, 9], [3 + (11 * i) % 4000 for i in range(300)], [4, 5], shared + [1, 2, 3, 4, 5]]
    want = [model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    e = engine(tiny_model, name)
    first = generate(e, prompts[:1], SamplingParams(10))  # its blocks stay cached for the last prompt
    rest = generate(e, prompts[1:], SamplingParams(10))
    assert [o[0].token_ids for o in first + rest] == want
    if name == "paged":
        assert e.kv.prefix_hits_tokens >= 48
