"""One step's sampling, batched over its rows: the logits each row samples from (logit bias, penalties,
temperature, min-p, top-k, top-p, as vLLM applies them), their argmax, and the raw model's logprobs (log-softmax
of the fp32 logits) with each row's top alternatives; then, row by row, the draw: greedy, or a multinomial
from the row's own seeded generator (reproducible under batching). A row's draw that fails fails its request
alone.

    step = process(logits, seqs)             # batched: every row's processed logits, argmax, raw logprobs
    token = sample(step.rows[i], params, generator, greedy=step.greedy[i])
    lp = step.logprobs(i, token)             # Logprob of the chosen token, or None where none was asked
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.host_copy import to_device
from engines.sequence import GREEDY_BELOW, SamplingParams, Sequence

MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound; vLLM's default max_logprobs is 20 too


@dataclass(frozen=True)
class Logprob:
    """One position's: the token there, its log-probability under the model, its rank (1: the most likely),
    and the `top` most likely tokens with theirs."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def make_generator(params: SamplingParams, sample_index: int, device: torch.device | str = "cpu"
                   ) -> torch.Generator | None:
    """The row's own generator, on the device its logits lie on: a draw then reads back one token, not the row's
    vocabulary (a synchronous 128k-float copy a sampled row, every step, on a GPU). Seeded per row, a draw is
    reproducible under batching on one kind of device; a CUDA generator's stream is not the CPU's."""
    if params.temperature < GREEDY_BELOW:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:  # any 64-bit seed and sample index give a seed manual_seed takes
        g.manual_seed((params.seed * 1_000_003 + sample_index) % 2**63)
    return g


@dataclass
class StepLogits:
    rows: torch.Tensor  # [R, V] what each row samples from (its own logits, processed where it asks)
    greedy: list[int]  # each row's argmax of those
    raw: torch.Tensor | None  # [L, V] the fp32 raw logits of the rows that asked logprobs
    lse: list[float]  # their log-sum-exp: a raw logprob is raw[token] - lse (no [L, V] log-softmax made)
    at: dict[int, int]  # row -> its index in raw
    asked: list[int | None]  # each row's params.logprobs
    # read once for every asking row in one batched pass and one device read: the greedy token's logprob and
    # rank (the token most rows take) and the top alternatives; another token is looked up alone
    greedy_logprob: list[float] = ()
    greedy_rank: list[int] = ()
    top: list[list[tuple[int, float]]] = ()

    def logprobs(self, row: int, token: int) -> Logprob | None:
        k = self.asked[row]
        if k is None:
            return None
        j = self.at[row]
        top = tuple(self.top[j][:k])
        if token == self.greedy[row]:
            return Logprob(token, self.greedy_logprob[j], self.greedy_rank[j], top)
        x = self.raw[j]
        return Logprob(token, float(x[token]) - self.lse[j], int((x > x[token]).sum()) + 1, top)


def process(logits: torch.Tensor, seqs: list[Sequence]) -> StepLogits:
    """Every row's logits as it samples from them, their argmax, and the raw logprobs asked for."""
    asked = [s.params.logprobs for s in seqs]
    at = {i: j for j, i in enumerate(i for i, k in enumerate(asked) if k is not None)}
    busy = [i for i, s in enumerate(seqs) if not s.params.plain]
    rows = logits
    if busy:
        rows = logits.clone()
        rows[busy] = processed(logits[busy], [seqs[i] for i in busy])
    argmax = rows.argmax(dim=-1)
    if not at:
        return StepLogits(rows, argmax.tolist(), None, [], at, asked)
    asking = list(at)
    x = (logits if len(asking) == len(seqs) else logits[asking]).float()
    lse = torch.logsumexp(x, dim=-1)
    chosen = x.gather(1, argmax[asking, None]).squeeze(1)
    rank = torch.ones(len(asking), dtype=torch.long, device=x.device)  # a plain row's argmax is the raw one's
    processed_rows = set(busy)
    moved = [j for j, i in enumerate(asking) if i in processed_rows]  # their argmax may rank lower in the raw
    if moved:
        rank[moved] = (x[moved] > chosen[moved, None]).sum(dim=-1) + 1
    k = max(asked[i] for i in at)
    values, ids = x.topk(k, dim=-1) if k else (x[:, :0], x[:, :0].long())
    values = values - lse[:, None]
    top = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return StepLogits(rows, argmax.tolist(), x, lse.tolist(), at, asked, (chosen - lse).tolist(), rank.tolist(),
                      top)


