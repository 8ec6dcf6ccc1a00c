"""Where the KV's memory comes from: the arena every machine has (arena.py), the real CUDA caching allocator under
a memory fraction (cuda.py, nvml.py), PyTorch's caching allocator emulated rule for rule (blocks.py, caching.py,
expandable.py, allocconf.py, allocstats.py, caching_memory.py) and the invariants it keeps (audit.py), a memory by
its `--memory` name (kinds.py), its state as a `_snapshot()` pickle (snapshot.py), and a real snapshot replayed
through the emulator (snapshot_replay.py)."""
