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
  4. choose, per batch size: the fastest candidate (speed-up against plain eager) whose speed-up's lower bound is
     above 1 (and at least `min_speedup`), re-checked on its own path; otherwise 'no reduction', with the reason
     and the candidate that came closest.
"""
import contextlib
import copy
import csv
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union, get_args

import timm
import torch
from torch import nn
from tqdm import tqdm

from .core import NO_REDUCTION, apply
from .kit import modes as modes_
from .kit.modes import TORCH_MODES, check_batches, check_modes
from .kit.paths import fast_paths
from .kit.stats import disagreement_lower_bound, mcnemar_exact_p, speedup_interval
from .models import build_base_model
from .precision import check_device, check_dtype, device_description, precision
from .kit.presets import device_type_of, versions, write_preset
from .extras import available, pyplot
from .identity import data_digest, weights_digest
from .data import UnlabeledImages, check_num_classes, open_images
from .measure import forward_counting, no_silent_eager_fallback, time_runs
from .methods import default_tune_space, method_class
from .outputs import replacing, run_folder, write_text
from .schedules import is_int, is_real
from .userfiles import fail, read_json

HELD_OUT_FIELDS = ("agree", "agree_n", "changed", "top1_plain", "top1", "top1_p")  # TuneRow's held-out figures
# what the budget limits, in the units of --budget: top-1 when the images have labels, agreement without them
BUDGET_MEASURES = {"top1": "points of top-1 lost", "agreement": "% of the plain model's predictions changed"}
OUT_FILES = ("tune.csv", "tune_config.json", "table.md", "pareto.png", "preset*.json")


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
    """One candidate at one batch size. status: 'pruned: ...' (not timed: budget broken on the screening images,
    or MACs that cannot beat the best speed-up), 'timed', 'failed: ...'. gmacs: per image; mac_ratio: plain / this;
    screen_agree: % agreement on the screening images (screen_n of them), screen_loss: the loss there in the
    budget's measure (BUDGET_MEASURES); ms: median per forward, ms_plain the plain model's in the same mode;
    speedup (the geometric mean of the rounds' ratios) with its 95 % interval; agree: % held-out agreement
    (agree_n images, changed: images whose top-1 class differs from the plain model's); top1 / top1_plain on
    labelled data with the exact McNemar p of the paired split; chosen: this batch size's choice."""

    batch: int
    mode: str
    candidate: str
    setting: str
    path: str
    method: str
    params: str
    status: str = "screened"
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


@dataclass
class Choice:
    """The choice for one batch size: row None means 'no reduction', and reason says why."""

    batch: int
    row: Optional[TuneRow]
    reason: str


@dataclass
class TuneResult:
    rows: List[TuneRow]
    choices: List[Choice]
    settings: Dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        return format_table(self.rows, self.choices)

    def budget_text(self) -> str:
        """'at most 1.0 points of top-1 lost on 384 held-out images (labelled)': what the choice was held to."""
        s = self.settings
        why = ("the images are labelled" if s["budget_on"] == "auto" and s["budget_measure"] == "top1" else
               "no labels: agreement with the plain model, stricter than top-1" if s["budget_on"] == "auto" else
               f"--budget-on {s['budget_on']}")
        return f"budget: at most {s['budget']} {BUDGET_MEASURES[s['budget_measure']]} on the {s['held_out']} " \
               f"held-out images ({why})"


# ---------------------------------------------------------------- statistics


# ---------------------------------------------------------------- selection


def eager_speedups(rows: Sequence[TuneRow]) -> Dict[int, float]:
    """id(row) -> its speed-up against the plain model in eager mode: its own ratio (measured interleaved with the
    plain model in its mode) times how much faster the plain model runs in that mode than in eager mode (medians
    of the plain times of all chunks, which side-steps drift between chunks). Without eager rows, modes are not
    converted."""
    plain: Dict[Tuple[int, str], float] = {}
    for key in {(r.batch, r.mode) for r in rows if r.ms_plain is not None}:
        plain[key] = statistics.median(r.ms_plain for r in rows if (r.batch, r.mode) == key and r.ms_plain is not None)
    return {id(r): r.speedup * plain.get((r.batch, "eager"), plain[(r.batch, r.mode)]) / plain[(r.batch, r.mode)]
            for r in rows if r.speedup is not None and r.ms_plain is not None}


def _loss_text(loss: float, measure: str) -> str:
    """'0.40 points of top-1 lost'; a negative top-1 loss reads as a gain."""
    if measure == "top1" and loss < 0:
        return f"{-loss:.2f} points of top-1 gained"
    return f"{loss:.2f} {BUDGET_MEASURES[measure]}"


def choose(rows: Sequence[TuneRow], batch: int, budget: float, min_speedup: Optional[float] = None,
           measure: str = "agreement") -> Choice:
    """The fastest timed row of this batch size (largest speed-up against plain eager, eager_speedups) whose
    held-out loss in the budget's measure (TuneRow.loss: top-1 points lost, or % of predictions changed) is at most
    `budget` and whose speed-up's lower bound is above 1 (and whose speed-up is at least min_speedup);
    Choice(batch, None, reason) when none qualifies, naming the candidate that came closest (among the rows with a
    held-out figure: timed, or not timed because they were above the budget there)."""
    timed = [r for r in rows if r.batch == batch and r.status == "timed"]
    unit = BUDGET_MEASURES[measure]
    within = [r for r in timed if r.loss(measure) is not None and r.loss(measure) <= budget + 1e-9]
    faster = [r for r in within if r.speedup_lo is not None and r.speedup_lo > 1.0]
    enough = [r for r in faster if min_speedup is None or r.speedup >= min_speedup]
    if enough:
        score = eager_speedups(timed)
        best = max(enough, key=lambda r: (score[id(r)], r.speedup_lo, [-ord(ch) for ch in r.candidate]))
        return Choice(batch, best, f"fastest within the budget: {best.speedup:.2f}x plain in {best.mode} mode "
                                   f"(95 % interval {best.speedup_lo:.2f}-{best.speedup_hi:.2f}), "
                                   f"{_loss_text(best.loss(measure), measure)} (budget {budget})")
    if not within:
        measured = [r for r in rows if r.batch == batch and r.loss(measure) is not None]
        if not measured:
            return Choice(batch, None, "no candidate was timed (all were pruned or failed)")
        best = min(measured, key=lambda r: (r.loss(measure), -(r.speedup or 0.0), r.candidate))
        speed = "" if best.speedup is None else f", at {best.speedup:.2f}x"
        return Choice(batch, None, f"no candidate stays within the budget of at most {budget} {unit} on the "
                                   f"held-out images (closest: {best.candidate}, {best.loss(measure):.2f}{speed})")
    if not faster:
        best = max(within, key=lambda r: r.speedup_lo)
        return Choice(batch, None, f"no candidate within the budget is surely faster than plain (best: {best.candidate}, "
                                   f"{best.speedup:.2f}x, lower bound {best.speedup_lo:.2f})")
    best = max(faster, key=lambda r: r.speedup)
    return Choice(batch, None, f"no candidate reaches the minimum speed-up {min_speedup}x (best: {best.candidate}, "
                               f"{best.speedup:.2f}x)")


# ---------------------------------------------------------------- candidates


def candidate_paths(method: str, params: Dict[str, Any], model: nn.Module, device: str,
                    modes: Sequence[str]) -> List[Candidate]:
    """Every way the device offers to run this setting (kit.paths.fast_paths: kernels, proportional-attention
    implementations, execution modes), as candidates."""
    out = []
    for path in fast_paths(model, method, params, device, modes):
        kw = path.params(method, params)
        out.append(Candidate(method, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items())),
                             path.mode))
    return out


