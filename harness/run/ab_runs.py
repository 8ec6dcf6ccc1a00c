"""`fragbench ab`'s measurement: each engine of each build served from its own work tree, and, per engine, many
short pairs of blocks (harness/run/ab_blocks.py) at one fixed rate well under both builds' knees, the builds'
order alternating pair by pair (AB, BA, ...), each pair a fresh stream both are sent; both builds' servers started
afresh every RESTART_PAIRS pairs, the build started first alternating, and warmed alike; the pairs decided as they
come (harness/analysis/ab.py) until every engine is PASS or a confirmed FAIL, or the time is spent. Then, where
time was given for it, one knee search of each build (this checkout's bench over the build's servers, each build's
run in its own results folder, as make bench writes them), reported beside the gate, never gating it. A failure of
NEW's build (a server that exits, hangs or never starts) FAILs its engine and the rest go on; one of BASE's stops
the run (Measured.error): the caller writes the verdict either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from engines.procs import spawn
from engines.registry import Kind, entry
from harness.analysis.ab import (
    SIDES,
    ABFigure,
    EngineGate,
    Pair,
    instructions_figure,
    side_name,
    side_order,
)
from harness.analysis.ab_instr import instr_ratio, shape_ratios
from harness.analysis.capacity import SLO
from harness.analysis.knee import Judged
from harness.analysis.operating import OPERATING_JUDGED, operating_rate
from harness.analysis.records import RunRecord
from harness.analysis.rundir import load_frames
from harness.analysis.summary import blocks_of
from harness.run.ab_blocks import BlockServer, Crashed, close_server, open_server, run_block
from harness.run.ab_instr_probes import InstrProbeError, instructions
from harness.run.ab_plan import ABPlan, BaseFailed, Measured, engine_args, step_log
from harness.run.loadargs import LoadArgs
from harness.run.servers import ServerFailed, ready_url, tail
from harness.run.speed_probes import reading
from harness.run.stats_poller import fetch_stats
from harness.run.trees import ROOT, Tree, run_child
from harness.sim import stepfit
from workloads.spec import load_spec
from workloads.streams import Streams, snap

SERVE_TIMEOUT_S = 300
INSTR_LIMIT_S = 1800  # one build's instruction count: 510-550 s of CPU here, 18-27 min wall on a loaded machine
QUIET_S = 60  # the longest a block waits for every server to hold no request
BLOCK_LIMIT_S = 90  # a block's judging bound: 30 requests at the slowest rate the check may leave (0.4 req/s)
RATE_CHECKS = 3  # halvings of the rate the check may make before it gives up on an engine
FALLBACK_RPS = 1.0  # an engine the operating table has no rate for starts its check here
WORKLOAD = "mixed-churn"
# Pairs an engine's two servers serve before both are started afresh. A server process carries an offset of its own
# (its heap, its threads' cores, what the other build's start left in the caches) that the order term cannot take
# out and that pairs on one process pair all share: every measured night leaned one way (A/A 0.980, 0.944; issue
# 87). Fresh processes make pairs replicates of the code. 4: even, so each serving holds AB and BA alike; the
# 10 pairs a PASS needs then span three servings; a restart (two starts and a warm-up block each, ~20 s) costs
# about an eighth of four pairs (40-55 s each here), where every 2 pairs would cost a quarter.
RESTART_PAIRS = 4
WARM_JUDGED = 10  # a restarted server's warm-up block, judged by no one: its first requests meet cold code paths


@dataclass
class Serving:
    """The builds' servers, by engine then side, and every live server's URL by its name (engine.side); what a
    (re)start needs (the trees, the traffic), and how many times each engine's servers were started."""

    servers: dict[str, dict[str, BlockServer]] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    trees: dict[str, Tree] = field(default_factory=dict)
    traffic: LoadArgs | None = None
    streams: Streams | None = None
    started: dict[str, int] = field(default_factory=dict)

    def close(self, engine: str) -> None:
        """An engine's servers stopped (a failed NEW's at once: a hung one would hold requests every later block
        waits on, and a live one takes a core from the engines still measured)."""
        for side, server in self.servers.pop(engine, {}).items():
            close_server(server)
            self.urls.pop(side_name(engine, side), None)

    def close_all(self) -> None:
        for engine in list(self.servers):
            self.close(engine)


