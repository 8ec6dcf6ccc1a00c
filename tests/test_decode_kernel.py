"""The compiled decode-attention kernel against a dense reference: every head size it compiles in (64, 128) and
one it reads at run time, contexts that end on, before and after its 16-row tile boundaries, grouped heads,
and rows scattered in blocks over the store as a block table lays them (the model's own tests run one head
size and whatever lengths their prompts have)."""

from __future__ import annotations

import pytest
import torch

from engines.scheduled.kernels import decode_attention_kernel

kernel = decode_attention_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the kernel could not be built here")


def dense(q, store, rows, lengths, scale):
    """softmax(q . K * scale) @ V over each sequence's first lengths[b] rows, in float64."""
    heads, kv_heads = q.shape[1], store.shape[2]
    out = torch.empty_like(q)
    for b, n in enumerate(lengths.tolist()):
        context = store[rows[b, :n]].double()  # [n, 2, kv_heads, D]
        keys = context[:, 0].repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, D]
        values = context[:, 1].repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), keys) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", weights, values).float()
    return out


@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_the_kernel_equals_dense_attention_over_scattered_blocks(head_dim, heads, kv_heads):
    gen = torch.Generator().manual_seed(head_dim * 100 + heads * 10 + kv_heads)
    block, blocks = 16, 64
    store = torch.randn(blocks * block, 2, kv_heads, head_dim, generator=gen)
    lengths = torch.tensor([1, 15, 16, 17, 33, 100, 160])
    longest = int(lengths.max())
    # each sequence's blocks drawn at random from the pool, as a churned block table lies
    order = torch.randperm(blocks, generator=gen)
    per_seq = -(-longest // block)
    rows = torch.stack([(order[(b * per_seq + torch.arange(per_seq)) % blocks, None] * block
                         + torch.arange(block)).flatten()[:longest] for b in range(len(lengths))])
    rows = rows.contiguous()
    q = torch.randn(len(lengths), heads, head_dim, generator=gen) * 3  # wide scores: the running max moves
    scale = head_dim**-0.5
    got = kernel.decode_attention(q, store, rows, lengths, scale)
    assert torch.allclose(got, dense(q, store, rows, lengths, scale), atol=1e-5, rtol=1e-4)


def test_a_contiguous_buffer_reads_the_same_as_its_rows_scattered():
    """The same context read from one contiguous run and from a block table: the same output."""
    gen = torch.Generator().manual_seed(1)
    store = torch.randn(512, 2, 2, 64, generator=gen)
    q = torch.randn(1, 4, 64, generator=gen)
    contiguous = torch.arange(100, 200)[None]
    moved = store.clone()
    blocks = torch.tensor([20, 3, 11, 28, 7, 0, 25])  # where the 7 blocks of rows 100..211 went
    table = (blocks[:, None] * 16 + torch.arange(16)).flatten()[:100][None].contiguous()
    moved[table[0]] = store[contiguous[0]]
    lengths = torch.tensor([100])
    a = kernel.decode_attention(q, store, contiguous.contiguous(), lengths, 0.125)
    b = kernel.decode_attention(q, moved, table, lengths, 0.125)
    assert torch.allclose(a, b, atol=1e-6)


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load():
    """torch's `lock` file in the extension's build folder, as a process killed mid-build leaves it (no process
    holds the folder's OS lock): `python -m engines.scheduled.kernels` removes it and answers. Before, every
    later load waited on it forever."""
    import fcntl
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    from engines.scheduled.kernels import NAME
    from tests.conftest import ROOT

    folder = Path(_get_build_directory(NAME, False))
    stale = folder / "lock"
    with open(folder / "fragbench.flock", "w") as held:  # no loader of another test is inside its load meanwhile
        fcntl.flock(held, fcntl.LOCK_EX)
        stale.touch()
    r = subprocess.run([sys.executable, "-m", "engines.scheduled.kernels"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and not stale.exists(), r.stdout + r.stderr


@pytest.mark.parametrize("moved", ["q", "store", "rows", "lengths"])
def test_an_input_off_the_cpu_is_refused_by_name_before_any_read(moved):
    """The kernel reads host memory: a CUDA tensor among its inputs (here the meta device, which a CPU machine
    has) is refused with its name, where its data pointer would have been read as a host address."""
    inputs = {"q": torch.randn(2, 4, 64), "store": torch.randn(32, 2, 2, 64),
              "rows": torch.arange(32).repeat(2, 1).contiguous(), "lengths": torch.tensor([3, 5])}
    inputs[moved] = inputs[moved].to("meta")
    with pytest.raises(RuntimeError, match=f"every input must be on the CPU; {moved} is on meta"):
        kernel.decode_attention(inputs["q"], inputs["store"], inputs["rows"], inputs["lengths"], 0.125)
