"""Which settings tune checks for accuracy, pure logic: the fastest first. Per batch size the settings the timing
screen did not find surely slower are ranked by their speed-up (speed-ups within TIE of each other are a tie, and
among tied settings the methods the study supports, PREFERRED, come first); the unchecked setting ranked highest
for a batch size whose answer is still open is checked next, and the first setting within the budget with no
faster one left unchecked is that batch size's answer. A method's settings that differ only in strength (r, keep
rate, flops_ratio) lie on one axis, along which the loss grows with the MACs saved: a setting stronger than one
above the budget is above it unchecked, one milder than the answer is slower. Settings with the same token schedule
on one axis (tome r=16 and flops_ratio=2.0) are one setting, measured once.

    axes, twins = make_axes(settings)             # [[mildest, ..., strongest], ...] of representatives
    search = FastestFirst(axes, {batch: {setting: speed-up}}, {setting: method})
    while (setting := search.next()) is not None:
        search.record(setting, within=...)        # or search.give_up(): the time budget ended the check
    search.answer(batch)                          # the setting, or None
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


PREFERRED = ("tome", "evit")  # the methods the study supports: first among settings tied in speed
TIE = 0.02  # speed-ups within 2 % of the first of a group are a tie


def ranking(speedups: Dict[str, float], methods: Dict[str, str]) -> List[str]:
    """The settings fastest first; a run of settings within TIE of its first is one tie group, ordered PREFERRED
    methods first, then by speed-up, then by name."""
    order = sorted(speedups, key=lambda s: (-speedups[s], s))
    out: List[str] = []
    while order:
        head = speedups[order[0]]
        group = [s for s in order if speedups[s] >= head / (1.0 + TIE)]
        group.sort(key=lambda s: (methods[s] not in PREFERRED, -speedups[s], s))
        out += group
        order = [s for s in order if s not in group]
    return out


class FastestFirst:
    """The accuracy checks in the order that finds each batch size's fastest setting within the budget with the
    fewest checks (module docstring). speedups: batch size -> setting -> its screened speed-up there (settings the
    screen found surely slower left out); methods: setting -> method."""

    def __init__(self, axes: Sequence[Sequence[str]], speedups: Dict[int, Dict[str, float]],
                 methods: Dict[str, str]):
        self.axes = [list(a) for a in axes]
        self.speedups = speedups
        self.ranks = {b: ranking(s, methods) for b, s in speedups.items()}
        self.verdicts: Dict[str, bool] = {}  # checked setting -> within
        self.stopped = False  # a check the time budget ended: no further checks

    def _axis(self, name: str) -> List[str]:
        return next((a for a in self.axes if name in a), [name])

    def above_by(self, name: str) -> Optional[str]:
        """The checked setting above the budget that makes name above it too (milder on its axis), or None."""
        axis = self._axis(name)
        return next((m for m in axis[:axis.index(name)] if self.verdicts.get(m) is False), None)

    def verdict(self, name: str) -> Optional[bool]:
        """Within the budget (checked), above it (checked, or stronger than one above), or None: unknown."""
        if name in self.verdicts:
            return self.verdicts[name]
        return False if self.above_by(name) is not None else None

    def _walk(self, batch: int) -> Tuple[Optional[str], Optional[str]]:
        """(this batch size's answer, the setting to check before it can be known): one of them is None."""
        for name in self.ranks[batch]:
            v = self.verdict(name)
            if v is True:
                return name, None
            if v is None:
                return None, name
        return None, None

    def answer(self, batch: int) -> Optional[str]:
        """The fastest setting within the budget with no faster one unchecked, or None (none within, or not known:
        open())."""
        return self._walk(batch)[0]

    def open(self, batch: int) -> bool:
        return self._walk(batch)[1] is not None

    def next(self) -> Optional[str]:
        """The unchecked setting ranked highest for a batch size whose answer is open, the fastest of those when
        several batch sizes are open; None when every batch size is decided (or the search stopped)."""
        if self.stopped:
            return None
        wanted = [(self.speedups[b][name], -i, name) for i, b in enumerate(self.ranks)
                  if (name := self._walk(b)[1]) is not None]
        return max(wanted)[2] if wanted else None

    def record(self, name: str, within: bool) -> None:
        self.verdicts[name] = within

    def give_up(self) -> None:
        """The time budget ended a check: the search goes no further."""
        self.stopped = True

    def milder_than(self, answer: str) -> List[str]:
        """The unchecked settings milder than answer on its axis: they save fewer MACs, so they are never faster."""
        axis = self._axis(answer)
        return [m for m in axis[:axis.index(answer)] if m not in self.verdicts]
