"""tune's time budget: one wall-clock allowance split into stage deadlines, the plan printed before any work, and
the progress bar of the work being done now."""
import math
import sys
import time
from typing import List, Optional

from tqdm import tqdm

from ...utils.checks import optional, real

# when each stage must end, as a fraction of the budget (every batch of images and every timed round reads it); time a
# stage does not use passes to the next one: loading the images by 15 % (keeping at least enough to hold some out),
# the timing screen by 45 %, the accuracy checks by 85 %, re-timing the finalists by 95 %, and the last 5 % are for
# checking the choice on its own path
STAGE_ENDS = {"loading": 0.15, "screen": 0.45, "accuracy": 0.85, "timing": 0.95, "choice": 1.0}


def monotonic() -> float:
    """The clock the budget reads (seconds); a test replaces it with recorded time."""
    return time.monotonic()


def count(n: int, noun: str) -> str:
    """'1 setting', '3 settings'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


TIME_BUDGET = optional(real("--time-budget", note="(minutes; None: no limit)"))  # the flag's check, and TimeBudget's


class TimeBudget:
    """minutes of wall time from now (None: no limit); stage s must end by STAGE_ENDS[s] of it."""

    def __init__(self, minutes: Optional[float]):
        TIME_BUDGET(minutes)
        self.minutes, self.start = minutes, monotonic()
        self.offset = 0.0  # seconds used before the current pass of the stages (rebase)

    @property
    def seconds(self) -> float:
        return math.inf if self.minutes is None else 60.0 * self.minutes

    def elapsed(self) -> float:
        return monotonic() - self.start

    def over(self, stage: str) -> bool:
        """True once stage's deadline has passed: its share of what was left when this pass began."""
        return self.elapsed() >= self.offset + STAGE_ENDS[stage] * (self.seconds - self.offset)

    def left(self) -> float:
        """Seconds left (inf: no limit)."""
        return self.seconds - self.elapsed()

    def rebase(self) -> None:
        """A new pass of the stages: they share what is left, in the same proportions."""
        self.offset = self.elapsed()

    def text(self) -> str:
        """'3.2 of 15 min' (elapsed of the budget)."""
        limit = "no limit" if self.minutes is None else f"{self.minutes:g} min"
        return f"{self.elapsed() / 60:.1f} min of {limit}"


def plan_text(settings: int, candidates: int, modes: List[str], images: int, screen: int, batches: List[int],
              rounds: int, screen_rounds: int, budget: TimeBudget, budget_line: str, promisable: float) -> List[str]:
    """The plan, printed before any work, in three short lines: what is measured, in which order, and which losses
    the held-out images can promise."""
    limit = "no time limit" if budget.minutes is None else f"{budget.minutes:g} minutes"
    held = images - screen
    can = (f"a setting whose true loss is about {promisable:.2f} or less (at 2 % of images changing, as for ToMe "
           f"r = 8 on DeiT-Tiny)" if promisable > 0 else "no setting: too few images (docs/speed.md: images needed)")
    return [f"tune: {count(settings, 'setting')} ({count(candidates, 'path')}, {', '.join(modes)}) at batch "
            f"{', '.join(map(str, batches))}; {images} images ({screen} to screen, {held} held out); {limit}",
            f"order: time every setting against plain ({screen_rounds} rounds), check accuracy fastest first, "
            f"re-time the finalists on every path (up to {rounds} rounds)",
            f"{budget_line}: {held} held-out images can promise {can}"]


class StageBar:
    """A progress bar for the work being done now: each stage (a batch size's timing, a setting's accuracy check)
    starts it again with that work's total and unit, and credits what ends early. Stage lines go to stderr above
    it and are kept for table.md."""

    def __init__(self, budget: TimeBudget, show: bool):
        self.budget, self.lines, self.name, self.show = budget, [], "starting", show
        self.bar = None  # shown from the first piece of work

    def _desc(self) -> str:
        return f"tune: {self.name} ({self.budget.text()}) "

    def start(self, name: str, total: int, unit: str) -> None:
        """A new piece of work: the bar counts its `total` units from 0."""
        self.name = name
        if self.bar is None:
            self.bar = tqdm(total=max(total, 1), desc=self._desc(), disable=not self.show, file=sys.stderr,
                            unit=unit, bar_format="{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit}")
            return
        self.bar.unit = unit
        self.bar.reset(total=max(total, 1))
        self.bar.set_description_str(self._desc())

    def update(self, n: int = 1) -> None:
        if self.bar is None:
            return
        n = min(n, self.bar.total - self.bar.n)
        if n > 0:
            self.bar.set_description_str(self._desc(), refresh=False)
            self.bar.update(n)

    def finish(self) -> None:
        """The piece of work has ended: what it did not need (an early stop, a pruned candidate) is credited."""
        if self.bar is not None:
            self.update(self.bar.total - self.bar.n)

    def say(self, line: str) -> None:
        """A stage line: printed above the bar (always, on stderr) and kept for table.md."""
        self.lines.append(line)
        tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
