"""One aiohttp app for every in-house engine: OpenAI-compatible completions, /metrics, /stats, /health.

The engine lives in its own thread and is only ever touched there: handlers send it commands (add,
abort, snapshot) through a queue that it drains between steps and, for the naive engine, inside its
long batches. A client that disconnects aborts its request; the engine frees its KV in that step.

Failures: an error while serving one sequence fails its request alone (a 500 body, or an error event on
its stream). An error the engine cannot pin on a sequence ends every open request with an error at once
(no client waits more than one event-loop turn for it), /health answers 503 from then on, and the process
exits with ENGINE_ERROR_EXIT_CODE after FAIL_GRACE_S so that whoever supervises it restarts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from engines.api.metrics import MetricsCollector
from engines.api.openai import MAX_BODY_BYTES, OpenAIRoutes, error_response
from engines.api.stats import StatsPayload
from engines.api.validation import InvalidRequest
from engines.engine import Engine, Request, TokenEvent
from engines.memory.allocstats import allocator_stats
from engines.memory.cuda import device_snapshot
from engines.memory.snapshot import write_state
from engines.oom import EngineCrash
from engines.percentile import percentile
from engines.procs import serve_app
from engines.step_faults import StepFault

CRASH_EXIT_CODE = 70  # the naive engine died of an OOM (--on-oom crash)
ENGINE_ERROR_EXIT_CODE = 71  # the engine raised an error no single request owns
FAIL_GRACE_S = 1.0  # failed responses get this long to reach their clients before the process exits


class InjectedFault(RuntimeError):
    """`serve --fail-at-step N`: an engine-wide error on purpose, to test supervisors (bench, systemd)."""


def injected_crash(step: int) -> None:
    """`serve --crash-after N`: the process killed at once, as a segfault or the kernel's OOM killer ends it: no
    request is answered, no exit handler runs; one line on stderr says it was on purpose."""
    print(f"fragbench-injected-crash at step {step}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Stream:
    """Per-request state on the HTTP side; events arrive from the engine thread."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)


