"""`tokcomp tune` / `timm_tokcomp.tune`: measure the training-free candidates on this device and choose the fastest
one that keeps accuracy within a budget (points of top-1 lost with labels, % of predictions changed without), or
none, within a time budget. Speed is the cheap question, so it comes first.

Stages (each written to the CSV as it is measured, so --resume continues from any point; each ends by its share of
--time-budget, budget.STAGE_ENDS, read before every batch of images and every timed round, and says in one line what
it kept and stopped):
  1. the timing screen (timing.TimingStage, screen=True): every setting (one token schedule under two names timed
     once) on its default path in every mode, interleaved with the plain model for a few rounds; one surely slower
     than plain (its interval below 1) is pruned, never checked for accuracy;
  2. accuracy, fastest first (accuracy.AccuracyStage): per batch size the settings ranked by their screened
     speed-up (ties: ToMe and EViT first), each checked with a sequential test (screened on the first
     `prune_images` images, then held out until surely within or surely above the budget) until the first within
     the budget with no faster one unchecked; a setting stronger than one above the budget on its axis is not
     checked, nor one slower than the answer;
  3. re-timing the finalists (the settings held out whose loss is below the budget) on every path, up to
     max_rounds; a stage cut short by its share gets what the later ones left (up to MAX_PASSES passes);
  4. the choice, per batch size: the fastest finalist whose loss is within the budget at its one-sided 95 % upper
     bound and whose speed-up's lower bound against the fastest plain model measured is above 1 (select.choose),
     re-checked on its own path; otherwise 'no reduction' in the preset, and the answer lines name the best measured
     setting with both intervals and what would let it be promised (every finalist gets a preset under
     candidates/).
"""
import contextlib
import copy
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import timm
import torch
from torch import nn
from tqdm import tqdm

from ...core import apply
from ...deployment.modes import check_batches, check_modes
from ...measure.agreement import NonFiniteScores, check_classifier, chunks, predict
from ..paths import FastPath
from ...models.build import build_base_model, check_finite_parameters, eval_transform, is_hf_folder, weights_source
from ...measure.precision import check_device, check_dtype, device_description, precision
from ...files.identity import data_digest, weights_digest
from ...files.data import UnlabeledImages, check_num_classes, open_images
from ...methods import default_tune_space
from ...files.outputs import run_folder, write_text
from ...utils import checks
from ...utils.checks import integer, optional, real
from ...utils.memory import check_batch_fits
from ...measure.stats import promisable_loss
from .budget import STAGE_ENDS, StageBar, TimeBudget, count, plan_text
from .report import OUT_FILES, TuneResult, sample_notes, write_outputs
from .rows import BUDGET_MEASURES, NOT_REACHED, SCREENED, TIMED, WAITING, Candidate, Choice, TuneRow
from .search import make_axes
from .select import best_measured, bound_text, choose, promise_text
from .space import accuracy_twin, applicable_candidates, check_space, default_modes
from .store import finished_run, mark_finished, resume_rows, write_rows
from .accuracy import DECIDED_UNCHECKED, AccuracyStage, Predictions
from .timing import SCREEN_ROUNDS, TimingStage


MAX_PASSES = 3  # passes of the stages at most: a stage cut short by its share gets what later ones left
MIN_PASS_SHARE = 0.1  # a further pass only while this share of the time budget is left


def _predictions(model: nn.Module, images: torch.Tensor, batch: int) -> torch.Tensor:
    return predict(model, chunks(images, batch))[0]