def _accuracy_twin(c: Candidate) -> Dict[str, Any]:
    """The candidate's params on the reference path (torch kernel, float mask): what screening runs."""
    kw = c.kwargs
    if "kernel" in kw:
        kw["kernel"] = "torch"
    if kw.get("prop_attn") not in (None, False):
        kw["prop_attn"] = "mask"
    return kw


# ---------------------------------------------------------------- the run


@torch.inference_mode()
def _predictions(model: nn.Module, images: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([model(images[i:i + batch]).argmax(dim=-1).cpu() for i in range(0, len(images), batch)])


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


def check_space(space: Sequence[Tuple[str, Dict[str, Any]]], model: nn.Module) -> None:
    """Raise ValueError / TypeError for an unknown method or parameter name in space. What depends on the model
    (a preset for another width, a class token needed) is left to candidate_paths, whose refusals become notes."""
    for entry in space:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[1], dict):
            raise TypeError(f"space must hold (method, params dict) pairs, got {entry!r}")
        method, params = entry
        cls = method_class(method)
        try:
            resolved = cls.resolve_params(model, dict(params))
        except ValueError:
            continue
        unknown = sorted(set(resolved) - set(cls.param_names()))
        if unknown:
            raise TypeError(f"space: unknown parameter(s) {unknown} for method {method!r}; valid: "
                            f"{list(cls.param_names())}")