def start(tree: Tree, engine: str, side: str, plan: ABPlan, logs: Path) -> tuple[subprocess.Popen, str, Path]:
    """One build's server on a free loopback port, from the build's own tree; its URL once healthy."""
    model = str(Path(plan.model).resolve())
    steps = step_log(plan, engine, side)
    cmd = [tree.python, "-m", "harness.cli", "serve", "--engine", engine, "--model", model, "--kv-budget",
           plan.kv_budget, "--port", "0", "--host", "127.0.0.1", "--threads", "2", *engine_args(plan, engine, side),
           *(["--step-log", str(steps)] if steps else [])]
    name = side_name(engine, side)
    log_path = logs / f"{name}.log"  # one log a server, its restarts appended
    logs.mkdir(parents=True, exist_ok=True)
    env = {**tree.env(), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        since = log_path.stat().st_size  # a restart reads its own URL, not the stopped server's before it
        proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree.path)
    try:
        return proc, ready_url(proc, log_path, since, SERVE_TIMEOUT_S), log_path
    except ServerFailed as e:
        raise Crashed(name, side, f"{name} did not start: {e}") from None


def holding(url: str) -> bool:
    """The server holds a request (running or waiting), by its /stats; a server that does not say counts as idle."""
    stats = fetch_stats(url)
    return stats is not None and (stats.running or 0) + (stats.waiting or 0) > 0


def quiesce(urls: dict[str, str], say: Callable[[str], None]) -> None:
    """Wait until no server of either build holds a request before a block: a block's tail, still decoding on one
    build's server, would fall on the other build's block (in A/A runs the second build of a turn read slower in
    four turns of five before the gate waited)."""
    deadline = time.monotonic() + QUIET_S
    busy = [n for n, u in urls.items() if holding(u)]
    while busy and time.monotonic() < deadline:
        time.sleep(0.3)
        busy = [n for n, u in urls.items() if holding(u)]
    if busy:
        say(f"ab: {', '.join(busy)} still held requests after {QUIET_S} s; measuring anyway")


def check_rate(engine: str, servers: dict[str, BlockServer], plan: ABPlan, slo: SLO, urls: dict[str, str],
               say: Callable[[str], None]) -> float | None:
    """The engine's pair rate: the operating table's (FALLBACK_RPS where it has none), checked tonight with one
    block and halved while BASE misses the SLO there (a table drawn on faster nights over-asks a slower one); None
    where BASE misses at every rate tried. Each check's block goes to both builds, the order alternating: BASE's
    alone warmed BASE, and NEW's first requests fell in pair 0 (issue 87). NEW's met share is said, not used."""
    rate = operating_rate(WORKLOAD, int(plan.kv_budget), plan.model, engine) or FALLBACK_RPS
    for attempt in range(RATE_CHECKS + 1):
        met = {}
        for side in side_order(attempt):
            quiesce(urls, say)
            rows = run_block(servers[side], 10_000 + attempt, f"abcheck{attempt}", rate, OPERATING_JUDGED,
                             BLOCK_LIMIT_S)
            rows = answered(servers[side], rows) if side == "new" else rows  # a hung NEW fails here, not later
            met[side] = float(rows.met.mean()) if len(rows) else 0.0
        say(f"ab: {engine}: BASE met {met['base']:.0%} (NEW {met['new']:.0%}) at {rate:g} req/s "
            f"({'kept' if met['base'] >= slo.attainment else 'halved'})")
        if met["base"] >= slo.attainment:
            return rate
        rate = snap(rate / 2)
    return None


def warm(engine: str, servers: dict[str, BlockServer], n: int, rate: float, urls: dict[str, str],
         say: Callable[[str], None]) -> None:
    """A restarted engine's two fresh servers warmed alike before its next pair: one short block of one stream
    each (`abwarm<n>`), in the order they started, judged by no one."""
    for side in side_order(n):
        quiesce(urls, say)
        answered(servers[side], run_block(servers[side], 20_000 + n, f"abwarm{n}", rate, WARM_JUDGED, BLOCK_LIMIT_S))


def pair(engine: str, k: int, servers: dict[str, BlockServer], rate: float, urls: dict[str, str],
         say: Callable[[str], None]) -> Pair:
    """Pair k: stream `ab<k>` to one build then the other, in the pair's order."""
    key, rows = f"ab{k}", {}
    for side in side_order(k):
        quiesce(urls, say)
        rows[side] = answered(servers[side], run_block(servers[side], k, key, rate, OPERATING_JUDGED, BLOCK_LIMIT_S))
    return Pair(engine, k, rate, key, side_order(k), rows["base"], rows["new"])


