"""Every user error is one line (issue 88): a closed pipe (`fragbench model list | head -1`) ends quietly, and a
negative seed is refused where it is parsed, not 36 s into a bench by its load generator."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.cli import main
from tests.conftest import ROOT


@pytest.mark.parametrize("args", [
    ("model", "list"),
    ("workload", "list"),
    ("workload", "show", "mixed-churn"),
    ("plan", "--model", "llama-3-8b", "--gpu", "h100-80gb"),
])
def test_a_reader_that_goes_away_ends_the_verb_quietly(args):
    """The pipe's reader closed before the verb writes a byte (`| head` once it has its line): no traceback, no
    shutdown warning, exit 141 as a shell tool killed by SIGPIPE."""
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before the child has imported anything: its first write meets no reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141) and err == "", err


@pytest.mark.parametrize("args", [
    ("simulate", "--seed", "-1"),
    ("workload", "trace", "mixed-churn", "--seed", "-1", "--out", "t.jsonl"),
    ("workload", "show", "mixed-churn", "--seed", "1.5"),
    ("bench", "--seed", "-1"),
    ("load", "--target", "http://127.0.0.1:1", "--workload", "mixed-churn", "--seed", "-1"),
    ("model", "build", "--preset", "tiny-llama", "--out", "m", "--seed", str(2**64)),
    ("generate", "--model", "m", "--seed", "-3"),
])
def test_a_seed_out_of_range_is_refused_where_it_is_parsed(args, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--seed" in err[0] and "a seed is" in err[0], err
    assert not list(tmp_path.iterdir())  # nothing written
