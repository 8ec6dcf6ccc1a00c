"""Running sequences that need memory on a fixed beat, bucketed by the residue of their due steps.

A paged sequence whose tail block is its own takes one block every block_size steps, at steps S = c (mod
block_size), c fixed while it runs (KVPolicy.period_tokens). The scheduler keeps such sequences here instead of on
its per-sequence heap: a step serves one residue's bucket, and a decode stretch of k steps serves each bucket the
number of times its residue comes round, whatever the number of sequences in it.

Invariants:
- every sequence in bucket r is due at the first step after the last one served that is = r (mod period): a
  bucket is served (or its sequences preempted) at each step of its residue, so no one in it is ever late;
- a bucket lists its sequences in admission-rank order (the running list's, which preemption reads backwards);
- one period for all (the policy's): residues of different periods would not line up.
"""

from __future__ import annotations

from engines.sequence import Sequence


class Beats:
    def __init__(self) -> None:
        self.period: int | None = None  # steps between a sequence's allocations; set by the first one put
        self._buckets: dict[int, dict[int, Sequence]] = {}  # residue -> admission rank -> sequence, ranks ascending
        self._where: dict[str, tuple[int, int]] = {}  # seq_id -> (residue, rank)

    def __len__(self) -> int:
        return len(self._where)

    def put(self, seq: Sequence, rank: int, due_step: int, period: int) -> None:
        """seq is next due at due_step, then every `period` steps. Already here: it must keep its residue."""
        if self.period is None:
            self.period = period
        assert period == self.period, f"{seq.seq_id}: a period of {period} steps among ones of {self.period}"
        residue = due_step % period
        at = self._where.get(seq.seq_id)
        if at is not None:
            assert at == (residue, rank), f"{seq.seq_id} moved from residue {at[0]} to {residue} while running"
            return
        self._where[seq.seq_id] = (residue, rank)
        bucket = self._buckets.setdefault(residue, {})
        if bucket and rank < next(reversed(bucket)):  # an older sequence back on the beat (a fork's parent): re-sort
            ranked = sorted([*bucket.items(), (rank, seq)], key=lambda item: item[0])
            bucket.clear()
            bucket.update(ranked)
        else:
            bucket[rank] = seq

    def remove(self, seq_id: str) -> None:
        at = self._where.pop(seq_id, None)
        if at is not None:
            del self._buckets[at[0]][at[1]]

    def due_at(self, step: int) -> dict[int, Sequence]:
        """The sequences due at `step`, rank -> sequence in rank order (do not change it while reading it)."""
        if self.period is None:
            return {}
        return self._buckets.get(step % self.period, {})

    def next_due(self, step: int) -> int | None:
        """The first step after `step` at which some sequence here is due."""
        if not self._where:
            return None
        for ahead in range(1, self.period + 1):
            if self._buckets.get((step + ahead) % self.period):
                return step + ahead
        raise AssertionError("sequences listed with no bucket holding them")

    def stretch(self, start: int, end: int) -> list[tuple[int, int, list[Sequence]]]:
        """Over steps (start, end]: (first due step, crossings, sequences in rank order) of each bucket due at all,
        by first due step: the order a per-sequence heap keyed by (due step, rank) would serve them in."""
        out = []
        for residue, bucket in self._buckets.items():
            first = start + (residue - start - 1) % self.period + 1
            if bucket and first <= end:
                out.append((first, (end - first) // self.period + 1, list(bucket.values())))
        out.sort(key=lambda entry: entry[0])
        return out