class EngineThread:
    def __init__(self, engine: Engine, on_crash: Callable[[EngineCrash], None], on_fatal: Callable[[str], None],
                 fail_at_step: int | None = None, oom_snapshot: Path | None = None, slow_step: float = 1.0,
                 crash_after: int | None = None):
        self.engine = engine
        # serve --slow-step for an engine whose step is not fragbench's (hf, hf-cb): a sleep after it; a scheduled
        # engine sleeps inside its own step instead (engines/step_faults.py), and serve gives this 1 then
        self.after_step = StepFault(slow=slow_step)
        self.oom_snapshot = oom_snapshot  # where the (emulated) CUDA allocator's segments at the first OOM go, once
        self.on_crash = on_crash
        self.on_fatal = on_fatal
        self.fail_at_step = fail_at_step
        self.crash_after = crash_after
        self.failure: str | None = None  # set once the engine cannot serve
        self.last_stats = StatsPayload()
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, Stream] = {}
        self.started_s = time.monotonic()
        engine.sink = self._deliver
        engine.poll = self.poll
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.stopping = False
        self.observe: Callable[[TokenEvent], None] = lambda event: None  # the request histograms (metrics.py)
        self.stepped: Callable[[], None] = lambda: None  # after each step: the step's batch gauge

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.commands.put(("wake",))
        self.thread.join(timeout=5)
        getattr(self.engine, "close", lambda: None)()

    # -- commands, callable from any thread
    def submit(self, request: Request, stream: Stream) -> None:
        self.commands.put(("add", request, stream))

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id, time.monotonic(), self.engine.steps))

    async def snapshot(self, releases: bool = False, maps: bool = False) -> StatsPayload:
        """The engine's stats, taken between steps on its thread; the memory maps only when asked (`maps`):
        a real model's pool has tens of thousands of blocks, and the samplers ask ten times a second."""
        if self.failure is not None:  # nobody is left to answer: the last snapshot, marked
            return self.last_stats.model_copy(update={"engine_error": self.failure})
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.commands.put(("snapshot", loop, fut, releases, maps))
        return await asyncio.wait_for(fut, timeout=30)

    # -- the engine thread
    def _run(self) -> None:
        try:
            while not self.stopping:
                self.poll()
                if self.engine.has_work():
                    began = time.perf_counter()
                    self.engine.step()
                    self.after_step.sleep_after(began)
                    self.stepped()
                    self.save_oom_snapshot()
                    if self.fail_at_step is not None and self.engine.steps >= self.fail_at_step:
                        raise InjectedFault(f"injected engine error at step {self.engine.steps}")
                    if self.crash_after is not None and self.engine.steps >= self.crash_after:
                        injected_crash(self.engine.steps)
                else:
                    try:
                        self._handle(self.commands.get(timeout=0.05))
                    except queue.Empty:
                        pass
        except EngineCrash as crash:  # the naive server's OOM: it goes down at once, as it would on a GPU
            self.failure = f"engine crashed on a KV allocation ({crash.event.cause})"
            self.on_crash(crash)
        except Exception as err:  # the engine, not one request, is broken
            self._fail(f"{type(err).__name__}: {err}")
        finally:
            if not self.stopping and self.failure is None:
                self._fail("the engine thread ended")

    def save_oom_snapshot(self) -> None:
        """The cuda (or caching) memory's snapshot at its first OOM, to its file (serve --oom-snapshot; a .pickle
        name: PyTorch's format), written once:
        an engine that crashes on that OOM (--on-oom crash) writes it before it goes down."""
        segments = getattr(self.engine.memory, "first_oom_snapshot", None)
        if self.oom_snapshot is None or segments is None or self.oom_snapshot.exists():
            return
        self.oom_snapshot.parent.mkdir(parents=True, exist_ok=True)
        t_s = round(time.monotonic() - self.started_s, 3)
        if self.oom_snapshot.suffix == ".pickle":  # torch.cuda.memory._snapshot()'s format: _memory_viz reads it
            write_state({"segments": segments, "device_traces": [[]], "t_s": t_s}, self.oom_snapshot)
            return
        self.oom_snapshot.write_text(json.dumps({"t_s": t_s, "segments": segments}))

    def _fail(self, message: str) -> None:
        self.failure = message[:500]
        self.last_stats.engine_errors = 1
        self.streams.clear()
        self.on_fatal(self.failure)

    def poll(self) -> None:
        while True:
            try:
                self._handle(self.commands.get_nowait())
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request, stream = cmd
            self.streams[request.request_id] = stream
            self.engine.add_request(request)
        elif kind == "abort":
            _, request_id, at, steps_at = cmd
            if request_id in self.streams:
                self.engine.abort(request_id, requested_at=at, steps_at=steps_at)
        elif kind == "snapshot":
            _, loop, fut, releases, maps = cmd
            data = self._snapshot()
            if releases:
                data = data.model_copy(update={"abort_release_s": list(self.engine.abort_release_s)})
            if maps:  # validated, not copied in: the maps' entries are records of their own
                data = StatsPayload.model_validate({**data.written(), **self._maps()})
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(data))

    def _snapshot(self) -> StatsPayload:
        self.last_stats = StatsPayload.model_validate(self._stats())  # typed once, here; sent as it was built
        return self.last_stats

    def _maps(self) -> dict:
        """The memory map now (runs of blocks, or extents) and the maps taken at fragmentation OOMs."""
        return {"memory_map": self.engine.memory_map(),
                "fragmentation_oom_maps": [{"t_s": t - self.started_s, "event": e.__dict__, "memory_map": mm}
                                           for t, e, mm in self.engine.fragmentation_maps]}

    def _stats(self) -> dict:
        stats = self.engine.stats().to_json()
        device = device_snapshot(getattr(self.engine, "device", "cpu"))
        stats.update(asdict(device))
        stats.update(allocator_stats(self.engine, device))  # the caching emulator's (memory/allocstats.py)
        releases = sorted(self.engine.abort_release_s)
        stats.update(
            t_s=time.monotonic() - self.started_s,
            finished_total=dict(self.engine.finished_total),
            oom_events=[
                {"t_s": t - self.started_s, **e.__dict__, **ctx} for t, e, ctx in self.engine.oom_events[-100:]
            ],
            abort_release_count=len(releases),
            abort_release_p50_s=percentile(releases, 0.5),
            abort_release_p99_s=percentile(releases, 0.99),
            abort_release_max_s=releases[-1] if releases else None,
            abort_release_p99_steps=percentile(self.engine.abort_release_steps, 0.99),
            threads=threading.active_count(),
            engine_errors=0,
            engine_config=getattr(self.engine, "config", dict)(),
            fragmentation_oom_maps_count=len(self.engine.fragmentation_maps),
        )
        return stats

    def _deliver(self, event: TokenEvent) -> None:
        self.observe(event)
        stream = self.streams.get(event.seq.request_id)
        if stream is None:
            return
        if event.request_done:
            del self.streams[event.seq.request_id]
        stream.loop.call_soon_threadsafe(stream.events.put_nowait, event)


