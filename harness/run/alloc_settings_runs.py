"""`bench --compare-alloc-conf CONF` (make bench ALLOC_CONFS=...): the engines whose KV a caching allocator
places piece by piece (the contiguous ones and hf) run again under each other PYTORCH_CUDA_ALLOC_CONF setting,
one run each inside the run's folder (`alloc_confs/<n>-<setting>/`, a whole run directory with its own
summary.json), read back side by side by harness/analysis/alloc_settings_summary.py.

Each setting's run gets the time the run's own `--time` gave the same engines: --time x (its engines / the
run's engines), so that every setting's searches are as long as the first setting's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from harness.analysis.alloc_settings_summary import SETTINGS_DIR, compared_engines, setting_id
from harness.run.config import BenchConfig


def setting_config(cfg: BenchConfig, run_dir: Path, number: int, conf: str) -> BenchConfig:
    """The run's configuration for one more setting: its compared engines alone, the same traffic, model and
    budget, no targets and no further budgets, the time the run gave those engines."""
    engines = compared_engines(cfg.engines)
    return replace(cfg, engines=engines, alloc_conf=conf, compare_alloc_confs=[], targets={}, kv_budgets=[],
                   run_id=setting_id(number, conf), out_dir=run_dir / SETTINGS_DIR,
                   time_s=cfg.time_s * len(engines) / max(1, len(cfg.engines)),
                   engine_args={e: a for e, a in cfg.engine_args.items() if e in engines})


def run_settings(cfg: BenchConfig, run_dir: Path, bench_of: Callable[[BenchConfig], object],
                 say: Callable[[str], None]) -> None:
    """Every compared setting's run, one after another, each written as it is produced (a killed run keeps the
    settings it finished). `bench_of` makes a Bench (handed in: this module lies below bench.py)."""
    for number, conf in enumerate(cfg.compare_alloc_confs, start=1):
        sub = setting_config(cfg, run_dir, number, conf)
        if not sub.engines:
            return
        say(f"allocator setting {conf!r}: {', '.join(sub.engines)} again, {sub.time_s:.0f} s")
        bench_of(sub).run()
