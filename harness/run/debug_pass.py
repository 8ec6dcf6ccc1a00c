"""The debugging pass: the engine's memory after model load, at the peak of one short and one long request
alone, and after the churn: what the report's "debugging pass" section shows of each engine bench started."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import psutil

from engines.api.stats import StatsPayload
from harness.run.stats_poller import fetch_stats


def debug_row(engine: str, url: str, pid: int, phase: str, stats: StatsPayload | None = None) -> dict | None:
    """One phase's row, from `stats` (a peak already taken) or the server's /stats now."""
    stats = stats or fetch_stats(url)
    if stats is None:
        return None
    cap = stats.kv_capacity_bytes or 1
    try:
        rss = psutil.Process(pid).memory_info().rss
    except psutil.Error:
        rss = None
    return {
        "engine": engine, "phase": phase, "kv_allocated_bytes": stats.allocated_bytes,
        "token_states_bytes": stats.token_states_bytes, "kv_usage": (stats.allocated_bytes or 0) / cap,
        "running": stats.running, "live_tokens": stats.live_tokens,
        "largest_free_bytes": stats.largest_free_bytes, "free_bytes": stats.free_bytes,
        "torch_allocated_bytes": stats.torch_allocated_bytes,
        "torch_reserved_bytes": stats.torch_reserved_bytes,
        "device_used_bytes": stats.device_used_bytes, "process_rss_bytes": rss,
    }


def request_alone(url: str, prompt_tokens: int, max_tokens: int) -> StatsPayload | None:
    """One request with nothing else running; the server's stats at its memory peak."""
    body = json.dumps({"prompt": [3 + (i * 7) % 4000 for i in range(prompt_tokens)], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    done = threading.Event()

    def send() -> None:
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=300).read()
        except OSError:
            pass
        done.set()

    threading.Thread(target=send, daemon=True).start()
    peak: StatsPayload | None = None
    while not done.is_set():
        stats = fetch_stats(url)
        if stats and (peak is None or (stats.allocated_bytes or 0) > (peak.allocated_bytes or 0)):
            peak = stats
        time.sleep(0.02)
    return peak
