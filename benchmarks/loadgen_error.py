"""The load generator's own error: client TTFT minus server TTFT at 64 concurrent streams.

Run by hand:  .venv/bin/python benchmarks/loadgen_error.py [--streams 64] [--duration 15]
A stub SSE server (no model) stamps when each request arrived and when its first token left; the load
generator replays a closed loop of 64 streams against it; the two TTFTs are joined per request.
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

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
SPEC = """name: ttft-probe
num_requests: 100000
arrival: {{process: closed, concurrency: {streams}}}
classes:
  - name: probe
    weight: 1
    prompt: {{dist: fixed, value: 16}}
    output: {{dist: fixed, value: 8}}
"""


def stub_server(port: int, stamps: Path) -> None:
    from aiohttp import web

    out = open(stamps, "a", buffering=1)

    async def completions(request: web.Request) -> web.StreamResponse:
        arrived = time.time()
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.02)  # "prefill"
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [5],
                                  "finish_reason": "length" if i == body["max_tokens"] - 1 else None}]}
            if i == 0:
                first = time.time()
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if i == 0:
                out.write(json.dumps({"seed": body["seed"], "server_ttft_s": first - arrived}) + "\n")
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--duration", type=float, default=15)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stamps", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return stub_server(args.serve, Path(args.stamps))
    from engines.procs import free_port

    tmp = Path(tempfile.mkdtemp())
    port, stamps = free_port(), tmp / "stamps.jsonl"
    spec = tmp / "probe.yaml"
    spec.write_text(SPEC.format(streams=args.streams))
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--stamps", str(stamps)])
    time.sleep(2)
    try:
        subprocess.run([sys.executable, "-m", "harness.loadgen", "--target", f"http://127.0.0.1:{port}",
                        "--workload", str(spec), "--duration", str(args.duration), "--out", str(tmp / "load"),
                        "--grace", "5"], cwd=ROOT, check=True, capture_output=True)
    finally:
        server.terminate()
    client = pd.read_parquet(tmp / "load" / "requests.parquet")
    client["seed"] = client.request_id.str[1:].astype(int)
    server_side = pd.read_json(stamps, lines=True)
    joined = client[client.status == "ok"].merge(server_side, on="seed")
    err_ms = (joined.ttft_s - joined.server_ttft_s) * 1e3
    print(f"{len(joined)} requests at {args.streams} concurrent streams: client TTFT - server TTFT "
          f"median {err_ms.median():.2f} ms, p90 {err_ms.quantile(0.9):.2f} ms, p99 {err_ms.quantile(0.99):.2f} ms")


if __name__ == "__main__":
    main()
