"""tune's timing stage: per batch size and mode, the candidates that kept the budget, interleaved with the plain
model in groups of six (default paths first, other paths only where the default is a contender), each until it is
settled, surely slower, surely not the winner, at max_rounds or at the time budget's end. A mixin of run._Tuner,
whose rows, settings, bar and budget it reads."""
import statistics
from typing import Callable, Dict, List, Tuple

import torch

from ..core import NO_REDUCTION
from ..kit import modes as modes_
from ..kit.paths import default_path
from ..kit.stats import speedup_interval
from ..timing import no_silent_eager_fallback, time_runs
from .budget import count
from .rows import NOT_REACHED, Candidate


class TimingStage:
    """The timing stage of run._Tuner (it reads the tuner's rows, candidates, settings s, images, base model,
    device, bar, budget and default_paths)."""

    def _time(self, batch: int, mode: str) -> None:
        """Time the candidates of this batch size and mode that kept the budget (_time_chunk): the default path of
        each setting first, in order of MAC ratio, then its other paths only where the default is a contender;
        a candidate whose MAC ratio cannot beat a lower bound measured here is not timed; what the time budget
        does not reach is left for a resume."""
        rows = {c.name: self.rows.get((batch, c.name)) for c in self.candidates if c.mode == mode}
        reserved, used = len(rows) * self.s["max_rounds"], 0
        defaults = {c.name for c in self.candidates if c.mode == mode and self._is_default(c)}
        todo = [c for c in self.candidates if c.mode == mode and rows[c.name] is not None
                and rows[c.name].status == "screened"]
        todo.sort(key=lambda c: (c.name not in defaults, -rows[c.name].mac_ratio, c.name))
        x = self.images[torch.arange(batch) % len(self.images)].to(self.device)
        counts = {"not a contender": 0, "not reached": 0}
        while todo:
            timed = [r for r in rows.values() if r is not None and r.status == "timed"]
            best = max(timed, key=lambda t: t.speedup_lo, default=None)
            best_lo = 0.0 if best is None else best.speedup_lo
            chunk = []
            for c in todo:
                row = rows[c.name]
                default = next((rows[d.name] for d in self.candidates if d.mode == mode and d.setting == c.setting
                                and d.name in defaults), None)
                if row.mac_ratio <= best_lo:  # cannot beat one surely this fast (every timed one kept the budget)
                    row.status = (f"pruned: MACs (at most {row.mac_ratio:.2f}x fewer; {best.candidate}, within the "
                                  f"budget, is at least {best_lo:.2f}x faster)")
                elif c.name not in defaults and default is not None and default.status == "timed" and \
                        default.speedup_hi < max(1.0, best_lo):
                    row.status = (f"pruned: its default path [{default.path}] is not a contender "
                                  f"({default.speedup:.2f}x, upper bound {default.speedup_hi:.2f})")
                    counts["not a contender"] += 1
                elif c.name in defaults or default is None or default.status != "screened":
                    chunk.append(c)  # other paths wait for their default's figures
                if len(chunk) == 6:
                    break
            todo = [c for c in todo if rows[c.name].status == "screened" and c not in chunk]
            if not chunk:
                break
            if self.budget.over("timing"):
                counts["not reached"] += len(chunk) + len(todo)
                break
            used += self._time_chunk(batch, mode, chunk, x, (best_lo, None if best is None else best.candidate))
            self._write()
        self.bar.update(reserved - used)
        timed = [r for r in rows.values() if r is not None and r.status == "timed"]
        best_lo = max((t.speedup_lo for t in timed), default=0.0)
        slower = sum(r.speedup_hi < 1.0 for r in timed)
        beaten = sum(1.0 <= r.speedup_hi < best_lo for r in timed)
        failed = sum(r is not None and r.status.startswith("failed") for r in rows.values())
        macs = sum(r is not None and r.status.startswith("pruned: MACs") for r in rows.values())
        self.bar.say(f"timing batch {batch}, {mode}: {count(len(timed), 'candidate')} timed ({slower} surely slower "
                     f"than plain, {beaten} surely slower than the best), {macs} not timed (their MACs cannot beat "
                     f"the best), {counts['not a contender']} other paths skipped (their default path is no "
                     f"contender), {failed} failed, {counts['not reached']} not reached (time budget)")

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
                    best: Tuple[float, str]) -> int:
        """Time the chunk interleaved with the plain model in this mode, a few rounds at a time. A candidate stops
        once its 95 % interval excludes 1 (surely faster, or surely slower) or lies below the best lower bound
        measured in this batch size and mode (best: that bound and its candidate; surely not the winner), its MAC
        ratio is at most that bound ('pruned: MACs'), at max_rounds, or when the time budget's timing stage ends;
        rows get the figures or the failure. Returns the progress units used (rounds timed per candidate)."""
        used, most = 0, self.s["max_rounds"]
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
                    if self.budget.over("timing"):  # the rest stay unreached
                        break
                    try:
                        runner = modes_.runner(self._model(c.kwargs, c.method), mode, x)
                        with torch.inference_mode():  # as timed: compile / capture now, so a failure is this path's
                            runner(x)
                        active[c.name] = runner
                    except Exception as e:  # a path this device or torch cannot run: recorded, not fatal
                        self.rows[(batch, c.name)].status = f"failed: {type(e).__name__}: {str(e)[:200]}"
                rounds, warmup = 0, 1 if mode == "eager" else 2
                while active and rounds < most and not self.budget.over("timing"):
                    step = min(5 if rounds == 0 else 3, most - rounds)
                    new = time_runs({NO_REDUCTION: plain, **active}, x, rounds=step,
                                    warmup=warmup if rounds == 0 else 0, stop=lambda: self.budget.over("timing"))
                    step = len(new[NO_REDUCTION])  # fewer where the time budget ended the step
                    if step == 0:
                        break
                    rounds += step
                    for name in active:
                        times[name] += new[name]
                        plain_times[name] += new[NO_REDUCTION]
                    self.bar.update(step * len(active))
                    used += step * len(active)
                    intervals = {k: speedup_interval(plain_times[k], times[k]) for k in active}
                    top = max(intervals, key=lambda k: intervals[k][1])
                    if intervals[top][1] > best_lo:
                        best_lo, best_name = intervals[top][1], top
                    for name, (_, lo, hi) in intervals.items():
                        if name != best_name and self.rows[(batch, name)].mac_ratio <= best_lo:
                            beaten[name] = f"{best_name}, within the budget, is at least {best_lo:.2f}x faster"
                        if lo > 1.0 or hi < 1.0 or hi < best_lo or name in beaten:
                            del active[name]
        except Exception as e:
            for c in chunk:
                if self.rows[(batch, c.name)].status == "screened":
                    self.rows[(batch, c.name)].status = f"failed: {type(e).__name__}: {str(e)[:200]}"
            return used
        for name, t in times.items():
            row = self.rows[(batch, name)]
            if row.status != "screened":
                continue
            if len(t) < 2:  # the budget ended before its first rounds
                row.status = f"{NOT_REACHED} (timing)"
                continue
            if name in beaten:
                row.status = f"pruned: MACs (at most {row.mac_ratio:.2f}x fewer; {beaten[name]})"
                continue
            row.speedup, row.speedup_lo, row.speedup_hi = speedup_interval(plain_times[name], t)
            row.status, row.rounds = "timed", len(t)
            row.ms_plain, row.ms = 1e3 * statistics.median(plain_times[name]), 1e3 * statistics.median(t)
        return used
