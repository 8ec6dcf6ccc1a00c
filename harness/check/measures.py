"""The measurements behind `fragbench check`'s questions (harness/check/__init__.py ties each question to its
function): the target's metrics sampled, one probe alone, the churn, and what each shows."""

from __future__ import annotations

import http.client
import json
import math
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pandas as pd

from engines.memory.nvml import fullest_gpu
from engines.procs import metric_samples
from harness.analysis.integrity import sentence
from harness.analysis.summary_records import Integrity
from harness.fetch import SERVER_PATHS, request, server_answers, stream, text_or_none
from harness.run.loadargs import LoadArgs, run_loadgen
from harness.run.targets import Target
from harness.run.telemetry import NoTelemetry, Telemetry, detect, family_named, scrape
from harness.units import KvBudget
from workloads.spec import load_spec


class Unreachable(RuntimeError):
    pass


@dataclass(frozen=True)
class Found:
    """What the measurement behind one question found."""

    status: str  # PASS | WARN | FAIL | UNKNOWN
    answer: object
    evidence: str


@dataclass(frozen=True)
class LayoutProbe:
    """One long answer streamed alone, and the KV usage the metrics showed around it."""

    baseline: float | None  # the usage before it
    rows: list[dict]  # metric samples: t_s, usage
    token_times: list[float]  # when each token arrived, on the samples' clock
    error: str | None  # why the probe ended early, if it did


@dataclass(frozen=True)
class ChurnLoad:
    """The workload's churn against the target: its requests and the server's metrics before and after."""

    requests: pd.DataFrame
    end_s: float
    t0: float
    metrics_before: list[tuple[str, dict, float]]
    metrics_after: list[tuple[str, dict, float]]


@dataclass
class Metrics:
    url: str
    family: str | None = None
    samples: list[dict] = field(default_factory=list)  # t_s, usage, running, waiting, preemptions, raw

    def detect(self) -> str | None:
        family = detect(scrape(self.url))
        self.family = family.name if family else None
        return self.family

    def sample(self, t0: float) -> dict | None:
        # stamped when the scrape is sent: the page it returns was read after that moment, so a sample stamped
        # after the first token shows the state after it (stamped on return, a busy machine's slow scrape showed
        # the state from before admission at the first token, and static-contiguous read as blocks)
        sent_s = time.time() - t0
        m = scrape(self.url)
        if m is None or self.family is None:
            return None
        read = family_named(self.family).row(m)  # harness/run/telemetry.py: one table of names per server
        row = {"t_s": sent_s, "usage": read.get("kv_cache_usage_perc"), "running": read.get("running"),
               "waiting": read.get("waiting"), "preemptions": read.get("preempted_total"), "raw": m}
        self.samples.append(row)
        return row


def reachable(target: str) -> None:
    if server_answers(target):  # an error status is an answer
        return
    raise Unreachable(f"target {target} does not answer (tried {' and '.join(SERVER_PATHS)})")


