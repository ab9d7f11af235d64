"""`tokcomp tune` / `timm_tokcomp.tune`: measure the training-free candidates on this device and choose the fastest
one that keeps accuracy within a budget (points of top-1 lost with labels, % of predictions changed without), or
none, within a time budget.

Stages (each written to the CSV as it is measured, so --resume continues from any point; each ends by its share of
--time-budget, budget.STAGE_ENDS, and says in one line what it kept and stopped):
  1. screen: per accuracy setting (method and parameters, proportional attention on or off), those that could save
     most first (MAC ratio), the loss on the first `prune_images` images; a setting whose loss is above the budget
     even at its exact 95 % lower bound goes no further;
  2. hold out: the loss of every other setting on the images after the first `prune_images`, with paired counts
     (and top-1 with exact McNemar p when the folder is labelled); a setting whose loss's one-sided 95 % upper
     bound is above the budget is not timed (the budget is a promise, not a point estimate). Both stages stop a
     setting before its last image once it is surely above the budget;
  3. time: per batch size and execution mode, the candidates within the budget (every kernel, proportional-attention
     implementation and mode the device offers) interleaved with the plain model in the same mode: the default
     path of each setting first, in order of MAC ratio, its other paths only where the default is a contender;
     each until its 95 % speed-up interval excludes 1 or lies below the best lower bound measured (surely not the
     winner), or `max_rounds`; a candidate whose MAC ratio cannot beat that lower bound is not timed;
  4. choose, per batch size: the fastest candidate whose speed-up's lower bound against the fastest plain model
     measured (plain in whichever mode ran fastest: compiled, say) is above 1 (and whose speed-up is at least
     `min_speedup`), re-checked on its own path; otherwise 'no reduction', with the reason, the candidate that came
     closest and, where the held-out images were too few for a promise, how many would do.
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
from ..kit.agreement import Paired, check_classifier, chunks, compare, predict
from ..kit.paths import FastPath
from ..kit.stats import loss_bounds
from ..models import build_base_model, check_finite_parameters, eval_transform, is_hf_folder
from ..precision import check_device, check_dtype, device_description, precision
from ..identity import data_digest, weights_digest
from ..data import UnlabeledImages, check_num_classes, open_images
from ..measure import forward_counting
from ..methods import default_tune_space
from ..outputs import run_folder, write_text
from ..checks import check_int, check_real, is_int
from .budget import StageBar, TimeBudget, count, estimate_text, monotonic, plan_text
from .report import OUT_FILES, TuneResult, sample_notes, write_outputs
from .rows import BUDGET_MEASURES, NOT_REACHED, Candidate, Choice, TuneRow
from .select import bound_text, choose
from .space import accuracy_twin, applicable_candidates, check_space, default_modes
from .store import resume_rows, write_rows
from .timing import TimingStage


def _predictions(model: nn.Module, images: torch.Tensor, batch: int) -> torch.Tensor:
    return predict(model, chunks(images, batch))[0]


def _load_images(data: str, model: nn.Module, limit: int, show_progress: bool,
                 num_classes: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    dataset = open_images(data, eval_transform(model), limit=limit)
    if num_classes and not isinstance(dataset, UnlabeledImages):
        check_num_classes(dataset, num_classes)
    items = [dataset[i] for i in tqdm(range(len(dataset)), desc="images", disable=not show_progress, file=sys.stderr)]
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
        from ..patch import check_supported, is_patched

        check_supported(model)
        check_finite_parameters(model, "model")
        if is_patched(model):
            raise ValueError("model is already reduced; tune a plain timm model (timm_tokcomp.remove(model) first)")
        name = (getattr(model, "pretrained_cfg", None) or {}).get("architecture", type(model).__name__)
        base = copy.deepcopy(model).to(device).eval()
    check_space(space, base)
    check_classifier(base, device)  # a feature model is refused before --out is touched
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
        result = tuner.run()
        if out:
            write_outputs(result, out)
    return result


class _Tuner(TimingStage):
    def __init__(self, base: nn.Module, data: str, settings: Dict[str, Any], candidates: List[Candidate],
                 notes: List[str], out, show_progress, budget: TimeBudget):
        self.base, self.s, self.out, self.show, self.budget = base, settings, out, show_progress, budget
        self.previous: Dict[Tuple[int, str], TuneRow] = {}  # a killed run's rows (resume)
        self.device, self.dtype, self.tf32 = settings["device"], settings["dtype"], settings["tf32"]
        self.candidates, self.notes = candidates, list(notes)
        self.images, self.labels = _load_images(data, base, settings["limit"], show_progress,
                                                 getattr(base, "num_classes", 0))
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
        # a killed run's rows carry on; what its time budget did not reach is measured now
        self.rows = {k: r for k, r in self.previous.items() if r.status != f"{NOT_REACHED} (screening)"}
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
            bar.stage("screening")
            start = monotonic()
            plain_screen = self._plain_predictions(screen_x, eval_batch)
            per_image = (monotonic() - start) / len(screen_x)
            gmacs = self._gmacs(settings, screen_x[:1])
            ratios = {k: self.plain_gmacs / v for k, v in gmacs.items()}
            timing_images = 2 * most * sum(batches) * len(self.candidates)  # each round: plain and the candidate
            bar.say(estimate_text(per_image, ratios, first, len(held_x), timing_images, self.budget))
            settings.sort(key=lambda k: (-ratios[k], k))  # the ones that could save most first
            self._screen(settings, gmacs, screen_x, plain_screen, eval_batch)
            bar.stage("held-out check")
            plain_held = self._plain_predictions(held_x, eval_batch)
            self._hold_out(settings, held_x, plain_held, eval_batch)
            for batch in batches:
                for mode in modes:
                    bar.stage(f"timing batch {batch}, {mode}")
                    self._time(batch, mode)
            bar.stage("checking the choice")
            choices = []
            for b in batches:
                choices.append(self._choose(b, held_x, plain_held, eval_batch))
                bar.update(1)
        self._close_unreached(settings)
        self._write()
        bar.close()
        return TuneResult(list(self.rows.values()), choices, dict(self.s, notes=self.notes, stages=bar.lines))

    def _plain_predictions(self, images: torch.Tensor, batch: int) -> torch.Tensor:
        return _predictions(self.base, images.to(self.device), batch)

    def _gmacs(self, settings: List[str], x: torch.Tensor) -> Dict[str, float]:
        """setting -> GMACs per image of one forward (on its reference path; an earlier run's figure reused)."""
        _, plain_macs = forward_counting(self.base, x.to(self.device))
        self.plain_gmacs = plain_macs / 1e9
        out = {}
        for setting in settings:
            known = next((r.gmacs for r in self._of(setting) if r.gmacs is not None), None)
            if known is None:
                c = next(c for c in self.candidates if c.setting == setting)
                with torch.inference_mode():
                    known = forward_counting(self._model(accuracy_twin(c), c.method), x.to(self.device))[1] / 1e9
            out[setting] = known
        return out

    def _paired(self, model: nn.Module, x: torch.Tensor, plain: torch.Tensor, labels: Optional[torch.Tensor],
                batch: int) -> Tuple[Paired, bool]:
        """(model's predictions against plain's on x, batch by batch, stopped early once its loss is above the
        budget even at a 99 % lower bound (stricter than the 95 % the decision uses, for the repeated looks);
        whether it stopped early)."""
        preds = []
        for i in range(0, len(x), batch):
            preds.append(_predictions(model, x[i:i + batch].to(self.device), batch))
            done = sum(len(p) for p in preds)
            paired = compare(torch.cat(preds), plain[:done], None if labels is None else labels[:done])
            if done < len(x) and self._bounds(paired, 0.99)[1] > self.s["budget"]:
                return paired, True
        return paired, False

    def _bounds(self, paired: Paired, confidence: float = 0.95) -> Tuple[float, float, float]:
        return loss_bounds(self.measure, paired.n, paired.changed, paired.gained, paired.lost, confidence)

    def _screen(self, settings: List[str], gmacs: Dict[str, float], x: torch.Tensor, plain: torch.Tensor,
                batch: int) -> None:
        """Per setting, the loss on the screening images; a setting above the budget even at the exact 95 % lower
        bound (kit.stats.loss_bounds) goes no further. Its rows (one per batch size and path) are written at once."""
        labels = None if self.labels is None else self.labels[:len(plain)]
        counts = {"kept": 0, "stopped": 0, "early": 0, "reused": 0, "not reached": 0}
        for setting in settings:
            self.bar.update(1)
            if any(r.screen_n is not None for r in self._of(setting)):
                counts["reused"] += 1
                counts["stopped" if self._of(setting)[0].status.startswith("pruned: budget") else "kept"] += 1
                continue
            if self.budget.over("screening"):
                counts["not reached"] += 1
                continue
            c = next(c for c in self.candidates if c.setting == setting)
            paired, early = self._paired(self._model(accuracy_twin(c), c.method), x, plain, labels, batch)
            loss, lo, _ = self._bounds(paired)
            status = "screened"
            if lo > self.s["budget"]:
                counts["early"] += early
                what = (f"changed {paired.changed} of {paired.n} images' top-1" if self.measure == "agreement" else
                        f"lost {paired.lost} and gained {paired.gained} correct of {paired.n} images")
                status = (f"pruned: budget (screening {what}; even the 95 % lower bound, {lo:.2f} "
                          f"{BUDGET_MEASURES[self.measure]}, is above the budget of {self.s['budget']})")
            counts["stopped" if status != "screened" else "kept"] += 1
            self._add_rows(setting, status=status, gmacs=gmacs[setting], mac_ratio=self.plain_gmacs / gmacs[setting],
                           screen_agree=paired.agreement, screen_n=paired.n, screen_loss=loss)
            self._write()
        self.bar.say(f"screening on {len(x)} images: {counts['kept']} of {count(len(settings), 'setting')} kept; "
                     f"{counts['stopped']} stopped, above the budget even at the 95 % lower bound ({counts['early']} "
                     f"of them before their last image); {counts['not reached']} not reached (time budget)"
                     + (f"; {counts['reused']} from the earlier run" if counts["reused"] else ""))

    def _hold_out(self, settings: List[str], x: torch.Tensor, plain: torch.Tensor, batch: int) -> None:
        """Per setting the screening kept, its held-out figures (_agreement, on its reference path); a setting whose
        loss's one-sided 95 % upper bound is above the budget is not timed (a promise: kit.stats.loss_bounds)."""
        counts = {"within": 0, "over": 0, "early": 0, "not reached": 0}
        for setting in settings:
            self.bar.update(1)
            rows = self._of(setting)
            if not rows or rows[0].status.startswith("pruned: budget"):  # not screened, or stopped there
                continue
            if rows[0].agree_n is None:
                if self.budget.over("held-out check"):
                    counts["not reached"] += 1
                    for r in rows:  # never timed without its held-out figure; a resume checks it
                        r.status = f"{NOT_REACHED} (held-out check)"
                    continue
                c = next(c for c in self.candidates if c.setting == setting)
                figures, early = self._agreement(self._model(accuracy_twin(c), c.method), x, plain, batch, early=True)
                for r in rows:
                    for k, v in figures.items():
                        setattr(r, k, v)
                counts["early"] += early
            upper = rows[0].loss_upper(self.measure)
            if upper > self.s["budget"] + 1e-9:
                counts["over"] += 1
                for r in rows:
                    if r.status == "screened":
                        r.status = f"pruned: held-out ({bound_text(r, self.measure, self.s['budget'])}; " \
                                   f"{r.agree_n} images)"
            else:
                counts["within"] += 1
            self._write()
        self.bar.say(f"held-out check on {len(x)} images: {count(counts['within'], 'setting')} within the budget at "
                     f"the one-sided 95 % upper bound; {counts['over']} above it ({counts['early']} stopped before "
                     f"their last image, surely above); {counts['not reached']} not reached (time budget)")

    def _agreement(self, model: nn.Module, x: torch.Tensor, plain: torch.Tensor, batch: int,
                   early: bool = False) -> Tuple[Dict[str, Any], bool]:
        """(the held-out figures of model, as TuneRow names them (agree, agree_n, changed; with labels gained, lost,
        top1_plain, top1, top1_p), whether it stopped early (only if early))."""
        labels = None if self.labels is None else self.labels[self.s["prune_images"]:]
        if early:
            paired, stopped = self._paired(model, x, plain, labels, batch)
        else:
            paired, stopped = compare(_predictions(model, x.to(self.device), batch), plain, labels), False
        figures: Dict[str, Any] = {"agree": paired.agreement, "agree_n": paired.n, "changed": paired.changed}
        if self.labels is not None:
            figures.update(gained=paired.gained, lost=paired.lost, top1_plain=paired.top1_reference, top1=paired.top1,
                           top1_p=paired.top1_p)
        return figures, stopped

    def _close_unreached(self, settings: List[str]) -> None:
        """Rows for what the time budget did not reach (a resume measures them), and a note saying what."""
        for setting in settings:
            if not self._of(setting):
                self._add_rows(setting, status=f"{NOT_REACHED} (screening)")
        for r in self.rows.values():
            if r.status == "screened":
                stage = "held-out check" if r.agree_n is None else "timing"
                r.status = f"{NOT_REACHED} ({stage})"
        said = []
        for stage, what in (("screening", "setting"), ("held-out check", "setting"), ("timing", "candidate")):
            left = {(r.batch, r.candidate) if stage == "timing" else r.setting for r in self.rows.values()
                    if r.status == f"{NOT_REACHED} ({stage})"}
            if left:
                said.append(f"{count(len(left), what)} without {'its' if len(left) == 1 else 'their'} {stage}")
        if said:
            self.notes.append(f"the time budget ({self.budget.text()}) ended with {', '.join(said)}; tune chose "
                              f"from what it measured (--resume with a larger --time-budget continues the run)")

    def _choose(self, batch: int, x: torch.Tensor, plain: torch.Tensor, eval_batch: int) -> Choice:
        """choose(), with the chosen candidate's held-out figures re-measured on its own path (kernel,
        implementation) where that differs from the reference path screening ran; a candidate that breaks the
        budget there is set aside and the next one is tried."""
        rows = list(self.rows.values())
        while True:
            choice = choose(rows, batch, self.s["budget"], self.s["min_speedup"], self.measure,
                            prune_images=self.s["prune_images"])
            if choice.row is None:
                return choice
            params = json.loads(choice.row.params)
            if params == accuracy_twin(next(k for k in self.candidates if k.name == choice.row.candidate)):
                choice.row.chosen = True  # the path screening and the held-out check ran
                return choice
            own, _ = self._agreement(self._model(params, choice.row.method), x, plain, eval_batch)
            checked = copy.copy(choice.row)
            for k, v in own.items():
                setattr(checked, k, v)
            if checked.loss_upper(self.measure) <= self.s["budget"] + 1e-9:
                for k, v in own.items():
                    setattr(choice.row, k, v)
                choice.row.chosen = True
                return choice
            rows = [r for r in rows if r is not choice.row]
