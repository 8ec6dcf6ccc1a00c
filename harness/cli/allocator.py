"""`fragbench allocator replay`: a real CUDA memory snapshot's trace through the caching allocator emulator
under one or more PYTORCH_CUDA_ALLOC_CONF settings (engines/memory/snapshot_replay.py holds the logic)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.cli.args import size_arg, usage_errors
from harness.cli.engine_flags import alloc_conf_arg
from harness.cli.user_paths import file_out
from harness.units import format_bytes


def register(sub) -> None:
    verb = sub.add_parser("allocator", help="PyTorch's caching allocator, emulated: replay a real memory snapshot")
    actions = verb.add_subparsers(dest="allocator_action", required=True, parser_class=type(verb))
    replay = actions.add_parser("replay", help="replay a torch.cuda.memory._snapshot() pickle's trace under "
                                "allocator settings and a cap")
    replay.add_argument("snapshot", help="a pickle from torch.cuda.memory._snapshot(), recorded with "
                        "torch.cuda.memory._record_memory_history()")
    replay.add_argument("--capacity", type=size_arg,
                        help="cap on reserved bytes, as torch.cuda.set_per_process_memory_fraction sets it, e.g. "
                             "40GiB (default: none, the replay never runs out)")
    replay.add_argument("--device-memory", type=size_arg, metavar="SIZE",
                        help="the total memory of the device the trace ran on, e.g. 80GiB: an expandable segment's "
                             "virtual range is 9/8 of it, and its pages map past --capacity until it runs out "
                             "(default: what the recording noted, else 64 TiB: never refused)")
    replay.add_argument("--alloc-conf", action="append", type=alloc_conf_arg, metavar="CONF",
                        help="a PYTORCH_CUDA_ALLOC_CONF setting, e.g. expandable_segments:True; repeat to compare "
                             "several (default: PyTorch's defaults alone)")
    replay.add_argument("--json", action="store_true", help="print a JSON list, one object per setting")
    replay.add_argument("--dump", metavar="FILE", type=file_out,
                        help="write the final state as a snapshot pickle that python -m torch.cuda._memory_viz stats "
                             "reads (FILE-1, FILE-2... with several settings) (default: none)")
    replay.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load the replay (pickle, difflib)
    from engines.memory.allocconf import parse_alloc_conf
    from engines.memory.snapshot_replay import SnapshotError, dump_paths, load_trace, replay

    with usage_errors(SnapshotError):
        trace = load_trace(args.snapshot)
    confs = [parse_alloc_conf(text) for text in (args.alloc_conf or [""])]
    dumps = dump_paths(Path(args.dump), len(confs)) if args.dump else [None] * len(confs)
    results = [replay(trace, args.capacity, conf, dump, args.device_memory)
               for conf, dump in zip(confs, dumps, strict=True)]
    if args.json:
        print(json.dumps([r.contract() for r in results], indent=2))
        return 0
    cap = format_bytes(args.capacity) if args.capacity else "none"
    print(f"{args.snapshot}: device {trace.device}, {len(trace.events)} events replayed, cap {cap}")
    for r in results:
        oom = "none" if r.oom is None else (
            f"event {r.oom.event_index}: {format_bytes(r.oom.requested_bytes)} requested, "
            f"{format_bytes(r.oom.cached_free_bytes)} cached free, "
            f"{format_bytes(r.oom.device_free_bytes)} free under the cap")
        print(f"  {r.alloc_conf}: peak reserved {format_bytes(r.peak_reserved_bytes)}, peak allocated "
              f"{format_bytes(r.peak_allocated_bytes)}, segments max {r.segments_max}, retries {r.alloc_retries}, "
              f"first OOM {oom}")
        if args.capacity and r.peak_reserved_bytes > args.capacity:  # only expandable segments get there
            print(f"    reserved {format_bytes(r.peak_reserved_bytes - args.capacity)} past the cap: the fraction is "
                  "checked before a request's pages map, and they map whole")
        if r.segment_events_trace:
            print(f"    segment events reproduced exactly: {r.segment_events_matched} of {r.segment_events_trace}")
            for m in r.mismatches[:20]:  # each with the allocator rule it most likely breaks
                print(f"    {m.describe()}")
        if r.unknown_frees:
            print(f"    {r.unknown_frees} frees of blocks allocated before the trace began, skipped")
    for path in filter(None, dumps):
        print(f"final state: {path}")
    return 0
