"""The OpenAI routes: POST /v1/completions and /v1/chat/completions, whole or streamed, shaped as vLLM's.

A body is typed once (`protocol`), its prompts made ids (text or token ids; chat through the template) and
checked against the engine (`validation`); each prompt is one engine request of `n` samples. Each sample's
answer is a `Choice`, which applies the API's stop rules; when every sample of a request has stopped, the
server aborts what the engine still runs of it, which frees its KV that step.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections import Counter

from aiohttp import web

from engines.api.chat import render
from engines.api.choices import Choice
from engines.api.protocol import ChatBody, CompletionBody, SamplingBody, parse
from engines.api.validation import CompletionRequest, InvalidRequest, check_engine, checked, error_body, prompt_ids
from engines.engine import Request
from engines.sequence import FinishReason

MAX_BODY_BYTES = 1 * 2**20


class EngineFailed(Exception):
    """Raised into a handler whose engine can no longer serve."""


def error_response(err: InvalidRequest) -> web.Response:
    return web.json_response(err.body(), status=err.status)


class Logprobs:
    """The logprobs of a choice as the APIs shape them: completions' `tokens`, `token_logprobs`,
    `top_logprobs` (the chosen token among them, as OpenAI and vLLM return it) and `text_offset`, the prompt's
    positions first with echo (its first has none); vLLM's `prompt_logprobs`; chat's `content` entries (token,
    logprob, bytes, top_logprobs). None where the request asked for none."""

    def __init__(self, tokenizer, req: CompletionRequest):
        self.tok, self.req = tokenizer, req

    def text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def completion(self, choice: Choice, new: range, echo: bool) -> dict | None:
        if self.req.logprobs is None:
            return None
        entries = []  # (token id, logprob or None, top dict or None)
        if echo:
            prompt = self.req.prompts[choice.index // self.req.n]
            scored = choice.prompt_logprobs or [None] * len(prompt)
            for token, lp in zip(prompt, scored, strict=False):
                entries.append((token, None if lp is None else lp.logprob, self.top(lp)))
        offset = 0 if echo else len(choice.prefix) + len(self.tok.decode(choice.tokens[: new.start]))
        for i in new:
            lp = choice.logprobs[i]
            entries.append((choice.tokens[i], None if lp is None else lp.logprob, self.top(lp)))
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top in entries:
            text = self.text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def top(self, lp) -> dict | None:
        if lp is None:
            return None
        return {**{self.text(t): v for t, v in lp.top}, self.text(lp.token_id): lp.logprob}

    def prompt(self, choice: Choice) -> dict:
        """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: logprob, rank,
        decoded_token}, the prompt's own token and the top alternatives."""
        if self.req.prompt_logprobs is None:
            return {}
        rows = []
        for lp in choice.prompt_logprobs or []:
            if lp is None:
                rows.append(None)
                continue
            row = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": self.text(t)} for r, (t, v) in
                   enumerate(lp.top)}
            row[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.text(lp.token_id)}
            rows.append(row)
        return {"prompt_logprobs": rows}

    def chat(self, logprobs: list) -> dict | None:
        if self.req.logprobs is None:
            return None

        def entry(token: int, value: float) -> dict:
            text = self.text(token)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs if lp is not None]}