def default_modes(device: str) -> Tuple[str, ...]:
    """Eager on the CPU; on CUDA also the eager forward in a CUDA graph and torch.compile (default and
    reduce-overhead)."""
    return TORCH_MODES if torch.device(device).type == "cuda" else ("eager",)


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
        from .patch import check_supported, is_patched

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
                "weights_sha256": weights_digest(base), "data_sha256": data_digest(data)}
    # an earlier run in out is set aside (--overwrite) and comes back if this one fails before writing
    with run_folder(out, resume, overwrite, OUT_FILES) if out else contextlib.nullcontext():
        previous = _resume(out, settings) if out and resume else {}  # before any image is read
        tuner = _Tuner(base, data, settings, candidates, notes, out, show_progress)  # opens and checks the images
        tuner.previous = previous
        result = tuner.run()
        if out:
            write_outputs(result, out)
    return result


SHOWN_ONLY = ("data",)  # recorded for the reader; a resume compares data_sha256, not how the path was spelled
_RESUME_NAMES = {"weights_sha256": "other weights (--checkpoint / --pretrained, or another module)",
                 "data_sha256": "other images in --data"}


def _resume(out: str, settings: Dict[str, Any]) -> Dict[Tuple[int, str], TuneRow]:
    """The rows of a killed run in out, keyed by (batch, candidate); ValueError when it ran other settings."""
    config = Path(out) / "tune_config.json"
    if not config.is_file():
        return {}
    saved = read_json(config)
    differing = sorted(k for k in settings if k not in SHOWN_ONLY and saved.get(k) != json.loads(json.dumps(settings[k])))
    if differing:
        named = ", ".join(_RESUME_NAMES.get(k, k) for k in differing)
        raise ValueError(f"--resume: {out} holds a run measured with other settings ({named}); give the same ones, or "
                         f"replace that run with --overwrite (without --resume), or choose another --out")
    return {(r.batch, r.candidate): r for r in read_rows(Path(out) / "tune.csv")}


def sample_notes(held_out: int, prune_images: int, budget: float, measure: str) -> List[str]:
    """A note when the held-out images cannot resolve the budget: one image moves the loss by 100 / held_out, and a
    budget of fewer than three images' worth is decided by one or two images' noise. Says how many would do."""
    step = 100.0 / held_out
    if budget == 0 or budget >= 3 * step:
        return []
    need = math.ceil(300.0 / budget)
    return [f"the budget of {budget} {BUDGET_MEASURES[measure]} is judged on {held_out} held-out images, where one "
            f"image is {step:.2f} points: fewer than three images decide it; {need} held-out images would resolve "
            f"it (--limit {need + prune_images} or more with --prune-images {prune_images})"]


