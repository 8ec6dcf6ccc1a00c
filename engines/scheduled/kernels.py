"""The runner's compiled kernel: decode attention read straight from the KV store on the CPU
(csrc/decode_attention.cpp), built with the machine's own g++ once and cached where torch keeps its
extensions. `make setup` builds it (`python -m engines.scheduled.kernels`); where it cannot be built (no
compiler), or off the CPU, or for a dtype it does not take, the runner attends through torch (gather, then
scaled_dot_product_attention), and says which in its `attention_path`.

    python -m engines.scheduled.kernels     # build (or find) it; one line on what happened
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
# the build folder (torch's extensions cache, shared by every checkout on the machine) is named by the source's
# hash: two checkouts with different kernels would otherwise rebuild over each other's module, and one could load
# the other's
NAME = f"fragbench_decode_attn_{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}"


@dataclass(frozen=True)
class Kernel:
    """The built operator (registered with torch by loading its library) and where that library lies."""

    decode_attention: Callable[..., torch.Tensor]
    path: str


@functools.cache
def decode_attention_kernel() -> Kernel | None:
    """The compiled operator, or None where it cannot be built here (the reason in `build_error`)."""
    global build_error
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        build_dir = Path(_get_build_directory(NAME, False))
        with no_stale_baton(build_dir):
            library = load(NAME, [str(source_in(build_dir))], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)  # loading registers it
        return Kernel(torch.ops.fragbench.decode_attention, str(library))
    except Exception as e:  # no compiler, no ninja, a read-only cache: the torch path serves
        build_error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
        return None


build_error: str | None = None


@contextlib.contextmanager
def no_stale_baton(build_dir: Path):
    """Torch's build lock is a file (`lock`) that a process killed while it held it leaves behind, and every later
    build of the extension then waits for it forever (a bench killed mid-build hung the next `make test` so).
    Every loader here holds an OS lock on the build folder while it loads, which the OS drops when its holder dies:
    a `lock` file found under it has no living owner, and is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "fragbench.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def source_in(build_dir: Path) -> Path:
    """The source, copied once into its build folder: torch's build file names the source by its path, so every
    checkout compiling from its own copy rebuilt the module over the others' (a server start waited a minute on
    it); from one path (the folder is named by the source's hash, so the copy is this source) one build serves
    them all."""
    copy = build_dir / SOURCE.name
    if not copy.exists():  # written once: a new mtime would make ninja rebuild
        tmp = copy.with_suffix(".tmp")
        tmp.write_bytes(SOURCE.read_bytes())
        tmp.replace(copy)
    return copy


def usable(store: torch.Tensor) -> bool:
    """Whether the kernel serves this store: fp32 on the CPU, and built."""
    return store.device.type == "cpu" and store.dtype == torch.float32 and decode_attention_kernel() is not None


def main() -> int:
    kernel = decode_attention_kernel()
    if kernel is None:
        print(f"fragbench: the decode-attention kernel could not be built ({build_error}); the runner attends "
              "through torch", file=sys.stderr)
        return 0
    print(f"fragbench: decode-attention kernel ready ({kernel.path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
