"""Every engine fragbench can serve, one entry each: what kind it is, where its KV lives, how the simulator
places it, which memory it takes, what budget it needs, how it is installed, and its one line of help.

Every list and rule about engines reads this table: the engine and policy names (`engines/__init__.py`,
`engines/kv/__init__.py`), which engines keep KV in blocks (the headline's reference), the simulator's
placement, the memory rule and the budget check (the factory at start, bench before any load), serve's and
bench's peers, the CLI's help and the KV invariant tests. Adding a policy is its module in `engines/kv/` and
one entry here; adding a peer is its module in `engines/peers/` (a `Peer`) and one entry here.

Torch-free on purpose: the CLI lists engines before it imports anything heavy, so policies and peers are
named by "module:Class" and imported only when one is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum
from typing import Literal

Layout = Literal["blocks", "contiguous"]  # where an engine keeps its KV: fixed-size blocks, or one extent a sequence
Placement = Literal["best-fit", "buddy"]  # the simulator's arena placement (engines/memory/arena.py)
ANY_MEMORY = ("arena", "cuda", "caching")  # --memory kinds an in-house engine whose KV may be many tensors takes
# contiguous reservations are rows of one store: one arena, or the caching emulator's one address space
ARENA_ONLY = ("arena", "caching")


class Kind(str, Enum):
    SCHEDULED = "in-house scheduled"  # fragbench's scheduler and runner over a KV policy (engines/scheduled/)
    IN_HOUSE = "in-house other"  # served by fragbench's server, scheduled by another loop (engines/peers/hf*)
    PEER = "peer"  # another server fragbench starts and fronts (engines/peers/base.Peer)


IN_HOUSE = (Kind.SCHEDULED, Kind.IN_HOUSE)  # the kinds fragbench's own server runs


@dataclass(frozen=True)
class BudgetRule:
    """The least KV budget an engine starts with: `sequences` max-length sequences of the model."""

    sequences: int = 1

    def least_bytes(self, max_seq_len: int, kv_bytes_per_token: int) -> int:
        return self.sequences * max_seq_len * kv_bytes_per_token

    def refusal(self, budget_bytes: int, max_seq_len: int, kv_bytes_per_token: int) -> str | None:
        """What a budget under the rule's bytes is ("smaller than ..."), for the caller's sentence; else None."""
        need = self.least_bytes(max_seq_len, kv_bytes_per_token)
        if budget_bytes >= need:
            return None
        what = "one max-length sequence" if self.sequences == 1 else f"{self.sequences} max-length sequences"
        return (f"smaller than {what} of this model (max_seq_len {max_seq_len} tokens x {kv_bytes_per_token} B = "
                f"{need / 2**20:.1f} MiB): raise --kv-budget or lower --max-seq-len")


ONE_SEQUENCE = BudgetRule(1)


@dataclass(frozen=True)
class EngineEntry:
    """One engine: what every list and rule needs to know of it (module docstring)."""

    name: str
    kind: Kind
    kv: Layout
    help: str
    policy: str | None = None  # "module:Class" of its KVPolicy (scheduled engines), built with `params`
    params: tuple[tuple[str, object], ...] = ()  # the policy's own arguments, e.g. (("reserve", "pow2"),)
    placement: Placement | None = None  # the simulator's arena for it; None: `simulate` does not offer it
    memory: tuple[str, ...] | None = ANY_MEMORY  # --memory kinds it takes; None: its own memory, flag unused
    budget: BudgetRule = ONE_SEQUENCE
    install: str = "make setup"  # what puts it on this machine
    peer: str | None = None  # "module:Class" of its engines.peers.base.Peer (peers)

    @property
    def in_house(self) -> bool:
        return self.kind is not Kind.PEER

    def policy_class(self):
        """The KVPolicy class, imported now (it needs torch)."""
        if self.policy is None:
            raise ValueError(f"{self.name} has no KV policy of fragbench's")
        return load(self.policy)

    def peer_class(self):
        if self.peer is None:
            raise ValueError(f"{self.name} is not a peer")
        return load(self.peer)

    def installed(self) -> bool:
        """In-house engines come with `make setup`; a peer says whether its own install is there."""
        return self.peer is None or self.peer_class().installed()

    def takes_memory(self, kind: str) -> bool:
        return self.memory is None or kind in self.memory


def load(ref: str):
    """The object a "module:Name" reference names."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


