"""tune's accuracy stage: the held-out losses of the settings the timing screen ranked, the fastest first
(search.FastestFirst), until each batch size has its answer: the first setting within the budget with no faster one
left unchecked. A checked setting is screened on the first `prune_images` images (stopped there when its loss is
above the budget even at the 95 % lower bound), then held out image batch by image batch until it is surely within
the budget or surely above it, no promise can come of the held-out images at its rates so far, or the images end; a
setting stronger than one above the budget on its axis is not checked, nor one slower than the answer. Every batch
of images reads the time budget and moves the bar. A mixin of run._Tuner, whose rows, settings, bar and budget it
reads."""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ...measure.agreement import Paired, compare
from ...measure.stats import images_needed, loss_bounds, rate_upper_bound
from ...measure.counting import forward_counting
from .budget import count
from .rows import BUDGET_MEASURES, NOT_REACHED, SCREENED
from .search import FastestFirst, SettingFacts
from .select import against_fastest_plain, bound_text
from .space import accuracy_twin

# the confidence of the looks taken before a setting's last image (stricter than the decision's 95 %: repeated looks)
LOOK_CONFIDENCE = 0.99
ABOVE, WITHIN, ALL, TIME = "surely above", "surely within", "all images", "time budget"
FUTILE = "no promise"  # at its rates so far, not even every held-out image would bring its bound within the budget
# a setting is judged futile only after this share of the held-out images (and at least FUTILE_LEAST of them)
FUTILE_SHARE, FUTILE_LEAST = 0.25, 256
# the statuses of settings the search decided without a check (a resumed run decides them again, at no cost)
DECIDED_UNCHECKED = ("pruned: milder than", "pruned: budget (stronger than", "not checked: slower than")


class Predictions:
    """The plain model's top-1 classes on images (n, 3, H, W), computed batch by batch as far as asked."""

    def __init__(self, predict: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, batch: int):
        self.predict, self.images, self.batch, self.done = predict, images, batch, torch.empty(0, dtype=torch.long)

    def upto(self, n: int) -> torch.Tensor:
        """The first n images' classes (n,)."""
        while len(self.done) < n:
            start = len(self.done)
            self.done = torch.cat([self.done, self.predict(self.images[start:start + self.batch])])
        return self.done[:n]


