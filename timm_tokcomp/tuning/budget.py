"""tune's time budget: one wall-clock allowance split into stage deadlines, the plan and estimate printed before
any work, and the progress bar whose total is fixed from the start."""
import math
import sys
import time
from typing import TYPE_CHECKING, Dict, List, Optional

from tqdm import tqdm

from ..checks import check_real

if TYPE_CHECKING:
    from .search import SettingFacts

# when each stage must end, as a fraction of the budget (every batch of images and every timed round reads it); time a
# stage does not use passes to the next one; loading the images ends by 20 % (keeping at least enough to hold some
# out), the accuracy search by 65 %, timing by 95 %, and the last 5 % are for checking the choice on its own path
STAGE_ENDS = {"loading": 0.2, "accuracy": 0.65, "timing": 0.95, "choice": 1.0}


def monotonic() -> float:
    """The clock the budget reads (seconds); a test replaces it with recorded time."""
    return time.monotonic()


def count(n: int, noun: str) -> str:
    """'1 setting', '3 settings'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def check_time_budget(minutes: Optional[float]) -> None:
    if minutes is not None:
        check_real("--time-budget", minutes, note="(minutes; None: no limit)")


class TimeBudget:
    """minutes of wall time from now (None: no limit); stage s must end by STAGE_ENDS[s] of it."""

    def __init__(self, minutes: Optional[float]):
        check_time_budget(minutes)
        self.minutes, self.start = minutes, monotonic()

    @property
    def seconds(self) -> float:
        return math.inf if self.minutes is None else 60.0 * self.minutes

    def elapsed(self) -> float:
        return monotonic() - self.start

    def over(self, stage: str) -> bool:
        """True once stage's deadline has passed."""
        return self.elapsed() >= STAGE_ENDS[stage] * self.seconds

    def text(self) -> str:
        """'3.2 of 15 min' (elapsed of the budget)."""
        limit = "no limit" if self.minutes is None else f"{self.minutes:g} min"
        return f"{self.elapsed() / 60:.1f} min of {limit}"


def plan_text(settings: int, candidates: int, modes: List[str], images: int, screen: int, batches: List[int],
              rounds: int, budget: TimeBudget) -> str:
    """The plan, printed before any work: what tune will measure at most."""
    return (f"tune plan: {count(settings, 'setting')} on {count(candidates, 'path')} and modes ({', '.join(modes)}); "
            f"{images} images "
            f"({screen} to screen, {images - screen} held out); batches {', '.join(map(str, batches))}, up to "
            f"{rounds} timed rounds per candidate; time budget "
            f"{'none' if budget.minutes is None else f'{budget.minutes:g} min'}")


def estimate_text(seconds_per_image: float, mac_ratios: Dict[str, float], screen: int, held_out: int,
                  timing_images: int, budget: TimeBudget) -> str:
    """From the plain model's first timed forward: how long each stage would take without stopping early (a
    setting's forward costs the plain one's divided by its MAC ratio), and whether the budget bounds it."""
    reduced = sum(1.0 / max(r, 1e-6) for r in mac_ratios.values())
    stages = {"screening": screen * seconds_per_image * reduced,
              "held-out check": held_out * seconds_per_image * reduced,
              "timing": timing_images * seconds_per_image}
    shown = ", ".join(f"{k} {v / 60:.1f} min" for k, v in stages.items())
    total = sum(stages.values())
    verdict = ("within the budget" if total <= budget.seconds else
               "the budget ends it earlier: what is not reached is said at the end")
    return (f"tune estimate (the plain model's first forward: {1e3 * seconds_per_image:.2f} ms per image): {shown} "
            f"without stopping early; {verdict}")


def search_text(facts: Dict[str, "SettingFacts"], seconds_per_image: float, screen: int, held_out: int,
                budget: TimeBudget) -> str:
    """The search's plan, printed before it: its axes, the twins checked once, the checks bisection makes at most,
    how many the accuracy stage fits at this machine's speed (a check: the screening images and, at most, every
    held-out image, at the setting's MAC ratio) and the order of the first round."""
    from .search import Bisection, make_axes

    axes, twins = make_axes(facts.values())
    search = Bisection(axes)
    first_round = [search.axes[i][(search.lo[i] + search.hi[i]) // 2] for i in range(len(axes))]
    costs = [(screen + held_out) * seconds_per_image / max(facts[s].mac_ratio, 1e-6) for s in first_round]
    seconds, fits = STAGE_ENDS["accuracy"] * budget.seconds - budget.elapsed(), 0
    for cost in costs:
        if seconds < cost:
            break
        seconds, fits = seconds - cost, fits + 1
    reach = ("every axis's first check fits the accuracy stage without stopping early" if fits == len(costs) else
             f"without stopping early, the accuracy stage fits the first checks of {fits} of them "
             f"({', '.join(first_round[:fits]) or 'none'}); stopping early reaches further")
    axes_text = f"{len(axes)} method {'axis' if len(axes) == 1 else 'axes'}"
    return (f"tune search: {count(len(facts), 'setting')} on {axes_text} (bisected for the "
            f"strongest setting within the budget, at most {search.most_checks()} checks); {len(twins)} the same "
            f"token schedule as another, checked once; first round: {', '.join(first_round)}; {reach}")


class StageBar:
    """A progress bar whose total is fixed from the start: one unit per screened setting, per held-out setting,
    per timing round a candidate may take and per checked choice; work that stopping early or the budget makes
    unnecessary is credited at once, so the bar always ends full. Stage lines go to stderr above it."""

    def __init__(self, total: int, budget: TimeBudget, show: bool):
        self.budget, self.lines, self.name = budget, [], "starting"
        # no remaining-time guess from the steps: most timing steps end early, and the budget is the limit shown
        # (set_description appends ": " to the text it gets; the constructor takes it as given)
        self.bar = tqdm(total=total, desc=f"tune: starting ({budget.text()}): ", disable=not show, file=sys.stderr,
                        bar_format="{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps")

    def stage(self, name: str) -> None:
        self.name = name
        self.bar.set_description(f"tune: {name} ({self.budget.text()})")

    def update(self, n: int = 1) -> None:
        self.bar.set_description(f"tune: {self.name} ({self.budget.text()})", refresh=False)
        self.bar.update(n)

    def say(self, line: str) -> None:
        """A stage line: printed above the bar (always, on stderr) and kept for table.md."""
        self.lines.append(line)
        tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()