def answered(server: BlockServer, rows: pd.DataFrame) -> pd.DataFrame:
    """A block's rows, or Crashed where its live server completed none of its judged requests: a hung engine
    (its HTTP loop still up) or one that fails every request is its build's failure, not a slow block (at a rate
    BASE met, 30 requests end in seconds)."""
    if len(rows) and not (rows.status == "ok").any():
        raise Crashed(server.name, server.side, f"{server.name} completed none of its {len(rows)} judged requests "
                                                f"(hung, or failing every request): {tail(server.log)}")
    return rows


def measure(base: Tree, new: Tree, plan: ABPlan, say: Callable[[str], None], m: Measured | None = None) -> Measured:
    """Serve both builds of every engine, check each engine's rate, then pairs engine by engine, round after
    round, until every engine is settled or the time is spent; then the knee turn, where time was given. Into `m`
    (the caller's, so that what was measured survives an error it did not foresee): a failure of NEW's build FAILs
    its engine and the others go on; one of BASE's stops the run with `m.error` set."""
    m = m if m is not None else Measured()
    live = Serving()
    m.speed.append(reading("start"))
    plan.gate_dir.mkdir(parents=True, exist_ok=True)
    try:
        if plan.instructions:  # before any server starts: the two builds' probes take the machine's two cores
            for engine in plan.engines:
                if entry(engine).kind == Kind.SCHEDULED:
                    m.instructions[engine] = counted(engine, base, new, plan, say)
        live.trees = {"base": base, "new": new}
        serve_all(plan, live, m, say)
        check_rates(plan, live, m, say)
        pairs(plan, live, m, say)
        alive = [e for e in plan.engines if e in live.servers and e in m.gates]
        if plan.knee_time_s > 0 and alive:
            knee_turn(live.urls, plan, alive, plan.knee_time_s, m, say)
            after_knee(live, plan, m, say)
        elif plan.knee_time_s > 0:
            m.notes.append("the knee turn skipped: no engine left to search")
    except BaseFailed as e:
        m.error = str(e)
        say(f"ab: could not run: {e}")
    finally:
        live.close_all()
        m.speed.append(reading("end"))
    for engine, gate in m.gates.items():
        logs = {side: step_log(plan, engine, side) for side in SIDES}
        if not gate.crashed and all(p is not None and p.is_file() for p in logs.values()):
            m.steps[engine] = step_figure(engine, logs)
    return m


def serve_all(plan: ABPlan, live: Serving, m: Measured, say: Callable[[str], None]) -> None:
    """Both builds' servers of every engine (live.trees), each under its load generator; an engine whose NEW does
    not start FAILs (its BASE stopped), and BASE's not starting stops the run."""
    live.streams = Streams(load_spec(WORKLOAD), plan.seed0)
    live.traffic = LoadArgs(workload=WORKLOAD, duration_s=plan.time_s + 3600.0, seed=plan.seed0, grace_s=10.0,
                            target="", out=plan.out, t0=time.time())
    for engine in plan.engines:
        try:
            serve(engine, plan, live, m, 0)
        except Crashed as crash:
            live.close(engine)
            m.fail(engine, crash, plan, say)


def serve(engine: str, plan: ABPlan, live: Serving, m: Measured, from_pair: int) -> None:
    """An engine's two servers started, its n-th serving (n from 0): BASE's first at even n, NEW's at odd (the
    first to start loads its model on a machine the other does not yet share; a fixed order put one build first
    every night), each under a load generator of its own writing to blocks/<engine.side>/<n>; Crashed where one
    does not start."""
    n = live.started.get(engine, 0)
    live.started[engine] = n + 1
    live.servers[engine] = {}
    m.servings.append({"engine": engine, "serving": n, "from_pair": from_pair, "first": start_order(n)[0]})
    for side in start_order(n):
        name = side_name(engine, side)
        proc, live.urls[name], log = start(live.trees[side], engine, side, plan, plan.gate_dir / "servers")
        live.servers[engine][side] = open_server(name, side, live.urls[name], proc, log,
                                                 plan.gate_dir / "blocks" / name / str(n), live.traffic,
                                                 live.streams, SLO())


def start_order(n: int) -> tuple[str, ...]:
    """Which build's server starts first at an engine's n-th serving: BASE, NEW, BASE, ..."""
    return side_order(n)


