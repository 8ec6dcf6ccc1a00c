"""The load generator's own clock error, side by side with a plain asyncio/aiohttp client in the same run.

Run by hand:  .venv/bin/python benchmarks/loadgen_error.py [--streams 64,256] [--duration 15]

A stub SSE server (no model) stamps when each request arrived and when its first token left. Against it:
- closed loops of N concurrent streams, once from fragbench's load generator and once from a reference
  client written as `vllm bench serve` writes its own (aiohttp, one task per stream); each client's TTFT
  minus the server's TTFT, joined per request, is that client's error;
- the default churn workload (mixed-churn) open-loop at its own rate, from both: late_s is how long after
  its scheduled arrival each request left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
PROBE = """name: ttft-probe
num_requests: {requests}
arrival: {{process: closed, concurrency: {streams}}}
classes:
  - name: probe
    weight: 1
    prompt: {{dist: fixed, value: 16}}
    output: {{dist: fixed, value: 8}}
"""
REFERENCE_SEEDS = 10**9  # the reference client's seeds start here: the stub's stamps tell the clients apart


def stub_server(port: int, stamps: Path) -> None:
    from aiohttp import web

    out = open(stamps, "a", buffering=1)

    async def completions(request: web.Request) -> web.StreamResponse:
        arrived = time.time()
        body = await request.json()
        await asyncio.sleep(0.02)  # "prefill"
        if not body.get("stream", True):
            await asyncio.sleep(0.01 * body["max_tokens"])
            return web.json_response({"choices": [{"index": 0, "text": "x", "token_ids": [5] * body["max_tokens"],
                                                   "finish_reason": "length"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(body["max_tokens"]):
                chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [5],
                                      "finish_reason": "length" if i == body["max_tokens"] - 1 else None}]}
                first = time.time()
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if i == 0:
                    out.write(json.dumps({"seed": body["seed"], "server_ttft_s": first - arrived}) + "\n")
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the workload's cancellations
            pass
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


async def reference_send(session, url: str, body: dict) -> float | None:
    """TTFT as the reference client sees it: from the post to the first data chunk."""
    sent = time.time()
    async with session.post(url, json=body) as resp:
        first = None
        async for chunk in resp.content:
            if first is None and chunk.startswith(b"data: ") and not chunk.startswith(b"data: [DONE]"):
                first = time.time()
        return None if first is None else first - sent


async def reference_closed(url: str, streams: int, duration_s: float) -> pd.DataFrame:
    import aiohttp

    rows, end = [], time.time() + duration_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def stream(i: int) -> None:
            while time.time() < end:
                seed = REFERENCE_SEEDS + i
                body = {"prompt": [5] * 16, "max_tokens": 8, "stream": True, "seed": seed}
                rows.append({"seed": seed, "ttft_s": await reference_send(session, url, body)})
                i += streams

        await asyncio.gather(*(stream(i) for i in range(streams)))
    return pd.DataFrame(rows)


async def reference_open(url: str, requests, duration_s: float) -> list[float]:
    """Each request leaves at its arrival time in a task of its own; how late each left."""
    import aiohttp

    late, tasks, t0 = [], [], time.time()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def send(req) -> None:
            late.append(time.time() - t0 - req.arrival_s)
            body = {"prompt": req.prompt_ids, "max_tokens": req.max_tokens, "stream": True,
                    "seed": REFERENCE_SEEDS + int(req.request_id[1:])}
            await reference_send(session, url, body)

        for req in requests:
            if req.arrival_s >= duration_s:
                break
            await asyncio.sleep(max(0.0, req.arrival_s - (time.time() - t0)))
            tasks.append(asyncio.create_task(send(req)))
        await asyncio.gather(*tasks)
    return late


def fragbench_load(url: str, workload: str, duration_s: float, out: Path) -> pd.DataFrame:
    subprocess.run([sys.executable, "-m", "harness.run.loadgen", "--target", url, "--workload", workload,
                    "--duration", str(duration_s), "--out", str(out), "--grace", "10"],
                   cwd=ROOT, check=True, capture_output=True)
    return pd.read_parquet(out / "requests.parquet")


def error_row(client: str, ttft: pd.DataFrame, server: pd.DataFrame) -> str:
    joined = ttft.dropna(subset=["ttft_s"]).merge(server, on="seed")
    err = (joined.ttft_s - joined.server_ttft_s) * 1e3
    return (f"| {client} | {len(joined):,} | {err.median():.2f} ms | {err.quantile(0.9):.2f} ms "
            f"| {err.quantile(0.99):.2f} ms |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="64,256", help="comma-separated closed-loop stream counts")
    ap.add_argument("--duration", type=float, default=15)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stamps", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return stub_server(args.serve, Path(args.stamps))
    from engines.procs import free_port, spawn, stop
    from workloads.generate import trace
    from workloads.spec import load_spec

    tmp = Path(tempfile.mkdtemp())
    port, stamps = free_port(), tmp / "stamps.jsonl"
    url = f"http://127.0.0.1:{port}"
    server = spawn([sys.executable, __file__, "--serve", str(port), "--stamps", str(stamps)])
    time.sleep(2)
    try:
        print("| client | requests done | client TTFT - server TTFT median | p90 | p99 |\n|---|---|---|---|---|")
        for streams in (int(s) for s in args.streams.split(",")):
            spec = tmp / f"probe-{streams}.yaml"
            # enough for every stream to finish a request each 0.1 s (the stub's own time) for the whole run
            spec.write_text(PROBE.format(streams=streams, requests=int(streams * args.duration * 12) + 1000))
            mine = fragbench_load(url, str(spec), args.duration, tmp / f"load-{streams}")
            mine = mine[mine.status == "ok"].assign(seed=lambda d: d.request_id.str[1:].astype(int))
            ref = asyncio.run(reference_closed(f"{url}/v1/completions", streams, args.duration))
            server_side = pd.read_json(stamps, lines=True)
            print(error_row(f"fragbench load generator, {streams} streams", mine, server_side))
            print(error_row(f"plain aiohttp client, {streams} streams", ref, server_side), flush=True)
        requests = trace(load_spec("mixed-churn"), 0, 2048, 4096).requests
        mine = fragbench_load(url, "mixed-churn", args.duration, tmp / "open")
        ref_late = np.array(asyncio.run(reference_open(f"{url}/v1/completions", requests, args.duration)))
        print(f"\nopen loop, mixed-churn at its own rate for {args.duration:g} s: late_s "
              f"fragbench p50 {mine.late_s.median() * 1e3:.2f} ms, p99 {mine.late_s.quantile(0.99) * 1e3:.2f} ms "
              f"({len(mine)} requests); aiohttp p50 {np.median(ref_late) * 1e3:.2f} ms, "
              f"p99 {np.quantile(ref_late, 0.99) * 1e3:.2f} ms ({len(ref_late)} requests)")
    finally:
        stop(server)


if __name__ == "__main__":
    main()
