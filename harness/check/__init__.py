"""`fragbench check`: the pre-deployment sanity check against any OpenAI-compatible server (vLLM, SGLang,
TGI or ours). Every answer comes from a measurement in this run, with its evidence and time window. Each
question is a record (`Question`: its number, its words, the function that answers it) over one `Session`;
the measurements are in harness/check/measures.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from engines.api.stats import StatsPayload
from engines.shapes import load_shape
from harness.check.measures import (
    CheckConfig,
    ChurnLoad,
    Found,
    Metrics,
    Unreachable,
    churn,
    classify_layout,
    failures,
    headroom,
    kv_integrity,
    live_budget,
    probe,
    queueing,
    reachable,
    release,
    served_model,
    sustained,
)
from harness.monitoring.envelope import envelope
from harness.plan import make_plan
from harness.run.integrity_probes import IntegrityProbes
from harness.run.telemetry import family_named, scrape
from workloads.generate import trace
from workloads.spec import load_spec

__all__ = ["QUESTIONS", "Answer", "CheckConfig", "Found", "Question", "Session", "Unreachable", "classify_layout",
           "run_check"]


@dataclass
class Answer:
    """One question answered, as the JSON report carries it."""

    id: int
    question: str
    status: str  # PASS | WARN | FAIL | UNKNOWN
    answer: object
    evidence: str


@dataclass
class Session:
    """What the questions share: the target, its metrics and model, the plan, what each question found so far,
    and the churn, measured once, the first time a question asks for it (the probes' idle answers first,
    then the churn with the probes sent into it: harness/run/integrity_probes.py)."""

    cfg: CheckConfig
    shape: object  # engines.shapes.ModelShape
    metrics: Metrics
    family: str | None
    model_name: str | None
    plan: object | None  # harness.plan.Plan, with --gpu or --gpu-mem
    probes: IntegrityProbes
    found: dict[int, Found] = field(default_factory=dict)
    churned: ChurnLoad | None = None

    @property
    def kvb(self) -> int:
        return self.shape.kv_bytes_per_token(self.cfg.dtype)

    def load(self) -> ChurnLoad:
        if self.churned is None:
            self.probes.idle()
            with self.probes:
                self.churned = churn(self.cfg, self.metrics, self.model_name)
        return self.churned


def kv_cost(s: Session) -> Found:
    shape = s.shape
    return Found("PASS", s.kvb, f"2 x {shape.num_layers} layers x {shape.num_kv_heads} KV heads x {shape.head_dim} "
                 f"head dim x {s.cfg.dtype} bytes = {s.kvb:,} B per token")


# The layout probe's answer lengths: a second, longer one where the first left too little to judge (a loaded
# server or machine answered /metrics a few times while 96 tokens streamed; seen under the suite's load)
PROBE_TOKENS = (96, 384)


def layout(s: Session) -> Found:
    cfg = s.cfg
    budget = s.found[2].answer
    capacity = budget.get("server_tokens") if isinstance(budget, dict) else None
    kind, said = None, []
    for tokens in PROBE_TOKENS if s.family else ():
        seen = probe(cfg.target, s.metrics, s.model_name, max_tokens=min(tokens, cfg.max_seq_len // 4), api=cfg.api)
        kind, evidence = classify_layout(seen, capacity)
        said.append(evidence)
        if kind is not None:
            break
    evidence = "; then a longer probe: ".join(said) or "no known KV metrics"
    return Found({"blocks": "PASS", "contiguous": "WARN"}.get(kind, "UNKNOWN"), kind, evidence)


def near_limit(s: Session) -> Found:
    cfg = s.cfg
    t = trace(load_spec(cfg.workload), cfg.seed, cfg.max_seq_len, s.shape.vocab_size)
    totals = np.array([len(r.prompt_ids) + r.max_tokens for r in t.requests])
    near = float((totals >= 0.9 * cfg.max_seq_len).mean())
    return Found("PASS" if near < 0.05 else "WARN", round(near, 4),
                 f"{near:.1%} of {len(totals)} requests of {cfg.workload} need >= 90% of max_seq_len "
                 f"{cfg.max_seq_len} (p99 total {np.percentile(totals, 99):.0f} tokens)")


def integrity_under_churn(s: Session) -> Found:
    s.load()
    return kv_integrity(s.probes.judged())


@dataclass(frozen=True)
class Question:
    """One pre-deployment question: its number in the report, its words, and what answers it."""

    id: int
    text: str
    answer: Callable[[Session], Found]


QUESTIONS: tuple[Question, ...] = (
    Question(1, "How many bytes does one token of KV cost for this model and precision?", kv_cost),
    Question(2, "What is the maximum live-token budget?",
             lambda s: live_budget(s.plan, s.metrics, s.family, s.kvb)),
    Question(3, "Does the server keep KV in contiguous buffers or fixed-size blocks?", layout),
    Question(4, "What share of the workload's requests approach the configured sequence limit?", near_limit),
    Question(5, "How much headroom is left for temporary kernels at peak concurrency?",
             lambda s: headroom(s.cfg, s.load())),
    Question(6, "Do cancellations and finished streams release KV promptly?", lambda s: release(s.load(), s.metrics)),
    Question(7, "Are failures under churn capacity or fragmentation?", lambda s: failures(s.load(), s.family)),
    Question(8, "How much preemption and queueing does the load cause, against the admitted-token budget?",
             lambda s: queueing(s.load(), s.metrics, s.family, s.plan)),
    Question(9, "What request rate does the server sustain at the SLO on this workload?",
             lambda s: sustained(s.cfg, s.model_name)),
    Question(10, "Does the KV cache give back the right numbers under churn (probes against their idle answers)?",
             integrity_under_churn),
)


def run_check(cfg: CheckConfig) -> dict:
    """Every question in order, each answered from a measurement of this run."""
    reachable(cfg.target)
    shape = load_shape(cfg.model)
    metrics = Metrics(cfg.metrics_url)
    family = metrics.detect()
    model_name = served_model(cfg.target)
    plan = make_plan(shape, cfg.gpu.memory_bytes, cfg.dtype, max_seq_len=cfg.max_seq_len) if cfg.gpu else None

    def counters() -> StatsPayload | None:  # the probes' engine counters, from the target's metrics
        if not family:
            return None
        return StatsPayload.model_validate(family_named(family).row(scrape(cfg.metrics_url) or {}))

    probes = IntegrityProbes(cfg.target, cfg.max_seq_len, shape.dtype or cfg.dtype, cfg.api, model_name, state=counters)
    session = Session(cfg, shape, metrics, family, model_name, plan, probes)
    answers = []
    for q in QUESTIONS:
        found = session.found[q.id] = q.answer(session)
        answers.append(Answer(q.id, q.text, found.status, found.answer, found.evidence))
    load = session.load()
    return {"target": cfg.target, "metrics_url": cfg.metrics_url,
            "metrics_found": family or "none (no fragbench:, vllm:, sglang: or tgi_ metrics)",
            "window_s": [0.0, load.end_s], "envelope": envelope(metrics.family, metrics.samples),
            "questions": [asdict(a) for a in answers]}
