"""A CUDA device on a CPU-only torch, for the GPU dry run (tests/test_gpu_dryrun.py, `make gpu-dryrun`).

torch's FakeTensorMode makes tensors on device `cuda` that hold no memory and runs every aten op's shape, dtype and
device rules (a cpu tensor meeting a cuda one raises). What it lacks, added here:
- a device guard for CUDA (c10's own FakeGuardImpl, registered by three lines of C++ built once): without one,
  any Python indexing of a cuda tensor fails on a CPU build;
- a tally of live fake storages (bytes, peak), and torch.cuda's memory functions answered from it, the process
  cap enforced as the caching allocator enforces it (an allocation past it raises torch.OutOfMemoryError);
- the dtype rules fake mode leaves out (it lets bf16 @ fp32 through matmul, index_copy_, index_put_);
- a value read back to the host (`.item()`, `.tolist()`, `int(t)`) answers a constant, and its line is recorded;
- a stand-in CUDA generator (fake mode has no device generator).
What it cannot show: which kernel a real GPU picks, kernels missing for a dtype, the caching allocator's rounding
and segments, numerics (docs/architecture.md, "The GPU dry run").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GUARD_SOURCE = """
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
"""
# the torch versions the shims were written against: fake mode's internals move between releases
TESTED_TORCH = ((2, 13), (2, 13))  # 2.13.0 is the one run; widen as others are
ROOT = Path(__file__).resolve().parent.parent
HOST_READ_VALUE = 3  # an int read back (a sampled token, an index): a valid id of every model here, no special one
# the ops whose floating operands must share one dtype (a real CUDA kernel refuses a mix; fake mode does not)
SAME_DTYPE_OPS = {"mm", "bmm", "addmm", "matmul", "baddbmm", "index_copy_", "index_copy", "index_put_",
                  "index_put", "copy_"}


@functools.cache
def guard_error() -> str | None:
    """None once the CUDA guard is registered in this process; else why it cannot be (one line)."""
    if torch.cuda.is_available():
        return "a real CUDA device is here: run make gpu-check, not the dry run"
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if not TESTED_TORCH[0] <= version <= TESTED_TORCH[1]:
        return f"torch {torch.__version__} is outside the range the shims were written for {TESTED_TORCH}"
    try:
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        name = f"fragbench_fake_cuda_guard_{hashlib.sha256(GUARD_SOURCE.encode()).hexdigest()[:10]}"
        _get_build_directory(name, False)
        load_inline(name, cpp_sources=[GUARD_SOURCE], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja: the dry run skips in one line
        return f"the fake CUDA guard could not be built ({type(e).__name__}: {str(e).strip().splitlines()[-1:]})"
    return None


class DtypeMismatch(RuntimeError):  # not a TypeError: torch turns one raised under @ into NotImplemented
    """Two floating operands of different dtypes met where a CUDA kernel would refuse them."""


@dataclass
class Tally:
    """Live bytes of fake cuda storages, their peak, the cap, and the host reads seen (file:line -> count)."""

    cap_bytes: int
    live_bytes: int = 0
    peak_bytes: int = 0
    host_reads: dict[str, int] = field(default_factory=dict)

    def reset_peak(self) -> int:
        self.peak_bytes = self.live_bytes
        return self.live_bytes


class TallyMode(TorchDispatchMode):
    """Sees every aten op before fake mode runs it: refuses mixed dtypes, answers host reads, and counts each new
    cuda storage until it dies (its Python object lives exactly as long as the storage does)."""

    def __init__(self, tally: Tally):
        super().__init__()
        self.tally = tally
        self.seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "item"):
            return self._host_read(args[0])
        if name in SAME_DTYPE_OPS:
            same_dtype(name, args)
        out = func(*args, **kwargs)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                self._count(t)
        return out

    def _host_read(self, t: torch.Tensor):
        site = caller_site()
        self.tally.host_reads[site] = self.tally.host_reads.get(site, 0) + 1
        if t.dtype.is_floating_point:
            return 0.0
        return True if t.dtype == torch.bool else HOST_READ_VALUE

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self.seen:
            return
        nbytes = storage.nbytes()
        tally = self.tally
        if tally.live_bytes + nbytes > tally.cap_bytes:  # the caching allocator's refusal under the process cap
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes / 2**20:.2f} MiB. GPU 0 has a total capacity of "
                f"{tally.cap_bytes / 2**30:.2f} GiB of which {(tally.cap_bytes - tally.live_bytes) / 2**20:.2f} "
                "MiB is free (fake CUDA)")
        self.seen[storage] = nbytes
        tally.live_bytes += nbytes
        tally.peak_bytes = max(tally.peak_bytes, tally.live_bytes)
        weakref.finalize(storage, _freed, weakref.ref(tally), nbytes)


def _freed(tally_ref, nbytes: int) -> None:
    tally = tally_ref()
    if tally is not None:
        tally.live_bytes -= nbytes


def same_dtype(name: str, args) -> None:
    dtypes = {a.dtype for a in flat_tensors(args) if a.dtype.is_floating_point}
    if len(dtypes) > 1:
        raise DtypeMismatch(f"{name} over {sorted(map(str, dtypes))} at {caller_site()}")


def flat_tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def caller_site() -> str:
    """The innermost frame of the project's own code (engines/, harness/) that led here, as path:line."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path.is_relative_to(ROOT) and path.parts[len(ROOT.parts)] in ("engines", "harness"):
            return f"{path.relative_to(ROOT).as_posix()}:{frame.lineno}"
    return "outside the project"