def restarted(engine: str, plan: ABPlan, live: Serving, m: Measured, say: Callable[[str], None]) -> None:
    """An engine's servers stopped and both started afresh (RESTART_PAIRS), the other first this time, and warmed
    alike at the engine's rate; Crashed where NEW's (or BASE's) does not start or fails its warm-up."""
    done = len(m.gates[engine].pairs)
    live.close(engine)
    serve(engine, plan, live, m, done)
    n = live.started[engine] - 1
    say(f"ab: {engine}: both servers started afresh after {done} pairs ({start_order(n)[0].upper()} first)")
    warm(engine, live.servers[engine], n, m.rates[engine], live.urls, say)


def check_rates(plan: ABPlan, live: Serving, m: Measured, say: Callable[[str], None]) -> None:
    """Each served engine's pair rate, checked on BASE (its blocks sent to both builds); an engine's gate opens
    with it (and with its instruction count, or NEW's crash there). NEW's failure in a check FAILs its engine."""
    for engine in [e for e in plan.engines if e in live.servers]:
        try:
            rate = check_rate(engine, live.servers[engine], plan, SLO(), live.urls, say)
        except Crashed as crash:  # BASE's stops the run (BaseFailed)
            m.fail(engine, crash, plan, say)
            live.close(engine)
            continue
        if rate is None:
            m.notes.append(f"{engine}: BASE missed the SLO at every rate checked: no pairs")
            live.close(engine)
            continue
        m.rates[engine] = rate
        gate = m.gates.setdefault(engine, EngineGate(engine, plan.threshold, plan.min_pairs))
        found = m.instructions.get(engine)
        gate.crashed, gate.instructions = (found, None) if isinstance(found, str) else (gate.crashed, found)
        if gate.crashed:
            live.close(engine)


def pairs(plan: ABPlan, live: Serving, m: Measured, say: Callable[[str], None]) -> None:
    """Pairs, engine by engine, round after round, while an engine is unsettled and the pairs' time (--time,
    counted from the first pair: the servers' starts and the rate checks come first) remains; an engine's servers
    started afresh every RESTART_PAIRS of its pairs (their restarts and warm-ups inside its time)."""
    pairs_log = plan.gate_dir / "pairs.jsonl"
    k, began = 0, time.monotonic()
    while (open_ := [e for e, g in m.gates.items() if not g.settled() and e in live.servers]) and \
            time.monotonic() - began < plan.time_s:
        for engine in open_:
            gate = m.gates[engine]
            try:
                if gate.pairs and len(gate.pairs) % RESTART_PAIRS == 0:
                    restarted(engine, plan, live, m, say)
                p = pair(engine, k, live.servers[engine], m.rates[engine], live.urls, say)
            except Crashed as crash:
                m.fail(engine, crash, plan, say)
                live.close(engine)
                continue
            gate.add(p)
            with open(pairs_log, "a") as f:
                f.write(json.dumps({**p.json(), "serving": live.started[engine] - 1}) + "\n")
            d = gate.decisions()["tpot_p50_s"]
            ratio = f"TPOT x{d.ratio:.3f} [{d.ci[0]:.3f}, {d.ci[1]:.3f}]" if d.ci else "TPOT: no interval yet"
            say(f"ab: {engine} pair {k + 1} ({''.join('A' if s == 'base' else 'B' for s in p.order)}): "
                f"{ratio}; {gate.verdict()} ({d.why})")
        k += 1


def after_knee(live: Serving, plan: ABPlan, m: Measured, say: Callable[[str], None]) -> None:
    """The servers once the knee turn is done: NEW's that died under its search FAILs its engine (a crash is
    NEW's whatever load met it); BASE's is a note, the gate already decided without it."""
    for engine, per in list(live.servers.items()):
        for side, server in per.items():
            if server.alive():
                continue
            crash = Crashed(server.name, side, f"{server.name}'s server exited ({server.proc.returncode}) in the "
                                               f"knee turn: {tail(server.log)}")
            if side == "base":
                m.notes.append(f"BASE's {crash} (the gate was decided before it)")
            else:
                m.fail(engine, crash, plan, say)


def step_figure(engine: str, logs: dict[str, Path]) -> ABFigure:
    """The engines' own step time, a diagnostic: each build's steps fitted on their work (harness/sim/stepfit.py:
    decodes, prefill chunks, tokens, context read), both fits priced on BASE's steps; NEW / BASE, reported."""
    try:
        fits = {side: stepfit.load(str(path)) for side, path in logs.items()}
    except stepfit.StepModelError as e:
        return ABFigure(engine, "step_s", None, None, "reported", str(e))
    rows = pd.read_csv(logs["base"])

    def priced(model: stepfit.FittedStepModel) -> float:
        c = model.coefficients
        return float(sum(c[name] * (len(rows) if col is None else rows[col].to_numpy(float).sum())
                         for name, col in stepfit.TERMS.items()))

    base, new = priced(fits["base"]), priced(fits["new"])
    r2 = ", ".join("n/a" if f.fit_r2 is None else f"{f.fit_r2:.2f}" for f in fits.values())
    return ABFigure(engine, "step_s", new / base if base > 0 else None, None, "reported",
                    f"each build's step model (r2 {r2}) priced on "
                    f"BASE's {len(rows)} steps; a diagnostic, not gated", base, new)


