"""`tokcomp calibrate`: ATM thresholds (alpha, beta, theta_min) that hit a GMACs budget on given images
(labels not needed) while agreeing most with the unmodified model, or DyMU's per-block thresholds for an r schedule
(calibrate_dymu); presets saved as JSON.

Search: alpha is fixed (1.0 by default: the first block never merges, as in the paper's presets).
For each decay rate beta of a grid, theta_min is bisected between the last block's unfloored
threshold (lower floors change nothing) and alpha (the executed GMACs do not decrease as theta_min
rises) until the GMACs per image are within the tolerance of the target; of the settings that hit
it, the one with the highest agreement wins (ties: the closest to the target).
"""
import copy
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core import apply, get_reducer, is_reduced, set_params
from ..families import facade
from ..deployment.presets import write_preset
from ..measure.agreement import compare, predict
from ..utils.checks import BATCH_SIZE, check_int, check_real_list, choice, integer, optional, real
from ..methods.atm import threshold_schedule
from ..methods.dymu import Calibration
from ..methods.schedules import resolve_r, validate_r

DEFAULT_BETAS = (0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15)

# the checks of calibrate's flags (the command line's types, and the Python calls' arguments)
METHODS = ("atm", "dymu")
METHOD = choice("--method", METHODS)
TARGET_GMACS = optional(real("--target-gmacs", note="(GMACs per image)"))
TARGET_RATIO = optional(real("--target-ratio", 0.0, high=1.0, high_strict=True,
                             note="(a fraction of the unmodified GMACs)"))
TOLERANCE = real("--tolerance", 0.0, high=0.5, high_strict=True, note="(relative to the target GMACs)")
ALPHA = real("--alpha", None)
SPLIT_LAYER = optional(integer("--split-layer", 0, "(blocks after it use size-distinctive matching)"))
LIMIT = integer("--limit", 1, "(images)")


def check_r(r: Any) -> Any:
    """--r, DyMU's merges per image and block: an int, a per-block list or (r, inflection) (validate_r)."""
    return validate_r(r, "--r")


@dataclass
class CalibrationResult:
    """A calibrated ATM setting and what it measured on the calibration images (GMACs per image,
    agreement in percent)."""

    model: str
    params: Dict[str, Any]
    gmacs: float
    agreement: float
    target_gmacs: Optional[float]  # None for DyMU (its thresholds follow an r schedule)
    baseline_gmacs: float
    images: int
    evaluations: int
    method: str = "atm"


def save_preset(result: CalibrationResult, path: str, overwrite: bool = False) -> None:
    """Write the preset (kit.presets' format) with its calibration figures; an existing file is refused unless
    overwrite."""
    calibration = {k: v for k, v in asdict(result).items() if k not in ("method", "params")}
    write_preset(path, result.method, result.params, overwrite, "--out", calibration=calibration)


class _Probe:
    """Runs a reduced copy `model` of `base` (its settings changed between runs) over cached batches: (GMACs per image,
    agreement % with the unmodified model)."""

    def __init__(self, base: nn.Module, batches: Sequence[torch.Tensor], model: nn.Module) -> None:
        self.batches = batches
        self.images = sum(len(x) for x in batches)
        self.reference, macs = self._run(base)
        self.baseline_gmacs = macs
        self.model = model
        self.evaluations = 0

    def _run(self, model: nn.Module) -> Tuple[torch.Tensor, float]:
        preds, macs = predict(model, self.batches, count_macs=True)
        return preds, sum(m * len(x) for m, x in zip(macs, self.batches)) / self.images / 1e9

    def measure(self) -> Tuple[float, float]:
        """The model as it is set now: (GMACs per image, agreement %)."""
        preds, gmacs = self._run(self.model)
        self.evaluations += 1
        return gmacs, compare(preds, self.reference).agreement

    def __call__(self, alpha: float, beta: float, theta_min: float) -> Tuple[float, float]:
        """An ATM setting (the model is ATM-reduced)."""
        set_params(self.model, alpha=alpha, beta=beta, theta_min=theta_min)
        return self.measure()


