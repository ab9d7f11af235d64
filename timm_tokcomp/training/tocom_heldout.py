"""ToCom's held-out evaluation: distillation losses per (source, target) pair without and with the plugins at
every scale of the grid, shared out between the ranks, and the choice of the inference scale."""
import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from tqdm import tqdm

from ..core import set_params
from ..files.outputs import write_text
from ..tocom.plugins import Plugins
from .engine import distill_loss, is_distributed, rank_share

if TYPE_CHECKING:
    from .tocom import TrainConfig


@dataclass
class HeldoutReport:
    """Mean held-out distillation losses: loss[(m, n)] uncompensated, loss_compensated[s][(m, n)];
    chosen_scale: the scale with the lowest mean loss."""

    images: int
    loss: Dict[Tuple[int, int], float]
    loss_compensated: Dict[float, Dict[Tuple[int, int], float]] = field(default_factory=dict)
    chosen_scale: Optional[float] = None

    def objective(self, scale: float, pairs: Sequence[Tuple[int, int]]) -> float:
        return sum(self.loss_compensated[scale][p] for p in pairs) / len(pairs)

    def changes(self, scale: float) -> List[Tuple[Tuple[int, int], float, float, float]]:
        """Per pair: (pair, loss without plugins, loss with them at scale, relative change in %)."""
        return [(pair, plain, self.loss_compensated[scale][pair],
                 100 * (self.loss_compensated[scale][pair] - plain) / plain) for pair, plain in self.loss.items()]


@torch.no_grad()
def heldout_losses(model: nn.Module, plugins: Plugins, batches: Iterable[torch.Tensor], pairs: Sequence[Tuple[int, int]],
                   scales: Sequence[float], config: "TrainConfig", has_head: bool, autocast: Callable,
                   progress: Optional[Callable[[], None]] = None) -> HeldoutReport:
    """Distillation loss per pair, without plugins and with them at every scale, averaged over images.
    Under torch.distributed each rank passes its share of the batches and gets the mean over all."""
    keys = [(s, p) for s in [None, *scales] for p in pairs]
    slot = {key: i for i, key in enumerate(keys)}
    totals = torch.zeros(len(keys) + 1, dtype=torch.float64)  # loss sums per key, then the image count
    for x in batches:
        for m in sorted({p[0] for p in pairs}):
            set_params(model, r=m)
            with autocast():
                teacher = model(x)
            for p in (p for p in pairs if p[0] == m):
                set_params(model, r=p[1])
                for s in [None, *scales]:
                    with autocast(), (plugins.active(*p, s) if s is not None else contextlib.nullcontext()):
                        loss = distill_loss(model(x), teacher, config.temperature, has_head)
                    totals[slot[(s, p)]] += loss.item() * len(x)
                    if progress:
                        progress()
        totals[-1] += len(x)
    if is_distributed():
        summed = totals.to(plugins.lora_a.device)
        torch.distributed.all_reduce(summed)
        totals = summed.cpu()
    count = int(totals[-1])
    mean = {key: totals[i].item() / count for key, i in slot.items()}
    report = HeldoutReport(count, {p: mean[(None, p)] for p in pairs})
    report.loss_compensated = {s: {p: mean[(s, p)] for p in pairs} for s in scales}
    return report


def choose_scale(model, plugins, heldout_set, config, has_head, autocast, device, show_progress, rank, world):
    """Held-out losses and the scale among scale_grid with the lowest mean loss over (0 -> t), t in
    scale_targets; the held-out batches are shared out between the ranks. Without held-out images, the
    training scale."""
    if len(heldout_set) == 0:
        return None, config.scale
    mine = rank_share(len(heldout_set), config.batch_size, rank, world)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(heldout_set, mine), batch_size=config.batch_size)
    pairs = [(0, t) for t in config.scale_targets]
    scales = sorted(set(config.scale_grid) | {config.scale})
    with tqdm(total=len(loader) * len(pairs) * (len(scales) + 1), desc="held-out loss", file=sys.stderr,
              disable=not show_progress) as bar:
        batches = (x.to(device) for x, _ in loader)
        report = heldout_losses(model, plugins, batches, pairs, scales, config, has_head, autocast, bar.update)
    report.chosen_scale = min(scales, key=lambda s: report.objective(s, pairs))
    return report, report.chosen_scale


def write_report(work: Path, report: Optional[HeldoutReport], config: "TrainConfig", chosen: float) -> None:
    data = {"chosen_scale": chosen, "train_scale": config.scale}
    if report is not None:
        data["heldout_images"] = report.images
        data["uncompensated"] = {f"{m}->{n}": v for (m, n), v in report.loss.items()}
        data["compensated"] = {str(s): {f"{m}->{n}": v for (m, n), v in per.items()}
                               for s, per in report.loss_compensated.items()}
    write_text(work / "heldout.json", json.dumps(data, indent=2) + "\n")


def results_summary(report: Optional[HeldoutReport], chosen: float) -> str:
    if report is None:
        return "No held-out images (holdout = 0): nothing measured; the scale is the training scale."
    lines = [f"Distillation loss on {report.images} held-out images (never trained on), source r = 0:", "",
             "| target r | without ToCom | with ToCom (s = %g) | change |" % chosen, "|---|---|---|---|"]
    for (m, n), plain, comp, change in report.changes(chosen):
        lines.append(f"| {n} | {plain:.4f} | {comp:.4f} | {change:+.1f}% |")
    lines += ["", f"The scale s = {chosen:g} was chosen among {', '.join(f'{s:g}' for s in sorted(report.loss_compensated))} "
              f"as the lowest mean held-out loss over these targets."]
    return "\n".join(lines)
