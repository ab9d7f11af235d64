"""`tokcomp tune` / `timm_tokcomp.tune`: measure the training-free candidates on this device and choose the fastest
one that keeps accuracy within a budget (points of top-1 lost with labels, % of predictions changed without), or
none.

Stages (each resumable from the CSV):
  1. screen: per accuracy setting (method and parameters, proportional attention on or off), the MACs per image of
     one forward and the loss on the first `prune_images` images; a setting whose loss is above the budget even at
     its exact 95 % lower bound goes no further;
  2. hold out: the loss of every other setting on the images after the first `prune_images`, with paired counts
     (and top-1 with exact McNemar p when the folder is labelled); a setting above the budget there is not timed;
  3. time: per batch size and execution mode, the settings within the budget (every kernel, proportional-attention
     implementation and mode the device offers) interleaved with the plain model in the same mode, in order of MAC
     ratio, until each one's 95 % speed-up interval excludes 1 or `max_rounds`; a candidate whose MAC ratio cannot
     beat the lower bound already measured for one within the budget is not timed;
  4. choose, per batch size: the fastest candidate whose speed-up's lower bound against the fastest plain model
     measured (plain in whichever mode ran fastest: compiled, say) is above 1 (and whose speed-up is at least
     `min_speedup`), re-checked on its own path; otherwise 'no reduction', with the reason
     and the candidate that came closest.
"""
import contextlib
import copy
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import timm
import torch
from torch import nn
from tqdm import tqdm

from ..core import NO_REDUCTION, apply
from ..kit import modes as modes_
from ..kit.modes import check_batches, check_modes
from ..kit.agreement import Paired, chunks, compare, predict
from ..kit.stats import disagreement_lower_bound, speedup_interval
from ..models import build_base_model
from ..precision import check_device, check_dtype, device_description, precision
from ..identity import data_digest, weights_digest
from ..data import UnlabeledImages, check_num_classes, open_images
from ..measure import forward_counting, no_silent_eager_fallback, time_runs
from ..methods import default_tune_space
from ..outputs import run_folder, write_text
from ..schedules import is_int, is_real
from .report import OUT_FILES, TuneResult, sample_notes, write_outputs
from .rows import BUDGET_MEASURES, Candidate, Choice, HELD_OUT_FIELDS, TuneRow
from .select import choose, loss_text
from .space import accuracy_twin, applicable_candidates, check_space, default_modes
from .store import resume_rows, write_rows


def _predictions(model: nn.Module, images: torch.Tensor, batch: int) -> torch.Tensor:
    return predict(model, chunks(images, batch))[0]


