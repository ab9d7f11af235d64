"""`tokcomp tune` / `timm_tokcomp.tune`: measure the training-free candidates on this device and choose the fastest
one that keeps accuracy within a budget (points of top-1 lost with labels, % of predictions changed without), or
none, within a time budget.

Stages (each written to the CSV as it is measured, so --resume continues from any point; each ends by its share of
--time-budget, budget.STAGE_ENDS, read before every batch of images and every timed round, and says in one line what
it kept and stopped):
  1. accuracy search (accuracy.AccuracyStage): per method axis (its settings that differ only in strength: r, keep
     rate, flops_ratio; one token schedule under two names counts once) a bisection for its strongest setting within
     the budget, the axes in turns. A check screens the setting on the first `prune_images` images (above the budget
     even at its exact 95 % lower bound: no further), then holds it out image batch by image batch, with paired
     counts (and top-1 with exact McNemar p when the folder is labelled), until it is surely within or surely above
     the budget or the images end; a setting whose loss's one-sided 95 % upper bound is above the budget is not
     timed (the budget is a promise, not a point estimate). A check decides the milder (within) or stronger (above)
     settings of its axis without checking them;
  2. time: per batch size and execution mode, the candidates within the budget (every kernel, proportional-attention
     implementation and mode the device offers) interleaved with the plain model in the same mode: the default
     path of each setting first, in order of MAC ratio, its other paths only where the default is a contender;
     each until its 95 % speed-up interval excludes 1 or lies below the best lower bound measured (surely not the
     winner), or `max_rounds`; a candidate whose MAC ratio cannot beat that lower bound is not timed;
  3. choose, per batch size: the fastest candidate whose speed-up's lower bound against the fastest plain model
     measured (plain in whichever mode ran fastest: compiled, say) is above 1 (and whose speed-up is at least
     `min_speedup`), re-checked on its own path; otherwise 'no reduction', with the reason, the candidate that came
     closest and, where the held-out images were too few for a promise, how many would do. Where the time budget
     left settings unchecked, the reason says so.
"""
import contextlib
import copy
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from tqdm import tqdm

from ..core import apply
from ..kit.modes import check_batches, check_modes
from ..kit.agreement import NonFiniteScores, check_classifier, chunks, predict
from ..kit.paths import FastPath
from ..models import build_base_model, check_finite_parameters, eval_transform, is_hf_folder, weights_source
from ..precision import check_device, check_dtype, device_description, precision
from ..identity import data_digest, weights_digest
from ..data import UnlabeledImages, check_num_classes, open_images
from ..methods import default_tune_space
from ..outputs import run_folder, write_text
from ..checks import check_int, check_real, is_int
from .budget import StageBar, TimeBudget, count, estimate_text, monotonic, plan_text, search_text
from .report import OUT_FILES, TuneResult, sample_notes, write_outputs
from .rows import BUDGET_MEASURES, NOT_REACHED, Candidate, Choice, TuneRow
from .select import choose
from .space import accuracy_twin, applicable_candidates, check_space, default_modes
from .store import resume_rows, write_rows
from .accuracy import DECIDED_UNCHECKED, AccuracyStage, Predictions
from .timing import TimingStage


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


