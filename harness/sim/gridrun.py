"""Running a grid's points: serially, on a local process pool, or as Ray tasks (a local Ray started for the run,
or a running cluster), and the rows they leave.

Every finished point's row is appended to `DIR/grid.rows.jsonl` as soon as it arrives (one JSON line, flushed
and synced), so a grid that is interrupted resumes from the rows already written: a point whose key (its
every value, harness/sim/grid.GridPoint.key) has a row there is not run again. JSON keeps a float exactly
(its shortest round-trip form), so a resumed row is the row a fresh run computes. The table is then the rows in
the grid's own order, whichever order they finished in: the same grid gives the same `grid.parquet` serially,
on the pool and on Ray. On Ray each point is one task, retried by Ray when the worker running it dies
(`max_retries`); the driver writes rows, so a task that ran twice still leaves one.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

from harness.sim.grid import Grid, GridPoint, evaluate

ROWS = "grid.rows.jsonl"
TABLE = "grid.parquet"
RAY_RETRIES = 5  # a task lost with its worker (a node gone, a process killed) runs again, this many times at most


class RayUnavailable(RuntimeError):
    """`--ray` without the extra installed, or a cluster that does not answer: the CLI's one line."""


class RowStore:
    """The rows written so far, by point key; append-only on disk."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / ROWS
        self.rows: dict[str, dict] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # the last line of a run killed while writing it
                    continue
                self.rows[row["key"]] = row

    def add(self, row: dict) -> None:  # the write edge: grid.evaluate's row, one JSONL line, read back as it was
        self.rows[row["key"]] = row
        with self.path.open("a") as f:
            f.write(json.dumps(row, allow_nan=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def run_grid(grid: Grid, out_dir: Path, jobs: int, ray: bool = False, ray_address: str | None = None,
             progress: Callable[[int, int], None] | None = None) -> tuple[pd.DataFrame, int]:
    """Every point's row (the table, in the grid's order) and how many rows were resumed from `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    store = RowStore(out_dir)
    todo = [p for p in grid.points if p.key() not in store.rows]
    resumed = len(grid.points) - len(todo)
    done = resumed
    if progress:
        progress(done, len(grid.points))

    def finished(row: dict) -> None:  # grid.evaluate's row, on its way to the store (RowStore.add)
        nonlocal done
        store.add(row)
        done += 1
        if progress:
            progress(done, len(grid.points))

    if todo:
        if ray or ray_address:
            run_on_ray(todo, finished, jobs, ray_address)
        elif jobs <= 1 or len(todo) == 1:
            for p in todo:
                finished(evaluate(p))
        else:
            with ProcessPoolExecutor(max_workers=min(jobs, len(todo))) as pool:
                for f in as_completed([pool.submit(evaluate, p) for p in todo]):
                    finished(f.result())
    table = grid_table([store.rows[p.key()] for p in grid.points], grid.prices)
    tmp = out_dir / (TABLE + ".tmp")
    table.to_parquet(tmp, index=False)
    tmp.replace(out_dir / TABLE)
    return table, resumed


def grid_table(rows: list[dict], prices: dict[str, float]) -> pd.DataFrame:
    """The rows as one table, with the price columns (a function of the GPU, kept out of the rows so that a new
    price needs no simulation)."""
    table = pd.DataFrame(rows)
    usd = table.gpu.map(prices).astype(float)
    table["usd_per_gpu_hour"] = usd
    table["requests_per_usd"] = np.where(usd > 0, table.requests_per_gpu_hour / usd, np.nan)
    return table


def pareto_front(table: pd.DataFrame, cost: str, value: str = "sustained_rps") -> pd.DataFrame:
    """The rows no other row beats on both: less (or equal) `cost` and more `value`; cheapest first."""
    rows = table[table[cost].notna() & (table[value] > 0)].sort_values([cost, value], ascending=[True, False],
                                                                         kind="stable")
    best, keep = -np.inf, []
    for i, v in zip(rows.index, rows[value], strict=True):
        if v > best:
            keep.append(i)
            best = v
    return rows.loc[keep]


def best_per_model(table: pd.DataFrame) -> pd.DataFrame:
    """Per model, the configuration that serves the traffic cheapest: the most requests per dollar (every preset
    has a price), else the most requests per GPU-hour; ties go to the first in the grid's order."""
    usable = table[table.sustained_rps > 0]
    if usable.empty:
        return usable
    key = "requests_per_usd" if usable.requests_per_usd.notna().all() else "requests_per_gpu_hour"
    order = usable.sort_values(key, ascending=False, kind="stable")
    return order.groupby("model", sort=False).head(1)


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--ray needs Ray, the `ray` extra: pip install 'fragbench[ray]'") from None
    return ray


def check_address(address: str) -> None:
    """An address that no process listens at fails here, at once, in one line (ray.init would retry for a minute
    and then raise at length). `auto` is Ray's own lookup of a cluster started on this machine."""
    if address == "auto":
        return
    host_port = address.split("://", 1)[-1]
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise RayUnavailable(f"--ray-address {address!r}: HOST:PORT of a Ray head (`ray start --head` prints it)")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise RayUnavailable(f"--ray-address {address}: no Ray cluster answers there ({e.strerror or e})") from None


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """Ray's C++ core logs every retry of a connection to the process' stderr (a line a second for some twenty
    seconds where something that is not a Ray head answers): the CLI's one line says it instead."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run_on_ray(todo: list[GridPoint], finished: Callable[[dict], None], jobs: int, address: str | None) -> None:
    """Each point a Ray task: on a local Ray of `jobs` CPUs started for the run (and stopped after it), or on the
    cluster at `address`. Rows are written by this process as the tasks finish."""
    ray = import_ray()
    if address:
        check_address(address)
    try:
        with quiet_stderr():
            if address:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            else:
                ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayUnavailable(f"--ray-address {address}: {str(e).splitlines()[0]}" if address else
                             f"--ray: the local Ray did not start: {str(e).splitlines()[0]}") from None
    try:
        task = ray.remote(num_cpus=1, max_retries=RAY_RETRIES)(evaluate)
        pending = [task.remote(p) for p in todo]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            finished(ray.get(ready[0]))
    finally:
        ray.shutdown()


__all__ = ["RayUnavailable", "best_per_model", "check_address", "grid_table", "import_ray", "pareto_front", "run_grid"]
