from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from engines.sequence import SamplingParams, Sequence


def seq(seq_id: str, prompt_len: int, max_tokens: int, max_seq_len: int = 2048, first_token: int = 10) -> Sequence:
    return Sequence(seq_id, list(range(first_token, first_token + prompt_len)), SamplingParams(max_tokens), max_seq_len)


def speed_probe(scale: float = 1.0) -> dict:
    """run.json's `speed_probe` of a quiet machine (a few % between moments), every reading x `scale`: 1 for two
    runs on one machine, 1.5 for a slower night."""
    moments = {"start": 1.0, "middle": 1.02, "end": 0.99}
    return {"compute": "fixed", "interpreter": "fixed",
            "readings": [{"at": at, "compute_s": [0.010 * f * scale] * 3, "interpreter_s": [0.015 * f * scale] * 3}
                         for at, f in moments.items()]}


def benchmark_module(name: str):
    """A script of benchmarks/ loaded as a module, registered under its name (its dataclasses look their module up
    there)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
