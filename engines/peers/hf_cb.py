"""transformers' own continuous batching with its paged cache, as a second paged peer.

The manager runs its own generation thread; `step()` drains its streamed outputs. Its cache is its
own (not the arena), sized to the same KV budget; memory state comes from the cache's block pool.
It decodes greedily: transformers' per-request sampling needs processors fixed at start. Its outputs carry
no logits: a request that asks for logprobs is scored by a second copy of the model (loaded on the first
such request), teacher-forced over the prompt and the tokens delivered so far.
"""

from __future__ import annotations

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from engines.engine import Engine, EngineStats, Request
from engines.kv import Breakdown, KVStats
from engines.sequence import FinishReason, SeqStatus, Sequence
from engines.shapes import batched_tokens
from engines.token_sampling import prompt_logprobs


class HFContinuousBatchingEngine(Engine):
    greedy_only = True

    def __init__(self, hf_model, spec, max_seq_len: int, kv_bytes_per_token: int):
        super().__init__("hf-cb", hf_model, max_seq_len)
        self.kv_bytes_per_token = kv_bytes_per_token
        page = spec.block_size
        cb_config = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=spec.kv_budget_bytes // (page * kv_bytes_per_token),
            max_batch_tokens=batched_tokens(max_seq_len, spec.max_num_batched_tokens),
            max_requests_per_batch=spec.max_num_seqs,
            auto_switch_to_flash=False,
            allow_block_sharing=spec.prefix_caching,
        )
        # eos -1: rows end on our terms (ignore_eos per request), checked as tokens arrive
        gen_config = GenerationConfig(max_new_tokens=max_seq_len, do_sample=False, eos_token_id=-1)
        self.manager = hf_model.init_continuous_batching(generation_config=gen_config,
                                                         continuous_batching_config=cb_config)
        self.manager.start()
        self.seqs: dict[str, Sequence] = {}  # manager request id -> sample
        self.model_dir = spec.model_dir
        self.scorer = None  # the model copy that scores logprobs, loaded when a request first asks

    def add_request(self, request: Request) -> list[Sequence]:
        seqs = []
        for i in range(request.n):
            seq = request.sample(i, self.max_seq_len)
            seq.status = SeqStatus.RUNNING
            self.seqs[seq.seq_id] = seq
            max_new = min(request.params.max_tokens, self.max_seq_len - seq.num_prompt_tokens)
            self.manager.add_request(seq.prompt_ids, request_id=seq.seq_id, max_new_tokens=max_new, streaming=True)
            seqs.append(seq)
        self.by_request[request.request_id] = seqs
        return seqs

    def abort(self, request_id: str, requested_at: float | None = None, steps_at: int | None = None) -> None:
        for seq in list(self.by_request.get(request_id, [])):
            if not seq.is_finished:
                self.manager.cancel_request(seq.seq_id)
                self._end(seq, FinishReason.ABORT)
        self._released(requested_at, steps_at)  # handed to transformers' manager, which frees on its thread

    def has_work(self) -> bool:
        return bool(self.seqs)

    def step(self) -> None:
        result = self.manager.get_result(timeout=0.01)
        while result is not None:
            self._deliver(result)
            result = self.manager.get_result(timeout=0)

    def _deliver(self, result) -> None:
        seq = self.seqs.get(result.request_id)
        if seq is None or seq.is_finished:
            return
        if result.error:
            self._end(seq, FinishReason.OOM)
            return
        new = result.generated_tokens[seq.num_output_tokens:]
        logprobs = self._score(seq, new) if new and (seq.params.logprobs is not None
                                                   or seq.params.prompt_logprobs is not None) else [None] * len(new)
        for token, logprob in zip(new, logprobs, strict=True):
            self.steps += 1
            self._append(seq, token, logprob)
            if seq.is_finished:
                return
        if result.is_finished():
            self._end(seq, FinishReason.LENGTH)

    def _score(self, seq: Sequence, new: list[int]) -> list:
        """Logprobs of the delivered tokens (and, the first time, of the prompt), from one teacher-forced forward
        of the scoring copy over the prompt, the tokens so far and these."""
        import torch
        from transformers import AutoModelForCausalLM


        if self.scorer is None:
            self.scorer = AutoModelForCausalLM.from_pretrained(self.model_dir).to(self.device).eval()
        ids = seq.token_ids + list(new)
        with torch.inference_mode():
            logits = self.scorer(torch.tensor([ids], device=self.device)).logits[0]
        if seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None, *prompt_logprobs(logits[: seq.num_prompt_tokens - 1], ids, 0,
                                                          seq.params.prompt_logprobs)]
        if seq.params.logprobs is None:
            return [None] * len(new)
        start = len(seq.token_ids) - 1  # the logits at this position predict the first new token
        return prompt_logprobs(logits[start: start + len(new)], ids, start, seq.params.logprobs)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if reason == FinishReason.STOP:
            self.manager.cancel_request(seq.seq_id)  # transformers would go on past our EOS
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)

    def stats(self) -> EngineStats:
        cache = self.manager.batch_processor.cache if self.manager.batch_processor else None
        capacity = cache.num_sectors * cache.bytes_per_sector if cache else 0
        free = int(cache.compute_free_capacity(relative=False)) if cache else 0
        live = [s for s in self.seqs.values() if not s.is_finished]
        allocated = capacity - free
        token_states = min(allocated, sum(s.num_tokens for s in live) * self.kv_bytes_per_token)
        # transformers keeps finished requests' blocks for prefix sharing: counted as allocated, not free
        bd = Breakdown(token_states, 0, allocated - token_states, 0, free)
        kv = KVStats(capacity, allocated, free, free, len(live))
        # in its batch, not merely handed to it: requests still queued in transformers are waiting. Its batch
        # also holds requests fragbench has already ended (cancelled, stopped at our EOS): running counts only
        # live ones, so waiting = live - running is never negative
        scheduler = getattr(self.manager.batch_processor, "scheduler", None)
        active = getattr(scheduler, "active_requests", None)
        running = sum(1 for s in live if s.seq_id in active) if active is not None else None
        return self._stats("paged (transformers)", kv, bd, live, len(live) - running if active is not None else None,
                           0, self.kv_bytes_per_token, running=running)

    def close(self) -> None:
        self.manager.stop(block=True)
