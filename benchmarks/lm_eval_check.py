"""Does EleutherAI's lm-evaluation-harness run against fragbench's engines, and are its log-likelihoods the
model's? lm-eval's `local-completions` (in a venv of its own under .venv-clients/, never fragbench's) runs a
log-likelihood task, a multiple-choice task and a generate_until task (benchmarks/lm_eval_tasks/, local json:
no hub) against each engine's server; every per-item log-likelihood it logged is compared with one
transformers forward of the same model over the same tokens.

Run by hand:  .venv/bin/python benchmarks/lm_eval_check.py [--engines paged,static-oracle,hf] [--model DIR]

Prints, per engine: lm-eval's exit code, each task's metrics, the largest |lm-eval's log-likelihood -
transformers'| over every item (a pass is under 1e-3), and how many generate_until answers equal transformers'
greedy text. Exit 1 if any engine failed a task, missed that bound or answered another text.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.run.servers import start_server  # noqa: E402

VENV = ROOT / ".venv-clients" / "lm-eval"
PIN = "lm-eval[api]==0.4.13"
# lm-eval tokenizes with transformers (tokenized_requests): the same release fragbench serves with
TOKENIZER_PIN = "transformers==5.24.0"
TASKS = ROOT / "benchmarks" / "lm_eval_tasks"
BOUND = 1e-3


def lm_eval() -> Path:
    """lm-eval's venv, made on first use: the CPU torch first (an unpinned one would pull a CUDA build)."""
    exe = VENV / "bin" / "lm_eval"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "torch==2.13.0"], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", PIN, TOKENIZER_PIN], check=True)
    return exe


def task_dir(out: Path) -> Path:
    """The task files with their data paths made absolute."""
    d = out / "tasks"
    d.mkdir(parents=True, exist_ok=True)
    for f in TASKS.iterdir():
        text = f.read_text().replace("DATA/", f"{d}/") if f.suffix == ".yaml" else f.read_text()
        (d / f.name).write_text(text)
    return d


def reference(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def loglikelihood(context: list[int], continuation: list[int]) -> float:
        ids = context + continuation
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return float(sum(lp[len(context) + i - 1, t] for i, t in enumerate(continuation)))

    def greedy(context: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([context]), max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(context):].tolist()

    return loglikelihood, greedy


def samples(out: Path) -> list[dict]:
    rows = []
    for path in out.rglob("samples_*.jsonl"):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def run(engine: str, model: str, out: Path, ll, greedy) -> tuple[bool, str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    with start_server(engine, model, "64MiB", out / f"{engine}.log", extra=["--max-seq-len", "512"]) as srv:
        args = [str(lm_eval()), "--model", "local-completions", "--model_args",
                f"base_url={srv.url}/v1/completions,tokenizer={model},tokenizer_backend=huggingface,"
                "tokenized_requests=True,num_concurrent=1,max_retries=1,model=tiny",
                "--tasks", "fb_ll,fb_mc,fb_gen", "--include_path", str(task_dir(out)), "--log_samples",
                "--output_path", str(out / engine), "--batch_size", "4"]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        return False, f"lm_eval exited {r.returncode}: {r.stderr.strip().splitlines()[-1:]}"
    worst, items, same, generated = 0.0, 0, 0, 0
    for s in samples(out / engine):
        if s["doc"].get("answer") is not None:  # generate_until: its text against transformers' greedy text
            context = s["arguments"]["gen_args_0"]["arg_0"]
            want = tok.decode(greedy(tok(context, add_special_tokens=True).input_ids, 8)).split("\n")[0]
            same, generated = same + (s["resps"][0][0] == want), generated + 1
            continue
        for (args_, resp) in zip(s["arguments"].values(), s["resps"], strict=False):
            context, continuation = args_["arg_0"], args_["arg_1"]
            got = float(resp[0][0])
            want = ll(tok(context, add_special_tokens=True).input_ids, tok(continuation, add_special_tokens=False)
                      .input_ids)
            worst, items = max(worst, abs(got - want)), items + 1
    results = next((json.loads(p.read_text()) for p in (out / engine).rglob("results_*.json")), {})
    metrics = {t: {k: v for k, v in m.items() if "stderr" not in k and k != "alias"}
               for t, m in results.get("results", {}).items()}
    ok = worst < BOUND and items > 0 and same == generated > 0 and set(metrics) >= {"fb_ll", "fb_mc", "fb_gen"}
    return ok, (f"{items} log-likelihoods, largest |lm-eval - transformers| {worst:.2e}; generate_until equal to "
                f"transformers' greedy text {same} of {generated}; metrics {metrics}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="paged,static-oracle,hf")
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="lm-eval-"))
    ll, greedy = reference(args.model)
    failed = 0
    for engine in args.engines.split(","):
        ok, what = run(engine, args.model, out, ll, greedy)
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {engine}: {what}", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
