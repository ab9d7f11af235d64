"""Which settings tune checks, pure logic: a method's settings that differ only in strength (r, keep rate,
flops_ratio) lie on one axis, along which the loss grows with the MACs saved; each axis is searched by bisection for
its strongest setting within the budget, the axes in turns; settings with the same token schedule on one axis (tome
r=16 and flops_ratio=2.0) are one setting, checked once.

    axes = make_axes(settings)          # [[mildest, ..., strongest], ...] of representatives
    search = Bisection(axes)
    while (setting := search.next()) is not None:
        search.record(setting, within=...)   # or search.give_up(setting): not decided (time budget)
"""
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

# the parameters that set a method's strength: along them the loss grows with the MACs saved
STRENGTH_PARAMS = ("r", "flops_ratio", "keep_rate")


@dataclass(frozen=True)
class SettingFacts:
    """What the search knows of a setting before checking it: its method, its other parameters (what fixes its axis),
    its MAC ratio (plain / its MACs) and its token schedule (tokens entering each block on one image)."""

    name: str
    method: str
    params: Dict[str, Any]
    mac_ratio: float
    schedule: Tuple[int, ...]

    @property
    def axis(self) -> Tuple[str, str]:
        rest = {k: v for k, v in self.params.items() if k not in STRENGTH_PARAMS}
        return self.method, repr(sorted(rest.items()))


def make_axes(settings: Iterable[SettingFacts]) -> Tuple[List[List[str]], Dict[str, str]]:
    """(the axes, each its settings' names from the mildest to the strongest (MAC ratio, then name); {twin: the
    setting of the same axis and token schedule that stands for it}). The first of twins by name stands for them."""
    groups: Dict[Tuple[str, str], List[SettingFacts]] = {}
    for s in sorted(settings, key=lambda s: s.name):
        groups.setdefault(s.axis, []).append(s)
    axes, twins = [], {}
    for members in groups.values():
        seen: Dict[Tuple[int, ...], str] = {}
        kept = []
        for s in members:
            if s.schedule in seen:
                twins[s.name] = seen[s.schedule]
            else:
                seen[s.schedule] = s.name
                kept.append(s)
        axes.append([s.name for s in sorted(kept, key=lambda s: (s.mac_ratio, s.name))])
    axes.sort(key=lambda names: names[0])
    return axes, twins


class Bisection:
    """Per axis, the strongest setting within the budget, found by bisection: lo is the strongest setting known
    within (-1: none yet), hi the mildest known above (len: none); a check of the middle setting moves one of them.
    The axes take turns, so each gets its first check before any gets a second."""

    def __init__(self, axes: Sequence[Sequence[str]]):
        self.axes = [list(a) for a in axes]
        self.lo = [-1] * len(self.axes)
        self.hi = [len(a) for a in self.axes]
        self.stopped = [False] * len(self.axes)  # a check that could not be decided (time budget)
        self.verdicts: Dict[str, bool] = {}  # checked setting -> within
        self._turn = 0

    def _open(self, i: int) -> bool:
        return not self.stopped[i] and self.hi[i] - self.lo[i] > 1

    def next(self) -> Optional[str]:
        """The next setting to check, or None when every axis is decided (or stopped)."""
        for step in range(len(self.axes)):
            i = (self._turn + step) % len(self.axes)
            if self._open(i):
                self._turn = i + 1
                return self.axes[i][(self.lo[i] + self.hi[i]) // 2]
        return None

    def _axis(self, name: str) -> Tuple[int, int]:
        return next((i, a.index(name)) for i, a in enumerate(self.axes) if name in a)

    def record(self, name: str, within: bool) -> None:
        """A checked setting's verdict: within the budget (so is every milder one) or above it (so is every stronger
        one)."""
        i, j = self._axis(name)
        self.verdicts[name] = within
        if within:
            self.lo[i] = max(self.lo[i], j)
        else:
            self.hi[i] = min(self.hi[i], j)

    def give_up(self, name: str) -> None:
        """The check of name was not decided: its axis is searched no further."""
        self.stopped[self._axis(name)[0]] = True

    def implied(self) -> Dict[str, Tuple[bool, str]]:
        """Unchecked settings whose verdict follows from a checked one on their axis: name -> (within, that one)."""
        out = {}
        for i, names in enumerate(self.axes):
            for j, name in enumerate(names):
                if name in self.verdicts:
                    continue
                if j < self.lo[i]:
                    out[name] = (True, names[self.lo[i]])
                elif j > self.hi[i] and self.hi[i] < len(names):
                    out[name] = (False, names[self.hi[i]])
        return out

    def most_checks(self) -> int:
        """The checks the search makes at most: about log2 of each axis's length, plus one."""
        return sum(max(len(a), 1).bit_length() for a in self.axes)
