"""Logprobs are the model's: every engine's prompt and output logprobs against one transformers forward of
the same model (what lm-eval's log-likelihood tasks read), and the sampling fields vLLM serves."""

from __future__ import annotations

import pytest
import torch

from engines.engine import Request
from engines.factory import EngineSpec, make_engine
from engines.sequence import SamplingParams, Sequence
from engines.token_sampling import Logprob, process

PROMPTS = [[5 + (7 * i + 3 * n) % 4000 for i in range(n)] for n in (9, 33, 70)]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Each prompt and its greedy continuation, and transformers' log-softmax at every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0].tolist()
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        out.append((ids, lp))
    return out


def served(engine, prompts, params) -> list[dict]:
    """Each request's tokens, their logprobs and its prompt logprobs, from the engine's events."""
    got = {str(i): {"tokens": [], "logprobs": [], "prompt": None} for i in range(len(prompts))}

    def sink(ev) -> None:
        row = got[ev.seq.request_id]
        if ev.token_id is not None:
            row["tokens"].append(ev.token_id)
            row["logprobs"].append(ev.logprob)
        if ev.prompt_logprobs is not None:
            row["prompt"] = ev.prompt_logprobs

    engine.sink = sink
    for i, p in enumerate(prompts):
        engine.add_request(Request(str(i), p, params))
    while engine.has_work():
        engine.step()
    return [got[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["paged", "static-oracle", "growth", "hf", "hf-cb"])
def test_prompt_and_output_logprobs_equal_a_transformers_forward(tiny_model, reference, name):
    engine = make_engine(EngineSpec(name, str(tiny_model), 64 * 2**20, max_seq_len=512))
    out = served(engine, PROMPTS, SamplingParams(6, logprobs=3, prompt_logprobs=2))
    getattr(engine, "close", lambda: None)()
    for (ids, lp), row, p in zip(reference, out, PROMPTS, strict=True):
        assert row["tokens"] == ids[len(p):]
        assert row["prompt"][0] is None and len(row["prompt"]) == len(p)
        for pos in range(1, len(ids)):  # the logprob of token pos, from the logits at pos - 1
            got = row["prompt"][pos] if pos < len(p) else row["logprobs"][pos - len(p)]
            assert isinstance(got, Logprob) and got.token_id == ids[pos]
            assert got.logprob == pytest.approx(float(lp[pos - 1, ids[pos]]), abs=1e-3)
            want_top = lp[pos - 1].topk(len(got.top))
            assert [t for t, _ in got.top] == want_top.indices.tolist()
            assert got.rank == int((lp[pos - 1] > lp[pos - 1, ids[pos]]).sum()) + 1


def test_a_prompt_asking_logprobs_is_not_served_from_the_prefix_cache(tiny_model):
    engine = make_engine(EngineSpec("paged", str(tiny_model), 64 * 2**20, max_seq_len=512))
    prompt = [[9 + (5 * i) % 4000 for i in range(64)]]
    served(engine, prompt, SamplingParams(2))
    again = served(engine, prompt, SamplingParams(2, prompt_logprobs=0))
    assert len(again[0]["prompt"]) == 64 and all(lp is not None for lp in again[0]["prompt"][1:])


def seq(params: SamplingParams, output: list[int] = ()) -> Sequence:
    s = Sequence("s", [1, 2, 3], params, 512)
    s.token_ids += list(output)
    return s


def test_the_sampling_fields_bend_the_logits_as_vllm_does():
    logits = torch.zeros(4, 8)
    logits[:, 5] = 1.0
    rows = [seq(SamplingParams(4, logit_bias=((2, 3.0),))),  # greedy, biased to token 2
            seq(SamplingParams(4, frequency_penalty=2.0), [5, 5]),  # token 5 said twice: -4
            seq(SamplingParams(4, repetition_penalty=2.0), [5]),  # a positive logit of a seen token halves
            seq(SamplingParams(4, temperature=1.0, top_k=2, min_p=0.0))]
    step = process(logits, rows)
    assert step.greedy[0] == 2 and step.rows[1, 5] == pytest.approx(1.0 - 4.0)
    assert step.rows[2, 5] == pytest.approx(0.5) and step.rows[2, 1] == pytest.approx(0.0)
    assert torch.isfinite(step.rows[3]).sum() == 2  # top-k 2: the rest out
    plain = process(logits, [seq(SamplingParams(4))])
    assert plain.rows.data_ptr() == logits.data_ptr()  # greedy, nothing asked: the logits untouched


def test_logprobs_are_read_off_one_batched_pass():
    """Batched over the step: one log-softmax and one top-k for every row that asks."""
    logits = torch.randn(32, 4096)
    rows = [seq(SamplingParams(4, logprobs=5)) for _ in range(32)]
    step = process(logits, rows)
    lp = step.logprobs(3, 7)
    assert lp.token_id == 7 and len(lp.top) == 5 and lp.logprob == pytest.approx(
        float(torch.log_softmax(logits[3], -1)[7]), abs=1e-5)