def applicable_candidates(space: Sequence[Tuple[str, Dict[str, Any]]], model: nn.Module, device: str,
                          modes: Sequence[str]) -> Tuple[List[Candidate], List[str]]:
    """Every candidate of the space on this model and device (candidate_paths), and a note per setting the model
    refuses (a class token needed, a preset for another width); ValueError when none is left."""
    if not space:
        raise ValueError("--methods: no candidate setting given (an empty list); leave --methods out for the "
                         "default space")
    candidates: List[Candidate] = []
    notes: List[str] = []
    for method, params in space:
        try:
            candidates += candidate_paths(method, params, model, device, modes)
        except (ValueError, TypeError) as e:
            notes.append(f"{label(method, params)}: not applicable ({e})")
    if not candidates:
        raise ValueError("--methods: no candidate applies to this model: " + "; ".join(notes))
    return candidates, notes


def _top1_changes(preds: torch.Tensor, plain: torch.Tensor, labels: torch.Tensor) -> Tuple[int, int]:
    """(gained, lost): images (N,) the candidate gets right where the plain model did not, and the reverse."""
    right_plain, right = plain == labels, preds == labels
    return int((right & ~right_plain).sum()), int((right_plain & ~right).sum())


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
            model = self._model(_accuracy_twin(c), c.method)
            with torch.inference_mode():
                _, macs = forward_counting(model, x[:1].to(self.device))
            preds = _predictions(model, x.to(self.device), batch)
            changed = int((preds != plain).sum())
            n = len(plain)
            loss, bound, counts = self._screen_loss(preds, plain, n, changed)
            reason = None
            if bound > self.s["budget"]:
                reason = (f"pruned: budget (screening {counts}; even the 95 % lower bound, {bound:.2f} "
                          f"{BUDGET_MEASURES[self.measure]}, is above the budget of {self.s['budget']})")
            result[setting] = (macs / 1e9, 100.0 * (n - changed) / n, n, loss, reason)
            bar.update(1)
        return result

    def _screen_loss(self, preds: torch.Tensor, plain: torch.Tensor, n: int, changed: int
                     ) -> Tuple[float, float, str]:
        """(loss on the screening images, its one-sided exact 95 % lower bound, both in the budget's measure, and
        the counts they rest on). top1: of the d images whose correctness differs, `lost` turned wrong; the drop's
        bound is d (2 p_lo - 1) / n with p_lo the Clopper-Pearson bound of lost / d."""
        if self.measure == "agreement":
            return (100.0 * changed / n, 100.0 * disagreement_lower_bound(changed, n),
                    f"changed {changed} of {n} images' top-1")
        gained, lost = _top1_changes(preds, plain, self.labels[:n])
        d = gained + lost
        bound = 0.0 if d == 0 else max(0.0, 100.0 * d * (2 * disagreement_lower_bound(lost, d) - 1) / n)
        return 100.0 * (lost - gained) / n, bound, f"lost {lost} and gained {gained} correct of {n} images"

    def _row(self, batch: int, c: Candidate, screened, held: Dict[str, Dict[str, Any]]) -> TuneRow:
        gmacs, agree, n, loss, reason = screened[c.setting]
        row = TuneRow(batch, c.mode, c.name, c.setting, c.path, c.method, json.dumps(c.kwargs, sort_keys=True),
                      status=reason or "screened", gmacs=gmacs, mac_ratio=self.plain_gmacs / gmacs,
                      screen_agree=agree, screen_n=n, screen_loss=loss, **held.get(c.setting, {}))
        if reason is None and row.loss(self.measure) > self.s["budget"] + 1e-9:
            row.status = (f"pruned: held-out ({_loss_text(row.loss(self.measure), self.measure)} on "
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
                held[setting] = self._agreement(self._model(_accuracy_twin(c), c.method), x, plain, batch)
            bar.update(1)
        return held

    def _agreement(self, model: nn.Module, x: torch.Tensor, plain: torch.Tensor, batch: int) -> Dict[str, Any]:
        preds = _predictions(model, x.to(self.device), batch)
        n, changed = len(plain), int((preds != plain).sum())
        figures: Dict[str, Any] = {"agree": 100.0 * (n - changed) / n, "agree_n": n, "changed": changed}
        if self.labels is not None:
            y = self.labels[self.s["prune_images"]:]
            gained, lost = _top1_changes(preds, plain, y)
            figures.update(top1_plain=100.0 * float((plain == y).float().mean()),
                           top1=100.0 * float((preds == y).float().mean()), top1_p=mcnemar_exact_p(gained, lost))
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


# ---------------------------------------------------------------- outputs


def save_tuned_preset(path: Union[str, Path], choice: "Choice", settings: Dict[str, Any], overwrite: bool = False) -> None:
    """Write tune's choice for one batch size as a preset (kit.presets): the method and its params (kernel and
    prop_attn implementation included), or method 'none' with the reason; the execution mode it was timed in; and
    what it was measured with (torch device and its name, dtype, TF32, batch size, package / torch / timm versions).
    An existing file is refused unless overwrite."""
    row = choice.row
    tuned = {"model": settings["model"], "device": settings["device_name"],
             "torch_device": settings.get("device") or device_type_of(settings["device_name"]), "dtype": settings["dtype"], "tf32": settings["tf32"], "batch_size": choice.batch,
             "budget": settings["budget"], "budget_measure": settings.get("budget_measure", "agreement"),
             "reason": choice.reason, "versions": versions()}
    if row is not None:
        tuned.update(speedup=row.speedup, speedup_95=[row.speedup_lo, row.speedup_hi], agreement=row.agree,
                     images=row.agree_n, changed=row.changed, top1=row.top1, top1_plain=row.top1_plain,
                     ms=row.ms, ms_plain=row.ms_plain)
    write_preset(path, NO_REDUCTION if row is None else row.method, {} if row is None else json.loads(row.params),
                 overwrite, execution={"mode": "eager" if row is None else row.mode}, tuned=tuned)


def write_rows(rows: Sequence[TuneRow], path: Path) -> None:
    with replacing(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(TuneRow)])
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))