# -- the instruction count (gated where measured)


def counted(engine: str, base: Tree, new: Tree, plan: ABPlan, say: Callable[[str], None]) -> ABFigure | str:
    """Each build's engine at the fixed step shapes under callgrind, both at once (harness/run/ab_instr_probes.py):
    the figure, or NEW's crash in words (a FAIL); BASE's crash stops the run (it could not run)."""
    say(f"ab: {engine}: counting the step's instructions in both builds (callgrind: minutes)")
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {side: pool.submit(instructions, tree.path, tree.python, engine, engine_args(plan, engine, side),
                                  plan.model, INSTR_LIMIT_S) for side, tree in zip(SIDES, (base, new), strict=True)}
        readings, why = {}, ""
        for side, run in runs.items():
            try:
                readings[side] = run.result()
            except InstrProbeError as e:
                if e.crashed and side == "new":
                    return f"NEW's {engine} crashed at the instruction count: {e}"
                if e.crashed:
                    raise BaseFailed(f"BASE's {engine} crashed at the instruction count: {e}") from None
                why = f"{side}: {e}"
    if len(readings) < len(SIDES):
        return instructions_figure(engine, None, None, plan.threshold, f"not counted ({why})")
    b, n = readings["base"], readings["new"]
    return instructions_figure(engine, b.instructions, n.instructions, plan.threshold,
                               f"callgrind, {len(b.shapes)} fixed batch shapes; per shape "
                               + ", ".join(f"{k} x{v:.3f}" for k, v in shape_ratios(b, n).items()),
                               ratio=instr_ratio(b, n))


# -- the knee turn (reported)


def bench_run(targets: dict[str, str], out: Path, plan: ABPlan, turn: int, what: list[str], limit_s: float) -> Path:
    """This checkout's bench over one build's servers (engine name -> URL), on the turn's seed, written to `out`."""
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-ab-{out.name}-turn{turn + 1}"
    cmd = [sys.executable, "-m", "harness.cli", "bench", "--engines", "", *what, "--seed", str(plan.seed0 + turn),
           "--out", str(out), "--reports", str(out / "reports"), "--run-id", run_id, "--grace", "5"]
    for name, url in targets.items():
        cmd += ["--target", f"{name}={url}"]
    done = run_child(cmd, ROOT, dict(os.environ), limit_s)
    if done.returncode != 0:
        raise ServerFailed(f"the knee turn's bench ({run_id}) failed: {done.last_line}")
    return out / run_id


def knee_turn(urls: dict[str, str], plan: ABPlan, engines: list[str], time_s: float, m: Measured,
              say: Callable[[str], None]) -> None:
    """Every live engine's knee search, one build's run then the other's, each in that build's results folder
    (`history` reads OUT/new night after night). Reported, never gated: a search that fails is a note."""
    say(f"ab: the knee turn, {time_s:.0f} s (reported, not gated)")
    what = ["--sweep", "--time", f"{time_s / len(SIDES):.0f}", "--calibrate-duration", "8"]
    points: dict[str, list[Judged]] = {}
    for side in SIDES:
        quiesce(urls, say)
        try:
            run_dir = bench_run({e: urls[side_name(e, side)] for e in engines}, plan.out / side, plan, 0, what,
                                3 * time_s + 600)
            meta = RunRecord.read(run_dir)
            own = blocks_of(load_frames(run_dir), meta).get(meta.config.kv_budget, {})
        except Exception as e:  # the search's own failure, whatever it is, must not cost the gate its verdict
            m.notes.append(f"the knee turn's {side} search failed: {last_line(e)}")
            say(f"ab: {m.notes[-1]}")
            continue
        m.dirs.append(run_dir)
        points.update({side_name(e, side): judged for e, (_, judged) in own.items()})
        m.target = meta.config.slo.attainment
    if points:
        m.knee_points.append(points)


def last_line(e: BaseException) -> str:
    """An exception in one line: its type and its message's last line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__