def _check_args(batches, budget, min_speedup, limit, prune_images, max_rounds, modes, device) -> None:
    check_batches(batches)
    check_real("--budget", budget, 0.0, strict=False, high=100.0, note="(percentage points)")
    if min_speedup is not None:
        check_real("--min-speedup", min_speedup, 1.0, strict=False)
    check_int("--prune-images", prune_images, 1)
    if not is_int(limit) or limit < prune_images + 1:
        raise ValueError(f"--limit must be an integer above --prune-images ({prune_images}): the images after the "
                         f"first {prune_images} are held out for the agreement that decides; got {limit!r}")
    check_int("--max-rounds", max_rounds, 3)
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
    if budget_on not in ("auto",) + tuple(BUDGET_MEASURES):
        raise ValueError(f"--budget-on must be auto, {' or '.join(BUDGET_MEASURES)}, got {budget_on!r}")
    space = list(space) if space is not None else list(default_tune_space())
    if isinstance(model, str):
        name = model
        base = build_base_model(model, checkpoint, pretrained, device)
    else:
        from ..families import patched_family, resolve

        resolve(model)
        check_finite_parameters(model, "model")
        if patched_family(model) is not None:
            raise ValueError("model is already reduced; tune a plain timm model (timm_tokcomp.remove(model) first)")
        name = (getattr(model, "pretrained_cfg", None) or {}).get("architecture", type(model).__name__)
        base = copy.deepcopy(model).to(device).eval()
    check_space(space, base)
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
        previous = resume_rows(out, settings) if out and resume else {}  # before any image is read
        tuner = _Tuner(base, data, settings, candidates, notes, out, show_progress, clock)  # opens and checks the images
        tuner.previous = previous
        tuner.weights = weights
        result = tuner.run()
        if out:
            write_outputs(result, out)
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

    def _add_rows(self, setting: str, **fields: Any) -> None:
        """The setting's rows, one per batch size and candidate (path and mode), with these fields."""
        for b in self.s["batches"]:
            for c in (c for c in self.candidates if c.setting == setting):
                self.rows[(b, c.name)] = TuneRow(b, c.mode, c.name, setting, c.path, c.method,
                                                 json.dumps(c.kwargs, sort_keys=True), **fields)

    def run(self) -> TuneResult:
        if self.out:
            write_text(Path(self.out) / "tune_config.json", json.dumps(self.s, indent=2) + "\n")
        # a killed run's rows carry on; what its time budget did not reach, and what a search decided without a
        # check (decided again at no cost), is measured now
        self.rows = {k: r for k, r in self.previous.items()
                     if r.status != f"{NOT_REACHED} (screening)" and not r.status.startswith(DECIDED_UNCHECKED)}
        for r in self.rows.values():
            if r.status.startswith(NOT_REACHED):
                r.status = "screened"
        first, batches, modes, most = self.s["prune_images"], self.s["batches"], self.s["modes"], self.s["max_rounds"]
        eval_batch = max(batches)
        settings = list(dict.fromkeys(c.setting for c in self.candidates))
        total = 2 * len(settings) + len(self.candidates) * len(batches) * most + len(batches)
        bar = self.bar = StageBar(total, self.budget, self.show)
        bar.say(plan_text(len(settings), len(self.candidates), modes, len(self.images), first, batches, most,
                          self.budget))
        for note in self.sample_notes:  # before any work: a budget too fine for the held-out images
            bar.say(f"note: {note}")
        with precision(self.device, self.dtype, self.tf32):
            screen_x, held_x = self.images[:first], self.images[first:]
            bar.stage("accuracy search")
            start = monotonic()
            screen = Predictions(self._predict_plain, screen_x, eval_batch)
            try:
                screen.upto(first)
            except NonFiniteScores as e:  # the plain model's first images: name its weights
                raise NonFiniteScores(f"{self.weights}: {e}") from None
            per_image = (monotonic() - start) / len(screen_x)
            facts = self._facts(settings, screen_x[:1])
            ratios = {k: f.mac_ratio for k, f in facts.items()}
            timing_images = 2 * most * sum(batches) * len(self.candidates)  # each round: plain and the candidate
            bar.say(estimate_text(per_image, ratios, first, len(held_x), timing_images, self.budget))
            bar.say(search_text(facts, per_image, first, len(held_x), self.budget))
            self.held = Predictions(self._predict_plain, held_x, eval_batch)  # as far as the checks need them
            self._search(facts, screen, self.held)
            for batch in batches:
                for mode in modes:
                    bar.stage(f"timing batch {batch}, {mode}")
                    self._time(batch, mode)
            bar.stage("checking the choice")
            choices = []
            for b in batches:
                choices.append(self._choose(b))
                bar.update(1)
        self._close_unreached(settings, choices)
        self._write()
        bar.close()
        return TuneResult(list(self.rows.values()), choices, dict(self.s, notes=self.notes, stages=bar.lines))

    def _predict(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        return _predictions(model, images.to(self.device), max(self.s["batches"]))

    def _predict_plain(self, images: torch.Tensor) -> torch.Tensor:
        return self._predict(self.base, images)

    def _close_unreached(self, settings: List[str], choices: List[Choice]) -> None:
        """Rows for what the time budget did not reach (a resume measures them), a note saying what, and each
        choice's reason saying that the time budget, not the accuracy budget, ended the search."""
        for setting in settings:
            if not self._of(setting):
                self._add_rows(setting, status=f"{NOT_REACHED} (screening)")
        for r in self.rows.values():
            if r.status == "screened":
                stage = "held-out check" if r.agree_n is None else "timing"
                r.status = f"{NOT_REACHED} ({stage})"
        said, unchecked = [], set()
        for stage in ("screening", "held-out check", "timing"):  # counted by setting (its paths share its accuracy)
            left = {r.setting for r in self.rows.values() if r.status == f"{NOT_REACHED} ({stage})"}
            if left:
                said.append(f"{count(len(left), 'setting')} without {'its' if len(left) == 1 else 'their'} {stage}")
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
            paired, how = self._paired(self._model(params, choice.row.method), self.images[first:], self.held,
                                       labels, sequential=False, stage="choice")
            if how == "all images":
                own = self._figures(paired)
                checked = copy.copy(choice.row)
                for k, v in own.items():
                    setattr(checked, k, v)
                if checked.loss_upper(self.measure) <= self.s["budget"] + 1e-9:
                    for k, v in own.items():
                        setattr(choice.row, k, v)
                    choice.row.chosen = True
                    return choice
            rows = [r for r in rows if r is not choice.row]
