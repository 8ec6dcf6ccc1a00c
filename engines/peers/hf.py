"""The naive engine: transformers' own `generate` on static, padded batches.

Up to `max_batch` waiting requests form a batch that runs until its longest member ends; later arrivals
wait for the next batch. Its dynamic cache grows by concatenation, and every concatenation allocates
through the device memory, so the arena sees the new buffer per layer per token that `torch.cat`
makes on a GPU. A failed allocation crashes the engine (`--on-oom crash`, the default) or fails the batch.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicLayer

from engines.engine import Engine, EngineStats, Request
from engines.kv import Breakdown, KVStats
from engines.memory.arena import Allocation, DeviceMemory, OutOfMemory
from engines.oom import FRAGMENTATION_MAPS, EngineCrash, oom_context, segment_asked
from engines.peers.transformers_api import generate_cache_argument
from engines.sequence import FinishReason, SeqStatus, Sequence
from engines.token_sampling import StepLogits, process, prompt_logprobs

CACHE_ARGUMENT = generate_cache_argument()  # `cache` from transformers 5.24, `past_key_values` before


class ArenaLayer(DynamicLayer):
    """A DynamicLayer whose concatenations allocate from the device memory."""

    def __init__(self, memory: DeviceMemory, owner: str, recent: deque[int]):
        super().__init__()
        self.memory = memory
        self.owner = owner
        self.recent = recent  # the engine's recent allocation sizes: what its next one will be like
        self.allocs: list[Allocation] = []

    def _cat(self, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, Allocation]:
        shape = (*new.shape[:-2], old.shape[-2] + new.shape[-2] if old.numel() else new.shape[-2], new.shape[-1])
        nbytes = new.dtype.itemsize * shape[0] * shape[1] * shape[2] * shape[3]
        alloc = self.memory.allocate(nbytes, owner=self.owner)
        self.recent.append(alloc.size)
        out = self.memory.view(alloc)[:nbytes].view(new.dtype).view(shape)
        torch.cat([old, new], dim=-2, out=out) if old.numel() else out.copy_(new)
        return out, alloc

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, k_alloc = self._cat(self.keys, key_states)
        try:
            values, v_alloc = self._cat(self.values, value_states)
        except OutOfMemory:
            self.memory.free(k_alloc)
            raise
        self.release()  # the old buffers go back only after the new ones exist
        self.keys, self.values, self.allocs = keys, values, [k_alloc, v_alloc]
        return self.keys, self.values

    def release(self) -> None:
        for alloc in self.allocs:
            self.memory.free(alloc)
        self.allocs = []


class RowSampling(LogitsProcessor):
    """fragbench's own sampling on transformers' batch (engines/token_sampling.py, the scheduled engines' too): each
    row's bias, penalties, temperature and truncations, and the raw logprobs its stopper reports; generate's
    own warpers are off, so it samples (or takes the argmax) from exactly these logits."""

    def __init__(self, rows: list[Sequence]):
        self.rows = rows  # their token_ids hold what the stopper appended: the sample so far, as penalties read it
        self.step: StepLogits | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.step = process(scores, self.rows)
        return self.step.rows


class RowStopper(StoppingCriteria):
    """Called once per generated token: emits it (with its logprob), applies aborts, and ends rows one by one."""

    def __init__(self, engine: HFEngine, rows: list[Sequence], sampling: RowSampling):
        self.engine = engine
        self.rows = rows
        self.sampling = sampling

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.engine.poll()  # adds and aborts that arrived during the batch
        self.engine.decode_steps += 1
        new = input_ids[:, -1].tolist()
        done = []
        for i, (seq, token) in enumerate(zip(self.rows, new, strict=True)):
            if not seq.is_finished:
                self.engine._append(seq, token, self.sampling.step.logprobs(i, token))
            done.append(seq.is_finished)
        return torch.tensor(done, device=input_ids.device)


class HFEngine(Engine):
    def __init__(self, hf_model, spec, max_seq_len: int, kv_bytes_per_token: int, memory: DeviceMemory):
        super().__init__("hf", hf_model, max_seq_len)
        self.model = hf_model
        self.max_batch = spec.max_batch
        self.on_oom = spec.on_oom or "crash"
        self.kv_bytes_per_token = kv_bytes_per_token
        self.memory = memory
        self.waiting: deque[Sequence] = deque()
        self.batch: list[Sequence] = []
        self.aborted_at: dict[str, tuple[float, int | None]] = {}  # KV held until the batch ends
        self.decode_steps = 0
        self.recent_bytes: deque[int] = deque(maxlen=256)  # its concatenations' sizes, for external fragmentation

    def add_request(self, request: Request) -> list[Sequence]:
        seqs = [request.sample(i, self.max_seq_len) for i in range(request.n)]
        self.by_request[request.request_id] = seqs
        self.waiting.extend(seqs)
        return seqs

    def abort(self, request_id: str, requested_at: float | None = None, steps_at: int | None = None) -> None:
        for seq in list(self.by_request.get(request_id, [])):
            if seq.is_finished:
                continue
            if seq in self.waiting:
                self.waiting.remove(seq)
                self._released(requested_at, steps_at)
            else:  # in the running batch: its KV goes back when the batch ends
                self.aborted_at[seq.seq_id] = (requested_at or time.monotonic(), steps_at)
            self._end(seq, FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Its row stays in the batch (and its KV with it) until the batch ends."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _fail_batch(self, batch: list[Sequence], reason: FinishReason, error: str | None = None) -> None:
        for seq in batch:
            if not seq.is_finished:
                seq.error = error
                self._end(seq, reason)

    def _next_batch(self) -> list[Sequence]:
        """Consecutive waiting requests that all sample or all decode greedily, up to max_batch rows (each
        row's own parameters apply in RowSampling; whether to sample is generate's, one for the batch)."""
        first = self.waiting[0].params
        batch: list[Sequence] = []
        while self.waiting and len(batch) < self.max_batch:
            if self.waiting[0].params.greedy != first.greedy:
                break
            batch.append(self.waiting.popleft())
        return batch

    def step(self) -> None:
        if not self.waiting:
            return
        self.batch = batch = self._next_batch()
        for seq in batch:
            seq.status = SeqStatus.RUNNING
        width = max(s.num_prompt_tokens for s in batch)
        pad = 0
        ids = torch.tensor([[pad] * (width - s.num_prompt_tokens) + s.prompt_ids for s in batch])
        mask = torch.tensor([[0] * (width - s.num_prompt_tokens) + [1] * s.num_prompt_tokens for s in batch])
        cache = DynamicCache()
        cache.layers = [ArenaLayer(self.memory, owner=f"batch:{batch[0].request_id}", recent=self.recent_bytes)
                        for _ in range(self.model.config.num_hidden_layers)]
        params = batch[0].params
        if params.seed is not None:
            torch.manual_seed(params.seed)
        max_new = min(max(s.params.max_tokens for s in batch), self.max_seq_len - width)
        sampling = RowSampling(batch)
        try:
            self._score_prompts(batch)
            self.model.generate(
                input_ids=ids.to(self.model.device),
                attention_mask=mask.to(self.model.device),
                **{CACHE_ARGUMENT: cache},
                max_new_tokens=max(1, max_new),
                do_sample=not params.greedy,
                # RowSampling applies each row's own: generate's warpers off (its top_k defaults to 50)
                temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=None,
                logits_processor=LogitsProcessorList([sampling]),
                eos_token_id=None,  # each row stops on its own terms, in RowStopper
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([RowStopper(self, batch, sampling)]),
            )
        except (OutOfMemory, torch.OutOfMemoryError) as err:
            # the KV past its budget (the memory's OOM), or the device's cap under the activations
            oom = err if isinstance(err, OutOfMemory) else \
                OutOfMemory(self.memory.device_oom(segment_asked(err), "activations"))
            live = [s for s in batch if not s.is_finished]
            mem = self.memory.stats()
            self.oom_events.append((time.monotonic(), oom.event,
                                    oom_context(live, len(self.waiting), mem.allocated_bytes, mem.capacity_bytes)))
            if oom.event.cause == "fragmentation" and len(self.fragmentation_maps) < FRAGMENTATION_MAPS:
                self.fragmentation_maps.append((self.oom_events[-1][0], oom.event, self.memory_map()))
            if self.on_oom == "crash":
                raise EngineCrash(oom.event) from None
            self._fail_batch(batch, FinishReason.OOM)
        except Exception as err:  # a failure inside generate belongs to this batch's requests alone
            self._fail_batch(batch, FinishReason.ERROR, f"{type(err).__name__}: {err}"[:300])
        finally:
            for layer in cache.layers:
                layer.release()
            self.steps += 1
            for seq in batch:
                if seq.seq_id in self.aborted_at:
                    self._released(*self.aborted_at.pop(seq.seq_id))
            self.batch = []

    def _score_prompts(self, batch: list[Sequence]) -> None:
        """The prompt logprobs rows ask for, one forward each over their own prompt (generate keeps no
        prompt logits). The naive engine pays for them as a naive server would."""
        for seq in batch:
            if seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None:
                with torch.inference_mode():
                    logits = self.model(torch.tensor([seq.prompt_ids], device=self.model.device)).logits[0]
                seq.prompt_logprobs = [None, *prompt_logprobs(logits[:-1], seq.prompt_ids, 0,
                                                              seq.params.prompt_logprobs)]

    def stats(self) -> EngineStats:
        mem = self.memory.stats()
        live = [s for s in self.batch if not s.is_finished]
        token_states = min(mem.allocated_bytes, sum(s.num_tokens for s in live) * self.kv_bytes_per_token)
        bd = Breakdown(
            token_states_bytes=token_states,
            reservation_bytes=0,  # concatenation reserves nothing ahead
            # padding, and rows that ended but whose KV the batch still holds
            internal_fragmentation_bytes=mem.allocated_bytes - token_states,
            # free bytes in extents too small for a concatenation like its recent ones (they hold none)
            external_fragmentation_bytes=(external := self.memory.free_bytes_below(
                int(statistics.median(self.recent_bytes))) if self.recent_bytes else 0),
            free_bytes=mem.free_bytes - external,
        )
        kv = KVStats(mem.capacity_bytes, mem.allocated_bytes, mem.free_bytes, mem.largest_free_bytes, len(live))
        return self._stats("growth", kv, bd, live, len(self.waiting), 0, self.kv_bytes_per_token,
                           decode_steps=self.decode_steps)

    def memory_map(self) -> list[dict]:
        return self.memory.memory_map()
