"""`--seed`, checked where it is parsed: numpy's generators refuse a negative seed and torch's one past 64 bits,
and a bench told `--seed -1` measured for 36 s before its load generator died of it (issue 88)."""

from __future__ import annotations

import argparse

SEED_MAX = 2**63 - 1  # the largest every seeded library here takes (numpy, torch, the servers' int64)


def seed_arg(text: str) -> int:
    """A random seed: a whole number from 0 to 2**63 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed is a whole number, not {text!r}") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"a seed is 0 to 2**63 - 1, not {text}")
    return value