def sampling(metrics: Metrics, t0: float, stop: threading.Event, interval_s: float) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            metrics.sample(t0)
            stop.wait(interval_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def probe(target: str, metrics: Metrics, model_name: str | None, max_tokens: int,
          api: str = "completions") -> LayoutProbe:
    """One streaming request alone: how usage moves at admission and as tokens are produced."""
    t0 = time.time()
    stop = threading.Event()
    metrics.samples.clear()
    base = metrics.sample(t0)
    thread = sampling(metrics, t0, stop, 0.02)
    text = "Where does the memory go?"
    body = {**({"messages": [{"role": "user", "content": text}]} if api == "chat" else {"prompt": text}),
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    if model_name:
        body["model"] = model_name
    token_times: list[float] = []
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    error = None
    try:
        with stream(f"{target}{path}", body) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    token_times.append(time.time() - t0)
    except (OSError, http.client.HTTPException) as e:  # a refused, truncated or garbled answer is evidence too
        error = f"{type(e).__name__}: {e}"[:200]
    time.sleep(0.3)
    stop.set()
    thread.join()
    rows = [r for r in metrics.samples if r["usage"] is not None]
    return LayoutProbe(base["usage"] if base else None, rows, token_times, error)


def classify_layout(p: LayoutProbe, capacity_tokens: int | None) -> tuple[str | None, str]:
    """Contiguous (a jump at admission then flat, or growth by any number of tokens) vs blocks (growth in
    whole blocks: every change a multiple of the same number of tokens)."""
    rows, times = p.rows, p.token_times
    if len(times) < 8 or not rows:
        failed = f" (probe: {p.error})" if p.error else ""
        return None, "too few tokens or samples to see how usage moves" + failed
    first, last = times[0], times[-1]
    during = [r for r in rows if first <= r["t_s"] <= last]
    if len(during) < 5:
        return None, f"only {len(during)} metric samples while the probe decoded"
    levels = [r["usage"] for r in during]
    # rises only: the server frees the probe's KV when it sends the last token, which the client reads a moment
    # later (longer on a loaded machine), so the release can fall inside the decode window; it is not growth
    changes = [r["t_s"] for a, r in zip(during, during[1:], strict=False) if r["usage"] > a["usage"]]
    tokens_per_change = len(times) / max(1, len(changes))
    jump = levels[0] - (p.baseline or 0.0)
    growth = levels[-1] - levels[0]
    evidence = (f"{len(times)} tokens streamed in {last - first:.2f} s; KV usage {p.baseline or 0:.4f} before, "
                f"{levels[0]:.4f} at the first token (jump {jump:+.4f}), {levels[-1]:.4f} at the last (growth "
                f"{growth:+.4f}); usage changed {len(changes)} times while decoding (~{tokens_per_change:.0f} tokens "
                "per change)")
    if not changes and jump > 0:
        return "contiguous", evidence + ": a whole reservation at admission, flat while decoding"
    if changes and capacity_tokens:
        deltas = [round((b["usage"] - a["usage"]) * capacity_tokens) for a, b in zip(during, during[1:], strict=False)
                  if b["usage"] > a["usage"]]
        step = math.gcd(*[d for d in deltas if d])
        evidence += f"; in tokens of a {capacity_tokens:,}-token capacity every change is a multiple of {step}"
        if step >= 4:
            return "blocks", evidence + f": growth in whole blocks of {step} tokens as live tokens grow"
        return "contiguous", evidence + ": growth by any number of tokens (a buffer re-allocated as it fills)"
    if changes and tokens_per_change >= 4:
        return "blocks", evidence + ": growth in steps of several tokens as live tokens grow"
    return None, evidence


@dataclass
class CheckConfig:
    target: str
    metrics_url: str
    model: str
    gpu: object | None
    max_seq_len: int
    workload: str
    duration_s: float
    dtype: str = "float16"
    seed: int = 0
    api: str = "completions"  # or "chat": the probe and the churn speak /v1/chat/completions
    capacity_s: float = 60.0  # seconds of arrivals the ninth question's knee search may spend; 0 skips it


def served_model(target: str) -> str | None:
    try:
        data = json.loads(request(f"{target}/v1/models"))
        return data["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return None


def live_budget(plan, metrics: Metrics, family: str | None, kvb: int) -> Found:
    samples = scrape_samples(metrics.url)  # one scrape serves both servers' ways of saying it
    server_tokens = None
    capacity = [v for name, _, v in samples if name == "fragbench:kv_capacity_bytes"]
    if family == "fragbench" and capacity and capacity[0]:
        server_tokens = int(capacity[0] // kvb)
    info = [s for s in samples if s[0] == "vllm:cache_config_info"]
    if info:
        labels = info[0][1]
        if labels.get("num_gpu_blocks") not in (None, "None") and labels.get("block_size"):
            server_tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    parts = []
    if plan:
        parts.append(f"plan: KV budget {plan.kv_budget_bytes:,} B after {plan.weights_bytes:,} B of weights and "
                     f"{plan.activation_headroom_bytes:,} B of headroom = {plan.max_live_tokens:,} live tokens")
    if server_tokens is not None:
        parts.append(f"server: {server_tokens:,} tokens of KV capacity (its own metrics)")
    if plan is None and server_tokens is None:
        return Found("UNKNOWN", None, "no --gpu/--gpu-mem given and the server exports no capacity")
    if plan is not None and not plan.fits:
        return Found("FAIL", plan.max_live_tokens, "; ".join(parts) + f"; {plan.reason}")
    answer = {"plan_tokens": plan.max_live_tokens if plan else None, "server_tokens": server_tokens}
    return Found("PASS", answer, "; ".join(parts))


def scrape_samples(url: str) -> list[tuple[str, dict, float]]:
    """The labelled samples of one scrape; nothing when the server does not answer or answers garbage."""
    text = text_or_none(url)
    try:
        return metric_samples(text) if text is not None else []
    except ValueError:
        return []


def churn(cfg: CheckConfig, metrics: Metrics, model_name: str | None) -> ChurnLoad:
    out = Path(tempfile.mkdtemp(prefix="fragbench-check-"))
    t0 = time.time()
    metrics.samples.clear()
    stop = threading.Event()
    thread = sampling(metrics, t0, stop, 0.1)
    load = LoadArgs(target=cfg.target, workload=cfg.workload, out=out, duration_s=cfg.duration_s, seed=cfg.seed,
                    max_seq_len=cfg.max_seq_len, t0=t0, grace_s=20, model=model_name, api=cfg.api)
    before = scrape_samples(cfg.metrics_url)
    run_loadgen(load, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end_s = time.time() - t0
    # then watch memory come back
    deadline = time.time() + 15
    while time.time() < deadline:
        time.sleep(0.1)
        if metrics.samples and metrics.samples[-1]["usage"] is not None and metrics.samples[-1]["usage"] <= 1e-9:
            break
    stop.set()
    thread.join()
    rows = pd.read_parquet(out / "requests.parquet") if (out / "requests.parquet").exists() else pd.DataFrame()
    return ChurnLoad(rows, end_s, t0, before, scrape_samples(cfg.metrics_url))


def headroom(cfg: CheckConfig, load: ChurnLoad) -> Found:
    host = urlparse(cfg.target).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        return Found("UNKNOWN", None, f"the target {host} is not local: NVML cannot see its GPU")
    fullest = fullest_gpu()  # which GPU the server runs on is its own business: the fullest is where it binds
    if fullest is None:
        return Found("UNKNOWN", None, "NVML unavailable on this machine, or it sees no GPU")
    index, mem = fullest
    free = mem.total - mem.used
    status = "PASS" if free >= 0.05 * mem.total else "WARN"
    return Found(status, int(free),
                  f"NVML after the churn, the fullest GPU (NVML index {index}): {mem.used:,} B used of "
                  f"{mem.total:,} B; {free:,} B free for temporaries")


def release(load: ChurnLoad, metrics: Metrics) -> Found:
    rows = load.requests
    cancelled = int((rows.status == "cancelled").sum()) if len(rows) else 0
    samples = [s for s in metrics.samples if s["usage"] is not None]
    if not samples:
        return Found("UNKNOWN", None, "no KV usage metric to watch")
    last_end = float(rows.end_s.max()) if len(rows) and rows.end_s.notna().any() else load.end_s
    after = [s for s in samples if s["t_s"] >= last_end]
    back = next((s["t_s"] for s in after if s["usage"] <= 1e-9), None)
    peak = max(s["usage"] for s in samples)
    if back is None:
        final = after[-1]["usage"] if after else samples[-1]["usage"]
        return Found("FAIL", None,
                      f"{cancelled} requests cancelled mid-stream; KV usage still {final:.4f} 15 s after the last "
                      f"request ended at t={last_end:.1f} s (peak {peak:.4f})")
    delay = max(0.0, back - last_end)
    status = "PASS" if delay <= 2.0 else "WARN"
    return Found(status, round(delay, 3),
                  f"{cancelled} requests cancelled mid-stream, {len(rows)} in all; KV usage back to 0 at "
                  f"t={back:.2f} s, {delay:.2f} s after the last request ended (peak usage {peak:.4f}); window "
                  f"0-{back:.1f} s")


def oom_by_cause(load: ChurnLoad) -> dict[str, float]:
    def counts(samples):
        return {lab.get("cause"): v for name, lab, v in samples if name == "fragbench:oom_total"}

    before, after = counts(load.metrics_before), counts(load.metrics_after)
    return {cause: after[cause] - before.get(cause, 0) for cause in after}


def failures(load: ChurnLoad, family: str | None) -> Found:
    rows = load.requests
    by_status = rows.status.value_counts().to_dict() if len(rows) else {}
    http = rows[rows.http_status.fillna(200) >= 400].http_status.value_counts().to_dict() if len(rows) else {}
    evidence = f"requests by status {by_status}; HTTP errors {http or 'none'}"
    ooms = oom_by_cause(load) if family == "fragbench" else {}
    if ooms:
        evidence += "; OOMs during the load: " + ", ".join(f"{v:.0f} {k}" for k, v in sorted(ooms.items()))
    errors = by_status.get("error", 0) + sum(v for k, v in http.items() if k >= 500)
    if errors:
        return Found("FAIL", "errors", evidence)
    if ooms.get("fragmentation", 0) > 0:
        return Found("FAIL", "fragmentation", evidence + ": free memory existed but did not fit")
    if by_status.get("oom", 0) or ooms.get("capacity", 0) > 0:
        return Found("WARN", "capacity", evidence + ": the KV budget ran out")
    return Found("PASS", "none", evidence)


def queueing(load: ChurnLoad, metrics: Metrics, family: str | None, plan) -> Found:
    samples = [s for s in metrics.samples if s["running"] is not None]
    if not samples:
        return Found("UNKNOWN", None, "no running/waiting metrics")
    counts = [s["preemptions"] for s in samples if s["preemptions"] is not None]
    preemptions = counts[-1] - counts[0] if counts else None  # unknown where the server exports none
    max_running = max(s["running"] for s in samples)
    max_waiting = max((s["waiting"] or 0) for s in samples)
    waited = float(np.mean([(s["waiting"] or 0) > 0 for s in samples]))
    rows = load.requests
    answer = {"preemptions": preemptions, "max_running": max_running, "max_waiting": max_waiting,
              "share_of_time_queueing": round(waited, 3), "requests": int(len(rows))}
    evidence = (f"over 0-{load.end_s:.0f} s: up to {max_running:.0f} running and {max_waiting:.0f} waiting; "
                f"requests queued {waited:.0%} of the time; {preemptions if preemptions is not None else 'n/a'} "
                f"preemptions; {len(rows)} requests sent")
    if plan:
        evidence += (f"; the plan admits {plan.paged_expected_concurrency} paged or {plan.static_max_concurrency} "
                     "max-reserved requests at once")
    status = "WARN" if (preemptions or 0) > 0 or waited > 0.5 else "PASS"
    return Found(status, answer, evidence)


def kv_integrity(result: Integrity) -> Found:
    answer = {"probes": result.probes, "diverged": result.diverged, "max_abs_logprob_diff": result.max_abs_logprob_diff}
    if not result.probes:
        return Found("UNKNOWN", answer, sentence(result))
    return Found("FAIL" if result.diverged else "PASS", answer, sentence(result))


def sustained(cfg: CheckConfig, model_name: str | None) -> Found:
    """The bench's own knee search (calibration, then bracketing and bisection) with the target as its one
    engine: the same search, SLO and interval as `bench --target`'s capacity."""
    # torch (through run/bench.py) loads for this question alone: `check --capacity-time 0` runs without it
    from harness.run.bench import Bench, BenchConfig

    if cfg.capacity_s <= 0:
        return Found("UNKNOWN", None, "skipped: --capacity-time 0")
    if load_spec(cfg.workload).arrival.process == "closed":
        return Found("UNKNOWN", None, f"{cfg.workload} is closed-loop: it has no rate to offer")
    try:
        telemetry = Telemetry.of(cfg.metrics_url)
    except NoTelemetry:
        telemetry = None  # the rate needs no memory figures; the bound then says what it could not see
    target = Target("target", cfg.target, telemetry, model_name or "", None)
    calibrate_s = min(8.0, cfg.capacity_s / 3)
    # the target serves from its own memory: no bytes of ours, only the label its records carry
    bench = BenchConfig(engines=[], targets={"target": target.describe()}, workload=cfg.workload, model=cfg.model,
                        kv_budget=KvBudget(0, "own"), duration_s=cfg.capacity_s,
                        out_dir=Path(tempfile.mkdtemp(prefix="fragbench-")),
                        seed=cfg.seed, max_seq_len=cfg.max_seq_len, grace_s=5.0, sweep=True,
                        # --capacity-time is the search's arrivals: the bench's time adds its calibration windows
                        time_s=cfg.capacity_s + 4 * calibrate_s + 5.0, calibrate_s=calibrate_s, api=cfg.api,
                        run_id="check-capacity")
    run_dir = Bench(bench).run()
    cap = json.loads((run_dir / "summary.json").read_text()).get("capacity", {}).get("target")
    if not cap:
        return Found("UNKNOWN", None, f"the knee search measured no point (rows in {run_dir})")
    ci, rates = cap.get("sustained_rps_ci"), [p["offered_rps"] for p in cap["points"]]
    slo = cap["slo"]
    judged = ", ".join(f"{p['judged']}" for p in cap["points"])
    evidence = (f"knee search on {cfg.workload}: {len(rates)} offered rates ({', '.join(f'{r:g}' for r in rates)} "
                f"req/s, judged at steady state on {judged} requests, {cfg.capacity_s:g} s in all); SLO TTFT <= "
                f"{slo['ttft_s']:g} s, TPOT <= {slo['tpot_s']:g} s for {slo['attainment']:.0%} of requests; "
                f"sustained {cap['sustained_rps']:.3g} req/s ({cap['sustained_where']} the measured rates)"
                + (f", 90 % interval [{ci[0]:.3g}, {ci[1]:.3g}]" if ci else "")
                + f"; bound by {cap.get('bound')} ({cap.get('bound_evidence')}); rows in {run_dir}")
    status = "PASS" if cap["sustained_rps"] > 0 else "FAIL"
    return Found(status, {"sustained_rps": cap["sustained_rps"], "sustained_rps_ci": ci,
                                            "bound": cap.get("bound")}, evidence)
