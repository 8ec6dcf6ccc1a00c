"""What a bench says as it runs: progress bars on a terminal, one plain line per phase elsewhere (cron, CI logs),
and the verdict on both."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console as RichConsole
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

Show = Callable[[str, float], None]  # one bar's text and how far along it is (seconds)
Shower = Callable[[str, float], Show]  # a new bar: its label and its total


class Console:
    def __init__(self, rich: RichConsole | None = None):
        self.rich = rich or RichConsole(stderr=True)

    def say(self, line: str) -> None:
        """A line every console shows, a terminal's too (the verdict)."""
        if self.rich.is_terminal:
            self.rich.print(line, markup=False, highlight=False)
        else:
            self.plain(line)

    def plain(self, line: str) -> None:
        """Progress where no terminal shows the bars (cron, CI logs): one line per phase."""
        if not self.rich.is_terminal:
            print(f"fragbench bench: {line}", file=sys.stderr, flush=True)

    @contextmanager
    def progress(self) -> Iterator[Shower]:
        """The run's bars: the shower it yields makes one bar per engine (and budget) and one for the decision."""
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=self.rich) as progress:
            def shower(engine: str, total: float) -> Show:
                task = progress.add_task(f"{engine:<6} starting", total=max(total, 1.0))
                return lambda text, done: progress.update(task, description=text, completed=min(done, total))

            yield shower
