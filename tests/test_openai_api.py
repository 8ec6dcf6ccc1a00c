"""The OpenAI API as a client we did not write sees it (the openai SDK): completions and chat, whole and
streamed, usage, max_completion_tokens, stop strings and stop token ids, errors, /v1/models; every engine."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module", params=["paged", "static-oracle", "hf", "hf-cb"])
def client(request, servers):
    srv = servers(request.param)  # the session's server of that engine (tests/conftest.py)
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_are_listed_as_vllm_lists_them(client):
    m = client.models.list().data[0]
    extra = m.model_extra or {}
    assert m.object == "model" and m.owned_by and m.created and extra["root"] and extra["max_model_len"] == 2048


def test_completions_whole_and_streamed_give_the_tokens_asked_for(client):
    model = model_of(client)
    whole = client.completions.create(model=model, prompt="Where does the memory go?", max_tokens=5, **GREEDY)
    assert whole.usage.completion_tokens == 5 and whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=model, prompt="Where does the memory go?", max_tokens=5,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5


def test_max_completion_tokens_is_honoured(client):
    out = client.completions.create(model=model_of(client), prompt="hi", max_tokens=16,
                                    extra_body={"max_completion_tokens": 5}, **GREEDY)
    assert out.usage.completion_tokens == 5


def test_chat_whole_and_streamed(client):
    model = model_of(client)
    messages = [{"role": "system", "content": "You count."}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=4, **GREEDY)
    assert whole.object == "chat.completion" and whole.usage.completion_tokens == 4
    assert whole.choices[0].message.role == "assistant" and isinstance(whole.choices[0].message.content, str)
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_completion_tokens=4,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and chunks[-1].usage.completion_tokens == 4


def test_stop_strings_and_stop_token_ids_end_with_finish_reason_stop(client):
    model = model_of(client)
    free = client.completions.create(model=model, prompt="hello there", max_tokens=12, **GREEDY)
    ids = free.choices[0].model_extra["token_ids"]
    by_ids = client.completions.create(model=model, prompt="hello there", max_tokens=12,
                                       extra_body={"stop_token_ids": [ids[3]]}, **GREEDY)
    assert by_ids.choices[0].finish_reason == "stop" and by_ids.usage.completion_tokens == ids.index(ids[3]) + 1
    stop = free.choices[0].text[len(free.choices[0].text) // 2:][:3]
    by_text = client.completions.create(model=model, prompt="hello there", max_tokens=12, stop=[stop], **GREEDY)
    assert by_text.choices[0].finish_reason == "stop" and stop not in by_text.choices[0].text
    assert free.choices[0].text.startswith(by_text.choices[0].text)


def test_unsupported_and_bad_fields_are_400s_naming_them(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_of(client), prompt="hi", max_tokens=2, best_of=3)
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_of(client), prompt="hi", max_tokens=2, logprobs=21)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_of(client), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, top_logprobs=2)  # without logprobs: true
    assert e.value.body["param"] == "top_logprobs"
    if _engine(client) == "hf-cb":
        with pytest.raises(openai.BadRequestError) as e:  # transformers' own logits, no per-request processors
            client.chat.completions.create(model=model_of(client), messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, frequency_penalty=1.0)
        assert e.value.body["param"] == "frequency_penalty"


def _engine(client: openai.OpenAI) -> str:
    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{url}/stats", timeout=30) as r:
        return json.load(r)["engine"]


def test_logprobs_as_the_sdk_parses_them(client):
    """Completions' legacy object (echo: the prompt's positions first, the first without one), chat's content
    entries, and the same greedy token on top of its own alternatives."""
    model = model_of(client)
    out = client.completions.create(model=model, prompt="hello there", max_tokens=3, logprobs=2, echo=True, **GREEDY)
    lp = out.choices[0].logprobs
    prompt_len = out.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == prompt_len + 3
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and "".join(lp.tokens) == out.choices[0].text
    for value, top in zip(lp.token_logprobs[prompt_len:], lp.top_logprobs[prompt_len:], strict=True):
        assert value == max(top.values())  # greedy: the chosen token is the most likely
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 and c.bytes is not None for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)
    scored = client.completions.create(model=model, prompt="hello there", max_tokens=0, echo=True, logprobs=0,
                                       **GREEDY)
    assert scored.usage.completion_tokens == 0 and scored.choices[0].text == "hello there" or \
        scored.choices[0].text.strip() == "hello there"
    assert scored.choices[0].logprobs.token_logprobs[1:] == lp.token_logprobs[1:prompt_len]


def test_unknown_routes_answer_openai_json(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == 404


def test_the_contract_bodies(client):
    """The issue's own requests, as curl would send them."""
    url = str(client.base_url).rstrip("/")

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    chat = post("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat["usage"]["completion_tokens"] == 4
    done = post("/completions", {"prompt": "hi", "max_completion_tokens": 5})
    assert done["usage"]["completion_tokens"] == 5


@pytest.fixture(scope="module")
def hf_forward(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()

    def logsoftmax(ids: list[int]):
        import torch

        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logsoftmax


def test_lm_eval_loglikelihood_requests_score_as_a_transformers_forward(client, hf_forward):
    """lm-eval's local-completions, as it asks for a log-likelihood (tokenized_requests): context and
    continuation as token ids, one token, logprobs 1, echo; it sums token_logprobs over the continuation
    and reads is_greedy from top_logprobs. A handful of items, each against one transformers forward."""
    url = str(client.base_url).rstrip("/")
    items = [([1, *range(40, 52)], [77, 78, 79]), ([1, 300, 301, 302], [9]), ([1, *range(500, 540, 3)], [600, 7])]
    body = {"model": model_of(client), "prompt": [c + t for c, t in items], "max_tokens": 1, "logprobs": 1,
            "echo": True, "temperature": 0, "seed": 1234}
    req = urllib.request.Request(f"{url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choices = sorted(json.load(r)["choices"], key=lambda c: c["index"])
    for (context, cont), choice in zip(items, choices, strict=True):
        lp = choice["logprobs"]
        ids = context + cont
        want = hf_forward(ids)
        n = len(ids)
        got = sum(lp["token_logprobs"][len(context):n])  # the echoed prompt's positions; the one new token after
        assert got == pytest.approx(sum(float(want[i - 1, ids[i]]) for i in range(len(context), n)), abs=1e-3)
        greedy = all(max(lp["top_logprobs"][i], key=lp["top_logprobs"][i].get) == lp["tokens"][i]
                     for i in range(len(context), n))
        assert greedy == all(int(want[i - 1].argmax()) == ids[i] for i in range(len(context), n))