def calibrate(
    base: nn.Module,
    batches: Sequence[torch.Tensor],
    model_name: str,
    target_gmacs: Optional[float] = None,
    target_ratio: Optional[float] = None,
    tolerance: float = 0.02,
    alpha: float = 1.0,
    betas: Sequence[float] = DEFAULT_BETAS,
    split_layer: Optional[int] = None,
    max_bisections: int = 12,
    progress: Callable[[str], None] = lambda msg: None,
) -> CalibrationResult:
    """Find (alpha, beta, theta_min) for `base` (an unmodified timm ViT in eval mode) whose GMACs per
    image on `batches` (list of (B, 3, H, W)) are within `tolerance` (relative) of the target, giving
    target_gmacs or target_ratio (fraction of the unmodified model's GMACs, in (0, 1)).

    Raises ValueError when the target cannot be reached, naming the reachable range, and for a `base` that
    is already reduced (its outputs and GMACs would be taken as the unmodified model's).
    progress(msg) is called after every evaluation.
    """

    _check_unreduced(base)
    if (target_gmacs is None) == (target_ratio is None):
        raise ValueError("give exactly one of --target-gmacs and --target-ratio")
    TARGET_RATIO(target_ratio)
    TARGET_GMACS(target_gmacs)
    TOLERANCE(tolerance)
    ALPHA(alpha)
    SPLIT_LAYER(split_layer)
    check_real_list("betas", betas, 0.0, strict=False)
    check_int("max_bisections", max_bisections, low=1)
    _check_batches(batches)

    probe = _Probe(base, batches, apply(copy.deepcopy(base), "atm", alpha=1.0, beta=0.0, theta_min=1.0,
                                        split_layer=split_layer))
    target = target_gmacs if target_gmacs is not None else target_ratio * probe.baseline_gmacs
    low, high = target * (1 - tolerance), target * (1 + tolerance)

    def run(beta: float, theta_min: float) -> Tuple[float, float]:
        gmacs, agreement = probe(alpha, beta, theta_min)
        progress(f"beta={beta:g} theta_min={theta_min:.4f}: {gmacs:.4f} GMACs, agreement {agreement:.2f}%")
        return gmacs, agreement

    least, _ = run(max(betas), alpha)  # thresholds stay at alpha: the least merging of the search
    most, _ = run(max(betas), -1.0)  # fastest decay to the lowest floor: the most merging
    if low > least or high < most:
        raise ValueError(
            f"target {target:.4f} GMACs per image ({target / probe.baseline_gmacs:.3f}x of {probe.baseline_gmacs:.4f}) "
            f"is out of reach: ATM with alpha={alpha} spans {most:.4f} to {least:.4f} GMACs "
            f"({most / probe.baseline_gmacs:.3f}x to {least / probe.baseline_gmacs:.3f}x) on these images"
        )

    hits: List[Tuple[float, float, float, float, float]] = []  # (agreement, -distance, beta, theta_min, gmacs)
    closest = (math.inf, 0.0, 0.0)  # (distance, beta, theta_min)

    def consider(beta: float, theta_min: float) -> float:
        nonlocal closest
        gmacs, agreement = run(beta, theta_min)
        distance = abs(gmacs - target)
        closest = min(closest, (distance, beta, theta_min))
        if low <= gmacs <= high:
            hits.append((agreement, -distance, beta, theta_min, gmacs))
        return gmacs

    depth = len(facade(base).blocks)  # open_clip's and transformers' blocks under timm's name
    for beta in sorted(betas):
        # floors below the last block's unfloored threshold change nothing: bisect above it
        lo, hi = max(-1.0, threshold_schedule(alpha, beta, -math.inf, depth)[-1]), alpha
        if consider(beta, lo) >= low:
            continue  # a hit already, or this decay rate cannot merge enough
        for _ in range(max_bisections):
            theta_min = (lo + hi) / 2
            gmacs = consider(beta, theta_min)
            if low <= gmacs <= high:
                break
            if gmacs > high:
                hi = theta_min  # too expensive: lower the floor
            else:
                lo = theta_min
    if not hits:
        raise ValueError(
            f"no setting came within {tolerance:.0%} of {target:.4f} GMACs (closest: beta={closest[1]:g}, "
            f"theta_min={closest[2]:.4f}, {closest[0]:.4f} GMACs away); try a larger --tolerance or more images"
        )
    agreement, _, beta, theta_min, gmacs = max(hits)
    params = dict(alpha=alpha, beta=beta, theta_min=theta_min, split_layer=split_layer)
    return CalibrationResult(
        model=model_name, params=params, gmacs=gmacs, agreement=agreement, target_gmacs=target,
        baseline_gmacs=probe.baseline_gmacs, images=probe.images, evaluations=probe.evaluations,
    )


