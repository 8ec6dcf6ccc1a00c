"""The naive engine: transformers' own `generate` on static, padded batches.

Up to `max_batch` waiting requests form a batch that runs until its longest member ends; later arrivals
wait for the next batch. Its dynamic cache grows by concatenation, and every concatenation allocates
through the device memory, so the arena sees the new buffer per layer per token that `torch.cat`
makes on a GPU. A failed allocation crashes the engine (`--on-oom crash`, the default) or fails the batch.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicLayer

from engines.engine import Engine, EngineStats, Request
from engines.kv import Breakdown, KVStats
from engines.memory import Allocation, DeviceMemory, OOMEvent, OutOfMemory
from engines.oom import FRAGMENTATION_MAPS, EngineCrash, oom_context
from engines.sequence import FinishReason, SeqStatus, Sequence


class ArenaLayer(DynamicLayer):
    """A DynamicLayer whose concatenations allocate from the device memory."""

    def __init__(self, memory: DeviceMemory, owner: str):
        super().__init__()
        self.memory = memory
        self.owner = owner
        self.allocs: list[Allocation] = []

    def _cat(self, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, Allocation]:
        shape = (*new.shape[:-2], old.shape[-2] + new.shape[-2] if old.numel() else new.shape[-2], new.shape[-1])
        nbytes = new.dtype.itemsize * shape[0] * shape[1] * shape[2] * shape[3]
        alloc = self.memory.allocate(nbytes, owner=self.owner)
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


class RowStopper(StoppingCriteria):
    """Called once per generated token: emits it, applies aborts, and ends rows one by one."""

    def __init__(self, engine: HFEngine, rows: list[Sequence], prompt_width: int):
        self.engine = engine
        self.rows = rows
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.engine.poll()  # adds and aborts that arrived during the batch
        self.engine.decode_steps += 1
        new = input_ids[:, -1].tolist()
        done = []
        for seq, token in zip(self.rows, new, strict=True):
            if not seq.is_finished:
                self.engine._append(seq, token)
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
        """Consecutive waiting requests that share one sampling configuration, up to max_batch rows."""
        first = self.waiting[0].params
        batch: list[Sequence] = []
        while self.waiting and len(batch) < self.max_batch:
            p = self.waiting[0].params
            if (p.temperature, p.top_p) != (first.temperature, first.top_p):
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
        cache.layers = [ArenaLayer(self.memory, owner=f"batch:{batch[0].request_id}")
                        for _ in range(self.model.config.num_hidden_layers)]
        params = batch[0].params
        if params.seed is not None:
            torch.manual_seed(params.seed)
        max_new = min(max(s.params.max_tokens for s in batch), self.max_seq_len - width)
        try:
            self.model.generate(
                input_ids=ids.to(self.model.device),
                attention_mask=mask.to(self.model.device),
                cache=cache,
                max_new_tokens=max(1, max_new),
                do_sample=params.temperature > 0,
                temperature=params.temperature if params.temperature > 0 else None,
                top_p=params.top_p if params.temperature > 0 else None,
                top_k=None,
                eos_token_id=None,  # each row stops on its own terms, in RowStopper
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([RowStopper(self, batch, width)]),
            )
        except (OutOfMemory, torch.OutOfMemoryError) as err:
            # the KV past its budget (the memory's OOM), or the device's cap under the activations
            oom = err if isinstance(err, OutOfMemory) else OutOfMemory(OOMEvent(0, 0, 0, "capacity", "activations"))
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

    def stats(self) -> EngineStats:
        mem = self.memory.stats()
        live = [s for s in self.batch if not s.is_finished]
        token_states = min(mem.allocated_bytes, sum(s.num_tokens for s in live) * self.kv_bytes_per_token)
        bd = Breakdown(
            token_states_bytes=token_states,
            reservation_bytes=0,  # concatenation reserves nothing ahead
            # padding, and rows that ended but whose KV the batch still holds
            internal_fragmentation_bytes=mem.allocated_bytes - token_states,
            external_fragmentation_bytes=mem.free_bytes - mem.largest_free_bytes,
            free_bytes=mem.largest_free_bytes,
        )
        kv = KVStats(mem.capacity_bytes, mem.allocated_bytes, mem.free_bytes, mem.largest_free_bytes, len(live))
        return self._stats("growth", kv, bd, live, len(self.waiting), 0, self.kv_bytes_per_token,
                           decode_steps=self.decode_steps)

    def memory_map(self) -> list[dict]:
        return self.memory.memory_map()
