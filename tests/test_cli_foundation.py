import json
import math

import pytest

from engines.shapes import load_shape, preset_names
from tests.conftest import run_cli


def plan_json(*args):
    """The plan as JSON; its exit code 0 where the model fits and 1 where it does not (with one line saying so)."""
    r = run_cli("plan", *args, "--json")
    plan = json.loads(r.stdout)
    assert r.returncode == (0 if plan["fits"] else 1), r.stderr
    assert plan["fits"] or (len(r.stderr.strip().splitlines()) == 1 and "does not fit" in r.stderr), r.stderr
    return plan


def test_plan_llama_2_13b_on_40gib():
    p = plan_json("--model", "llama-2-13b", "--gpu-mem", "40GiB", "--max-seq-len", "2048")
    assert p["kv_bytes_per_token"] == 819_200
    assert p["static_max_concurrency"] == p["kv_budget_bytes"] // (2048 * 819_200)
    assert 11e9 < p["kv_budget_bytes"] < 13e9  # the vLLM paper: about 12 GB of KV cache
    assert p["max_live_tokens"] == p["kv_budget_bytes"] // 819_200
    assert p["paged_expected_concurrency"] > p["static_max_concurrency"]
    assert p["fits"] is True


@pytest.mark.parametrize("name", preset_names())
def test_plan_every_preset_never_negative(name):
    p = plan_json("--model", name, "--gpu", "a100-80gb")
    assert p["kv_bytes_per_token"] == load_shape(name).kv_bytes_per_token("float16")
    for key in ("weights_bytes", "kv_budget_bytes", "max_live_tokens", "static_max_concurrency",
                "paged_expected_concurrency"):
        assert p[key] >= 0


def test_a_model_that_does_not_fit_says_so_and_exits_1():
    p = plan_json("--model", "llama-3-70b", "--gpu-mem", "80GiB")
    assert p["kv_bytes_per_token"] == 327_680
    assert p["fits"] is False and p["kv_budget_bytes"] == 0
    text = run_cli("plan", "--model", "llama-3-70b", "--gpu-mem", "80GiB")
    assert text.returncode == 1
    assert "fits                      NO: the weights alone exceed" in text.stdout
    assert text.stderr.strip() == ("fragbench plan: llama-3-70b does not fit on 80.00 GiB: the weights alone exceed "
                                   "the usable GPU memory")


def test_a_model_that_fits_says_what_fits_and_exits_0():
    r = run_cli("plan", "--model", "llama-2-7b", "--gpu", "a100-40gb")
    assert r.returncode == 0, r.stderr
    assert "yes: fits" not in r.stdout
    assert "fits                      yes: the KV budget holds" in r.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("plan", "--model", "no-such-model", "--gpu-mem", "40GiB"),
        ("plan", "--model", "llama-2-7b", "--gpu-mem", "banana"),
        ("plan", "--model", "llama-2-7b", "--gpu-mem=-5GiB"),
        ("plan", "--model", "/no/such/dir", "--gpu-mem", "40GiB"),
        ("plan", "--model", "llama-2-7b", "--gpu", "tpu-v9"),
        ("model", "build", "--preset", "nope", "--out", "/tmp/x"),
        ("plan", "--model", "llama-2-7b"),
    ],
)
def test_bad_input_exits_2_with_one_line(args):
    r = run_cli(*args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_too_large_preset_is_refused_with_the_size_it_needs(tmp_path):
    r = run_cli("model", "build", "--preset", "llama-3-70b", "--out", str(tmp_path / "m"))
    assert r.returncode == 2
    assert "GiB" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_model_list_shows_every_preset():
    r = run_cli("model", "list")
    assert r.returncode == 0
    for name in preset_names():
        assert name in r.stdout
    assert "819,200" in r.stdout


def test_built_tiny_model_loads_offline_in_transformers_and_generates(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = tok("def plan(capacity):", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    assert isinstance(tok.decode(out[0]), str)
    assert len(tok) == 4096 and tok.eos_token_id == 2
    assert math.isclose(sum(p.numel() for p in model.parameters()), load_shape("tiny-llama").num_params)
    assert next(model.parameters()).dtype == torch.float32


def test_model_build_is_seeded(tmp_path):
    from safetensors.torch import load_file

    from engines.modelbuild import build_model

    a = load_file(build_model("tiny-llama", tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(build_model("tiny-llama", tmp_path / "b", seed=3) / "model.safetensors")
    assert all(a[k].equal(b[k]) for k in a)


def test_plan_takes_the_length_mix_of_a_workload():
    short = plan_json("--model", "llama-2-13b", "--gpu", "a100-80gb", "--workload", "chat-short")
    long = plan_json("--model", "llama-2-13b", "--gpu", "a100-80gb", "--workload", "rag-long")
    assert short["paged_expected_concurrency"] > long["paged_expected_concurrency"] > 0
    assert "rag-long" in long["workload"]
    assert short["static_max_concurrency"] == long["static_max_concurrency"]


def test_every_flag_of_every_verb_explains_itself_with_its_default():
    """A help line for every argument of every verb (sub-verbs too), and for every optional flag its default:
    argparse's value, or the help's own words where a size or a rule reads better."""
    import argparse

    from harness.cli import build_parser
    from harness.cli.args import DefaultsFormatter

    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for verb, sub in action.choices.items():
                    yield from walk(sub, f"{name} {verb}")
            elif not isinstance(action, argparse._HelpAction | argparse._VersionAction):
                yield name, action

    formatter = DefaultsFormatter("fragbench")
    silent = []
    for verb, action in walk(build_parser(), "fragbench"):
        text = formatter._get_help_string(action) if action.help else ""
        optional = action.option_strings and not action.required
        if not text or (optional and "default" not in text.lower()):
            silent.append(f"{verb} {'/'.join(action.option_strings) or action.dest}")
    assert not silent, silent
    bench = build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    assert "(default: 16MiB)" in bench and "(default: 0)" in bench  # --kv-budget in words, --seed argparse's
