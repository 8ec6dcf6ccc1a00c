"""A rich bar on stderr while simulations run (a sweep is many of them)."""

from __future__ import annotations


class SimulationProgress:
    """`with SimulationProgress() as update:` hands `update(done, total)` to `run_simulation`."""

    def __enter__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("simulate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True), transient=True)
        self.bar.start()
        self.task = None
        return self.update

    def update(self, done: int, total: int) -> None:
        if self.task is None or done == 0:
            self.task = self.bar.add_task("", total=total)
        self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        self.bar.stop()
