"""Refresh the operating-point table (harness/analysis/operating_points.json) from recorded runs, by its rule:
per workload, KV budget and model, each engine's grid rate at or under half the median lower end of its
sustained-rate interval over the runs whose knee was bracketed (harness/analysis/operating.rule_rate).

    .venv/bin/python scripts/operating_points.py RESULTS_DIR [RESULTS_DIR ...] [--write]

Prints the table it would write; --write replaces the repository's table (the tables of other workloads, budgets
and models are kept)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from harness.analysis.operating import TABLE, rule_rate, table_key
from harness.analysis.records import RunRecord


def lower_ends(run_dirs: list[Path]) -> dict[str, dict[str, list[float]]]:
    """Per table key and engine, the lower ends of the bracketed sustained-rate intervals the runs measured."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in run_dirs:
        summary, meta = run / "summary.json", run / "run.json"
        if not (summary.is_file() and meta.is_file()):
            continue
        run_meta = json.loads(meta.read_text())
        cfg, budget = run_meta.get("config", {}), RunRecord.of(run_meta).config.budget
        if budget is None:  # targets alone (`own`): no budget of ours, no key in the table
            continue
        key = table_key(cfg["workload"], budget.bytes, cfg["model"])
        for engine, cap in (json.loads(summary.read_text()).get("capacity") or {}).items():
            if (cap.get("knee") or {}).get("bracketed") and cap.get("sustained_rps_ci"):
                out[key][engine].append(float(cap["sustained_rps_ci"][0]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="results folders (or run folders) to read")
    ap.add_argument("--write", action="store_true", help="replace the repository's table (default: print only)")
    args = ap.parse_args()
    runs = [d for r in args.results for d in ([r] if (r / "summary.json").is_file() else sorted(r.glob("*/")))]
    found = {key: {e: rate for e, ends in engines.items() if (rate := rule_rate(ends)) is not None}
             for key, engines in lower_ends(runs).items()}
    if not found:
        print("operating_points: no run with a bracketed knee under " + ", ".join(map(str, args.results)),
              file=sys.stderr)
        return 2
    table = json.loads(TABLE.read_text())
    table["tables"].update(found)
    table["source"] = f"refreshed from {len(runs)} runs: " + ", ".join(r.name for r in runs)
    print(json.dumps(found, indent=2))
    if args.write:
        TABLE.write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
