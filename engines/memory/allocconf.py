"""PYTORCH_CUDA_ALLOC_CONF, read as PyTorch reads it: `key:value,key:value`, lists in brackets
(`roundup_power2_divisions:[256:1,512:2,>:4]`), spaces ignored. A bad key or value is an `AllocConfError`
naming it, so the CLI can say it in one line before any engine starts.

The same string configures the emulator (`engines/memory/caching.py`, `--memory caching`) and, under
`--memory cuda`, the real allocator of the server's process (set in its environment before CUDA starts).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

MiB = 2**20
LARGE_BUFFER_BYTES = 20 * MiB  # kLargeBuffer: also the least max_split_size_mb and max_non_split_rounding_mb
NO_LIMIT = 2**63 - 1  # max_split_size when unset: every block may be split
POWER2_INTERVALS = 16  # roundup_power2_divisions holds one value per power of two from 1 MiB to 32 GiB
POWER2_FIRST_LOG2 = 20  # the first interval starts at 1 MiB
BOOLEAN_KEYS = ("expandable_segments", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
                "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_use_background_threads")


# The variables the real allocator reads its settings from, in the installed torch's order: from 2.9,
# PYTORCH_ALLOC_CONF where it is set (empty included), else PYTORCH_CUDA_ALLOC_CONF (deprecated, with a warning);
# before 2.9, PYTORCH_CUDA_ALLOC_CONF alone (c10's AllocatorConfig::instance, CUDAAllocatorConfig)
GENERIC_VAR_SINCE = (2, 9)
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def installed_torch_version() -> tuple[int, int]:
    """(major, minor) of the torch this interpreter would import, read from its metadata (importing torch costs
    1.4 s, and the harness's processes that start servers import none)."""
    from importlib.metadata import version

    major, minor = version("torch").split(".")[:2]
    return int(major), int(minor)


def alloc_conf_vars(torch_version: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The variables the installed torch reads, first first."""
    return ALLOC_CONF_VARS if (torch_version or installed_torch_version()) >= GENERIC_VAR_SINCE \
        else ALLOC_CONF_VARS[1:]


def torch_alloc_conf(environ: Mapping[str, str] | None = None, torch_version: tuple[int, int] | None = None
                     ) -> str | None:
    """The settings string the real allocator reads from `environ` (os.environ by default), or None: the first of
    alloc_conf_vars that is set, set-but-empty included, as c10 reads it."""
    environ = os.environ if environ is None else environ
    return next((environ[name] for name in alloc_conf_vars(torch_version) if name in environ), None)


def cuda_memory_refusal(text: str | None) -> str | None:
    """One line where the real allocator's settings `text` leave `--memory cuda` nothing to read, else None:
    backend:cudaMallocAsync hands allocations to CUDA's own pool, which keeps no segments or blocks
    (torch.cuda.memory_snapshot refuses: "not meaningful"), and CudaMemory sizes its pool, its largest free block
    and its OOM verdicts from them."""
    try:
        backend = parse_alloc_conf(text).backend
    except AllocConfError:  # a bad setting is refused where it is read, naming its key
        return None
    if backend == "native":
        return None
    return (f"--memory cuda reads PyTorch's caching allocator (its segments and blocks), which backend:{backend} "
            "replaces with CUDA's own pool that keeps none: drop backend from the allocator's settings "
            "(--alloc-conf, PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF), or run --memory arena under it")


def alloc_conf_environ(conf: str) -> dict[str, str]:
    """What a child's environment needs for its real allocator to read `conf`, whatever its torch: every variable
    any torch reads set to it (a user's PYTORCH_ALLOC_CONF would otherwise win over a PYTORCH_CUDA_ALLOC_CONF set
    for the child)."""
    return dict.fromkeys(ALLOC_CONF_VARS, conf)


class AllocConfError(ValueError):
    """An allocator setting PyTorch would refuse: the message names the key (and the value)."""


@dataclass(frozen=True)
class AllocConf:
    text: str = ""  # as given: what reports print
    max_split_size_bytes: int = NO_LIMIT
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * POWER2_INTERVALS)
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    backend: str = "native"

    def divisions(self, size: int) -> int:
        """The roundup_power2_divisions that apply to a request of `size` bytes (its power-of-two interval)."""
        index = min(max(size.bit_length() - 1 - POWER2_FIRST_LOG2, 0), POWER2_INTERVALS - 1)
        return self.roundup_power2_divisions[index]

    @property
    def label(self) -> str:
        return self.text or "default"


def tokens(text: str) -> list[str]:
    """PyTorch's lexer: `,` `:` `[` `]` are tokens of their own, spaces vanish, the rest are words."""
    return [t for t in re.split(r"([,:\[\]])", text.replace(" ", "")) if t]


def parse_alloc_conf(text: str | None) -> AllocConf:
    """An AllocConf from PYTORCH_CUDA_ALLOC_CONF's syntax; "" or None or "default" is PyTorch's default."""
    if not text or text.strip() == "default":
        return AllocConf()
    parser = _Parser(tokens(text))
    values: dict = {}
    while not parser.done():
        key = parser.word("a setting name")
        parser.expect(":", key)
        values.update(_SETTINGS.get(key, _unknown)(parser, key))
        if not parser.done():
            parser.expect(",", key)
    return AllocConf(text=text.strip(), **values)


class _Parser:
    def __init__(self, toks: list[str]):
        self.toks, self.i = toks, 0

    def done(self) -> bool:
        return self.i >= len(self.toks)

    def peek(self) -> str | None:
        return None if self.done() else self.toks[self.i]

    def word(self, what: str) -> str:
        tok = self.peek()
        if tok is None or tok in ",:[]":
            raise AllocConfError(f"alloc conf: expected {what}, found {tok or 'the end'}")
        self.i += 1
        return tok

    def expect(self, sep: str, key: str) -> None:
        if self.peek() != sep:
            raise AllocConfError(f"alloc conf: {key}: expected {sep!r}, found {self.peek() or 'the end'!r}")
        self.i += 1

    def integer(self, key: str) -> int:
        tok = self.word(f"a value for {key}")
        if not tok.isdigit():
            raise AllocConfError(f"alloc conf: {key}:{tok} is not a whole number")
        return int(tok)


def _unknown(parser: _Parser, key: str) -> dict:
    raise AllocConfError(f"alloc conf: unrecognized setting {key!r} (PyTorch's keys: {', '.join(_SETTINGS)})")


def _megabytes(attr: str):
    def parse(parser: _Parser, key: str) -> dict:
        mb = parser.integer(key)
        if mb * MiB < LARGE_BUFFER_BYTES:
            raise AllocConfError(f"alloc conf: {key}:{mb} is too small, it must be >= {LARGE_BUFFER_BYTES // MiB}")
        return {attr: mb * MiB}
    return parse


def _threshold(parser: _Parser, key: str) -> dict:
    tok = parser.word(f"a value for {key}")
    try:
        value = float(tok)
    except ValueError:
        raise AllocConfError(f"alloc conf: {key}:{tok} is not a number") from None
    if not 0.0 < value < 1.0:
        raise AllocConfError(f"alloc conf: {key}:{tok} must lie in (0.0, 1.0)")
    return {"garbage_collection_threshold": value}


def _boolean(parser: _Parser, key: str) -> dict:
    tok = parser.word(f"a value for {key}")
    if tok not in ("True", "False"):
        raise AllocConfError(f"alloc conf: {key}:{tok} must be True or False")
    return {"expandable_segments": tok == "True"} if key == "expandable_segments" else {}


def _backend(parser: _Parser, key: str) -> dict:
    tok = parser.word(f"a value for {key}")
    if tok not in ("native", "cudaMallocAsync"):
        raise AllocConfError(f"alloc conf: {key}:{tok} is not a backend (native or cudaMallocAsync)")
    return {"backend": tok}


def _threads(parser: _Parser, key: str) -> dict:
    n = parser.integer(key)
    if n < 1 or n & (n - 1):
        raise AllocConfError(f"alloc conf: {key}:{n} must be a power of two")
    return {}  # pinned host memory only: nothing the device allocator does changes


def _power2_divisions(parser: _Parser, key: str) -> dict:
    table = [0] * POWER2_INTERVALS
    if parser.peek() != "[":  # one value for every interval
        n = parser.integer(key)
        if n < 1 or n & (n - 1):
            raise AllocConfError(f"alloc conf: {key}:{n} must be a power of two")
        return {"roundup_power2_divisions": (n,) * POWER2_INTERVALS}
    parser.expect("[", key)
    first, last = True, 0
    while parser.peek() != "]":
        bound = parser.word(f"an interval of {key}")
        parser.expect(":", key)
        n = _division(parser.integer(key), key)
        if bound == ">":  # this value from the last interval named to the end
            table[last:] = [n] * (POWER2_INTERVALS - last)
        else:
            if not bound.isdigit() or int(bound) & (int(bound) - 1) or int(bound) == 0:
                raise AllocConfError(f"alloc conf: {key}: interval {bound} is not a power of two (in MB)")
            index = min(int(bound).bit_length() - 1, POWER2_INTERVALS - 1)
            if first:  # the first value also covers every interval below it
                table[:index] = [n] * index
                first = False
            table[index] = n
            last = index
        if parser.peek() == ",":
            parser.expect(",", key)
        elif parser.peek() != "]":
            raise AllocConfError(f"alloc conf: {key}: expected ',' or ']', found {parser.peek() or 'the end'!r}")
    parser.expect("]", key)
    return {"roundup_power2_divisions": tuple(table)}


def _division(n: int, key: str) -> int:
    if n and n & (n - 1):
        raise AllocConfError(f"alloc conf: {key}: divisions {n} must be a power of two (or 0 for none)")
    return n


_SETTINGS = {
    "max_split_size_mb": _megabytes("max_split_size_bytes"),
    "max_non_split_rounding_mb": _megabytes("max_non_split_rounding_bytes"),
    "garbage_collection_threshold": _threshold,
    "roundup_power2_divisions": _power2_divisions,
    "expandable_segments": _boolean,
    "backend": _backend,
    **{k: _boolean for k in BOOLEAN_KEYS if k != "expandable_segments"},
    "pinned_num_register_threads": _threads,
}
