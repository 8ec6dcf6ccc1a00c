"""`fragbench ab`'s measurement: each engine of each build served from its own work tree, and this checkout's
bench measuring one build's servers as one run (its calibration, knee search, SLO and summary, in that build's
results folder), then the other build's, then, per engine, a fixed-rate run of each build at a rate both sustain
with margin (ab.margin_rate), turn after turn, each turn a fresh stream (its own seed) both builds are given, their
order reversed every turn (ABBA), until every figure is PASS or FAIL or the time is spent (harness/analysis/ab.py
judges them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engines.procs import spawn, stop
from harness.analysis.ab import (
    MIN_TURNS,
    SIDES,
    ABFigure,
    FixedSide,
    knee_figure,
    margin_rate,
    operating_figures,
    overall,
    point_requests,
    side_name,
)
from harness.analysis.knee import Judged
from harness.analysis.records import RunRecord
from harness.analysis.rundir import load_frames
from harness.analysis.summary import blocks_of
from harness.analysis.summary_records import Summary
from harness.run.servers import READY, ServerFailed, healthy, tail
from harness.run.stats_poller import fetch_stats
from harness.run.trees import ROOT, Tree, run_child

SERVE_TIMEOUT_S = 300
FIXED_JUDGED = 30  # requests a fixed-rate point judges per build: analysis/operating.py's OPERATING_JUDGED
SEARCH_SHARE = 0.75  # of a turn's time, the search's; the fixed-rate runs take the rest (about 60 s a server)
QUIET_S = 60  # the longest a run waits for every server to hold no request
MIN_TURN_S_PER_SERVER = 150  # a calibration and a bracket of a few points per build (75 s left one point of one)


@dataclass(frozen=True)
class ABPlan:
    engines: list[str]
    time_s: float
    threshold: float  # a share
    out: Path
    model: str
    kv_budget: str
    new_engine_args: dict[str, list[str]]
    seed0: int = 0


@dataclass
class Turns:
    """What the turns measured, per turn: each side's judged points and capacity blocks."""

    dirs: list[Path] = field(default_factory=list)  # every run: the searches' and the fixed rates'
    points: list[dict[str, list[Judged]]] = field(default_factory=list)  # per search turn, side name -> points
    fixed: list[dict[str, FixedSide]] = field(default_factory=list)  # per fixed-rate turn, side name -> its point
    target: float = 0.9

    def figures(self, engines: list[str], threshold: float) -> list[ABFigure]:
        out = []
        for e in engines:
            out.append(knee_figure(e, self.points, self.target, threshold))
            out += operating_figures(e, self.fixed, threshold, self.target)
        return out


def serve_args(engine: str, side: str, plan: ABPlan) -> list[str]:
    """A build's serve flags: bench's defaults for the engine (static-max admits unchecked, as make bench serves
    it) and, on NEW's side, --new-engine-args."""
    base = ["--no-preflight"] if engine == "static-max" else []
    return base + (plan.new_engine_args.get(engine, []) if side == "new" else [])


def start(tree: Tree, engine: str, side: str, plan: ABPlan, logs: Path) -> tuple[subprocess.Popen, str]:
    """One build's server on a free loopback port, from the build's own tree; its URL once healthy."""
    model = str(Path(plan.model).resolve())
    cmd = [tree.python, "-m", "harness.cli", "serve", "--engine", engine, "--model", model, "--kv-budget",
           plan.kv_budget, "--port", "0", "--host", "127.0.0.1", "--threads", "2", *serve_args(engine, side, plan)]
    log_path = logs / f"{side_name(engine, side)}.log"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**tree.env(), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree.path)
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"{side_name(engine, side)} did not start (exit {proc.returncode}): {tail(log_path)}")
        found = READY.search(log_path.read_text(errors="replace"))
        if found and healthy(found.group(1)):
            return proc, found.group(1)
        time.sleep(0.3)
    stop(proc)
    raise ServerFailed(f"{side_name(engine, side)} not healthy after {SERVE_TIMEOUT_S} s: {tail(log_path)}")


def side_order(turn: int) -> tuple[str, ...]:
    """ABBA: the builds' order reversed every turn."""
    return SIDES if turn % 2 == 0 else SIDES[::-1]


def side_folder(plan: ABPlan, side: str, fixed: bool = False) -> Path:
    """A build's results folder (its searches), or the one of its fixed-rate runs: bench's layout, so `history`
    and `report` read each build's runs as they read make bench's."""
    return plan.out / (f"{side}-fixed" if fixed else side)


def bench_run(targets: dict[str, str], out: Path, plan: ABPlan, turn: int, what: list[str], label: str,
              limit_s: float) -> Path:
    """This checkout's bench over one build's servers (engine name -> URL), on the turn's seed, `what` its
    measurement, written to `out`."""
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-ab-{out.name}-turn{turn + 1}{label}"
    cmd = [sys.executable, "-m", "harness.cli", "bench", "--engines", "", *what, "--seed", str(plan.seed0 + turn),
           "--out", str(out), "--reports", str(out / "reports"), "--run-id", run_id, "--grace", "5"]
    for name, url in targets.items():
        cmd += ["--target", f"{name}={url}"]
    done = run_child(cmd, ROOT, dict(os.environ), limit_s)
    if done.returncode != 0:
        raise ServerFailed(f"turn {turn + 1}'s bench ({run_id}) failed: {done.last_line}")
    return out / run_id


