"""What a peer is: another serving system (vLLM, an SGLang) that fragbench starts as a child on a private port
and fronts on the asked one, so that bench, check and the report read it as they read an in-house engine.

A peer says how it starts, whether it is healthy, which models it lists, which Prometheus family its
/metrics exports and how that reads as fragbench's /stats, and how it stops. The proxy in front of it is
the same for every peer: /v1/completions (with the peer's own request defaults), /metrics, /health and
/v1/models passed through, /stats built from its metrics; served by `engines.procs.serve_app`, the loop the
in-house server runs too. Adding a peer is its module here (a `Peer`) and one entry in engines/registry.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from pathlib import Path

import aiohttp
from aiohttp import web

from engines.procs import serve_app
from engines.registry import entry

STARTUP_TIMEOUT_S = 900  # a peer compiling its kernels on first start takes minutes


class PeerUnavailable(ValueError):
    """A peer that cannot serve this: not installed, no model, a budget under one sequence, or it would not start."""


class Peer(ABC):
    """One peer process and what the proxy needs of it. `url` is where the child answers (its private port)."""

    name: str  # its registry name
    metrics_family: str  # the Prometheus family its /metrics exports (harness/run/telemetry.py reads it too)
    url: str
    model_name: str  # the id its /v1/models lists and every request names

    @classmethod
    @abstractmethod
    def installed(cls) -> bool:
        """Whether its software is on this machine (bench refuses it up front when not)."""

    @classmethod
    @abstractmethod
    def of(cls, model_dir: str, kv_budget_bytes: int, max_seq_len: int | None, block_size: int) -> Peer:
        """The peer for a model directory and fragbench's KV budget; PeerUnavailable with one sentence."""

    @abstractmethod
    def start(self) -> None:
        """Spawn the child (engines.procs.spawn: its own process group, dying with us)."""

    @abstractmethod
    def exited(self) -> int | None:
        """The child's exit code once it has exited, else None."""

    @abstractmethod
    def stop(self) -> None:
        """The child and every process it started, gone."""

    @abstractmethod
    def stats(self, metrics_text: str) -> dict:
        """fragbench's /stats fields, read from one page of the peer's own Prometheus metrics."""

    def request_defaults(self) -> dict:
        """Fields set on every completion body that does not set them (what the bench's client reads)."""
        return {}

    async def healthy(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(f"{self.url}/health") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    async def models(self, session: aiohttp.ClientSession) -> list[str]:
        """The model ids its /v1/models lists."""
        async with session.get(f"{self.url}/v1/models") as r:
            return [m["id"] for m in (await r.json()).get("data", [])]

    async def wait_healthy(self, session: aiohttp.ClientSession, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (code := self.exited()) is not None:
                raise RuntimeError(f"{self.name} exited with {code} before it was healthy")
            if await self.healthy(session):
                return
            await asyncio.sleep(1)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s")


def proxy_app(peer: Peer, session: aiohttp.ClientSession) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if isinstance(body, dict):
                body = {"model": peer.model_name, **peer.request_defaults(), **body}
                raw = json.dumps(body).encode()
        except ValueError:
            pass  # the peer answers malformed bodies itself
        async with session.post(f"{peer.url}/v1/completions", data=raw,
                                headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get(
                "Content-Type", "application/json")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def passthrough(request: web.Request) -> web.Response:
        async with session.get(f"{peer.url}{request.path}") as up:
            return web.Response(body=await up.read(), status=up.status,
                                content_type=up.content_type if up.content_type != "application/octet-stream"
                                else "text/plain")

    async def stats(request: web.Request) -> web.Response:
        async with session.get(f"{peer.url}/metrics") as up:
            return web.json_response(peer.stats(await up.text()))

    app = web.Application(client_max_size=2**20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", passthrough)
    app.router.add_get("/health", passthrough)
    app.router.add_get("/v1/models", passthrough)
    app.router.add_get("/stats", stats)
    return app


async def run(peer: Peer, host: str, port: int) -> None:
    peer.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            await peer.wait_healthy(session)

            def ready(bound: int) -> None:
                print(f"fragbench serve: {peer.name} on http://{host}:{bound}", flush=True)

            await serve_app(proxy_app(peer, session), host, port, ready)
    finally:
        peer.stop()


def serve_peer(name: str, model_dir: str, kv_budget_bytes: int, max_seq_len: int | None, block_size: int,
               host: str, port: int) -> int:
    """Run the peer of that registry name behind the proxy until stopped. Raises PeerUnavailable with one
    sentence."""
    known = entry(name)
    cls: type[Peer] = known.peer_class()
    if not cls.installed():
        raise PeerUnavailable(f"{name} is not installed: run `{known.install}`")
    if not (Path(model_dir) / "config.json").is_file():
        raise PeerUnavailable(f"--model {model_dir!r} is not a model directory (no config.json)")
    peer = cls.of(model_dir, kv_budget_bytes, max_seq_len, block_size)
    try:
        asyncio.run(run(peer, host, port))
    except RuntimeError as e:
        raise PeerUnavailable(str(e)) from None
    except KeyboardInterrupt:  # SIGTERM (SystemExit) and Ctrl-C unwind through run(), which stops the peer's group
        pass
    return 0


__all__ = ["Peer", "PeerUnavailable", "proxy_app", "serve_peer"]