def _load_images(data: str, cfg: Dict, limit: int, show_progress: bool,
                 num_classes: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    dataset = open_images(data, timm.data.create_transform(**cfg), limit=limit)
    if num_classes and not isinstance(dataset, UnlabeledImages):
        check_num_classes(dataset, num_classes)
    items = [dataset[i] for i in tqdm(range(len(dataset)), desc="images", disable=not show_progress, file=sys.stderr)]
    images = torch.stack([x for x, _ in items])
    labelled = not isinstance(dataset, UnlabeledImages)
    return images, (torch.tensor([y for _, y in items]) if labelled else None)


def _check_args(batches, budget, min_speedup, limit, prune_images, max_rounds, modes, device) -> None:
    check_batches(batches)
    if not is_real(budget) or not 0 <= budget <= 100 or not math.isfinite(budget):
        raise ValueError(f"--budget must be a number of percentage points in [0, 100], got {budget!r}")
    if min_speedup is not None and (not is_real(min_speedup) or not math.isfinite(min_speedup) or min_speedup < 1.0):
        raise ValueError(f"--min-speedup must be a number >= 1, got {min_speedup!r}")
    if not is_int(prune_images) or prune_images < 1:
        raise ValueError(f"--prune-images must be an integer >= 1, got {prune_images!r}")
    if not is_int(limit) or limit < prune_images + 1:
        raise ValueError(f"--limit must be an integer above --prune-images ({prune_images}): the images after the "
                         f"first {prune_images} are held out for the agreement that decides; got {limit!r}")
    if not is_int(max_rounds) or max_rounds < 3:
        raise ValueError(f"--max-rounds must be an integer >= 3, got {max_rounds!r}")
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
    limit: int = 512,
    prune_images: int = 128,
    max_rounds: int = 30,
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
    run continues from its CSV."""
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
        if is_patched(model):
            raise ValueError("model is already reduced; tune a plain timm model (timm_tokcomp.remove(model) first)")
        name = (getattr(model, "pretrained_cfg", None) or {}).get("architecture", type(model).__name__)
        base = copy.deepcopy(model).to(device).eval()
    check_space(space, base)
    candidates, notes = applicable_candidates(space, base, device, modes)
    settings = {"model": name, "device": device, "device_name": device_description(device), "dtype": dtype, "tf32": tf32,
                "batches": list(batches), "budget": budget, "budget_on": budget_on, "min_speedup": min_speedup,
                "modes": list(modes),
                "limit": limit, "prune_images": prune_images, "max_rounds": max_rounds, "data": str(data),
                "space": [[m, p] for m, p in space],
                # what the rows were measured on, by content (a resume needs the same; the path is only shown)
                "weights_sha256": weights_digest(base), "data_sha256": data_digest(data),
                "random_weights": isinstance(model, str) and not checkpoint and not pretrained}
    # an earlier run in out is set aside (--overwrite) and comes back if this one fails before writing
    with run_folder(out, resume, overwrite, OUT_FILES) if out else contextlib.nullcontext():
        previous = resume_rows(out, settings) if out and resume else {}  # before any image is read
        tuner = _Tuner(base, data, settings, candidates, notes, out, show_progress)  # opens and checks the images
        tuner.previous = previous
        result = tuner.run()
        if out:
            write_outputs(result, out)
    return result


class _Tuner:
    def __init__(self, base: nn.Module, data: str, settings: Dict[str, Any], candidates: List[Candidate],
                 notes: List[str], out, show_progress):
        self.base, self.s, self.out, self.show = base, settings, out, show_progress
        self.previous: Dict[Tuple[int, str], TuneRow] = {}  # a killed run's rows (resume)
        self.device, self.dtype, self.tf32 = settings["device"], settings["dtype"], settings["tf32"]
        self.cfg = timm.data.resolve_model_data_config(base)
        self.candidates, self.notes = candidates, list(notes)
        self.images, self.labels = _load_images(data, self.cfg, settings["limit"], show_progress,
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
        self.notes += sample_notes(len(self.images) - settings["prune_images"], settings["prune_images"],
                                   settings["budget"], self.measure)
        self.rows: Dict[Tuple[int, str], TuneRow] = {}

    def _write(self) -> None:
        if self.out:
            write_rows(list(self.rows.values()), Path(self.out) / "tune.csv")

    def _model(self, kwargs: Dict[str, Any], method: str) -> nn.Module:
        return apply(copy.deepcopy(self.base), method, **kwargs)

    def run(self) -> TuneResult:
        if self.out:
            write_text(Path(self.out) / "tune_config.json", json.dumps(self.s, indent=2) + "\n")
        first = self.s["prune_images"]
        eval_batch = max(self.s["batches"])
        with precision(self.device, self.dtype, self.tf32):
            screen_x, held_x = self.images[:first], self.images[first:]
            settings = list(dict.fromkeys(c.setting for c in self.candidates))
            # one tick per screened setting, timed round (the timing phases add their rounds when they start and
            # give back what they did not need), held-out setting and checked choice
            total = 2 * len(settings) + len(self.s["batches"])
            with tqdm(total=total, desc="tune: screening", unit="step", disable=not self.show,
                      file=sys.stderr) as bar:
                self.bar = bar
                plain_screen = self._plain_predictions(screen_x, eval_batch)
                screened = self._screen(settings, screen_x, plain_screen, eval_batch, bar)
                bar.set_description("tune: held-out check")
                plain_held = self._plain_predictions(held_x, eval_batch)
                held = self._hold_out(screened, held_x, plain_held, eval_batch, bar)
                for batch in self.s["batches"]:
                    for mode in self.s["modes"]:
                        bar.set_description(f"tune: timing batch {batch}, {mode}")
                        self._time(batch, mode, screened, held)
                bar.set_description("tune: checking the choice")
                choices = []
                for b in self.s["batches"]:
                    choices.append(self._choose(b, held_x, plain_held, eval_batch))
                    bar.update(1)
        self._write()
        return TuneResult(list(self.rows.values()), choices, dict(self.s, notes=self.notes))

    def _plain_predictions(self, images: torch.Tensor, batch: int) -> torch.Tensor:
        return _predictions(self.base, images.to(self.device), batch)

    def _screen(self, settings: List[str], x: torch.Tensor, plain: torch.Tensor, batch: int, bar
                ) -> Dict[str, Tuple[float, float, int, Optional[str]]]:
        """setting -> (GMACs per image, agreement %, images, loss in the budget's measure, pruning reason or None)."""
        by_setting = {c.setting: c for c in self.candidates}
        _, plain_macs = forward_counting(self.base, x[:1].to(self.device))
        self.plain_gmacs = plain_macs / 1e9
        result = {}
        for setting in settings:
            known = next((r for r in self.previous.values() if r.setting == setting and r.screen_n is not None), None)
            if known is not None:
                reason = known.status if known.status.startswith("pruned: budget") else None
                result[setting] = (known.gmacs, known.screen_agree, known.screen_n, known.screen_loss, reason)
                bar.update(1)
                continue
            c = by_setting[setting]
            model = self._model(accuracy_twin(c), c.method)
            with torch.inference_mode():
                _, macs = forward_counting(model, x[:1].to(self.device))
            paired = compare(_predictions(model, x.to(self.device), batch), plain,
                             None if self.labels is None else self.labels[:len(plain)])
            n = paired.n
            loss, bound, counts = self._screen_loss(paired)
            reason = None
            if bound > self.s["budget"]:
                reason = (f"pruned: budget (screening {counts}; even the 95 % lower bound, {bound:.2f} "
                          f"{BUDGET_MEASURES[self.measure]}, is above the budget of {self.s['budget']})")
            result[setting] = (macs / 1e9, paired.agreement, n, loss, reason)
            bar.update(1)
        return result

    def _screen_loss(self, paired: Paired) -> Tuple[float, float, str]:
        """(loss on the screening images, its one-sided exact 95 % lower bound, both in the budget's measure, and
        the counts they rest on). top1: of the d images whose correctness differs, `lost` turned wrong; the drop's
        bound is d (2 p_lo - 1) / n with p_lo the Clopper-Pearson bound of lost / d."""
        n, changed, gained, lost = paired.n, paired.changed, paired.gained, paired.lost
        if self.measure == "agreement":
            return (100.0 * changed / n, 100.0 * disagreement_lower_bound(changed, n),
                    f"changed {changed} of {n} images' top-1")
        d = gained + lost
        bound = 0.0 if d == 0 else max(0.0, 100.0 * d * (2 * disagreement_lower_bound(lost, d) - 1) / n)
        return 100.0 * (lost - gained) / n, bound, f"lost {lost} and gained {gained} correct of {n} images"

    def _row(self, batch: int, c: Candidate, screened, held: Dict[str, Dict[str, Any]]) -> TuneRow:
        gmacs, agree, n, loss, reason = screened[c.setting]
        row = TuneRow(batch, c.mode, c.name, c.setting, c.path, c.method, json.dumps(c.kwargs, sort_keys=True),
                      status=reason or "screened", gmacs=gmacs, mac_ratio=self.plain_gmacs / gmacs,
                      screen_agree=agree, screen_n=n, screen_loss=loss, **held.get(c.setting, {}))
        if reason is None and row.loss(self.measure) > self.s["budget"] + 1e-9:
            row.status = (f"pruned: held-out ({loss_text(row.loss(self.measure), self.measure)} on "
                          f"{row.agree_n} images; budget {self.s['budget']})")
        return row

    def _time(self, batch: int, mode: str, screened, held: Dict[str, Dict[str, Any]]) -> None:
        in_mode = [c for c in self.candidates if c.mode == mode]
        for c in in_mode:
            done = self.previous.get((batch, c.name))
            self.rows[(batch, c.name)] = done if done is not None and done.status != "screened" else \
                self._row(batch, c, screened, held)
        todo = sorted((c for c in in_mode if self.rows[(batch, c.name)].status == "screened"),
                      key=lambda c: (-self.rows[(batch, c.name)].mac_ratio, c.name))
        x = self.images[torch.arange(batch) % len(self.images)].to(self.device)
        group, most = 6, self.s["max_rounds"]
        reserved = math.ceil(len(todo) / group)  # chunks whose rounds the progress bar counts on
        self.bar.total += reserved * most
        while todo:
            timed = [r for r in self.rows.values() if r.batch == batch and r.mode == mode and r.status == "timed"]
            for c in list(todo):
                row = self.rows[(batch, c.name)]
                # beaten for sure: a timed candidate (within the budget on the held-out images, as every timed one is)
                # is surely faster than row's MACs allow
                better = [t for t in timed if t.speedup_lo >= row.mac_ratio]
                if better:
                    best = max(better, key=lambda t: t.speedup_lo)
                    row.status = (f"pruned: MACs (at most {row.mac_ratio:.2f}x fewer; {best.candidate}, within the "
                                  f"budget, is at least {best.speedup_lo:.2f}x faster)")
                    todo.remove(c)
            chunk, todo = todo[:group], todo[group:]
            if chunk:
                rounds = self._time_chunk(batch, mode, chunk, x)
                self.bar.total -= most - rounds  # the rounds this chunk did not need
                reserved -= 1
                self._write()
            needed = math.ceil(len(todo) / group)
            self.bar.total -= (reserved - needed) * most  # chunks the pruning made unnecessary
            reserved = needed
            self.bar.refresh()

    def _time_chunk(self, batch: int, mode: str, chunk: List[Candidate], x: torch.Tensor) -> int:
        """Time the chunk interleaved with the plain model in this mode, a few rounds at a time, until every
        interval excludes 1 or max_rounds; the rows get the figures or the failure. Returns the rounds timed."""
        rounds = 0
        try:
            with no_silent_eager_fallback(len(chunk) + 1):
                torch._dynamo.reset()
                models: Dict[str, Callable] = {NO_REDUCTION: modes_.runner(self.base, mode, x)}
                for c in chunk:
                    try:
                        runner = modes_.runner(self._model(c.kwargs, c.method), mode, x)
                        with torch.inference_mode():  # as timed: compile / capture now, so a failure is this path's
                            runner(x)
                        models[c.name] = runner
                    except Exception as e:  # a path this device or torch cannot run: recorded, not fatal
                        self.rows[(batch, c.name)].status = f"failed: {type(e).__name__}: {str(e)[:200]}"
                times: Dict[str, List[float]] = {k: [] for k in models}
                warmup = 1 if mode == "eager" else 2
                while rounds < self.s["max_rounds"]:
                    step = min(5 if rounds == 0 else 3, self.s["max_rounds"] - rounds)
                    new = time_runs(models, x, rounds=step, warmup=warmup if rounds == 0 else 0)
                    for k, v in new.items():
                        times[k] += v
                    rounds += step
                    self.bar.update(step)
                    intervals = {k: speedup_interval(times[NO_REDUCTION], t) for k, t in times.items()
                                 if k != NO_REDUCTION}
                    if all(lo > 1.0 or hi < 1.0 for _, lo, hi in intervals.values()):
                        break
        except Exception as e:
            for c in chunk:
                if self.rows[(batch, c.name)].status == "screened":
                    self.rows[(batch, c.name)].status = f"failed: {type(e).__name__}: {str(e)[:200]}"
            return rounds
        for name, (point, lo, hi) in intervals.items():
            row = self.rows[(batch, name)]
            row.status, row.ms_plain = "timed", 1e3 * statistics.median(times[NO_REDUCTION])
            row.ms, row.speedup, row.speedup_lo, row.speedup_hi = 1e3 * statistics.median(times[name]), point, lo, hi
            row.rounds = len(times[name])
        return rounds

    def _hold_out(self, screened, x: torch.Tensor, plain: torch.Tensor, batch: int, bar) -> Dict[str, Dict[str, Any]]:
        """setting -> its held-out figures (_agreement, on its reference path), for every setting the screening
        kept; a resumed run's figures are reused."""
        held = {}
        for setting, (*_, reason) in screened.items():
            known = next((r for r in self.previous.values() if r.setting == setting and r.agree is not None), None)
            if known is not None:
                held[setting] = {k: getattr(known, k) for k in HELD_OUT_FIELDS}
            elif reason is None:
                c = next(c for c in self.candidates if c.setting == setting)
                held[setting] = self._agreement(self._model(accuracy_twin(c), c.method), x, plain, batch)
            bar.update(1)
        return held

    def _agreement(self, model: nn.Module, x: torch.Tensor, plain: torch.Tensor, batch: int) -> Dict[str, Any]:
        paired = compare(_predictions(model, x.to(self.device), batch), plain,
                         None if self.labels is None else self.labels[self.s["prune_images"]:])
        figures: Dict[str, Any] = {"agree": paired.agreement, "agree_n": paired.n, "changed": paired.changed}
        if self.labels is not None:
            figures.update(top1_plain=paired.top1_reference, top1=paired.top1, top1_p=paired.top1_p)
        return figures

    def _choose(self, batch: int, x: torch.Tensor, plain: torch.Tensor, eval_batch: int) -> Choice:
        """choose(), with the chosen candidate's agreement re-measured on its own path (kernel, implementation);
        a candidate that fails there is set aside and the next one is tried."""
        rows = list(self.rows.values())
        while True:
            choice = choose(rows, batch, self.s["budget"], self.s["min_speedup"], self.measure)
            if choice.row is None:
                return choice
            own = self._agreement(self._model(json.loads(choice.row.params), choice.row.method), x, plain, eval_batch)
            checked = copy.copy(choice.row)
            for k, v in own.items():
                setattr(checked, k, v)
            if checked.loss(self.measure) <= self.s["budget"] + 1e-9:
                for k, v in own.items():
                    setattr(choice.row, k, v)
                choice.row.chosen = True
                return choice
            rows = [r for r in rows if r is not choice.row]