def read_rows(path: Path) -> List[TuneRow]:
    """The rows of a tune.csv (empty if there is none); ValueError naming the file when it is not one."""
    if not path.is_file():
        return []
    types = {fl.name: fl.type for fl in fields(TuneRow)}
    rows = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != list(types):
                raise ValueError(f"is not a tune.csv of this version (columns {reader.fieldnames})")
            for line in reader:
                if None in line or None in line.values():
                    raise ValueError(f"line {reader.line_num} has {'more' if None in line else 'fewer'} cells than "
                                     f"the header")
                try:
                    values = {k: _parse(types[k], v) for k, v in line.items()}
                except (TypeError, ValueError) as e:
                    raise ValueError(f"line {reader.line_num}: {e}") from None
                rows.append(TuneRow(**values))
    except (ValueError, csv.Error) as e:  # UnicodeDecodeError is a ValueError: not a text file
        raise fail("--resume", path, f"cannot be read as tune's CSV: {e}") from None
    return rows


def _parse(kind: Any, text: str) -> Any:
    """A CSV cell as the TuneRow field type kind (int, bool, str, Optional[int / float])."""
    if kind is bool:
        if text not in ("True", "False"):
            raise ValueError(f"expected True or False, got {text!r}")
        return text == "True"
    if kind in (int, str):
        return kind(text)
    if text == "":
        return None
    return int(text) if int in get_args(kind) else float(text)


