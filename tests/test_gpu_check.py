"""scripts/gpu_check.py, the release check, read on a CPU: the runner (each item in a child under its limit, one
line each, the JSON, the exit codes, --item), the rules its items apply (greedy near-ties, the causes of torch's
own OOMs on the emulated device, the churn recording kept in the repository only when asked)."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import scripts.gpu_check as gpu_check
import scripts.gpu_items as items
from tests.conftest import ROOT
from tests.test_cuda_counts import device  # noqa: F401 (the emulated CUDA device, a fixture)

MiB = 2**20
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")

CHILD = """
import json, sys, time
verdict, result = sys.argv[1], sys.argv[2]
if verdict == "hang":
    time.sleep(60)
if verdict == "crash":
    sys.exit("Segmentation fault, as a dying driver says it")
json.dump({"item": sys.argv[3], "verdict": verdict, "detail": f"{verdict} detail", "seconds": 0.5,
           "figures": {"tokens_per_s": 12.5}}, open(result, "w"))
"""


@pytest.fixture
def fake_items(monkeypatch, tmp_path):
    """Items whose children answer as told (pass, fail, absent), die, or hang past a 1 s limit."""
    plan = {"a": "pass", "b": "fail", "c": "crash", "d": "hang", "e": "absent"}
    monkeypatch.setattr(gpu_check, "ITEMS", {k: gpu_check.Item(f"item {k}", None, 1 if v == "hang" else 60)
                                             for k, v in plan.items()})
    monkeypatch.setattr(gpu_check, "child_command",
                        lambda key, args, result: [sys.executable, "-c", CHILD, plan[key], str(result), key])
    return Namespace(out=str(tmp_path), json=str(tmp_path / "gpu-check.json"), model="m", keep_fixture=False)


def test_each_item_runs_in_its_child_with_its_limit_and_the_json_holds_every_verdict(fake_items, capsys):
    assert gpu_check.run(list(gpu_check.ITEMS), fake_items) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[0] for x in lines[:5]] == ["PASS", "FAIL", "FAIL", "FAIL", "ABSENT"]
    assert "exited 1 without a result: Segmentation fault" in lines[2] and "no answer in 1 s" in lines[3]
    body = json.loads((ROOT / fake_items.json).read_text())
    assert body["failed"] == ["b", "c", "d"] and body["passed"] == 1 and body["absent"] == 1
    first = body["items"][0]
    assert (first["verdict"], first["figures"], first["seconds"]) == ("pass", {"tokens_per_s": 12.5}, 0.5)
    assert lines[-1] == f"gpu-check: 1 passed, 3 failed, 1 absent; {fake_items.json}"


@pytest.mark.parametrize("keys, code", [(["a"], 0), (["a", "e"], 0), (["e"], 1), (["a", "b"], 1)])
def test_it_exits_0_only_when_every_item_that_ran_passed(fake_items, keys, code):
    """An absent item (vLLM not installed) is not counted; a run where nothing passed is no pass."""
    assert gpu_check.run(keys, fake_items) == code


def test_item_runs_that_item_alone_in_its_child(fake_items, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "one.json"
    assert gpu_check.main(["--item", "a", "--out", str(tmp_path), "--json", str(out)]) == 0
    assert [i["item"] for i in json.loads(out.read_text())["items"]] == ["a"]
    assert gpu_check.main(["--item", "b", "--out", str(tmp_path), "--json", str(out)]) == 1


@no_cuda
@pytest.mark.parametrize("argv", [[], ["--item", "churn"]])
def test_without_cuda_it_exits_2_in_one_line_and_writes_nothing(argv, tmp_path):
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path), *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no CUDA device" in r.stderr
    assert not list(tmp_path.iterdir())


def test_an_unknown_item_is_bad_input_in_one_line(capsys):
    assert gpu_check.main(["--item", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no item 'nope'" in err[0] and "real-oom" in err[0]


# -- the rules the items apply
def logits(*pairs: tuple[int, float]) -> torch.Tensor:
    row = torch.zeros(10)
    for token, value in pairs:
        row[token] = value
    return row


def test_greedy_agreement_allows_a_near_tie_and_nothing_else():
    """transformers chose 3 over 4 by 2e-5 (the CPU case): an engine that picks 4 agrees, and what follows is of
    another context. A token 0.5 below is wrong; so is a sequence cut short."""
    steps = [logits((1, 5.0)), logits((3, 7.00002), (4, 7.0)), logits((2, 1.0))]
    assert items.greedy_agreement([1, 3, 2], steps, [1, 3, 2], 1e-3) is None
    assert items.greedy_agreement([1, 3, 2], steps, [1, 4, 9], 1e-3) == 1
    with pytest.raises(AssertionError, match="step 0: token 2 where transformers chose 1, 5.00e\\+00 below"):
        items.greedy_agreement([1, 3, 2], steps, [2, 3, 2], 1e-3)
    with pytest.raises(AssertionError, match="2 tokens where transformers gave 3"):
        items.greedy_agreement([1, 3, 2], steps, [1, 3], 1e-3)


def test_the_real_oom_item_judges_torchs_own_refusals_on_the_emulated_device(device):  # noqa: F811
    events = items.real_oom_causes()
    assert (events["full"].cause, events["holes"].cause) == ("capacity", "fragmentation")
    assert "truly full is capacity" in items.check_real_oom(None)[0]


def test_the_churn_recording_enters_the_repository_only_when_asked(tmp_path, monkeypatch):
    """The churn item, its server faked (it writes a recording when stopped): the cut recording stays in OUT;
    --keep-fixture alone writes tests/fixtures/. Before, the fixture was rewritten whatever the item found."""
    from tests.test_allocator_replay import synthetic_snapshot

    fixture = tmp_path / "fixtures" / "gpu_hf_churn_snapshot.pickle"
    monkeypatch.setattr(items, "CHURN_FIXTURE", fixture)

    def server(engine, model, budget, log, timeout_s, alloc_conf, extra):
        recorded = extra[extra.index("--record-memory-history") + 1]
        return SimpleNamespace(url="http://fake", stop=lambda timeout_s: synthetic_snapshot(recorded, 200, 80 * MiB))

    monkeypatch.setattr(items, "start_server", server)
    monkeypatch.setattr(items, "drive_churn", lambda url, bodies, timeout_s: len(bodies))
    for keep in (False, True):
        out = tmp_path / f"out-{keep}"
        args = Namespace(out=str(out), model="m", keep_fixture=keep, limit_s=gpu_check.ITEMS["churn"].limit_s)
        with pytest.raises(AssertionError, match="segment events reproduced"):  # no cap recorded: mismatches
            items.check_churn_replay(args)
        assert fixture.exists() == keep and (out / "churn" / fixture.name).exists() != keep


def test_the_decode_rate_item_measures_both_engines(tiny_model):
    rates = items.decode_rates(str(tiny_model), "cpu", tokens=4)
    assert set(rates) == {"paged", "static"} and min(rates.values()) > 0


# -- issue 80, 6: the GPU's default dtype through the kernel and vllm items; no report written into the checkout
def test_the_kernel_item_checks_the_tiny_model_in_bf16_beside_fp32(tiny_model, tmp_path, monkeypatch):
    seen = []

    def error(model, on):
        cfg = json.loads((Path(model) / "config.json").read_text())
        seen.append(cfg.get("dtype") or cfg.get("torch_dtype"))
        return 0.0, "torch path"

    monkeypatch.setattr(items, "decode_attention_error", error)
    line, figures = items.check_kernel(Namespace(model=str(tiny_model), out=str(tmp_path)))
    assert seen == ["float32", "bfloat16"] and "(bf16)" in line and figures["max_abs_error_bf16"] == 0.0


def test_the_bf16_decode_attention_is_held_to_its_reference_and_a_wrong_one_is_caught(tmp_path, monkeypatch):
    """The comparison itself in bf16, on the CPU (the torch path: no compiled kernel for bf16): within the
    tolerance, and a wrong attention far past it."""
    from engines.scheduled import model

    bf16 = str(items.bf16_tiny_model(Namespace(out=str(tmp_path))))
    worst, path = items.decode_attention_error(bf16, "cpu")
    assert worst < items.BF16_ATTENTION_TOLERANCE and "kernel" not in path
    monkeypatch.setattr(model.ModelRunner, "_decode_attention", lambda self, q, store, b: q * 0)
    assert items.decode_attention_error(bf16, "cpu")[0] > 10 * items.BF16_ATTENTION_TOLERANCE


class Ran(Exception):
    """The inner run's command, stopped before it runs."""


@pytest.mark.parametrize("key", ["bench", "vllm"])
def test_the_bench_and_vllm_items_write_their_reports_into_out_not_the_checkout(key, tiny_model, tmp_path,
                                                                               monkeypatch):
    def run_bounded(cmd, timeout_s):
        raise Ran(cmd)

    monkeypatch.setattr(items, "run_bounded", run_bounded)
    monkeypatch.setattr(items, "vllm_installed", lambda: True)
    args = Namespace(out=str(tmp_path), model=str(tiny_model), limit_s=gpu_check.ITEMS[key].limit_s)
    with pytest.raises(Ran) as ran:
        gpu_check.ITEMS[key].check(args)
    cmd = ran.value.args[0]
    assert Path(cmd[cmd.index("--reports") + 1]).is_relative_to(tmp_path)
    assert Path(cmd[cmd.index("--out") + 1]).is_relative_to(tmp_path)
    if key == "vllm":  # vLLM's CUDA attention takes no fp32: the tiny model in bf16
        cfg = json.loads((Path(cmd[cmd.index("--model") + 1]) / "config.json").read_text())
        assert (cfg.get("dtype") or cfg.get("torch_dtype")) == "bfloat16"