STATIC = "engines.kv.static:StaticKV"
REGISTRY: dict[str, EngineEntry] = {e.name: e for e in (
    EngineEntry("hf", Kind.IN_HOUSE, "contiguous", "the naive transformers generate loop on padded static "
                "batches, its cache grown by concatenation in the arena (an OOM crashes it)"),
    EngineEntry("hf-cb", Kind.IN_HOUSE, "blocks", "transformers' continuous batching over its own paged cache",
                memory=None),
    EngineEntry("static", Kind.SCHEDULED, "contiguous", "static-max, whose --reserve flag picks another "
                "reservation", policy=STATIC, params=(("reserve", "max"),), memory=ARENA_ONLY),
    EngineEntry("static-max", Kind.SCHEDULED, "contiguous", "one max_seq_len extent per sequence, reserved at "
                "admission", policy=STATIC, params=(("reserve", "max"),), placement="buddy", memory=ARENA_ONLY),
    EngineEntry("static-pow2", Kind.SCHEDULED, "contiguous", "one extent per sequence, its final length rounded "
                "up to a power of two", policy=STATIC, params=(("reserve", "pow2"),), placement="buddy",
                memory=ARENA_ONLY),
    EngineEntry("static-oracle", Kind.SCHEDULED, "contiguous", "one extent per sequence of exactly prompt + "
                "max_tokens", policy=STATIC, params=(("reserve", "oracle"),), placement="best-fit",
                memory=ARENA_ONLY),
    EngineEntry("growth", Kind.SCHEDULED, "contiguous", "one extent per sequence, re-allocated as it fills "
                "(torch.cat)", policy="engines.kv.growth:GrowthKV", placement="best-fit", memory=ARENA_ONLY),
    EngineEntry("paged", Kind.SCHEDULED, "blocks", "fixed-size blocks from one pool, prefix caching, "
                "copy-on-write (vLLM's PagedAttention)", policy="engines.kv.paged:PagedKV", placement="best-fit"),
    EngineEntry("vllm", Kind.PEER, "blocks", "a real vLLM behind fragbench's proxy", memory=None,
                install="make vllm", peer="engines.peers.vllm:VLLMPeer"),
)}


class UnknownEngine(ValueError):
    """A name no entry has."""


def entry(name: str) -> EngineEntry:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownEngine(f"unknown engine {name!r}; engines: {', '.join(REGISTRY)}") from None


def names(*kinds: Kind) -> tuple[str, ...]:
    """Every engine's name (of these kinds, when given), in the table's order."""
    return tuple(n for n, e in REGISTRY.items() if not kinds or e.kind in kinds)


def policies() -> tuple[str, ...]:
    """The KV policies `simulate` and `make_policy` offer: scheduled engines the simulator can place."""
    return tuple(n for n, e in REGISTRY.items() if e.policy is not None and e.placement is not None)


def in_blocks() -> tuple[str, ...]:
    """Engines that keep KV in blocks (the headline's paged side); every other one reserves contiguously."""
    return tuple(n for n, e in REGISTRY.items() if e.kv == "blocks")


def listing(chosen: tuple[str, ...] | None = None) -> str:
    """Names for a flag's help: `a, b, c`."""
    return ", ".join(chosen if chosen is not None else REGISTRY)


def described(chosen: tuple[str, ...] | None = None) -> str:
    """One sentence per engine for a verb's help: name, kind, where its KV lives, what it does."""
    return "Engines: " + "; ".join(f"{n} ({REGISTRY[n].kind.value}, KV in {REGISTRY[n].kv}): {REGISTRY[n].help}"
                                   for n in (chosen if chosen is not None else REGISTRY)) + "."


def memory_refusal(engines: list[str], kind: str) -> str | None:
    """One line naming the engines that cannot take `--memory kind`, and which take it; None if all do."""
    refused = [e for e in engines if not entry(e).takes_memory(kind)]
    if not refused:
        return None
    takers = [n for n, e in REGISTRY.items() if e.memory is not None and kind in e.memory]
    instead = [k for k in ANY_MEMORY if all(entry(e).takes_memory(k) for e in refused)]
    why = "keep contiguous reservations in one arena; " if {entry(e).kv for e in refused} == {"contiguous"} else ""
    return (f"--memory {kind}: {', '.join(refused)} {why}run them with --memory {' or '.join(instead) or 'arena'} "
            f"(on the GPU too)" + (f"; --memory {kind} serves {', '.join(takers)}" if takers else ""))


__all__ = ["ANY_MEMORY", "ARENA_ONLY", "IN_HOUSE", "ONE_SEQUENCE", "REGISTRY", "BudgetRule", "EngineEntry", "Kind",
           "UnknownEngine", "described", "entry", "in_blocks", "listing", "load", "memory_refusal", "names", "policies"]
