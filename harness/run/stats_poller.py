"""Samples a server's /stats at a fixed rate into the samples journal; keeps the worst memory map, and the
maps the server took at fragmentation OOMs."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from engines.api.stats import AllocatorBlock, StatsPayload
from engines.kv_categories import CATEGORY_COLUMNS
from harness.analysis.allocator_summary import STATS_COLUMNS as ALLOCATOR_BLOCK_COLUMNS
from harness.fetch import json_or_none as fetch_json  # bench and the samplers read /stats through it
from harness.results import SAMPLE_COLUMNS, Journal, write_whole

# the samples columns read from /stats' `allocator` block (the caching allocator's figures), by its keys
ALLOCATOR_COLUMNS = {column: key for key, column in ALLOCATOR_BLOCK_COLUMNS.items()}
# /stats fields copied into every sample row: the samples columns, then what the report needs beside them
FIELDS = (
    *(c for c in SAMPLE_COLUMNS if c not in ("engine", "t_s") and c not in ALLOCATOR_COLUMNS),
    *(c for c in CATEGORY_COLUMNS.values() if c not in SAMPLE_COLUMNS), "live_tokens",
    "oom_total", "oom_fragmentation", "abort_release_p99_s", "abort_release_count", "steps", "waiting_for_memory",
    "kv_bytes_per_token", "kv_cache_usage_perc",
)


def fetch_stats(url: str, timeout_s: float = 5.0, query: str = "") -> StatsPayload | None:
    """The server's /stats (`query`: "?map=1", "?releases=1"), read into its record once, here."""
    body = fetch_json(f"{url}/stats{query}", timeout_s)
    return StatsPayload.model_validate(body) if isinstance(body, dict) else None


def allocator_fields(figures: AllocatorBlock | None) -> dict:
    """The allocator's figures as samples columns; every one None where no caching allocator holds the KV."""
    return {column: figures.figure(key) if figures else None for column, key in ALLOCATOR_COLUMNS.items()}


def waste(stats: StatsPayload) -> int:
    """Allocated but holding no live token, plus free bytes no request can use: what the map should show."""
    token = stats.token_states_bytes or 0
    return (stats.allocated_bytes or 0) - token + (stats.external_fragmentation_bytes or 0)


class StatsPoller:
    """One server's /stats polled into the samples journal (its thread), its memory map saved when worth it."""

    def __init__(self, engine: str, url: str, pid: int | None, journal: Journal, t0: float, map_path: Path,
                 interval_s: float = 0.1, fetch: Callable[[], StatsPayload | None] | None = None):
        """`fetch`: where a row's figures come from (a target's metrics); the server's /stats by default.
        `pid` None: a process that is not ours (no RSS)."""
        self.engine, self.url, self.journal, self.t0 = engine, url, journal, t0
        self.interval_s, self.map_path = interval_s, map_path
        self.own = fetch is None  # a fragbench server: its memory maps are asked for when worth saving
        self.fetch = fetch or (lambda: fetch_stats(url))
        self.process = psutil.Process(pid) if pid is not None else None
        self.last: StatsPayload | None = None
        self.worst = -1
        self.oom_maps_saved = 0  # of this server's fragmentation maps
        self.oom_maps_base = 0  # maps an earlier server of the same engine saved (their files come first)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"sampler-{engine}")

    def start(self) -> StatsPoller:
        self._thread.start()
        return self

    def resumed(self, url: str, pid: int | None) -> StatsPoller:
        """A sampler for the same engine's next server (a revisit), keeping what this one saved."""
        nxt = StatsPoller(self.engine, url, pid, self.journal, self.t0, self.map_path, self.interval_s)
        nxt.worst = self.worst
        nxt.oom_maps_base = self.oom_maps_base + self.oom_maps_saved
        return nxt

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def save_maps(self, sample_t_s: float, stats: StatsPayload) -> None:
        """The server's memory map when it shows more waste than any saved so far (the worst moment), and
        the maps it took at fragmentation OOMs: asked for only then (/stats?map=1), never ten times a second.
        `sample_t_s`: the sample row's time, on this engine's clock."""
        full = fetch_stats(self.url, timeout_s=10, query="?map=1")
        if full is None:
            return
        server_t_s = full.t_s if full.has("t_s") else (stats.t_s if stats.has("t_s") else 0.0)
        offset = sample_t_s - server_t_s  # server uptime -> this engine's clock
        for i, snap in enumerate((full.fragmentation_oom_maps or [])[self.oom_maps_saved:],
                                 start=self.oom_maps_saved):
            path = self.map_path.with_name(f"{self.map_path.stem}-oom-{self.oom_maps_base + i}.json")
            path.write_text(json.dumps({**snap.written(), "t_s": round(snap.t_s + offset, 4)}))
            self.oom_maps_saved = i + 1
        previous, self.worst = self.worst, max(self.worst, waste(stats))  # asked once per new worst, not again
        if waste(full) > previous and full.memory_map:
            self.worst = max(self.worst, waste(full))
            write_whole(self.map_path,  # the worst map so far, rewritten at each new worst: whole
                        json.dumps({"t_s": round((full.t_s if full.has("t_s") else 0.0) + offset, 4),
                                    "stats": {k: full.figure(k) for k in FIELDS}, "memory_map": full.memory_map}))

    def _run(self) -> None:
        next_t = time.time()
        while not self._stop.is_set():
            self.sample()
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.time()))

    def sample(self) -> StatsPayload | None:
        stats = self.fetch()
        if stats is None:
            return None
        self.last = stats
        now = time.time()
        row = {"engine": self.engine, "t_s": round(now - self.t0, 4), "t_wall": now}
        row.update({k: stats.figure(k) for k in FIELDS})
        row.update(allocator_fields(stats.allocator))
        try:
            row["process_rss_bytes"] = self.process.memory_info().rss if self.process else None
        except psutil.Error:
            row["process_rss_bytes"] = None
        self.journal.write(row)
        if self.own and (waste(stats) > self.worst
                         or (stats.fragmentation_oom_maps_count or 0) > self.oom_maps_saved):
            self.save_maps(row["t_s"], stats)
        return stats
