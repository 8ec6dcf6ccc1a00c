"""Numbers out of range, refused in one line where they are read (issue 88): a KV block longer than a sequence
may grow (`simulate --block-size 1000000000` ended in the paged pool's traceback), a vocabulary past the token ids
a model or numpy's draw can hold."""

from __future__ import annotations

import argparse

from harness.cli.args import UsageError, int_at_least, positive_int

TOKEN_ID_MAX = 2**31 - 1  # token ids are int32 in the servers' tensors and tokenizers; numpy's draw stops at int64


def nonneg_int(text: str) -> int:
    """A count where 0 means none."""
    return int_at_least(text, 0)


def vocab_size_arg(text: str) -> int:
    """Token ids of synthetic prompts are drawn below this: 1 to 2**31 - 1."""
    value = positive_int(text)
    if value > TOKEN_ID_MAX:
        raise argparse.ArgumentTypeError(f"a vocabulary holds at most 2**31 - 1 token ids (int32), not {text}")
    return value


def block_fits(block_size: int, max_seq_len: int) -> None:
    """A paged block holds at most one whole sequence: a longer one is never filled, and its bytes dwarf the KV."""
    if block_size > max_seq_len:
        raise UsageError(f"--block-size {block_size}: a KV block holds at most one sequence's {max_seq_len} tokens "
                         "(max_seq_len): a longer block is never filled")
