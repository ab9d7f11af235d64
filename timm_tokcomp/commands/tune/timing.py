"""tune's two timing stages, per batch size and mode, each candidate interleaved with the plain model in the same
mode in groups of six (default paths first, in order of MAC ratio; a setting's other paths only where its default
is no worse than the stage asks):
  - the screen (`_time(batch, mode, screen=True)`), before any accuracy check: every setting on its default path
    for SCREEN_ROUNDS rounds (ToMe and EViT first); one surely slower than plain is pruned there and never checked
    for accuracy, the rest are ranked by their speed-up; a setting's other paths follow its default (the path does
    not change accuracy) and are timed only when re-timing, if it is a finalist;
  - the re-timing of the finalists (`screen=False`): the settings the accuracy stage measured on its held-out images
    and whose loss is below the budget, up to max_rounds, each until it is settled, surely slower, surely not the
    winner (its interval below the best lower bound of one within the budget) or at the time budget's end.
A mixin of run._Tuner, whose rows, settings, bar and budget it reads."""
import statistics
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...core import NO_REDUCTION
from ...deployment import modes as modes_
from ..paths import default_path
from ...measure.stats import speedup_interval
from ...measure.timing import no_silent_eager_fallback, time_runs
from .budget import count
from .rows import NOT_REACHED, SCREENED, TIMED, WAITING, Candidate, TuneRow
from .search import PREFERRED

SCREEN_ROUNDS = 3  # the timing screen's rounds per candidate (a round: one forward of it, one of plain)
SLOWER = "pruned: slower than plain"  # the status of a candidate the screen found surely slower