def processed(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The rows' logits with their bias, penalties, temperature and truncations applied, all rows at once."""
    x = logits.float()
    R, V = x.shape
    dev = x.device
    params = [s.params for s in seqs]
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if bias:
        rows, ids, values = zip(*bias, strict=True)
        x.index_put_((to_device(list(rows), dev), to_device(list(ids), dev)), to_device(list(values), dev, x.dtype),
                     accumulate=True)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = token_counts([s.output_ids for s in seqs], V, dev)
        freq = to_device([p.frequency_penalty for p in params], dev, torch.float32)[:, None]
        pres = to_device([p.presence_penalty for p in params], dev, torch.float32)[:, None]
        x = x - freq * counts - pres * (counts > 0)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = token_counts([s.token_ids for s in seqs], V, dev) > 0  # prompt and output, as vLLM
        rp = to_device([p.repetition_penalty for p in params], dev, torch.float32)[:, None].expand(R, V)
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    temperature = to_device([p.temperature if not p.greedy else 1.0 for p in params], dev, torch.float32)[:, None]
    x = x / temperature
    sampled = [i for i, p in enumerate(params) if not p.greedy and (p.min_p > 0 or p.top_k > 0 or p.top_p < 1)]
    if sampled:
        x[sampled] = truncated(x[sampled], [params[i] for i in sampled])
    return x.to(logits.dtype)


def token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[rows, vocab]: how often each token occurs in each row's list, in one scatter."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    rows = [i for i, ids in enumerate(token_lists) for _ in ids]
    if rows:
        ids = [t for ids in token_lists for t in ids]
        counts.index_put_((to_device(rows, device), to_device(ids, device)),
                          torch.ones(len(ids), device=device), accumulate=True)
    return counts


def truncated(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """min-p, then top-k, then top-p, per row, on tempered logits: what falls out is -inf."""
    dev = x.device
    probs = torch.softmax(x, dim=-1)
    min_p = to_device([p.min_p for p in params], dev, torch.float32)[:, None]
    x = x.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    order = x.argsort(dim=-1, descending=True)
    ranked = x.gather(-1, order)
    k = to_device([p.top_k if p.top_k > 0 else x.shape[-1] for p in params], dev)[:, None]
    position = torch.arange(x.shape[-1], device=dev)[None, :]
    ranked = ranked.masked_fill(position >= k, float("-inf"))
    p_sorted = torch.softmax(ranked, dim=-1)
    top_p = to_device([p.top_p for p in params], dev, torch.float32)[:, None]
    ranked = ranked.masked_fill(p_sorted.cumsum(-1) - p_sorted >= top_p, float("-inf"))  # keeps the first
    return torch.full_like(x, float("-inf")).scatter(-1, order, ranked)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           greedy: int | None = None) -> int:
    """One token from one row of processed logits (`process`): its argmax when greedy (`greedy`, read with the
    whole step's), else a draw from its softmax with the row's own generator."""
    if params.temperature < GREEDY_BELOW:
        return greedy if greedy is not None else int(logits.argmax())
    if generator is not None and generator.device != logits.device:  # a generator made for another device
        logits = logits.to(generator.device)
    probs = torch.softmax(logits.float(), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def prompt_logprobs(logits: torch.Tensor, ids: list[int], start: int, k: int) -> list[Logprob]:
    """Logprobs of tokens ids[start + 1 .. start + n] from the logits [n, V] at positions start .. start + n - 1,
    batched over the positions."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    target = to_device(ids[start + 1: start + 1 + lp.shape[0]], lp.device)
    lp = lp[: len(target)]
    chosen = lp.gather(-1, target[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    top = lp.topk(k, dim=-1) if k else None
    out = []
    for j, (t, c, r) in enumerate(zip(target.tolist(), chosen.tolist(), ranks.tolist(), strict=True)):
        alts = tuple(zip(top[1][j].tolist(), top[0][j].tolist(), strict=True)) if top is not None else ()
        out.append(Logprob(t, c, r, alts))
    return out
