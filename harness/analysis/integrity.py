"""KV integrity under churn, judged: a probe's answer under load against its answer on the idle server
(harness/run/integrity_probes.py sends them). A probe diverges where a logprob differs from its idle one by more
than the tolerance, or where it chose another token than idle and the idle answer's own margin between the
two was wider than the tolerance (a flip between near-tied tokens is arithmetic: a batch sums in another
order; the comparison stops there and counts a tie)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.json_record import Num, Record
from harness.analysis.summary_records import Integrity

TOLERANCE = {"float32": 1e-3}  # |logprob - idle logprob| beyond which a probe diverges, by the KV's dtype
HALF_TOLERANCE = 0.25  # float16 / bfloat16: a batch's other summation order moves logprobs this much
WHILE = {"preempted_total_during": "preemptions", "prefix_cache_hit_tokens_during": "prefix-cache hit tokens",
         "oom_total_during": "OOMs"}


def tolerance_of(dtype: str | None) -> float:
    return TOLERANCE.get(str(dtype or "float32").removeprefix("torch."), HALF_TOLERANCE)


@dataclass
class Served:
    """One probe's answer: each output token's text, logprob and top alternatives (text -> logprob)."""

    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)
    error: str | None = None
    finish_reason: str | None = None


@dataclass
class Comparison:
    """One probe against its idle answer."""

    compared: int  # output positions compared
    max_abs_logprob_diff: float
    diverged_at: int | None = None  # the output position where it diverged
    why: str | None = None
    tie_at: int | None = None  # a flip between tokens tied within the tolerance: the comparison stopped there
    ended: str | None = None  # the engine ended it early and said so (an OOM rejection, an error): no divergence


# finish reasons of an answer the engine cut short on purpose: its tokens up to there are compared, its length
# is a failure to serve (counted apart), not wrong numbers
ENDED_EARLY = ("oom", "error", "abort")


def compare(idle: Served, got: Served, tolerance: float) -> Comparison:
    worst = 0.0
    for i, (a, b) in enumerate(zip(idle.tokens, got.tokens, strict=False)):
        if a != b:
            alt = idle.top[i].get(b) if i < len(idle.top) else None
            if alt is None:
                return Comparison(i, worst, i, f"token {b!r} where alone it was {a!r} (not among the idle answer's "
                                               f"top {len(idle.top[i]) if i < len(idle.top) else 0})")
            margin = idle.logprobs[i] - alt
            if margin <= tolerance:
                return Comparison(i, worst, tie_at=i)
            return Comparison(i, worst, i, f"token {b!r} where alone it was {a!r} (idle margin {margin:.3g} "
                                           f"> {tolerance:g})")
        diff = abs(idle.logprobs[i] - got.logprobs[i])
        worst = max(worst, diff)
        if diff > tolerance:
            return Comparison(i + 1, worst, i, f"logprob {got.logprobs[i]:.5g} where alone it was "
                                               f"{idle.logprobs[i]:.5g} (|diff| {diff:.3g} > {tolerance:g})")
    if len(got.tokens) != len(idle.tokens):
        n = min(len(got.tokens), len(idle.tokens))
        if len(got.tokens) < len(idle.tokens) and got.finish_reason in ENDED_EARLY:
            return Comparison(n, worst, ended=got.finish_reason)
        return Comparison(n, worst, n, f"{len(got.tokens)} tokens where alone it made {len(idle.tokens)}")
    return Comparison(len(idle.tokens), worst)


class ProbeCounters(Record):
    """The engine's counters over one probe, as its row carries them (integrity_probes.during); the rest of the
    row rides along."""

    preempted_total_during: Num | None = None
    prefix_cache_hit_tokens_during: Num | None = None
    oom_total_during: Num | None = None
    running: Num | None = None  # at the probe's end
    waiting: Num | None = None
    engine_step: Num | None = None


class IdleFigures(Record):
    """The probe set's idle phase (integrity.json, integrity_probes.IntegrityProbes.idle), in the order it is written
    (`written()`: no defaults added, an older integrity.json has fewer keys)."""

    tolerance: Num
    idle_max_abs_logprob_diff: Num | None = None  # the two idle servings' largest difference; None: none compared
    reference_probes: Num | None = None
    of_probes: Num | None = None
    probe_set: list[dict] | None = None  # name, kind, max_tokens, prompt_words: written as they are


def doing(state: ProbeCounters) -> str:
    """What the engine did while a probe ran, in words, from its counters at the probe's start and end."""
    parts = [f"{getattr(state, k):.0f} {w}" for k, w in WHILE.items() if getattr(state, k)]
    if state.running is not None:
        parts.append(f"{state.running:.0f} running, {state.waiting or 0:.0f} waiting at its end")
    if state.engine_step is not None:
        parts.append(f"engine step {state.engine_step:.0f}")
    return ", ".join(parts) or "nothing its counters show"


def integrity(idle: IdleFigures, rows: list[dict]) -> dict:
    """engines.<name>.integrity: probes compared under load, how many diverged, the largest logprob
    difference; and what it rests on (the tolerance, the idle repeat, failures, ties, what the probes ran
    through). `idle` is the probe set's idle phase. A dict: summary.json writes it as it is."""
    judged = [r for r in rows if "error" not in r]
    diverged = [r for r in judged if r.get("diverged_at") is not None]
    return {"probes": len(judged), "diverged": len(diverged),
            "max_abs_logprob_diff": max((r["max_abs_logprob_diff"] for r in judged), default=None),
            **idle.written(), "failed": len(rows) - len(judged),
            "ties": sum(r.get("tie_at") is not None for r in judged),
            "ended_early": sum(r.get("ended") is not None for r in judged),
            "preempted_probes": sum(bool(r.get("preempted_total_during")) for r in judged),
            "prefix_hit_probes": sum(bool(r.get("prefix_cache_hit_tokens_during")) for r in judged),
            "divergences": [{**r, "doing": doing(ProbeCounters.model_validate(r))} for r in diverged[:20]]}


def sentence(result: Integrity | None) -> str:
    """One plain line per engine for the report and check."""
    if result is None or not (result.model_fields_set or result.model_extra):
        return "not checked"
    if not result.probes:
        return (f"no probe was compared ({result.reference_probes} of {result.of_probes} "
                f"served alone, {result.failed} failed under load)")
    worst = result.max_abs_logprob_diff or 0.0
    head = (f"{result.diverged} of {result.probes} probes diverged from their idle answers (tolerance "
            f"|logprob diff| <= {result.tolerance:g}; largest diff {worst:.2g}, idle repeat "
            f"{result.idle_max_abs_logprob_diff or 0:.2g}; {result.preempted_probes} ran through "
            f"preemptions, {result.prefix_hit_probes} through prefix-cache hits, {result.ties} "
            f"stopped at a near tie, {result.ended_early} ended early by the engine (an OOM: the tokens "
            f"before it compared), {result.failed} failed under load)")
    for d in result.divergences[:3]:
        head += f"; {d.probe} ({d.kind}) at output token {d.diverged_at}: {d.why}, while {d.doing}"
    return head
