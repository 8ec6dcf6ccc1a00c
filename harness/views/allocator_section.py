"""The caching allocator's lines in the run report (`--memory caching`): what the Figure-2 breakdown gains, "reserved
by the allocator, unallocated", and which layer each OOM was (policy or allocator). Empty where no engine's KV
went through a caching allocator (the arena, a target), so a run without one reads as before."""

from __future__ import annotations

import pandas as pd

from harness.analysis.summary_records import SimulationOut, SizeClasses, Summary
from harness.views.html import fmt, mib, table

LAYER_WORDS = {"policy": "policy (the live KV and this request pass the cap)",
               "allocator": "allocator (cached free + never reserved would hold it; no block does, and the segment "
                            "it asks for does not fit)"}


def reserved_unallocated(summary: Summary) -> str:
    """The Figure-2 breakdown's extra line, per engine with an allocator: bytes PyTorch would hold from the device
    that no tensor uses (inside the breakdown's external fragmentation + free, which count from the budget)."""
    rows = [[name, fmt(a.reserved_unallocated_share, "%"), mib(a.peak_reserved_unallocated_bytes),
             mib(a.allocated_bytes), mib(a.reserved_bytes), mib(a.inactive_split_bytes), a.segments,
             a.alloc_retries, classes(a.size_classes)]
            for name, s in summary.engines.items() if (a := s.allocator)]
    if not rows:
        return ""
    return ("<h3>Reserved by the allocator, unallocated</h3><p class='how'>The caching allocator's figures "
            "(--memory caching, as torch.cuda.memory_stats() names them): the mean share of the KV budget it "
            "reserved from the device but allocated to nothing over the steady churn (cached free blocks and "
            "inactive splits, part of the external fragmentation + free above), its peak, and its state after the "
            "load, once every request completed: allocated falling while reserved stays high is the allocator "
            "retaining blocks. Requests by PyTorch's size class: small (<= 1 MiB, packed in 2 MiB segments), large "
            "(under 10 MiB, a 20 MiB segment each), huge (a segment of their own size); whether they fall where a "
            "real model's would is the size-class comparison below.</p>"
            + table(["engine", "reserved, unallocated (mean share)", "its peak", "allocated after the load",
                     "reserved after the load", "inactive split", "segments", "alloc retries",
                     "requests small / large / huge"], rows))


def classes(counts: SizeClasses | None) -> str:
    """Requests by PyTorch's size class: small <= 1 MiB, large under 10 MiB (a 20 MiB segment each), huge."""
    return "n/a" if not counts else f"{counts.small} / {counts.large} / {counts.huge}"


def has_layer(ooms: pd.DataFrame) -> bool:
    return "layer" in ooms and ooms.layer.notna().any()


def layer_cell(event) -> str:
    """One OOM's layer and the bytes that tell it: free inside the allocator's segments, and under the cap."""
    layer = getattr(event, "layer", None)
    if layer is None or pd.isna(layer):
        return "n/a"
    return (f"{layer}: {mib(getattr(event, 'cached_free_bytes', None))} cached free, "
            f"{mib(getattr(event, 'device_free_bytes', None))} free under the cap")


def oom_layers(ooms: pd.DataFrame) -> str:
    """OOMs by engine and layer, where a caching allocator held the KV; "" otherwise."""
    if not has_layer(ooms):
        return ""
    rows = [[engine, LAYER_WORDS.get(layer, layer), len(e), mib(e.cached_free_bytes.max()),
             mib(e.device_free_bytes.max())]
            for (engine, layer), e in ooms[ooms.layer.notna()].groupby(["engine", "layer"], sort=False)]
    return ("<h3>By engine and layer</h3><p class='how'>Which layer failed: the KV policy's, or PyTorch's caching "
            "allocator's. Cached free: inside its segments; free under the cap: never reserved.</p>"
            + table(["engine", "layer", "count", "most cached free", "most free under the cap"], rows))


def sim_allocator_lines(out: SimulationOut) -> list[str]:
    """`fragbench simulate --memory caching`'s text: per policy, what PyTorch's allocator reserved for what it
    allocated, and its OOMs by layer."""
    lines = []
    for name, r in out.policies.items():
        a = r.allocator
        if not a:
            continue
        gib = 2**30
        lines.append(f"  {name}: caching allocator ({a.alloc_conf}): peak reserved "
                     f"{a.peak_reserved_bytes / gib:.2f} GiB for peak allocated "
                     f"{a.peak_allocated_bytes / gib:.2f} GiB; reserved, unallocated "
                     f"{fmt(a.reserved_unallocated_share, '%')} of the budget (time-weighted); after the run "
                     f"{a.reserved_bytes / gib:.2f} GiB reserved, {a.allocated_bytes / gib:.2f} GiB allocated; "
                     f"{a.peak_segments} segments at most, {a.alloc_retries} retries; OOMs "
                     f"{a.oom_policy} policy, {a.oom_allocator} allocator; requests small / large / huge "
                     f"{classes(a.size_classes)}")
    return lines