def build_urls(urls: dict[str, str], engines: list[str], side: str) -> dict[str, str]:
    """One build's servers under their engines' own names: its run is that build's bench of those engines."""
    return {e: urls[side_name(e, side)] for e in engines}


def holding(url: str) -> bool:
    """The server holds a request (running or waiting), by its /stats; a server that does not say counts as idle."""
    stats = fetch_stats(url)
    return stats is not None and (stats.running or 0) + (stats.waiting or 0) > 0


def quiesce(urls: dict[str, str], say: Callable[[str], None]) -> None:
    """Wait until no server of either build holds a request, before a build's run: a search ends on an overloaded
    point and its server decodes what it holds until its steps notice the closed streams, which would fall on the
    next build's run. In A/A runs the second build of a turn read slower in four turns of five (TPOT 3.9x, 2.1x,
    1.4x; then 0.43x and 0.88x with the order reversed)."""
    deadline = time.monotonic() + QUIET_S
    busy = [n for n, u in urls.items() if holding(u)]
    while busy and time.monotonic() < deadline:
        time.sleep(0.5)
        busy = [n for n, u in urls.items() if holding(u)]
    if busy:
        say(f"ab: {', '.join(busy)} still held requests after {QUIET_S} s; measuring anyway")


def search_turn(urls: dict[str, str], plan: ABPlan, turn: int, turn_s: float, turns: Turns,
                say: Callable[[str], None]) -> None:
    """Every engine's knee search, one build's run then the other's (the bench stops itself at --time; the limit
    is a guard)."""
    what = ["--sweep", "--time", f"{turn_s / len(SIDES):.0f}", "--calibrate-duration", "8"]
    points: dict[str, list[Judged]] = {}
    for side in side_order(turn):
        quiesce(urls, say)
        run_dir = bench_run(build_urls(urls, plan.engines, side), side_folder(plan, side), plan, turn, what, "",
                            3 * turn_s + 600)
        meta = RunRecord.read(run_dir)
        own = blocks_of(load_frames(run_dir), meta).get(meta.config.kv_budget, {})
        turns.dirs.append(run_dir)
        points.update({side_name(e, side): judged for e, (_, judged) in own.items()})
        turns.target = meta.config.slo.attainment
    turns.points.append(points)


def fixed_turn(urls: dict[str, str], plan: ABPlan, turn: int, turns: Turns, say: Callable[[str], None]) -> None:
    """Per engine, both builds at the rate they sustain with margin, on the turn's stream, in the turn's order."""
    sides: dict[str, FixedSide] = {}
    for engine in plan.engines:
        rate = margin_rate(engine, turns.points, turns.target)
        if rate is None:
            say(f"ab: turn {turn + 1}: {engine} has no rate both builds sustain with margin yet")
            continue
        what = ["--rates", f"{rate:g}", "--point-requests", str(FIXED_JUDGED), "--point-duration", "10"]
        for side in side_order(turn):
            quiesce(urls, say)
            run_dir = bench_run(build_urls(urls, [engine], side), side_folder(plan, side, fixed=True), plan, turn,
                                what, f"-{engine}-at-{rate:.3g}", 1200)
            summary = Summary.model_validate(json.loads((run_dir / "summary.json").read_text()))
            turns.dirs.append(run_dir)
            requests = load_frames(run_dir)["requests"]
            point = summary.capacity[engine].points[-1]
            sides[side_name(engine, side)] = FixedSide(point, point_requests(requests[requests.engine == engine],
                                                                             point))
    turns.fixed.append(sides)


def measure(base: Tree, new: Tree, plan: ABPlan, say: Callable[[str], None]) -> tuple[Turns, list[ABFigure]]:
    """Serve both builds of every engine, then turns until every figure is decided or the time is spent."""
    servers: list[subprocess.Popen] = []
    urls: dict[str, str] = {}
    turns, figures = Turns(), []
    began = time.monotonic()
    try:
        for engine in plan.engines:
            for side, tree in zip(SIDES, (base, new), strict=True):
                proc, urls[side_name(engine, side)] = start(tree, engine, side, plan, plan.out / "servers")
                servers.append(proc)
        least = MIN_TURN_S_PER_SERVER * len(urls)
        turn_s = max(least, plan.time_s / 2)  # two turns (ABBA) where the time allows
        while True:
            left = plan.time_s - (time.monotonic() - began)
            # BA follows AB whatever the time left (a turn overruns its share by its fixed-rate runs and the
            # bench's own start and finish: at --time 600 the first turn took 337 s and left no second); after
            # that, a turn only where the time left holds one
            if len(turns.points) >= MIN_TURNS and left < least:
                break
            k = len(turns.points)
            this_s = min(turn_s, max(left, least))
            say(f"ab: turn {k + 1}, {this_s:.0f} s, order {', '.join(side_order(k))}")
            search_turn(urls, plan, k, SEARCH_SHARE * this_s, turns, say)
            fixed_turn(urls, plan, k, turns, say)
            figures = turns.figures(plan.engines, plan.threshold)
            say(f"ab: after turn {k + 1}: {overall([f.verdict for f in figures])}")
            # ABBA whole before any verdict: one turn alone (A then B) would read a machine that slowed during it
            # as B's doing (one AB turn read slow-step 1.2 as TPOT 1.95x)
            if k + 1 >= MIN_TURNS and overall([f.verdict for f in figures]) != "INCONCLUSIVE":
                break
    finally:
        for proc in servers:
            stop(proc)
    return turns, figures