def _check_unreduced(base: nn.Module) -> None:
    if is_reduced(base):
        raise ValueError(f"calibrate needs the unmodified model as its reference, got one reduced by "
                         f"{get_reducer(base)!r}; pass timm_tokcomp.remove(model) (or a fresh model) instead")


def _check_batches(batches: Sequence[torch.Tensor]) -> None:
    if not batches:
        raise ValueError("--data: no calibration images")
    for i, x in enumerate(batches):
        if not torch.is_tensor(x) or x.dim() != 4 or x.shape[0] == 0 or x.shape[1] != 3:
            raise ValueError(f"batches[{i}] must be a (B, 3, H, W) tensor of B >= 1 images, got "
                             f"{tuple(x.shape) if torch.is_tensor(x) else type(x).__name__}")


def calibrate_dymu(base: nn.Module, batches: Sequence[torch.Tensor], model_name: str, r: Any,
                   progress: Callable[[str], None] = lambda msg: None) -> CalibrationResult:
    """DyMU's thresholds for `base` (an unmodified timm ViT in eval mode): r, the merges per image and block to
    calibrate for (an int, a per-block list, or (r, inflection) as ToMe's schedules), gives each block its r_l; every
    batch of `batches` ((B, 3, H, W) each) merges, per block, its B * r_l best A-token edges, and the block's threshold
    is the mean over the batches of the best edge not taken (methods.dymu). Then the calibrated model runs once more on
    the same images for its GMACs per image and agreement with `base`. progress(msg) after every batch."""
    _check_unreduced(base)
    _check_batches(batches)
    schedule = resolve_r(check_r(r), len(facade(base).blocks))
    if not any(schedule):
        raise ValueError(f"--r must merge in at least one block, got {r!r}")
    model = apply(copy.deepcopy(base), "dymu", thresholds=[1.0 if r_l else None for r_l in schedule])
    reducer = get_reducer(model)
    reducer.calibration = Calibration(schedule)
    with torch.no_grad():
        for i, x in enumerate(batches):
            model(x)
            progress(f"batch {i + 1} / {len(batches)}")
    thresholds = reducer.calibration.thresholds()
    reducer.calibration = None
    set_params(model, thresholds=thresholds)
    probe = _Probe(base, batches, model)
    gmacs, agreement = probe.measure()
    return CalibrationResult(model=model_name, params={"thresholds": thresholds}, gmacs=gmacs, agreement=agreement,
                             target_gmacs=None, baseline_gmacs=probe.baseline_gmacs, images=probe.images,
                             evaluations=len(batches) + 1, method="dymu")


def calibrate_folder(model_name: str, data: str, checkpoint: Optional[str], pretrained: bool, device: str, limit: int,
                     batch_size: int, num_workers: int, show_progress: bool, method: str = "atm",
                     **search: Any) -> CalibrationResult:
    """calibrate() (method 'atm') or calibrate_dymu() (method 'dymu') on the first `limit` images of a folder, read
    once in batches of batch_size onto the device (with progress bars), for the model timm builds by name (weights
    from checkpoint or pretrained); search: calibrate's target_gmacs / target_ratio, tolerance, alpha, split_layer, or
    calibrate_dymu's r."""
    import sys

    from tqdm import tqdm

    from ..files.data import open_images
    from ..models.build import build_base_model, eval_transform

    METHOD(method)
    LIMIT(limit)
    BATCH_SIZE(batch_size)
    base = build_base_model(model_name, checkpoint, pretrained, device)
    dataset = open_images(data, eval_transform(base), limit=limit)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
    batches = [x.to(device) for x, _ in tqdm(loader, desc="load images", disable=not show_progress, file=sys.stderr)]
    with tqdm(desc="calibrate", unit="eval", disable=not show_progress, file=sys.stderr) as bar:
        def step(msg: str) -> None:
            bar.set_postfix_str(msg, refresh=False)
            bar.update(1)

        if method == "dymu":
            return calibrate_dymu(base, batches, model_name, progress=step, **search)
        return calibrate(base, batches, model_name, progress=step, **search)
