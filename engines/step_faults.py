"""Step faults, to test a regression gate: an engine made slower on purpose, as a code change would make it
(`serve --slow-step F`, `serve --burn-step F`).

A scheduled engine applies them inside its step, after the forward (and its logits' processing) and before the
step's tokens go out, so that what a regression moves moves with them: the tokens' TTFT and TPOT, and the step's
`duration_s` (steps.parquet, --step-log). Two forms:
- slow (`--slow-step F`): the step sleeps (F - 1) x its own time so far. The core is free meanwhile: a slower device
  or a lock, not more arithmetic; an instruction count does not see it.
- burn (`--burn-step F`): the step repeats its own forward and logits processing (some 96 % of a tiny-model step's
  work; the scheduling and sampling are not repeated), so it computes about (F - 1) x its work more on the core, as
  a real regression does (a busier machine slows it as it slows the rest, and an instruction count sees it). A
  forward is repeated whole: a credit of F - 1 accrues every step and each whole unit of it is one more forward,
  so over any n steps with n x (F - 1) whole the step does exactly that many forwards more (F = 1.2: one in five
  steps runs its forward twice), and the K/V it rewrites is the same bytes in the same rows.
Engines whose steps are not fragbench's (hf, hf-cb) take `--slow-step` after their step, on the server's engine
thread (engines/api/server.py), and no `--burn-step`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction


@dataclass
class StepFault:
    slow: float = 1.0  # every step takes this many times its time (a sleep inside it)
    burn: float = 1.0  # every step computes this many times its forward (repeated forwards, on average)
    # the burn's unspent credit, in forwards: exact (a Fraction of F's decimal text), so that 5 steps at 1.2
    # repeat one forward and not, by a float's rounding, none
    _credit: Fraction = field(default=Fraction(0), repr=False)

    @property
    def active(self) -> bool:
        return self.slow > 1.0 or self.burn > 1.0

    def after_forward(self, started_s: float, forward: Callable[[], object]) -> None:
        """Inside a step, once its forward has run and before its tokens go out: repeat `forward` (the step's
        forward and logits processing) as the burn's credit allows (the burn first, so the sleep scales the step's
        time with it: slow and burn multiply), then sleep (slow - 1) x the step's time since `started_s`
        (time.perf_counter())."""
        if self.burn > 1.0:
            self._credit += Fraction(repr(self.burn)) - 1
            while self._credit >= 1:
                forward()
                self._credit -= 1
        self.sleep_after(started_s)

    def sleep_after(self, started_s: float) -> None:
        """The slow form alone: sleep (slow - 1) x the time since `started_s`."""
        if self.slow > 1.0:
            time.sleep((self.slow - 1.0) * (time.perf_counter() - started_s))