class CompletionServer:
    def __init__(self, engine: Engine, tokenizer, model_name: str, api_key: str | None = None,
                 fail_at_step: int | None = None, model_root: str | None = None, oom_snapshot: Path | None = None,
                 slow_step: float = 1.0, crash_after: int | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_root = model_root or model_name  # where the model loads from (vLLM's `root`)
        self.created = int(time.time())
        self.routes = OpenAIRoutes(self)
        self.api_key = api_key
        self.thread = EngineThread(engine, self._crashed, self._failed, fail_at_step, oom_snapshot, slow_step,
                                   crash_after)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead: asyncio.Event | None = None  # set on the loop when the engine fails
        self.metrics = MetricsCollector(self.routes.ignored, engine)
        self.thread.observe, self.thread.stepped = self.metrics.requests.on_event, self.metrics.requests.on_step
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.metrics)
        # what must be written before the process leaves through os._exit, which skips every `finally` and atexit
        # (serve --record-memory-history's trace: the crash is the event it records for)
        self.before_exit: list[Callable[[], None]] = []

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._json_errors, self._auth])
        app.router.add_post("/v1/completions", self.routes.completions)
        app.router.add_post("/v1/chat/completions", self.routes.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/health", self.health)
        app.router.add_get("/memory_snapshot", self.memory_snapshot)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.loop, self.dead = asyncio.get_running_loop(), asyncio.Event()
        self.thread.start()

    async def _stop(self, app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.thread.stop)

    def _crashed(self, crash: EngineCrash) -> None:
        """A naive server dies on OOM: say why on one line, then go down hard."""
        _, _, context = self.engine.oom_events[-1] if self.engine.oom_events else (0, None, {})
        self.thread.save_oom_snapshot()
        print("fragbench-crash " + json.dumps({**crash.event.__dict__, **context}), file=sys.stderr, flush=True)
        self._exit(CRASH_EXIT_CODE)

    def _failed(self, message: str) -> None:
        """From the engine thread: end every open request now, then exit so a supervisor restarts us."""
        print("fragbench-engine-error " + json.dumps({"error": message}), file=sys.stderr, flush=True)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.dead.set)
        threading.Timer(FAIL_GRACE_S, self._exit, [ENGINE_ERROR_EXIT_CODE]).start()

    def _exit(self, code: int) -> None:
        """Down hard (a supervisor restarts us), once what before_exit writes is written: one that fails says so
        on one line and the rest still run."""
        for write in self.before_exit:
            try:
                write()
            except Exception as e:  # the exit code is what the supervisor reads: nothing may stop it
                print(f"fragbench serve: before exit: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(code)

    @web.middleware
    async def _json_errors(self, request: web.Request, handler):
        """Unknown routes and methods answer OpenAI's error object, not aiohttp's plain text."""
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return error_response(InvalidRequest(f"no route {request.path}", None, status=404))
        except web.HTTPMethodNotAllowed as e:
            return error_response(InvalidRequest(f"{request.method} is not allowed on {request.path} (allowed: "
                                                 f"{', '.join(sorted(e.allowed_methods))})", None, status=405))

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.path != "/health":
            if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
                err = InvalidRequest("missing or wrong API key", "authorization", status=401)
                return error_response(err)
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        alive = self.thread.thread.is_alive() and self.thread.failure is None
        body = {"status": "ok"} if alive else {"status": "down", "error": self.thread.failure}
        return web.json_response(body, status=200 if alive else 503)

    def _oom_snapshot(self) -> list[dict] | None:
        """The CUDA caching allocator's segments at the engine's first OOM (the cuda memory mode only)."""
        return getattr(self.engine.memory, "first_oom_snapshot", None)

    async def memory_snapshot(self, request: web.Request) -> web.Response:
        segments = self._oom_snapshot()
        if segments is None:
            return error_response(InvalidRequest("no OOM snapshot: the cuda memory mode takes one at its first "
                                                 "OOM", "memory_snapshot", status=404))
        return web.json_response({"segments": segments})

    async def models(self, request: web.Request) -> web.Response:
        """As vLLM's: the served name, where it loads from, its context."""
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "fragbench",
            "root": self.model_root, "parent": None, "max_model_len": self.engine.max_seq_len, "permission": []}]})

    async def stats(self, request: web.Request) -> web.Response:
        """GET /stats: the engine's state; `?map=1` adds its memory map and the maps of its fragmentation
        OOMs, `?releases=1` every cancel's release time."""
        snap = await self.thread.snapshot(releases="releases" in request.query, maps="map" in request.query)
        snap = snap.model_copy(update={"asyncio_tasks": len(asyncio.all_tasks()),
                                       "oom_snapshot": self._oom_snapshot() is not None})
        return web.json_response(snap.written())

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.stats = await self.thread.snapshot()
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    def stream(self, loop: asyncio.AbstractEventLoop) -> Stream:
        return Stream(loop)


async def serve(server: CompletionServer, host: str, port: int, ready: Callable[[int], None]) -> None:
    await serve_app(server.app(), host, port, ready)
