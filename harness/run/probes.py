"""What the bench asks an engine outside its load: the debugging pass (harness/run/debug_pass.py: its memory
after model load, a short and a long request alone, after those complete and after the churn mix, rows in
debug.jsonl), the KV-integrity probes served on the idle engine (harness/run/integrity_probes.py), and the abort
releases the server measured (events)."""

from __future__ import annotations

import json
import time

from engines.api.stats import StatsPayload
from engines.shapes import load_shape
from harness.results import Journal
from harness.run.config import BenchConfig
from harness.run.console import Console, Show
from harness.run.debug_pass import debug_row, request_alone
from harness.run.engine_run import EngineRun
from harness.run.integrity_probes import IntegrityProbes
from harness.run.record import RunWriter
from harness.run.stats_poller import fetch_stats
from harness.run.supervisor import Supervisor


class Probes:
    def __init__(self, cfg: BenchConfig, servers: Supervisor, record: RunWriter, console: Console):
        self.cfg, self.servers, self.record, self.console = cfg, servers, record, console
        self.debug = Journal(record.dir / "debug.jsonl")

    def debug_passes(self, run: EngineRun, show: Show) -> None:
        show(f"{run.engine:<6} debug pass", 0)
        self.console.plain(f"{run.engine}: server up, debugging pass")
        self.debug_pass(run, "after model load")
        self.debug_pass(run, "short request alone", request_alone(run.server.url, prompt_tokens=16, max_tokens=16))
        self.debug_pass(run, "long request alone", request_alone(run.server.url, int(self.cfg.max_seq_len * 0.75), 32))
        self.debug_pass(run, "after those requests complete")

    def after_churn(self, run: EngineRun) -> None:
        """The debugging pass's last row, once the engine has settled, and the abort releases it measured."""
        time.sleep(1.0)
        self.debug_pass(run, "after the churn mix")
        self.releases(run)

    def integrity_idle(self, run: EngineRun, show: Show) -> IntegrityProbes:
        """The KV-integrity probes served alone on the idle engine (harness/run/integrity_probes.py): the answers the
        ones sent into its load are judged against. Rows in engines/<name>/integrity.jsonl as they come."""
        show(f"{run.engine:<6} integrity probes", 0)
        d = self.record.dir / "engines" / run.engine
        journal = Journal(d / "integrity.jsonl")
        target = self.servers.targets.get(run.engine)
        # a target's weights are not here and /v1/models names no dtype: judged at the half-precision tolerance
        dtype = "unknown" if target else load_shape(self.cfg.model).dtype
        check = IntegrityProbes(run.server.url, self.cfg.max_seq_len, dtype, self.cfg.api,
                          target.model if target else None, target.api_key if target else None,
                          state=lambda: self.servers.stats_of(run) if run.server.alive() else None,
                          on_row=journal.write)
        (d / "integrity.json").write_text(json.dumps(check.idle().written(), indent=2))
        return check

    def debug_pass(self, run: EngineRun, phase: str, stats: StatsPayload | None = None) -> None:
        row = debug_row(run.engine, run.server.url, run.server.proc.pid, phase, stats)
        if row is not None:
            self.debug.write(row)

    def releases(self, run: EngineRun) -> None:
        stats = fetch_stats(run.server.url, timeout_s=10, query="?releases=1")
        for value in (stats.abort_release_s if stats else None) or []:
            self.record.event(run, "cancel_release", detail=f"{value:.6f}", requested_bytes=None,
                              cause=None, release_s=value)
