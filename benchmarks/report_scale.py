"""How the report scales with the run's length: its size and the time headless Chromium takes to draw it,
for a synthetic one-minute and one-hour run of three engines (10 Hz samples, 5 requests/s, OOM events).

Run by hand:  .venv/bin/python benchmarks/report_scale.py [--minutes 60]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from harness.analysis.summary import finalize
from harness.run.synthetic import write_run
from harness.views.report import render

ENGINES = {"static-max": {"token_states": 0.2, "running": 3, "ttft_s": 0.1},
           "static-oracle": {"token_states": 0.45, "running": 10, "ttft_s": 0.3},
           "paged": {"token_states": 0.93, "running": 15, "ttft_s": 0.5}}


def measure(minutes: float, ooms: int, tmp: Path) -> tuple[int, float, float]:
    run = write_run(tmp / f"run-{minutes:g}m", ENGINES, duration_s=60 * minutes, ooms=ooms)
    start = time.perf_counter()
    finalize(run)
    out = render(run, tmp / f"run-{minutes:g}m.html")
    rendered = time.perf_counter() - start
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    drawn = float("nan")
    if chromium:
        start = time.perf_counter()
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp / 'c'}",
                        "--virtual-time-budget=30000", "--dump-dom", out.as_uri()], capture_output=True, timeout=300)
        drawn = time.perf_counter() - start
    return out.stat().st_size, rendered, drawn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=60.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        print(f"{'run':>10}{'OOM events':>12}{'report MB':>11}{'fragbench report s':>20}{'chromium draws s':>18}")
        for minutes, ooms in ((1.0, 171), (args.minutes, 5000)):
            size, rendered, drawn = measure(minutes, ooms, Path(d))
            print(f"{minutes:>8g} m{ooms:>12}{size / 1e6:>11.2f}{rendered:>20.1f}{drawn:>18.1f}", flush=True)


if __name__ == "__main__":
    main()