class OpenAIRoutes:
    def __init__(self, server):
        self.server = server  # the CompletionServer: its engine thread, tokenizer, model name, dead event
        self.ignored: Counter[str] = Counter()  # fields in neither schema, by name

    # -- parsing
    async def _body(self, request: web.Request, model: type[SamplingBody]) -> SamplingBody:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise InvalidRequest(f"body over {MAX_BODY_BYTES} bytes", None, status=413) from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest("the body is not valid JSON", None) from None
        except RecursionError:
            raise InvalidRequest("the body nests too deeply", None) from None
        parsed = parse(model, body)
        if parsed.ignored():
            self.ignored.update(parsed.ignored())
            print(f"fragbench serve: ignored request fields (in neither the OpenAI nor the vLLM schema): "
                  f"{', '.join(parsed.ignored())}"[:300], file=sys.stderr, flush=True)
        return parsed

    def _tokenize(self, add_special_tokens: bool):
        return lambda text: self.server.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def _checked(self, body: SamplingBody, prompts: list[list[int]], chat: bool, echo: bool) -> CompletionRequest:
        engine = self.server.engine
        req = checked(body, prompts, engine.vocab_size, engine.max_seq_len, chat=chat, echo=echo,
                      default_temperature=0.0 if getattr(engine, "greedy_only", False) else 1.0)
        check_engine(engine, req)
        return req

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request, CompletionBody)
            prompts = prompt_ids(body.prompt, self._tokenize(body.add_special_tokens))
            req = self._checked(body, prompts, chat=False, echo=body.echo)
        except InvalidRequest as err:
            return error_response(err)
        return await self._serve(request, f"cmpl-{uuid.uuid4().hex[:16]}", req)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request, ChatBody)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = render(self.server.tokenizer, messages, body.add_generation_prompt, body.continue_final_message)
            prompts = prompt_ids(text, self._tokenize(body.add_special_tokens))
            req = self._checked(body, prompts, chat=True, echo=False)
        except InvalidRequest as err:
            return error_response(err)
        return await self._serve(request, f"chatcmpl-{uuid.uuid4().hex[:16]}", req)

    # -- serving
    async def _serve(self, request: web.Request, rid: str, req: CompletionRequest) -> web.StreamResponse:
        thread = self.server.thread
        if thread.failure is not None:
            return web.json_response(error_body(f"engine failed: {thread.failure}", "engine_error", 503),
                                     status=503)
        params = req.sampling()
        loop = asyncio.get_running_loop()
        streams = []
        for i, prompt in enumerate(req.prompts):
            stream = self.server.stream(loop)
            thread.submit(Request(f"{rid}-{i}", prompt, params, req.n), stream)
            streams.append(stream)
        choices = [self._choice(req, i) for i in range(len(req.prompts) * req.n)]
        try:
            if req.stream:
                return await self._stream(request, rid, req, streams, choices)
            return await self._whole(rid, req, streams, choices)
        except EngineFailed as err:  # before any byte was sent
            return web.json_response(error_body(str(err), "engine_error", 500), status=500)
        except (asyncio.CancelledError, ConnectionResetError):
            self._abort(rid, req)
            raise

    def _choice(self, req: CompletionRequest, index: int) -> Choice:
        tok = self.server.tokenizer
        prompt = req.prompts[index // req.n]
        return Choice(index, lambda ids: tok.decode(ids, skip_special_tokens=req.skip_special_tokens),
                      stop=req.stop, stop_token_ids=frozenset(req.stop_token_ids),
                      include_stop_str=req.include_stop_str_in_output, min_tokens=req.min_tokens,
                      eos_token_ids=(self.server.engine.eos_token_ids if req.min_tokens and not req.ignore_eos
                                     else frozenset()),
                      prefix=tok.decode(prompt, skip_special_tokens=req.skip_special_tokens) if req.echo else "",
                      score_only=req.score_only)

    def _abort(self, rid: str, req: CompletionRequest, prompts: range | None = None) -> None:
        for i in prompts if prompts is not None else range(len(req.prompts)):
            self.server.thread.abort(f"{rid}-{i}")

    async def _events(self, rid: str, req: CompletionRequest, streams: list, choices: list[Choice]):
        """(choice, text to send) as the engine's events arrive, until every choice has ended. Raises
        EngineFailed when a sample fails (the request's other samples are aborted) or the engine does."""
        merged: asyncio.Queue = asyncio.Queue()

        async def watch_engine() -> None:
            await self.server.dead.wait()
            await merged.put(EngineFailed(f"engine failed: {self.server.thread.failure}"))

        async def one(i: int, stream) -> None:
            while True:
                ev = await stream.events.get()
                await merged.put((i * req.n + ev.seq.sample_index, ev))
                if ev.request_done:
                    return

        tasks = [asyncio.create_task(one(i, s)) for i, s in enumerate(streams)]
        tasks.append(asyncio.create_task(watch_engine()))
        try:
            while any(c.finish_reason is None for c in choices):
                item = await merged.get()
                if isinstance(item, EngineFailed):
                    raise item
                index, ev = item
                if ev.seq.finish_reason == FinishReason.ERROR:
                    self._abort(rid, req)
                    raise EngineFailed(f"request failed: {ev.seq.error}")
                choice = choices[index]
                if choice.finish_reason is not None:
                    continue  # stopped by the API; the engine's events for it come after
                if ev.prompt_logprobs is not None:
                    choice.prompt_logprobs = ev.prompt_logprobs
                kept = len(choice.tokens)
                delta = choice.add(ev.token_id, ev.seq.finish_reason.value if ev.finished else None, ev.logprob)
                if choice.finish_reason is not None and not ev.finished:
                    self._stop_early(rid, req, choices, index)
                yield choice, delta, ev.token_id if len(choice.tokens) > kept else None
        finally:
            for t in tasks:
                t.cancel()

    def _stop_early(self, rid: str, req: CompletionRequest, choices: list[Choice], index: int) -> None:
        """A choice the API stopped: once every sample of its prompt has, abort the engine's request."""
        prompt = index // req.n
        if all(c.finish_reason is not None for c in choices[prompt * req.n:(prompt + 1) * req.n]):
            self._abort(rid, req, range(prompt, prompt + 1))

    def _usage(self, req: CompletionRequest, choices: list[Choice]) -> dict:
        prompt = sum(len(p) for p in req.prompts) * req.n
        completion = sum(len(c.tokens) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _head(self, rid: str, req: CompletionRequest, created: int, chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if req.chat else "text_completion"
        return {"id": rid, "object": kind, "created": created, "model": self.server.model_name}

    async def _whole(self, rid: str, req: CompletionRequest, streams: list, choices: list[Choice]) -> web.Response:
        async for _ in self._events(rid, req, streams, choices):
            pass
        lp = Logprobs(self.server.tokenizer, req)
        if req.chat:
            out = [{"index": c.index, "message": {"role": "assistant", "content": c.output},
                    "logprobs": lp.chat(c.logprobs), "finish_reason": c.finish_reason} for c in choices]
        else:
            out = [{"index": c.index, "text": c.output, "token_ids": c.tokens,
                    "logprobs": lp.completion(c, range(len(c.tokens)), echo=req.echo),
                    "finish_reason": c.finish_reason, **lp.prompt(c)} for c in choices]
        return web.json_response({**self._head(rid, req, int(time.time())), "choices": out,
                                  "usage": self._usage(req, choices)})

    def _chunk_choice(self, req: CompletionRequest, choice: Choice, delta: str, token_id: int | None,
                      first: bool) -> dict:
        finish = choice.finish_reason
        lp = Logprobs(self.server.tokenizer, req)
        new = range(len(choice.tokens) - 1, len(choice.tokens)) if token_id is not None else range(0)
        if req.chat:
            message = {"role": "assistant", "content": delta} if first else {"content": delta}
            return {"index": choice.index, "delta": message,
                    "logprobs": lp.chat([choice.logprobs[i] for i in new]), "finish_reason": finish}
        return {"index": choice.index, "text": delta, "token_ids": [token_id] if token_id is not None else [],
                "logprobs": lp.completion(choice, new, echo=req.echo and first), "finish_reason": finish,
                **(lp.prompt(choice) if first else {})}

    async def _stream(self, request: web.Request, rid: str, req: CompletionRequest, streams,
                      choices: list[Choice]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created, started = int(time.time()), set()

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await resp.write(f"data: {data}\n\n".encode())

        try:
            async for choice, delta, token_id in self._events(rid, req, streams, choices):
                first = choice.index not in started
                started.add(choice.index)
                event = {**self._head(rid, req, created, chunk=True),
                         "choices": [self._chunk_choice(req, choice, delta, token_id, first)]}
                if req.continuous_usage:
                    event["usage"] = self._usage(req, choices)
                await send(event)
        except EngineFailed as err:  # the headers are out: the error travels as the stream's last event
            await send(error_body(str(err), "engine_error", 500))
            await send("[DONE]")
            await resp.write_eof()
            return resp
        if req.include_usage:
            await send({**self._head(rid, req, created, chunk=True), "choices": [],
                        "usage": self._usage(req, choices)})
        await send("[DONE]")
        await resp.write_eof()
        return resp