def _load_images(data: str, model: nn.Module, limit: int, show_progress: bool, num_classes: int,
                 budget: TimeBudget, least: int, notes: List[str]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The images (n, 3, H, W) through the model's eval transform and their labels (None without); loading stops
    when the time budget's loading share ends, once more than `least` are loaded (a note says so)."""
    dataset = open_images(data, eval_transform(model), limit=limit)
    if num_classes and not isinstance(dataset, UnlabeledImages):
        check_num_classes(dataset, num_classes)
    items = []
    for i in tqdm(range(len(dataset)), desc="images", disable=not show_progress, file=sys.stderr):
        if len(items) > least and budget.over("loading"):
            notes.append(f"the time budget let tune load {len(items)} of the {len(dataset)} images (a larger "
                         f"--time-budget loads them all)")
            break
        items.append(dataset[i])
    images = torch.stack([x for x, _ in items])
    labelled = not isinstance(dataset, UnlabeledImages)
    return images, (torch.tensor([y for _, y in items]) if labelled else None)


# the checks of tune's flags (the command line's types, and tune()'s arguments)
BUDGET = real("--budget", 0.0, strict=False, high=100.0, note="(percentage points)")
BUDGET_ON_CHOICES = ("auto",) + tuple(BUDGET_MEASURES)
BUDGET_ON = checks.choice("--budget-on", BUDGET_ON_CHOICES)
MIN_SPEEDUP = optional(real("--min-speedup", 1.0, strict=False))
LIMIT = integer("--limit", 2, "(images: the first --prune-images screen, the rest decide)")
PRUNE_IMAGES = integer("--prune-images", 1)
ROUNDS = integer("--rounds", 3)


def _check_args(batches, budget, min_speedup, limit, prune_images, max_rounds, modes, device) -> None:
    check_batches(batches)
    BUDGET(budget)
    MIN_SPEEDUP(min_speedup)
    PRUNE_IMAGES(prune_images)
    if LIMIT(limit) < prune_images + 1:
        raise ValueError(f"--limit must be an integer above --prune-images ({prune_images}): the images after the "
                         f"first {prune_images} are held out for the agreement that decides; got {limit!r}")
    ROUNDS(max_rounds)
    check_device(device)
    check_modes(modes, device)


def tune(
    model: Union[str, nn.Module],
    data: str,
    batches: Sequence[int] = (64,),
    device: str = "cpu",
    dtype: str = "fp32",
    tf32: bool = False,
    budget: float = 1.0,
    budget_on: str = "auto",
    min_speedup: Optional[float] = None,
    modes: Optional[Sequence[str]] = None,
    space: Optional[Sequence[Tuple[str, Dict[str, Any]]]] = None,
    checkpoint: Optional[str] = None,
    pretrained: bool = False,
    limit: int = 1500,
    prune_images: int = 128,
    max_rounds: int = 30,
    time_budget: Optional[float] = 15.0,
    out: Optional[str] = None,
    resume: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
) -> TuneResult:
    """Measure the candidates (methods.default_tune_space(), or `space`: (method, params) pairs, on every path and mode the
    device offers) on `data` (a folder of images) and choose per batch size (module docstring).
    model: a timm architecture name (weights from checkpoint / pretrained) or a plain timm ViT module.
    budget: the largest allowed loss on the held-out images, measured as budget_on says: 'top1', points of top-1
    lost (needs labels); 'agreement', % of the plain model's top-1 predictions changed (several times stricter: on
    ImageNet, ToMe r8 changes 3.5 % of DeiT-Tiny's predictions for 0.39 points of top-1); 'auto', top1 when the
    images are labelled. out: a folder for `tune.csv`, `table.md`, `pareto.png` (with the plot extra's matplotlib)
    and the preset(s) (`preset.json` for one batch size, `preset_b<B>.json` for several); with resume, a killed
    run continues from its CSV. time_budget: minutes of wall time for the whole run, loading included (None: no
    limit); when it ends, tune chooses from what it measured and says what it did not reach."""
    clock = TimeBudget(time_budget)  # checks it; the run's minutes count from here
    check_device(device)  # before anything reads the device
    if not isinstance(data, (str, Path)):
        raise TypeError(f"data must be the path of a folder of images (--data), got {data!r}")
    modes = tuple(modes) if modes else default_modes(device)
    check_dtype(dtype)
    _check_args(batches, budget, min_speedup, limit, prune_images, max_rounds, modes, device)
    BUDGET_ON(budget_on)
    space = list(space) if space is not None else list(default_tune_space())
    if isinstance(model, str):
        name = model
        base = build_base_model(model, checkpoint, pretrained, device)
    else:
        from ...families import patched_family, resolve

        resolve(model)
        check_finite_parameters(model, "model")
        if patched_family(model) is not None:
            raise ValueError("model is already reduced; tune a plain timm model (timm_tokcomp.remove(model) first)")
        name = (getattr(model, "pretrained_cfg", None) or {}).get("architecture", type(model).__name__)
        base = copy.deepcopy(model).to(device).eval()
    check_space(space, base)
    check_batch_fits("--batches", max(batches), timm.data.resolve_model_data_config(base)["input_size"],
                     torch.device(device))
    weights = weights_source(model, checkpoint, pretrained) if isinstance(model, str) else "model"
    try:
        check_classifier(base, device)  # a feature model is refused before --out is touched
    except NonFiniteScores as e:
        raise NonFiniteScores(f"{weights}: {e}") from None
    candidates, notes = applicable_candidates(space, base, device, modes)
    settings = {"model": name, "device": device, "device_name": device_description(device), "dtype": dtype, "tf32": tf32,
                "batches": list(batches), "budget": budget, "budget_on": budget_on, "min_speedup": min_speedup,
                "modes": list(modes),
                "limit": limit, "prune_images": prune_images, "max_rounds": max_rounds, "time_budget": time_budget,
                "data": str(data),
                "space": [[m, p] for m, p in space],
                # what the rows were measured on, by content (a resume needs the same; the path is only shown)
                "weights_sha256": weights_digest(base), "data_sha256": data_digest(data),
                "random_weights": isinstance(model, str) and not is_hf_folder(model) and not checkpoint
                and not pretrained}
    # an earlier run in out is set aside (--overwrite) and comes back if this one fails before writing
    with run_folder(out, resume, overwrite, OUT_FILES) if out else contextlib.nullcontext():
        done = finished_run(out, settings) if out and resume else None
        if done is not None:  # a resume of a finished run measures and writes nothing: its stored answer
            saved, rows, choices, answer = done
            note = f"--resume: {out} holds a finished run (every setting decided); nothing was measured or written"
            return TuneResult(rows, choices, dict(saved, notes=[note], stages=[]), answer)
        previous = resume_rows(out, settings) if out and resume else {}  # before any image is read
        tuner = _Tuner(base, data, settings, candidates, notes, out, show_progress, clock)  # opens and checks the images
        tuner.previous = previous
        tuner.weights = weights
        result = tuner.run()
        if out:
            write_outputs(result, out)
            if not any(r.status.startswith(NOT_REACHED) for r in result.rows):
                mark_finished(out, settings, result.choices, result.answer)
    return result


class _Tuner(AccuracyStage, TimingStage):
    def __init__(self, base: nn.Module, data: str, settings: Dict[str, Any], candidates: List[Candidate],
                 notes: List[str], out, show_progress, budget: TimeBudget):
        self.base, self.s, self.out, self.show, self.budget = base, settings, out, show_progress, budget
        self.previous: Dict[Tuple[int, str], TuneRow] = {}  # a killed run's rows (resume)
        self.weights = "model"  # where the weights come from, as an error names them (models.weights_source)
        self.device, self.dtype, self.tf32 = settings["device"], settings["dtype"], settings["tf32"]
        self.candidates, self.notes = candidates, list(notes)
        self.images, self.labels = _load_images(data, base, settings["limit"], show_progress,
                                                getattr(base, "num_classes", 0), budget, settings["prune_images"],
                                                self.notes)
        if len(self.images) <= settings["prune_images"]:
            raise ValueError(f"--data holds {len(self.images)} images; tune needs more than --prune-images "
                             f"({settings['prune_images']}): the rest are held out for the agreement that decides")
        if settings["budget_on"] == "top1" and self.labels is None:
            raise ValueError(f"--budget-on top1 needs labelled --data ({data} has no labels.csv or class folders); "
                             f"give labelled images or --budget-on agreement")
        self.measure = settings["budget_on"] if settings["budget_on"] != "auto" else \
            "agreement" if self.labels is None else "top1"
        self.s["budget_measure"], self.s["held_out"] = self.measure, len(self.images) - settings["prune_images"]
        self.sample_notes = sample_notes(len(self.images) - settings["prune_images"], settings["prune_images"],
                                         settings["budget"], self.measure)
        self.notes += self.sample_notes
        self.rows: Dict[Tuple[int, str], TuneRow] = {}
        self.default_paths: Dict[str, FastPath] = {}

    def _write(self) -> None:
        if self.out:
            write_rows(list(self.rows.values()), Path(self.out) / "tune.csv")

    def _model(self, kwargs: Dict[str, Any], method: str) -> nn.Module:
        return apply(copy.deepcopy(self.base), method, **kwargs)

    def _of(self, setting: str) -> List[TuneRow]:
        return [r for r in self.rows.values() if r.setting == setting]

    def _set(self, setting: str, status: Optional[str] = None, force: bool = False, **fields: Any) -> None:
        """Give the setting's rows (every batch size and path) these fields, and `status` to those still in the
        running (SCREENED; every row with force)."""
        for r in self._of(setting):
            for k, v in fields.items():
                setattr(r, k, v)
            if status is not None and (force or r.status == SCREENED):
                r.status = status

    def _within(self, row: TuneRow) -> bool:
        return row.keeps(self.measure, self.s["budget"])

    def _finalist(self, row: TuneRow) -> bool:
        """A row waiting to be re-timed: not surely slower, held out, its loss below the budget."""
        return row.status == SCREENED and row.agree_n is not None and row.loss(self.measure) < self.s["budget"]

    def _start_rows(self) -> None:
        """A row per batch size and candidate; a killed run's rows carry on (_reopen)."""
        self.rows = {}
        for b in self.s["batches"]:
            for c in self.candidates:
                row = self.previous.get((b, c.name)) or TuneRow(b, c.mode, c.name, c.setting, c.path, c.method,
                                                                 json.dumps(c.kwargs, sort_keys=True))
                self.rows[(b, c.name)] = row
        self._reopen()

    def _reopen(self) -> None:
        """What the time budget did not reach, and what the search decided without a check (decided again at no
        cost), waits for the stage that measures it: a resume's rows, or a pass's before the next one."""
        for row in self.rows.values():
            if row.status == f"{NOT_REACHED} (screen)" or row.status.startswith("pruned: the same token"):
                row.status = WAITING
            elif row.status.startswith((f"{NOT_REACHED} (", *DECIDED_UNCHECKED)) or (
                    row.status == TIMED and (row.rounds or 0) <= SCREEN_ROUNDS < self.s["max_rounds"]):
                row.status = SCREENED  # (a finalist with only the screen's rounds is re-timed)

    def _keep_screen_timing(self) -> None:
        """A finalist whose re-timing the time budget did not reach keeps the timing screen's figures (a few rounds:
        a wide interval, but a measured one), so that the choice and the answer can use it; a note says which."""
        kept = [r for r in self.rows.values() if self._finalist(r) and r.speedup is not None]
        for r in kept:
            r.status = TIMED
        if kept:
            self.notes.append(f"{count(len({r.setting for r in kept}), 'setting')} kept the timing screen's speed-up "
                              f"({SCREEN_ROUNDS} rounds; the time budget did not reach its re-timing: --resume with "
                              f"more minutes re-times them): {', '.join(sorted({r.setting for r in kept}))}")

    def _open_work(self) -> bool:
        """Whether anything is left to measure: a candidate not screened, a setting not checked, a finalist not
        re-timed."""
        return any(r.status == WAITING or r.status.startswith(NOT_REACHED) or self._finalist(r)
                   for r in self.rows.values())

    def run(self) -> TuneResult:
        if self.out:
            write_text(Path(self.out) / "tune_config.json", json.dumps(self.s, indent=2) + "\n")
        self._start_rows()
        first, batches, modes, most = self.s["prune_images"], self.s["batches"], self.s["modes"], self.s["max_rounds"]
        settings = list(dict.fromkeys(c.setting for c in self.candidates))
        bar = self.bar = StageBar(self.budget, self.show)
        held_n = len(self.images) - first
        for line in plan_text(len(settings), len(self.candidates), modes, len(self.images), first, batches, most,
                              min(SCREEN_ROUNDS, most), self.budget,
                              f"budget {self.s['budget']} {BUDGET_MEASURES[self.measure]}",
                              promisable_loss(self.measure, held_n, self.s["budget"])):
            bar.say(line)
        for note in self.sample_notes:  # before any work: a budget too fine for the held-out images
            bar.say(f"note: {note}")
        with precision(self.device, self.dtype, self.tf32):
            screen_x, held_x = self.images[:first], self.images[first:]
            facts = self._facts(settings, screen_x[:1])
            axes, twins = make_axes(facts.values())
            for setting, f in facts.items():
                self._set(setting, gmacs=self.plain_gmacs / f.mac_ratio, mac_ratio=f.mac_ratio)
            for twin, rep in twins.items():
                self._set(twin, f"pruned: the same token schedule as {rep} (measured once)", force=True)
            screen = Predictions(self._predict_plain, screen_x, max(batches))
            self.held = Predictions(self._predict_plain, held_x, max(batches))  # as far as the checks need them
            for passes in range(1, MAX_PASSES + 1):
                self._pass(axes, {k: f for k, f in facts.items() if k not in twins}, screen)
                if not self._open_work() or self.budget.left() < MIN_PASS_SHARE * self.budget.seconds:
                    break
                if passes < MAX_PASSES:  # a stage's share ended and a later one needed less: the next pass
                    bar.say(f"pass {passes + 1}: {self.budget.left() / 60:.1f} min left, shared by the stages again")
                    self._reopen()
                    self.budget.rebase()
            self._keep_screen_timing()
            choices = []
            for b in batches:
                bar.start(f"checking the choice, batch {b}", 1, "batch size")
                choices.append(self._choose(b))
                bar.finish()
        ended = self._close_unreached(choices)
        self._write()
        bar.close()
        answer = self._answer(choices, ended)
        return TuneResult(list(self.rows.values()), choices, dict(self.s, notes=self.notes, stages=bar.lines),
                          answer)

    def _pass(self, axes: List[List[str]], facts: Dict[str, Any], screen: Predictions) -> None:
        """One pass of the stages over what is open: the timing screen, accuracy fastest first, re-timing."""
        for batch in self.s["batches"]:
            for mode in self.s["modes"]:
                self._time(batch, mode, screen=True)
        try:
            screen.upto(self.s["prune_images"])
        except NonFiniteScores as e:  # the plain model's first images: name its weights
            raise NonFiniteScores(f"{self.weights}: {e}") from None
        self._search(axes, facts, screen, self.held)
        for batch in self.s["batches"]:
            for mode in self.s["modes"]:
                self._time(batch, mode, screen=False)

    def _predict(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        return _predictions(model, images.to(self.device), max(self.s["batches"]))

    def _predict_plain(self, images: torch.Tensor) -> torch.Tensor:
        return self._predict(self.base, images)

    def _close_unreached(self, choices: List[Choice]) -> List[str]:
        """The statuses of what the time budget did not reach (a resume measures it), a note saying what, and each
        choice's reason saying that the time budget, not the accuracy budget, ended the search. Returns the stages
        it cut short."""
        for r in self.rows.values():
            if r.status == WAITING:
                r.status = f"{NOT_REACHED} (screen)"
            elif self._finalist(r):
                r.status = f"{NOT_REACHED} (timing)"
        said, unchecked, cut = [], set(), []
        for stage, what in (("screen", "timing screen"), ("accuracy check", "accuracy check"),
                            ("timing", "re-timing")):  # counted by setting (its paths share its accuracy)
            left = {r.setting for r in self.rows.values() if r.status == f"{NOT_REACHED} ({stage})"}
            if left:
                said.append(f"{count(len(left), 'setting')} without {'its' if len(left) == 1 else 'their'} {what}")
                cut.append(what)
            if stage != "timing":
                unchecked |= left
        if said:
            self.notes.append(f"the time budget ({self.budget.text()}) ended with {', '.join(said)}; tune chose "
                              f"from what it measured (--resume with a larger --time-budget continues the run)")
        if unchecked:
            for choice in choices:
                choice.reason += (f"; the time budget, not the accuracy budget, ended the search: "
                                  f"{count(len(unchecked), 'setting')} never checked (--resume with a larger "
                                  f"--time-budget checks them)")
        return cut

    def _answer(self, choices: List[Choice], cut: List[str]) -> List[str]:
        """The last lines: per batch size the choice, or 'no reduction' and the best measured setting with both
        intervals and what would let it be promised; then why the run ended."""
        lines, budget = [], self.s["budget"]
        preset = "preset.json" if len(choices) == 1 else "preset_b<B>.json"
        for choice in choices:
            row = choice.row
            if row is not None:
                lines.append(f"batch {choice.batch}: {row.candidate}, {row.speedup:.2f}x [{row.speedup_lo:.2f}, "
                             f"{row.speedup_hi:.2f}], {bound_text(row, self.measure, budget)} ({preset})")
                continue
            why = choice.reason.split(" (closest")[0].split("; ")[0]  # the full reason is in table.md and the preset
            lines.append(f"batch {choice.batch}: no reduction promised ({preset}): {why}")
            best = best_measured(list(self.rows.values()), choice.batch, self.measure)
            if best is not None:
                lines.append(f"  best measured: {best.candidate}, {best.speedup:.2f}x [{best.speedup_lo:.2f}, "
                             f"{best.speedup_hi:.2f}], {bound_text(best, self.measure, budget)}; to promise it: "
                             f"{promise_text(best, self.measure, budget, self.s['prune_images'])}; its preset: "
                             f"candidates/ (deploy it knowingly)")
        left = self.budget.left()
        if not cut:
            unused = "" if self.budget.minutes is None else f", {left / 60:.1f} min of the budget unused"
            lines.append(f"tune ended: all decided in {self.budget.elapsed() / 60:.1f} min{unused}")
        else:
            why = (f"; {left / 60:.1f} min left unused because each stage ends by its share of the budget "
                   f"({', '.join(f'{k} {100 * v:.0f} %' for k, v in STAGE_ENDS.items())}) and the later ones "
                   f"needed less" if left > 0.05 * self.budget.seconds else "")
            lines.append(f"tune ended: the time budget ended the {' and '.join(cut)} ({self.budget.text()}){why}; "
                         f"--resume with a larger --time-budget continues")
        return lines
    def _choose(self, batch: int) -> Choice:
        """choose(), with the chosen candidate's held-out figures re-measured on its own path (kernel,
        implementation) where that differs from the reference path the accuracy stage ran; a candidate that breaks
        the budget there, or that the time budget leaves no time to re-measure, is set aside and the next one is
        tried."""
        rows = list(self.rows.values())
        first = self.s["prune_images"]
        while True:
            choice = choose(rows, batch, self.s["budget"], self.s["min_speedup"], self.measure,
                            prune_images=first)
            if choice.row is None:
                return choice
            params = json.loads(choice.row.params)
            if params == accuracy_twin(next(k for k in self.candidates if k.name == choice.row.candidate)):
                choice.row.chosen = True  # the path the accuracy stage ran
                return choice
            labels = None if self.labels is None else self.labels[first:]
            self.bar.start(f"checking {choice.row.candidate} on its own path", len(self.images) - first, "images")
            paired, how = self._paired(self._model(params, choice.row.method), self.images[first:], self.held,
                                       labels, sequential=False, stage="choice")
            self.bar.finish()
            if how == "all images":
                own = self._figures(paired)
                checked = copy.copy(choice.row)
                for k, v in own.items():
                    setattr(checked, k, v)
                if self._within(checked):
                    for k, v in own.items():
                        setattr(choice.row, k, v)
                    choice.row.chosen = True
                    return choice
            rows = [r for r in rows if r is not choice.row]