class TimingStage:
    """The timing stages of run._Tuner (it reads the tuner's rows, candidates, settings s, images, base model,
    device, bar, budget and default_paths, and decides what is a finalist: _finalist)."""

    def _time(self, batch: int, mode: str, screen: bool) -> None:
        """Time the waiting candidates of this batch size and mode (module docstring) and say in one line what came
        of it; what the time budget does not reach is left for a resume."""
        stage = "screen" if screen else "timing"
        rows = {c.name: self.rows[(batch, c.name)] for c in self.candidates if c.mode == mode}
        waiting = (lambda r: r.status == WAITING) if screen else self._finalist
        defaults = {c.name for c in self.candidates if c.mode == mode and self._is_default(c)}
        todo = [c for c in self.candidates if c.mode == mode and waiting(rows[c.name])]
        # re-timing: the settings within the budget first (the answer), then those a promise needs more images for;
        # ToMe and EViT first (the study's methods, ToMe's axis always screened), each by MACs saved
        todo.sort(key=lambda c: (not screen and not self._within(rows[c.name]), c.name not in defaults,
                                 c.method not in PREFERRED, -(rows[c.name].mac_ratio or 1.0), c.name))
        most = min(SCREEN_ROUNDS, self.s["max_rounds"]) if screen else self.s["max_rounds"]
        timed_here = [c for c in todo if not screen or c.name in defaults]  # in the screen, other paths follow
        self.bar.start(f"{'timing screen' if screen else 're-timing the finalists'}, batch {batch}, {mode}",
                       len(timed_here) * most, "rounds")
        x = self.images[torch.arange(batch) % len(self.images)].to(self.device)
        counts = {"other": 0}
        while todo:
            best = None if screen else self._best_within(rows.values())
            best_lo = 0.0 if best is None else best.speedup_lo
            chunk = []
            for c in todo:
                row = rows[c.name]
                default = next((rows[d.name] for d in self.candidates if d.mode == mode and d.setting == c.setting
                                and d.name in defaults), None)
                if best is not None and row.mac_ratio <= best_lo:  # cannot beat one within the budget this fast
                    row.status = (f"pruned: MACs (at most {row.mac_ratio:.2f}x fewer; {best.candidate}, within the "
                                  f"budget, is at least {best_lo:.2f}x faster)")
                elif c.name not in defaults and default is not None and _no_contender(default, best_lo, screen):
                    row.status = (f"pruned: its default path [{default.path}] is not a contender "
                                  f"({default.speedup:.2f}x, upper bound {default.speedup_hi:.2f})")
                    counts["other"] += 1
                elif screen and c.name not in defaults and default is not None and default.status == SCREENED:
                    row.status = SCREENED  # follows its default (the path does not change accuracy)
                elif c.name in defaults or default is None or not waiting(default):
                    chunk.append(c)  # other paths wait for their default's figures (screened if it failed)
                if len(chunk) == 6:
                    break
            todo = [c for c in todo if waiting(rows[c.name]) and c not in chunk]
            if not chunk:
                break
            if self.budget.over(stage):
                break
            self._time_chunk(batch, mode, chunk, x, (best_lo, None if best is None else best.candidate), most,
                             screen)
            self._write()
        self.bar.finish()
        mine = [rows[c.name] for c in timed_here]  # what this call was to time
        done = (lambda r: r.status == SCREENED and r.rounds is not None) if screen else (lambda r: r.status == TIMED)
        timed = [r for r in mine if done(r)]
        slower = sum(r.status.startswith(SLOWER) for r in mine)
        failed = sum(r.status.startswith("failed") for r in mine)
        not_reached = sum(r.status in (WAITING, SCREENED, f"{NOT_REACHED} ({stage})") and r not in timed for r in mine)
        if screen:
            self.bar.say(f"timing screen, batch {batch}, {mode}: {count(len(timed) + slower, 'setting')} timed "
                         f"on the default path, {slower} surely slower than plain (never checked for accuracy), "
                         f"{failed} failed, {not_reached} not reached")
        else:
            macs = sum(r.status.startswith("pruned: MACs") for r in rows.values())
            self.bar.say(f"re-timing, batch {batch}, {mode}: {count(len(timed), 'finalist')} timed, {macs} not "
                         f"timed (their MACs cannot beat the best), {failed} failed, {not_reached} not reached")

    def _best_within(self, rows) -> Optional[TuneRow]:
        """The re-timed row within the budget with the highest lower bound, or None."""
        within = [r for r in rows if r.status == TIMED and self._within(r)]
        return max(within, key=lambda r: r.speedup_lo, default=None)

    def _is_default(self, c: Candidate) -> bool:
        """Whether c runs the path its setting's defaults pick on this device and precision (kit.paths.default_path,
        once per setting)."""
        if c.setting not in self.default_paths:
            params = {k: v for k, v in c.kwargs.items() if k not in ("kernel", "prop_attn")}
            if "prop_attn" in c.kwargs:
                params["prop_attn"] = c.kwargs["prop_attn"] is not False  # on or off, its implementation left open
            self.default_paths[c.setting] = default_path(self.base, c.method, params, self.device, self.dtype)
        path, kw = self.default_paths[c.setting], c.kwargs
        return kw.get("kernel") == path.kernel and kw.get("prop_attn", False) == path.prop_attn

    def _time_chunk(self, batch: int, mode: str, chunk: List[Candidate], x: torch.Tensor,
                    best: Tuple[float, Optional[str]], most: int, screen: bool) -> None:
        """Time the chunk interleaved with the plain model in this mode, a few rounds at a time. A candidate stops
        once its 95 % interval excludes 1 (surely faster, or surely slower), at `most` rounds or when the time
        budget's stage ends; when re-timing also once its interval lies below the best lower bound of one within
        the budget (best: that bound and its candidate) or its MAC ratio is at most that bound ('pruned: MACs').
        Rows get the figures or the failure; the bar counts the rounds."""
        stage = "screen" if screen else "timing"
        best_lo, best_name = best
        beaten: Dict[str, str] = {}
        times: Dict[str, List[float]] = {c.name: [] for c in chunk}
        plain_times: Dict[str, List[float]] = {c.name: [] for c in chunk}  # the plain rounds paired with each
        try:
            with no_silent_eager_fallback(len(chunk) + 1):
                torch._dynamo.reset()
                plain = modes_.runner(self.base, mode, x)
                active: Dict[str, Callable] = {}
                for c in chunk:
                    if self.budget.over(stage):  # the rest stay unreached
                        break
                    try:
                        runner = modes_.runner(self._model(c.kwargs, c.method), mode, x)
                        with torch.inference_mode():  # as timed: compile / capture now, so a failure is this path's
                            runner(x)
                        active[c.name] = runner
                    except Exception as e:  # a path this device or torch cannot run: recorded, not fatal
                        self.rows[(batch, c.name)].status = f"failed: {type(e).__name__}: {str(e)[:200]}"
                        self.bar.update(most)
                with torch.inference_mode():
                    plain(x)  # each model has run once: the screen's eager rounds need no further warm-up
                rounds, warmup = 0, (0 if screen else 1) if mode == "eager" else 2
                while active and rounds < most and not self.budget.over(stage):
                    step = 1 if screen else min(5 if rounds == 0 else 3, most - rounds)  # the screen's bar moves
                    # round by round
                    new = time_runs({NO_REDUCTION: plain, **active}, x, rounds=step,
                                    warmup=warmup if rounds == 0 else 0, stop=lambda: self.budget.over(stage))
                    step = len(new[NO_REDUCTION])  # fewer where the time budget ended the step
                    if step == 0:
                        break
                    rounds += step
                    for name in active:
                        times[name] += new[name]
                        plain_times[name] += new[NO_REDUCTION]
                    self.bar.update(step * len(active))
                    intervals = {k: speedup_interval(plain_times[k], times[k]) for k in active}
                    if not screen:
                        top = max(intervals, key=lambda k: intervals[k][1])
                        if intervals[top][1] > best_lo and self._within(self.rows[(batch, top)]):
                            best_lo, best_name = intervals[top][1], top
                    for name, (_, lo, hi) in intervals.items():
                        if not screen and name != best_name and self.rows[(batch, name)].mac_ratio <= best_lo:
                            beaten[name] = f"{best_name}, within the budget, is at least {best_lo:.2f}x faster"
                        if lo > 1.0 or hi < 1.0 or (not screen and hi < best_lo) or name in beaten:
                            self.bar.update(most - len(times[name]))
                            del active[name]
                self.bar.update(sum(most - len(times[name]) for name in active))
        except Exception as e:
            for c in chunk:
                if self.rows[(batch, c.name)].status in (WAITING, SCREENED):
                    self.rows[(batch, c.name)].status = f"failed: {type(e).__name__}: {str(e)[:200]}"
            return
        for name, t in times.items():
            row = self.rows[(batch, name)]
            if row.status.startswith("failed"):
                continue
            if len(t) < 2:  # the budget ended before its first rounds
                row.status = f"{NOT_REACHED} ({stage})"
                continue
            if name in beaten:
                row.status = f"pruned: MACs (at most {row.mac_ratio:.2f}x fewer; {beaten[name]})"
                continue
            row.speedup, row.speedup_lo, row.speedup_hi = speedup_interval(plain_times[name], t)
            row.rounds = len(t)
            row.ms_plain, row.ms = 1e3 * statistics.median(plain_times[name]), 1e3 * statistics.median(t)
            if screen and row.speedup_hi < 1.0:
                row.status = (f"{SLOWER} (timing screen: {row.speedup:.2f}x [{row.speedup_lo:.2f}, "
                              f"{row.speedup_hi:.2f}])")
            else:
                row.status = SCREENED if screen else TIMED


def _no_contender(default: TuneRow, best_lo: float, screen: bool) -> bool:
    """Whether a setting's default path rules out its other paths: surely slower than plain in the screen; when
    re-timing, surely slower than plain or than the best lower bound within the budget."""
    if screen:
        return default.status.startswith(SLOWER)
    return default.status == TIMED and default.speedup_hi < max(1.0, best_lo)
