"""`ScheduledEngine`: the static, growth and paged engines. The shared scheduler, the model runner and a KV
policy; what differs between them is the policy alone."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from engines.engine import BlockPoolStats, Engine, EngineStats, Request
from engines.kv import KVPolicy, PagedKV
from engines.memory.arena import DeviceMemory, OOMEvent, OutOfMemory
from engines.oom import oom_context, segment_asked
from engines.scheduled.model import ModelRunner
from engines.scheduled.scheduler import Scheduler, SchedulerConfig
from engines.scheduled.steps import StepRecorder, StepRow
from engines.sequence import FinishReason, Sequence
from engines.shapes import decode_gather_rows, live_decode_tokens
from engines.step_faults import StepFault
from engines.token_sampling import make_generator, process, prompt_logprobs, sample

# prompt logprobs a slice of positions at a time: 256 rows of a 128k vocabulary are about 0.35 GiB of logits,
# log-softmax and ranks at their peak, after the forward's activations are freed (smaller than what they left)
PROMPT_LOGPROBS_ROWS = 256


class ScheduledEngine(Engine):
    def __init__(self, name: str, hf_model, kv: KVPolicy, config: SchedulerConfig, max_seq_len: int):
        super().__init__(name, hf_model, max_seq_len)
        self.kv = kv
        self.scheduler = Scheduler(kv, config)
        self.oom_events = self.scheduler.oom_events
        self.fragmentation_maps = self.scheduler.fragmentation_maps
        live = live_decode_tokens(kv.memory.capacity_bytes // kv.kv_bytes_per_token, config.max_num_seqs, max_seq_len)
        self.runner = ModelRunner(hf_model, kv, decode_gather_rows(live))  # the bound the headroom counts
        self.generators: dict[str, torch.Generator | None] = {}
        self.pending_forks: dict[str, Request] = {}  # parent seq id -> request still to fork
        self.step_recorder: StepRecorder | None = None  # serve --step-log: every step's row
        self.step_fault = StepFault()  # serve --slow-step / --burn-step: applied inside the step (step_faults.py)

    # -- requests
    def _new_seq(self, request: Request, index: int, token_ids: list[int] | None = None) -> Sequence:
        seq = request.sample(index, self.max_seq_len, token_ids)
        self.generators[seq.seq_id] = make_generator(request.params, index, self.runner.device)
        self.by_request.setdefault(request.request_id, []).append(seq)
        return seq

    def add_request(self, request: Request) -> list[Sequence]:
        seq = self._new_seq(request, 0)
        if request.n > 1:
            self.pending_forks[seq.seq_id] = request
        self.scheduler.add(seq)
        return [seq]

    def abort(self, request_id: str, requested_at: float | None = None, steps_at: int | None = None) -> None:
        self._end_request(request_id, FinishReason.ABORT)
        self._released(requested_at, steps_at)

    def fail_request(self, request_id: str, err: Exception) -> None:
        """Serving the request raised: every sample of it ends with an error, its KV freed in this step."""
        for seq in self.by_request.get(request_id, []):
            seq.error = f"{type(err).__name__}: {err}"[:300]
        self._end_request(request_id, FinishReason.ERROR)

    def _end_request(self, request_id: str, reason: FinishReason) -> None:
        for seq in list(self.by_request.get(request_id, [])):
            if not seq.is_finished:
                self._end(seq, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step
    def step(self) -> None:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        for seq in plan.rejected:
            self._emit(seq, None, True)
        if not plan.chunks:
            return
        chunks = plan.chunks
        # prompt logprobs: the logits of every prompt position of a chunk that computes them for the first time
        scored = {i for i, c in enumerate(chunks) if c.seq.params.prompt_logprobs is not None
                  and c.seq.prompt_logprobs is None and c.end - c.start > 1}
        refused = event = None
        try:
            logits = self.runner.forward(chunks, scored)
        except torch.OutOfMemoryError as err:  # the cap's headroom ran out under this step's activations
            # judged here, while the forward's tensors still live (its traceback holds their frames): once they
            # are released their bytes read as free, and every forward OOM would be judged fragmentation
            event = self.memory.device_oom(segment_asked(err), "activations")
            # then let go of the traceback (and, past this block, of the exception being handled), so that the
            # cache _forward_oom empties holds the activations no more
            refused = err.with_traceback(None)
        if refused is not None:
            self._forward_oom(plan, refused, event)
            return
        self.steps += 1
        seqs = [c.seq for c in chunks]
        step = process(logits, seqs)  # one batched pass: processed logits, argmax, logprobs
        if self.step_fault.active:  # before the tokens go out: their TTFT and TPOT and duration_s see it
            self.step_fault.after_forward(started, lambda: process(self.runner.forward(chunks, scored), seqs))
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            if seq.is_finished:  # a sibling's failure earlier in this loop ended it
                continue
            try:
                if i in scored:
                    seq.prompt_logprobs = self._prompt_logprobs(seq, chunk, self.runner.position_states[i])
                if seq.seq_id in self.pending_forks:
                    self._fork(seq, step, i)
                token = sample(step.rows[i], seq.params, self.generators[seq.seq_id], greedy=step.greedy[i])
                self._append(seq, token, step.logprobs(i, token))
            except Exception as err:  # one sequence's failure is its request's alone
                self.fail_request(seq.request_id, err)
        if self.step_recorder is not None:
            self.step_recorder.record(StepRow(
                time.time(), time.perf_counter() - started, len(plan.decodes), len(plan.prefills),
                sum(c.end - c.start for c in chunks), sum(c.end for c in chunks), self.runner.last_buckets,
                len(self.scheduler.running), len(self.scheduler.waiting)))

    def _prompt_logprobs(self, seq: Sequence, chunk, states: torch.Tensor) -> list:
        """Every prompt position's logprob (the first has none), from the chunk that computed the whole prompt:
        a sequence that asks for them is never served from the prefix cache (its prompt's logits are needed).
        PROMPT_LOGPROBS_ROWS positions at a time: their logits, log-softmax and ranks are that many rows of the
        vocabulary, not the prompt's (2.4 to 3.4 GiB at 2,000 tokens of a 128k vocabulary, past the cap's
        headroom)."""
        states = states[: seq.num_prompt_tokens - 1 - chunk.start]
        out: list = [None]
        for at in range(0, len(states), PROMPT_LOGPROBS_ROWS):
            logits = self.runner.position_logits(states[at: at + PROMPT_LOGPROBS_ROWS])
            out += prompt_logprobs(logits, seq.prompt_ids, chunk.start + at, seq.params.prompt_logprobs)
        return out

    def _forward_oom(self, plan, err: Exception, event: OOMEvent) -> None:
        """An OOM event (the device's, under the activations, not the KV budget's) and a smaller step at once: the
        sequence cap comes down to half of what this step held (and its batched tokens to half, where it
        prefilled), and the step's prefills and every running sequence past the new cap are preempted and
        recomputed later, so that the retried step is half the failed one: a GPU whose headroom falls short by
        any margin is back within it in a few failed steps, not one per sequence (256 -> 152 took 103). A
        sequence alone fails its request. The engine goes on; what its device can hold is what it now runs."""
        self.scheduler.unstep()  # no sequence gained a token: the step is taken again, whatever is preempted below
        mem = self.memory.stats()
        live = self.scheduler.live()
        self.oom_events.append((time.monotonic(), event, oom_context(live, len(self.scheduler.waiting),
                                                                     mem.allocated_bytes, mem.capacity_bytes)))
        held = len(plan.decodes) + len(plan.prefills)
        if held == 1:
            victim = plan.chunks[0].seq
            self.kv.discard(victim)  # what it hashed was never written: not a prefix for anyone
            self.fail_request(victim.request_id, err)
            return
        cap = max(1, held // 2)
        tokens = sum(c.end - c.start for c in plan.chunks)
        cfg = self.scheduler.config
        self.scheduler.config = replace(
            cfg, max_num_seqs=min(cfg.max_num_seqs, cap),
            max_num_batched_tokens=max(self.max_seq_len, tokens // 2) if plan.prefills else cfg.max_num_batched_tokens)
        # a prefill that failed wrote part of its K/V: it is recomputed whole; the newest go first, as ever
        failed = {c.seq.seq_id for c in plan.prefills}
        victims = [s for i, s in enumerate(self.scheduler.running) if i >= cap or s.seq_id in failed]
        for seq in reversed(victims):  # newest first: each goes to the queue's head, so they keep their order
            self.scheduler.preempt(seq, discard=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.step_recorder is not None:
            self.step_recorder.close()
        super().close()

    def _fork(self, parent: Sequence, step, row: int) -> None:
        """Parallel samples: after the prompt's prefill, children share its KV and sample on their own, from
        the parent's row of the step."""
        request = self.pending_forks.pop(parent.seq_id)
        logits = step.rows[row]
        for i in range(1, request.n):
            child = self._new_seq(request, i, parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.prompt_logprobs = parent.prompt_logprobs
            oom = None
            try:
                self.kv.fork(parent, child)
            except OutOfMemory as e:  # contiguous policies copy, and the copy may not fit
                oom = e
            token = sample(logits, child.params, self.generators[child.seq_id])
            if oom is None:
                self.scheduler.add_running(child, parent)
                self._append(child, token, step.logprobs(row, token))
            else:
                child.token_ids.append(token)
                self._emit(child, token, False, step.logprobs(row, token))
                self.scheduler.add(child)  # recomputes its prompt when there is room

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)

    def _forget(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)
        # a parent that ends before its prefill takes its unborn samples with it
        self.pending_forks.pop(seq.seq_id, None)

    # -- what it reports
    def stats(self) -> EngineStats:
        live = self.scheduler.live()
        blocks = None
        if isinstance(self.kv, PagedKV):
            pool = self.kv.pool
            blocks = BlockPoolStats(self.kv.block_size, len(pool.blocks), pool.shared, pool.max_refs,
                                    self.kv.prefix_hits_tokens, self.kv.prefix_queries_tokens)
        waiting = len(self.scheduler.waiting)
        return self._stats(self.kv.name, self.kv.stats(), self.kv.breakdown(live), live, waiting,
                           self.scheduler.preempted_total, self.kv.kv_bytes_per_token, blocks=blocks,
                           waiting_for_memory=waiting if self.scheduler.memory_blocked else 0)

    def memory_map(self) -> list[dict]:
        return self.kv.memory_map()

    def config(self) -> dict:
        """What a simulated twin of this engine needs to schedule and allocate as it does."""
        cfg = self.scheduler.config
        return {"policy": self.kv.name, "placement": getattr(self.memory, "placement", None),
                "block_size": getattr(self.kv, "block_size", None), "preflight": getattr(self.kv, "preflight", True),
                "prefix_caching": getattr(self.kv, "prefix_caching", False), "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens, "on_oom": cfg.on_oom,
                "kv_budget_bytes": self.memory.capacity_bytes, "kv_bytes_per_token": self.kv.kv_bytes_per_token,
                "max_seq_len": self.max_seq_len, "row_pad_bytes": getattr(self.kv, "pad_bytes", 0)}

    @property
    def memory(self) -> DeviceMemory:
        return self.kv.memory
