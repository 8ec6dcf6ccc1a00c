"""Does the twin predict a workload its step model never saw? Each engine's step model is fitted on one
bench run's steps (--fit) and the twin replays another run (--check: another workload, its own
measurement), point by point, exactly as bench's own twin does.

Run by hand:  .venv/bin/python benchmarks/twin_transfer.py --fit results/RUN_A --check results/RUN_B

Prints, per engine, the measured sustained rate (with its 90 % interval), the twin's, the signed errors
(twin / measured - 1; the token-state share as a difference in points), and every ratio between two
engines measured and simulated.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from harness.analysis.rundir import load_meta
from harness.sim.stepfit import run_steps
from harness.sim.twin import run_twin


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", required=True, help="the run whose engine steps the step models are fitted on")
    ap.add_argument("--check", required=True, help="the run the twin replays and is compared with")
    args = ap.parse_args()
    fit_dir, check_dir = Path(args.fit), Path(args.check)
    meta, summary = load_meta(check_dir), json.loads((check_dir / "summary.json").read_text())
    twin = run_twin(meta, run_steps(fit_dir), summary)
    measured = summary["capacity"]
    print(f"step models fitted on {fit_dir.name} ({load_meta(fit_dir)['config']['workload']}); twin of "
          f"{check_dir.name} ({meta['config']['workload']})")
    for engine, t in twin.items():
        m, e = measured[engine], t["error"]
        ci = m.get("sustained_rps_ci") or [None, None]
        print(f"{engine:<14} measured {m['sustained_rps']:.3f} [{ci[0]}, {ci[1]}] twin {t['sustained_rps']:.3f} "
              f"error {100 * e['sustained_rps']:+.0f} %; mean running {fmt(e['mean_running'])}, TTFT p50 "
              f"{fmt(e['ttft_p50_s'])}, TPOT p50 {fmt(e['tpot_p50_s'])}, token share "
              f"{100 * (e['token_states_share'] or 0):+.1f} pts (fit R² {t['step_model']['fit_r2']:.3f})")
    for a, b in itertools.combinations(twin, 2):
        if measured[b]["sustained_rps"] and twin[b]["sustained_rps"]:
            print(f"{a}/{b}: measured {measured[a]['sustained_rps'] / measured[b]['sustained_rps']:.2f}x, twin "
                  f"{twin[a]['sustained_rps'] / twin[b]['sustained_rps']:.2f}x")


def fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:+.0f} %"


if __name__ == "__main__":
    main()