class AccuracyStage:
    """The accuracy stage of run._Tuner (it reads the tuner's rows, candidates, settings s, images, labels, measure,
    base model, bar and budget)."""

    def _facts(self, settings: List[str], x: torch.Tensor) -> Dict[str, SettingFacts]:
        """setting -> its facts (GMACs from one counted forward of x on its reference path, an earlier run's
        GMACs reused; its token schedule)."""
        from ...core import last_stats

        _, plain_macs = forward_counting(self.base, x.to(self.device))
        self.plain_gmacs = plain_macs / 1e9
        out = {}
        for setting in settings:
            c = next(c for c in self.candidates if c.setting == setting)
            model = self._model(accuracy_twin(c), c.method)
            with torch.inference_mode():
                macs = forward_counting(model, x.to(self.device))[1] / 1e9
            known = next((r.gmacs for r in self._of(setting) if r.gmacs is not None), macs)
            schedule = tuple(last_stats(model).tokens_per_block)
            params = {k: v for k, v in accuracy_twin(c).items() if k != "kernel"}
            out[setting] = SettingFacts(setting, c.method, params, self.plain_gmacs / known, schedule)
        return out

    def _search(self, axes: List[List[str]], facts: Dict[str, SettingFacts], screen: Predictions,
                held: Predictions) -> None:
        """Check the settings in FastestFirst's order (_check), then give the unchecked ones their reason, and say
        in one line what the stage did."""
        alive = [r for r in self.rows.values() if r.status == SCREENED and r.setting in facts]
        score = against_fastest_plain([r for r in self.rows.values() if r.speedup is not None])
        speedups: Dict[int, Dict[str, float]] = {b: {} for b in self.s["batches"]}
        for r in alive:
            if id(r) in score:
                speedups[r.batch][r.setting] = max(score[id(r)][0], speedups[r.batch].get(r.setting, 0.0))
        search = FastestFirst(axes, speedups, {k: f.method for k, f in facts.items()})
        counts = {"within": 0, "above": 0, "early": 0, "reused": 0}
        for setting in {r.setting for r in alive}:  # a resumed run's verdicts first
            verdict = self._verdict(setting)
            if verdict is not None:
                search.record(setting, verdict)
                counts["reused"] += 1
        while (setting := search.next()) is not None:
            verdict, early = self._check(setting, facts[setting], screen, held)
            self.bar.finish()
            if verdict is None:
                search.give_up()
                break
            search.record(setting, verdict)
            counts["within" if verdict else "above"] += 1
            counts["early"] += early
        stronger, slower, milder = self._close_search(search, speedups)
        self._write()
        left = len({r.setting for r in self.rows.values() if r.status == f"{NOT_REACHED} (accuracy check)"})
        self.bar.say(f"accuracy, fastest first: {count(counts['within'] + counts['above'], 'setting')} checked "
                     f"({counts['within']} within the budget, {counts['above']} above it, {counts['early']} decided "
                     f"before their last image); not checked: {stronger} stronger than one above, {milder} milder "
                     f"than the answer, {slower} slower than the answer"
                     + (f", {count(left, 'setting')} not reached (time budget)" if left else "")
                     + (f"; {counts['reused']} from the earlier run" if counts["reused"] else ""))

    def _close_search(self, search: FastestFirst, speedups: Dict[int, Dict[str, float]]) -> Tuple[int, int, int]:
        """The statuses of the rows the search left unchecked: stronger than one above the budget, milder than the
        answer on its axis, slower than the answer, or not reached (the time budget). Returns the first three
        counts, in settings."""
        stronger, slower, milder = set(), set(), set()
        for b in speedups:
            answer = search.answer(b)
            for r in (r for r in self.rows.values() if r.batch == b and r.status == SCREENED):
                by = search.above_by(r.setting)
                if r.setting in search.verdicts:
                    continue
                if by is not None:
                    r.status = (f"pruned: budget (stronger than {by} on its axis, which is above the budget: not "
                                f"checked)")
                    stronger.add(r.setting)
                elif answer is not None and r.setting in search.milder_than(answer):
                    r.status = f"pruned: milder than {answer} on its axis, which keeps the budget: never faster"
                    milder.add(r.setting)
                elif answer is not None:
                    r.status = (f"not checked: slower than {answer}, which keeps the budget "
                                f"({speedups[b][answer]:.2f}x in the timing screen)")
                    slower.add(r.setting)
                else:
                    r.status = f"{NOT_REACHED} (accuracy check)"
        return len(stronger), len(slower), len(milder)

    def _verdict(self, setting: str) -> Optional[bool]:
        """An earlier run's verdict on setting (within the budget, above it), or None where it has none."""
        rows = self._of(setting)
        if not rows:
            return None
        if rows[0].status.startswith(("pruned: budget (screening", "pruned: held-out")):
            return False
        return None if rows[0].agree_n is None else rows[0].keeps(self.measure, self.s["budget"])

    def _check(self, setting: str, facts: SettingFacts, screen: Predictions, held: Predictions
               ) -> Tuple[Optional[bool], bool]:
        """(within the budget / above it / None: the time budget ended the check; whether it was decided before its
        last image). Its rows get the screening and held-out figures as they are measured; one whose held-out loss
        is below the budget but whose upper bound is not stays a finalist (more images could make it a promise)."""
        c = next(c for c in self.candidates if c.setting == setting)
        model = self._model(accuracy_twin(c), c.method)
        first = self.s["prune_images"]
        rows = self._of(setting)
        self.bar.start(f"accuracy: {setting}", len(self.images) - (first if rows[0].screen_n is not None else 0),
                       "images")
        if rows[0].screen_n is None:
            labels = None if self.labels is None else self.labels[:first]
            paired, how = self._paired(model, self.images[:first], screen, labels, sequential=False)
            if how == TIME:
                self._set(setting, f"{NOT_REACHED} (accuracy check)")
                return None, False
            loss, lo, _ = self._bounds(paired)
            self._set(setting, screen_agree=paired.agreement, screen_n=paired.n, screen_loss=loss)
            if lo > self.s["budget"]:
                what = (f"changed {paired.changed} of {paired.n} images' top-1" if self.measure == "agreement" else
                        f"lost {paired.lost} and gained {paired.gained} correct of {paired.n} images")
                self._set(setting, f"pruned: budget (screening {what}; even the 95 % lower bound, {lo:.2f} "
                                   f"{BUDGET_MEASURES[self.measure]}, is above the budget of {self.s['budget']})")
                self._write()
                return False, how == ABOVE
            self._write()
        how = ALL
        if rows[0].agree_n is None:
            labels = None if self.labels is None else self.labels[first:]
            paired, how = self._paired(model, self.images[first:], held, labels, sequential=True)
            if how == TIME:  # a resume checks it
                self._set(setting, f"{NOT_REACHED} (accuracy check)")
                self._write()
                return None, False
            self._set(setting, **self._figures(paired))
        within = rows[0].keeps(self.measure, self.s["budget"])
        if not within and rows[0].loss(self.measure) >= self.s["budget"]:
            futile = (f"; at these rates not even all {len(self.images) - first} held-out images would bring the "
                      f"bound within the budget") if how == FUTILE else ""
            self._set(setting, f"pruned: held-out ({bound_text(rows[0], self.measure, self.s['budget'])}; "
                               f"{rows[0].agree_n} images{futile})")
        self._write()
        return within, how in (ABOVE, WITHIN, FUTILE)

    def _paired(self, model: nn.Module, x: torch.Tensor, plain: Predictions, labels: Optional[torch.Tensor],
                sequential: bool, stage: str = "accuracy") -> Tuple[Paired, str]:
        """(model's predictions against plain's on x, batch by batch; how it ended: ABOVE, the loss above the
        budget even at a 99 % lower bound (stricter than the decision's 95 %, for the repeated looks), WITHIN (only
        if sequential), the changed images' share below the budget at a 99 % upper bound (a bound on the loss in
        either measure), FUTILE (only if sequential, after FUTILE_SHARE of the images: at the rates so far not even
        every image of x would bring the 95 % upper bound within the budget, so no promise can come of them), ALL
        (every image) or TIME (the time budget's stage ended first))."""
        preds: List[torch.Tensor] = []
        batch = max(self.s["batches"])
        paired = None
        for i in range(0, len(x), batch):
            if self.budget.over(stage):
                return paired, TIME
            preds.append(self._predict(model, x[i:i + batch]))
            self.bar.update(len(preds[-1]))
            done = sum(len(p) for p in preds)
            paired = compare(torch.cat(preds), plain.upto(done), None if labels is None else labels[:done])
            if done == len(x):
                break
            if self._bounds(paired, LOOK_CONFIDENCE)[1] > self.s["budget"]:
                return paired, ABOVE
            moved = paired.changed if self.measure == "agreement" else (paired.gained or 0) + (paired.lost or 0)
            if sequential and 100.0 * rate_upper_bound(moved, done, LOOK_CONFIDENCE) <= self.s["budget"]:
                return paired, WITHIN
            if sequential and done >= max(FUTILE_LEAST, FUTILE_SHARE * len(x)):
                need = images_needed(self.measure, done, paired.changed, paired.gained or 0, paired.lost or 0,
                                     self.s["budget"], most=len(x))
                if need is None or need > len(x):
                    return paired, FUTILE
        return paired, ALL

    def _bounds(self, paired: Paired, confidence: float = 0.95) -> Tuple[float, float, float]:
        return loss_bounds(self.measure, paired.n, paired.changed, paired.gained, paired.lost, confidence)

    def _figures(self, paired: Paired) -> Dict[str, Any]:
        """The held-out figures as TuneRow names them: agree, agree_n, changed; with labels gained, lost, top1_plain,
        top1, top1_p."""
        figures: Dict[str, Any] = {"agree": paired.agreement, "agree_n": paired.n, "changed": paired.changed}
        if self.labels is not None:
            figures.update(gained=paired.gained, lost=paired.lost, top1_plain=paired.top1_reference, top1=paired.top1,
                           top1_p=paired.top1_p)
        return figures
