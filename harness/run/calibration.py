"""How fast each engine can go on this workload and hardware (saturating windows of its load), and the churn
each window is: one load generator run to its end while the engine's server is supervised (the same churn is
a whole engine's run without --sweep)."""

from __future__ import annotations

import subprocess
import time

from harness.results import read_journals, token_times
from harness.run.config import BenchConfig
from harness.run.console import Show
from harness.run.engine_run import EngineRun
from harness.run.loadargs import LoadArgs, start_loadgen, stop_loadgen
from harness.run.stats_poller import StatsPoller
from harness.run.supervisor import Supervisor
from workloads.generate import trace
from workloads.spec import load_spec

LOADGEN_STARTUP_S = 3.0  # the load generator starts its trace this long after it is launched: none late


class Calibration:
    def __init__(self, cfg: BenchConfig, servers: Supervisor):
        self.cfg, self.servers = cfg, servers

    def calibrate(self, run: EngineRun, show: Show) -> float:
        """The requests/s an engine sustains when saturated: output tokens it streamed per second inside the
        window (requests still running count: an engine that runs many at once finishes them later) over
        the workload's mean output per request. The offered rate starts at four times the workload's own and
        doubles until the engine falls behind (at most four windows)."""
        reqs = trace(load_spec(self.cfg.workload), self.cfg.seed, self.cfg.max_seq_len).requests
        span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
        offered = 4 * (len(reqs) - 1) / span if span > 0 else 10.0
        tokens_per_request = sum(r.max_tokens * r.n for r in reqs) / len(reqs)
        achieved = 0.0
        for attempt in range(4):
            out = self.servers.dir / "engines" / run.engine / "calibrate" / f"{run.budget}-{attempt}"
            start = time.time() - run.t0 + LOADGEN_STARTUP_S
            self.churn(run, None, show, self.servers.load_args(run, out=out, duration_s=self.cfg.calibrate_s,
                                                               grace_s=2, rate=offered, start_at_s=start), start)
            self.servers.drain(run)
            rows = read_journals([out / "requests.jsonl"], "requests")
            end = start + self.cfg.calibrate_s
            tokens = sum(start <= t <= end for row in rows.itertuples() for t in token_times(row))
            achieved = tokens / self.cfg.calibrate_s / tokens_per_request
            if achieved < 0.8 * offered:  # it fell behind: that is its pace
                break
            offered *= 2
        return round(achieved, 3)

    def churn(self, run: EngineRun, sampler: StatsPoller | None, show: Show, load: LoadArgs,
              start_s: float = 0.0) -> None:
        out = load.out
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "loadgen.log", "ab") as log:
            loadgen = start_loadgen(load, stdout=log, stderr=subprocess.STDOUT)
        killed = False
        try:
            while loadgen.poll() is None:
                elapsed = time.time() - run.t0
                if self.cfg.kill_after_s is not None and not killed and elapsed >= self.cfg.kill_after_s \
                        and run.server.proc is not None:
                    run.server.proc.kill()  # fault injection: the engine dies mid-run, as a GPU fault would
                    run.server.proc.wait()
                    killed = True
                show(f"{run.engine:<6} churn ({run.crashes} crashes)", max(0.0, elapsed - start_s))
                self.servers.supervise(run, sampler)
                time.sleep(0.3)
        finally:
            stop_loadgen(loadgen)
        show(f"{run.engine:<6} done ({run.crashes} crashes)", load.duration_s)