class GeneratorStandIn:
    """torch.Generator where fake mode has no CUDA one: a CPU generator answers for device cuda (fake ops draw
    nothing from it); the real class for any other device."""

    real = torch.Generator

    def __new__(cls, device="cpu"):
        return cls.real("cpu" if "cuda" in str(device) else device)


@contextlib.contextmanager
def fake_cuda(total_bytes: int, name: str = "NVIDIA H100 80GB HBM3"):
    """Inside: cuda tensors are fake, torch.cuda answers as a device of `total_bytes` with a process cap (the
    fraction the engine sets), and the tally counts what lives. Yields the Tally."""
    if err := guard_error():
        raise RuntimeError(err)
    import torch._subclasses.fake_tensor as fake_tensor_module
    from torch._subclasses.fake_tensor import FakeTensorMode

    tally = Tally(cap_bytes=total_bytes)
    state = {"fraction": 1.0}

    def set_fraction(fraction, device=None):
        state["fraction"] = fraction
        tally.cap_bytes = int(fraction * total_bytes)

    props = SimpleNamespace(total_memory=total_bytes, name=name, uuid="fake-0", major=9, minor=0,
                            multi_processor_count=132)
    answers = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "get_device_properties": lambda d=None: props, "get_device_name": lambda d=None: name,
        "memory_allocated": lambda d=None: tally.live_bytes, "memory_reserved": lambda d=None: tally.live_bytes,
        "max_memory_allocated": lambda d=None: tally.peak_bytes,
        "memory_stats": lambda d=None: {"allocated_bytes.all.current": tally.live_bytes,
                                        "reserved_bytes.all.current": tally.live_bytes},
        "mem_get_info": lambda d=None: (total_bytes - tally.live_bytes, total_bytes),
        "get_per_process_memory_fraction": lambda d=None: state["fraction"],
        "set_per_process_memory_fraction": set_fraction, "empty_cache": lambda: None,
        "memory_snapshot": lambda: [], "synchronize": lambda d=None: None,
    }
    saved = {k: getattr(torch.cuda, k) for k in answers}
    saved_methods = {k: getattr(torch.Tensor, k) for k in ("__getitem__", "__setitem__", "pin_memory")}

    def getitem(t, index):  # a list index copies past the Python key, as torch.tensor(list) does
        return saved_methods["__getitem__"](t, on_device_index(t, index))

    def setitem(t, index, value):
        return saved_methods["__setitem__"](t, on_device_index(t, index), value)

    saved_generator, saved_tensor = torch.Generator, torch.tensor

    def tensor(data, *args, device=None, **kw):  # torch.tensor(list, device=cuda) copies past the Python key
        t = saved_tensor(data, *args, **kw)
        return t.to(device) if device is not None else t

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    # fake mode keeps a one-element tensor's value and runs ops on it for real: a copy to a CUDA this build lacks
    saved_limit, fake_tensor_module.CONSTANT_NUMEL_LIMIT = fake_tensor_module.CONSTANT_NUMEL_LIMIT, 0
    try:
        for k, v in answers.items():
            setattr(torch.cuda, k, v)
        torch.Generator, torch.tensor = GeneratorStandIn, tensor
        # a real GPU copies a list index to the device (synchronously) and pins host memory; fake mode does neither
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = getitem, setitem
        torch.Tensor.pin_memory = lambda t, *a, **k: t
        with fake_mode, TallyMode(tally):
            yield tally
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)
        torch.Generator, torch.tensor = saved_generator, saved_tensor
        fake_tensor_module.CONSTANT_NUMEL_LIMIT = saved_limit
        for k, v in saved_methods.items():
            setattr(torch.Tensor, k, v)


def on_device_index(t: torch.Tensor, index):
    """An index of Python int lists made a tensor on t's device (each list as a real GPU copies it)."""
    if t.device.type != "cuda":
        return index

    def one(i):
        return torch.tensor(i, device=t.device) if isinstance(i, list) else i

    return tuple(one(i) for i in index) if isinstance(index, tuple) else one(index)


def fake_model(config: dict, dtype: torch.dtype):
    """A transformers model of `config`'s shape on fake cuda in `dtype`, its weights never materialised (call it
    inside fake_cuda): what the factory's load_hf_model returns on a GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures", "transformers_version",
                                                                                "torch_dtype", "dtype")})
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)  # fake cpu tensors: nothing materialised
    for module in model.modules():  # the factory's .to("cuda"), one tensor at a time (fake mode has no Module.to)
        for key, p in module._parameters.items():
            if p is not None:
                module._parameters[key] = torch.nn.Parameter(p.to("cuda"), requires_grad=False)
        for key, b in module._buffers.items():
            if b is not None:
                module._buffers[key] = b.to("cuda")
    return model.eval()


def patched_loader(config: dict, dtype: torch.dtype):
    """engines.scheduled.model.load_hf_model's stand-in: the fake model, whatever the directory."""
    return lambda model_dir, device="cpu": fake_model(config, dtype)


if "pytest" not in sys.modules:  # python tests/fake_cuda.py: is the shim usable here?
    print(guard_error() or "fake CUDA: ready")
