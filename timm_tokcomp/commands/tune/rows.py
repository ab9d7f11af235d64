"""What tune measures and decides, as data: a candidate (a setting on one path and mode), the CSV row of one
candidate at one batch size, and the choice for a batch size."""
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ...measure.stats import loss_bounds

# a row's statuses as the stages move it: WAITING (nothing measured), SCREENED (the timing screen's speed-up, not
# surely slower: waiting for its accuracy check, then, as a finalist, for its re-timing), TIMED (re-timed: the choice
# reads these), 'pruned: ...' / 'failed: ...' (final), NOT_REACHED (the time budget ended first; a resume measures it)
WAITING, SCREENED, TIMED = "waiting", "screen-timed", "timed"
NOT_REACHED = "not reached: time budget"  # with the stage in parentheses

# what the budget limits, in the units of --budget: top-1 when the images have labels, agreement without them
BUDGET_MEASURES = {"top1": "points of top-1 lost", "agreement": "% of the plain model's predictions changed"}


@dataclass(frozen=True)
class Candidate:
    """One way to run one setting: method and params (kernel and prop_attn included) in an execution mode.
    setting: the method and parameters that decide accuracy (kernel and prop_attn implementation left out)."""

    method: str
    params: Tuple[Tuple[str, Any], ...]
    mode: str

    @property
    def kwargs(self) -> Dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.params}

    @property
    def setting(self) -> str:
        shown = {k: v for k, v in self.kwargs.items() if k not in ("kernel", "prop_attn")}
        prop = self.kwargs.get("prop_attn")
        if prop is not None:
            shown["prop_attn"] = prop is not False
        return label(self.method, shown)

    @property
    def path(self) -> str:
        """The kernel / proportional-attention implementation, e.g. 'triton, fold'."""
        kw = self.kwargs
        parts = [kw["kernel"]] if "kernel" in kw else []
        if kw.get("prop_attn") not in (None, False):
            parts.append(str(kw["prop_attn"]))
        return ", ".join(parts) or "-"

    @property
    def name(self) -> str:
        return f"{self.setting} [{self.path}] {self.mode}"


def label(method: str, params: Dict[str, Any]) -> str:
    """'tome r=16', 'tome flops_ratio=2.0 prop_attn=False'."""
    return " ".join([method] + [f"{k}={v}" for k, v in sorted(params.items())])


@dataclass
class TuneRow:
    """One candidate at one batch size. status: WAITING, SCREENED, TIMED, 'pruned: ...' (surely slower than
    plain in the timing screen, budget broken on the screening or held-out images, stronger than a setting above the
    budget, MACs that cannot beat the best speed-up, another path whose default is no contender), 'failed: ...',
    NOT_REACHED (the time budget ended first). gmacs: per image; mac_ratio: plain / this;
    screen_agree: % agreement on the screening images (screen_n of them), screen_loss: the loss there in the
    budget's measure (BUDGET_MEASURES); ms: median per forward, ms_plain the plain model's in the same mode;
    speedup (the geometric mean of the rounds' ratios) with its 95 % interval (the timing screen's
    until a finalist is re-timed); agree: % held-out agreement
    (agree_n images, changed: images whose top-1 class differs from the plain model's; gained / lost: images it
    gets right where the plain model did not and the reverse); top1 / top1_plain on labelled data with the exact
    McNemar p of the paired split; chosen: this batch size's choice."""

    batch: int
    mode: str
    candidate: str
    setting: str
    path: str
    method: str
    params: str
    status: str = WAITING
    gmacs: Optional[float] = None
    mac_ratio: Optional[float] = None
    screen_agree: Optional[float] = None
    screen_n: Optional[int] = None
    screen_loss: Optional[float] = None
    ms_plain: Optional[float] = None
    ms: Optional[float] = None
    speedup: Optional[float] = None
    speedup_lo: Optional[float] = None
    speedup_hi: Optional[float] = None
    rounds: Optional[int] = None
    agree: Optional[float] = None
    agree_n: Optional[int] = None
    changed: Optional[int] = None
    gained: Optional[int] = None
    lost: Optional[int] = None
    top1_plain: Optional[float] = None
    top1: Optional[float] = None
    top1_p: Optional[float] = None
    chosen: bool = False

    def loss(self, measure: str) -> Optional[float]:
        """The held-out loss in the budget's measure: points of top-1 lost ('top1'), or % of the predictions
        changed ('agreement'); None where not measured."""
        if measure == "top1":
            return None if self.top1 is None else self.top1_plain - self.top1
        return None if self.agree is None else 100.0 - self.agree

    def loss_upper(self, measure: str) -> Optional[float]:
        """The held-out loss's one-sided 95 % upper bound in the budget's measure (kit.stats.loss_bounds): what the
        budget is judged on; None where not measured."""
        if self.agree_n is None:
            return None
        return loss_bounds(measure, self.agree_n, self.changed, self.gained or 0, self.lost or 0)[2]

    def keeps(self, measure: str, budget: float) -> bool:
        """Whether its held-out loss keeps `budget` at the one-sided 95 % upper bound (False where not measured):
        the promise tune makes."""
        upper = self.loss_upper(measure)
        return upper is not None and upper <= budget + 1e-9


@dataclass
class Choice:
    """The choice for one batch size: row None means 'no reduction', and reason says why."""

    batch: int
    row: Optional[TuneRow]
    reason: str
