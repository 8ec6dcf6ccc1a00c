"""A run's results written without running anything: for the report's scale benchmark and its tests.
Every row has the columns a real bench writes; the numbers are drawn from a seeded generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from harness.results import Journal


def write_run(run_dir: Path, engines: dict[str, dict], duration_s: float, ooms: int = 0, seed: int = 0,
              started: str = "2026-11-30T00:00:00+00:00", git_sha: str = "0" * 40, sample_hz: float = 10.0,
              requests_per_s: float = 5.0) -> Path:
    """engines: name -> {"token_states": share, "running": mean, "ttft_s": median}. OOM events go to the first
    contiguous-looking engine, half of them fragmentation."""
    rng = np.random.default_rng(seed)
    names = list(engines)
    (run_dir / "engines").mkdir(parents=True, exist_ok=True)
    meta = {"run_id": run_dir.name, "status": "complete", "started": started, "git_sha": git_sha,
            "config": {"engines": names, "workload": "mixed-churn", "kv_budget": "32MiB", "duration_s": duration_s},
            "engines_done": names, "engine_t0": {}}
    cap = 32 * 2**20
    samples, events = Journal(run_dir / "samples.jsonl"), Journal(run_dir / "events.jsonl")
    for name, shape in engines.items():
        t = np.arange(0, duration_s, 1 / sample_hz)
        token = np.clip(shape["token_states"] + rng.normal(0, 0.05, len(t)), 0, 1) * cap
        for ti, tok, run in zip(t, token, rng.poisson(shape["running"], len(t)), strict=True):
            samples.write({"engine": name, "t_s": float(ti), "kv_capacity_bytes": cap, "token_states_bytes": int(tok),
                           "reservation_bytes": 0, "internal_fragmentation_bytes": 0,
                           "external_fragmentation_bytes": 0, "largest_free_bytes": int(cap - tok),
                           "usable_free_bytes": int(cap - tok),
                           "allocated_bytes": int(tok), "free_bytes": int(cap - tok), "running": int(run),
                           "waiting": 0, "preempted_total": 0})
        with Journal(run_dir / "engines" / name / "requests.jsonl") as requests:
            for i in range(int(duration_s * requests_per_s)):
                sent = i / requests_per_s
                ttft = float(rng.lognormal(np.log(shape["ttft_s"]), 0.5))
                requests.write({"engine": name, "request_id": f"r{i:06d}", "class": "chat", "arrival_s": sent,
                                "sent_s": sent, "first_token_s": sent + ttft, "end_s": sent + ttft + 2.0,
                                "prompt_tokens": 100, "output_tokens_target": 50, "output_tokens": 50, "n": 1,
                                "stream": True, "status": "ok", "error": "", "ttft_s": ttft, "tpot_s": 0.04,
                                "e2e_s": ttft + 2.0, "inter_token_s": json.dumps([0.04] * 49)})
    victim = next((n for n in names if n.startswith(("static", "growth", "hf"))), names[0])
    for i in range(ooms):
        frag = i % 2 == 0
        requested = 4 * 2**20
        free = requested + 2**20 if frag else requested // 2
        events.write({"engine": victim, "t_s": float(i * duration_s / max(ooms, 1)), "kind": "oom",
                      "requested_bytes": requested, "free_bytes": free, "largest_free_bytes": requested // 3,
                      "cause": "fragmentation" if frag else "capacity", "detail": "the request failed",
                      "running": int(rng.integers(1, 20)), "waiting": 0, "live_tokens": int(rng.integers(100, 8000)),
                      "kv_usage": 0.9})
    samples.close()
    events.close()
    (run_dir / "run.json").write_text(json.dumps(meta))
    return run_dir