def format_table(rows: Sequence[TuneRow], choices: Sequence[Choice]) -> str:
    """Markdown: per batch size the timed candidates, fastest first, then what was not timed and why, then the
    choice."""
    out: List[str] = []
    for choice in choices:
        timed = sorted((r for r in rows if r.batch == choice.batch and r.status == "timed"), key=lambda r: r.ms)
        out += [f"### batch {choice.batch}", "",
                "| candidate | GMACs | ms (plain) | speed-up [95 %] | held-out agreement (changed / n) | top-1 (plain), McNemar p |",
                "| --- | --- | --- | --- | --- | --- |"]
        for r in timed:
            agree = "-" if r.agree is None else f"{r.agree:.2f} % ({r.changed} / {r.agree_n})"
            top1 = "-" if r.top1 is None else f"{r.top1:.2f} ({r.top1_plain:.2f}), p = {r.top1_p:.2g}"
            mark = " **chosen**" if r.chosen else ""
            out.append(f"| {r.candidate}{mark} | {r.gmacs:.3f} | {r.ms:.2f} ({r.ms_plain:.2f}) | {r.speedup:.2f}x "
                       f"[{r.speedup_lo:.2f}, {r.speedup_hi:.2f}] | {agree} | {top1} |")
        skipped = [r for r in rows if r.batch == choice.batch and r.status != "timed"]
        if skipped:
            counts: Dict[str, int] = {}
            for r in skipped:
                key = r.status.split(" (")[0]
                counts[key] = counts.get(key, 0) + 1
            out += ["", "not timed: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))]
        verdict = "no reduction" if choice.row is None else choice.row.candidate
        out += ["", f"choice: **{verdict}**: {choice.reason}", ""]
    return "\n".join(out).rstrip() + "\n"


def preset_paths(out: str, batches: Sequence[int]) -> Dict[int, Path]:
    """preset.json for one batch size, `preset_b<B>.json` for several."""
    if len(batches) == 1:
        return {batches[0]: Path(out) / "preset.json"}
    return {b: Path(out) / f"preset_b{b}.json" for b in batches}


def write_outputs(result: TuneResult, out: str) -> None:
    """table.md, pareto.png (with the plot extra; a note without it) and the presets, in the run folder out."""
    s = result.settings
    write_text(Path(out) / "table.md", f"# tokcomp tune: {s['model']} on {s['device_name']}, {s['dtype']}"
                                       f"{', TF32' if s['tf32'] else ''}\n\n{result.budget_text()}\n\n"
                                       + result.table())
    if available("matplotlib"):  # the one output the core install leaves out (the plot extra)
        plot_pareto(result, Path(out) / "pareto.png")
    else:
        s["notes"].append("pareto.png not drawn: it needs matplotlib, which the core install leaves out: "
                          "pip install 'timm-tokcomp[plot]'")
    for batch, path in preset_paths(out, s["batches"]).items():
        choice = next(c for c in result.choices if c.batch == batch)
        save_tuned_preset(path, choice, s, overwrite=True)  # inside the run folder tune holds


def plot_pareto(result: TuneResult, path: Path) -> None:
    """Speed-up against the held-out loss in the budget's measure, one panel per batch size: every timed candidate,
    the frontier (no other point both faster and losing less), the budget line and the chosen point."""
    plt = pyplot("plot", "tune's pareto.png")
    batches = [c.batch for c in result.choices]
    measure = result.settings["budget_measure"]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, choice in zip(axes[0], result.choices):
        pts = [r for r in result.rows if r.batch == choice.batch and r.status == "timed"
               and r.loss(measure) is not None]
        ax.scatter([r.loss(measure) for r in pts], [r.speedup for r in pts], s=12, alpha=0.6, label="timed candidates")
        frontier = sorted(pareto_front(pts, measure), key=lambda r: r.loss(measure))
        ax.plot([r.loss(measure) for r in frontier], [r.speedup for r in frontier], "-", color="C1", label="frontier")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axvline(result.settings["budget"], color="C3", ls="--", lw=0.8, label="budget")
        if choice.row is not None:
            ax.plot([choice.row.loss(measure)], [choice.row.speedup], "*", ms=14, color="C2", label="chosen")
        ax.set_xlabel(f"held-out loss: {BUDGET_MEASURES[measure]}")
        ax.set_ylabel("speed-up against plain (same mode)")
        ax.set_title(f"batch {choice.batch}" + ("" if choice.row else ": no reduction"))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def pareto_front(rows: Iterable[TuneRow], measure: str = "agreement") -> List[TuneRow]:
    """The rows no other row beats in both speed-up and held-out loss (TuneRow.loss)."""
    rows = list(rows)
    return [r for r in rows if not any(o.speedup >= r.speedup and o.loss(measure) <= r.loss(measure)
                                       and (o.speedup > r.speedup or o.loss(measure) < r.loss(measure))
                                       for o in rows)]
