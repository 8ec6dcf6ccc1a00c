"""Do the clients users already run work against fragbench's engines, and do they measure what fragbench does?

Run by hand:  .venv/bin/python benchmarks/clients.py [--engine paged] [--seconds 20] [--rate 1]

Installs guidellm and aiperf each in a venv of its own under .venv-clients/ (never in fragbench's), uses
vLLM's `vllm bench serve` where `make vllm` installed it, starts `fragbench serve --engine E`, and runs each
client for --seconds at --rate requests/s in completions and chat modes (64 prompt / 32 output tokens),
then fragbench's own load generator on the same shape. Each row: the client's exit code, the requests the
server completed during it (its /stats finished_total: what reached the engine and came back), and the
client's own last summary lines, beside fragbench's requests and TTFT p50 for the same load.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENVS = ROOT / ".venv-clients"
PINS = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}
PROMPT, OUTPUT = 64, 32


def venv_bin(name: str) -> Path:
    """A client's venv, made and filled on first use."""
    venv = VENVS / name
    if not (venv / "bin" / name).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", PINS[name]], check=True)
    return venv / "bin"


def completed(url: str) -> int:
    with urllib.request.urlopen(f"{url}/stats", timeout=10) as r:
        finished = json.load(r)["finished_total"]
    return sum(v for k, v in finished.items() if k in ("stop", "length"))


def commands(client: str, api: str, url: str, model: str, model_dir: str, seconds: int, rate: float,
             out: Path) -> list[str] | None:
    chat = api == "chat"
    if client == "guidellm":  # guidellm 0.8's kind=... arguments
        return [str(venv_bin("guidellm") / "guidellm"), "run", "--backend",
                f"kind=openai_http,target={url},model={model},request_format=/v1/{'chat/' if chat else ''}completions",
                "--profile", f"kind=constant,rate={rate}", "--constraint", f"kind=max_duration,seconds={seconds}",
                "--tokenizer", f"kind=hf_auto,model={model_dir}",
                "--data", f"kind=synthetic_text,prompt_tokens={PROMPT},output_tokens={OUTPUT}",
                "--output", f"kind=json,path={out / f'guidellm-{api}.json'}", "--disable-console-interactive"]
    if client == "aiperf":
        return [str(venv_bin("aiperf") / "aiperf"), "profile", "--model", model, "--tokenizer", model_dir,
                "--url", url, "--endpoint-type", api, "--streaming",
                "--synthetic-input-tokens-mean", str(PROMPT), "--synthetic-input-tokens-stddev", "0",
                "--output-tokens-mean", str(OUTPUT), "--output-tokens-stddev", "0", "--request-rate", str(rate),
                "--request-count", str(int(seconds * rate)), "--artifact-dir", str(out / f"aiperf-{api}"),
                "--ui-type", "none"]
    vllm = ROOT / ".venv-vllm" / "bin" / "vllm"
    if not vllm.exists():
        return None
    return [str(vllm), "bench", "serve", "--backend", "openai-chat" if chat else "openai", "--base-url", url,
            "--endpoint", "/v1/chat/completions" if chat else "/v1/completions", "--model", model,
            "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", str(PROMPT),
            "--random-output-len", str(OUTPUT), "--num-prompts", str(int(seconds * rate)),
            "--request-rate", str(rate), "--ignore-eos"]


def measured(client: str, api: str, out: Path, stdout: str) -> str:
    """What the client itself reports: requests it counted as successful and its TTFT median."""
    if client == "guidellm":
        m = json.loads((out / f"guidellm-{api}.json").read_text())["benchmarks"][0]["metrics"]
        ttft = m["time_to_first_token_ms"]["successful"]["median"]
        return f"{m['request_totals']['successful']} successful, TTFT p50 {ttft:.0f} ms"
    if client == "aiperf":
        m = json.loads((out / f"aiperf-{api}" / "profile_export_aiperf.json").read_text())
        return f"{m['request_count']['avg']:.0f} requests, TTFT p50 {m['time_to_first_token']['p50']:.0f} ms"
    found = dict(re.findall(r"^(Successful requests|Median TTFT \(ms\)):\s+([0-9.]+)", stdout, re.M))
    return f"{found.get('Successful requests', '?')} successful, TTFT p50 {found.get('Median TTFT (ms)', '?')} ms"


def fragbench_load(url: str, api: str, seconds: int, rate: float, out: Path) -> str:
    spec = out / "shape.yaml"
    spec.write_text(json.dumps({  # YAML reads JSON
        "name": "clients", "num_requests": int(seconds * rate) + 5, "arrival": {"process": "poisson", "rate": rate},
        "classes": [{"name": "fixed", "weight": 1, "prompt": {"dist": "fixed", "value": PROMPT},
                     "output": {"dist": "fixed", "value": OUTPUT}}]}))
    rows = out / f"fragbench-{api}"
    subprocess.run([sys.executable, "-m", "harness.cli", "load", "--target", url, "--workload", str(spec), "--api",
                    api, "--duration", str(seconds), "--out", str(rows)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import pandas as pd

    req = pd.read_parquet(rows / "requests.parquet")
    ok = req[req.status == "ok"]
    return f"{len(ok)} of {len(req)} ok, TTFT p50 {1000 * ok.ttft_s.median():.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="paged")
    ap.add_argument("--model", default="models/tiny-llama")
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--clients", default="guidellm,aiperf,vllm")
    args = ap.parse_args()
    from harness.run.servers import start_server

    out = Path(tempfile.mkdtemp(prefix="fragbench-clients-"))
    model_dir = str(Path(args.model).resolve())
    with start_server(args.engine, args.model, "64MiB", out / "server.log") as srv:
        with urllib.request.urlopen(f"{srv.url}/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        for api in ("completions", "chat"):
            ours = fragbench_load(srv.url, api, args.seconds, args.rate, out)
            print(f"== {args.engine}, {api}: fragbench load: {ours}", flush=True)
            for client in args.clients.split(","):
                cmd = commands(client, api, srv.url, model, model_dir, args.seconds, args.rate, out)
                if cmd is None:
                    print(f"{client:<9} not installed (make vllm)")
                    continue
                before = completed(srv.url)
                run = subprocess.run(cmd, capture_output=True, text=True, cwd=out, timeout=600)
                seen = measured(client, api, out, run.stdout) if run.returncode == 0 else \
                    " | ".join((run.stdout + run.stderr).strip().splitlines()[-3:])[:400]
                print(f"{client:<9} exit {run.returncode}, server completed {completed(srv.url) - before}; "
                      f"the client measured: {seen}", flush=True)
    print(f"outputs in {out}")


if __name__ == "__main__":
    main()
