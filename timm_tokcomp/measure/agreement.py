"""One agreement evaluation: a model's top-1 predictions against a reference's (the plain model's) on the same
images, image by image, with labels where given (-1: unlabelled), and MACs counted from the run. bench, tune,
calibrate and finetune measure accuracy through it."""
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from tqdm import tqdm

from .counting import forward_counting
from .stats import mcnemar_exact_p


@dataclass(frozen=True)
class Paired:
    """A model's predictions against the reference's on n images. changed: images whose top-1 class differs;
    with labels (over the labelled images): gained / lost, the images it gets right where the reference did not and
    the reverse, top1 / top1_reference in percent (None without labels)."""

    n: int
    changed: int
    gained: int = 0
    lost: int = 0
    top1: Optional[float] = None
    top1_reference: Optional[float] = None

    @property
    def agreement(self) -> float:
        """Percent of the images whose top-1 class is the reference's."""
        return 100.0 * (self.n - self.changed) / self.n

    @property
    def top1_p(self) -> float:
        """Exact two-sided McNemar p of the gained / lost split."""
        return mcnemar_exact_p(self.gained, self.lost)


def compare(preds: torch.Tensor, reference: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Paired:
    """preds, reference: (n,) top-1 classes of the same images; labels: (n,) classes, -1 for unlabelled images."""
    if preds.shape != reference.shape or len(preds) == 0:
        raise ValueError(f"compare needs two non-empty predictions of the same images, got {tuple(preds.shape)} and "
                         f"{tuple(reference.shape)}")
    n, changed = len(preds), int((preds != reference).sum())
    if labels is None or not bool((labels >= 0).any()):
        return Paired(n, changed)
    known = labels >= 0
    right, right_ref = (preds == labels) & known, (reference == labels) & known
    return Paired(n, changed, int((right & ~right_ref).sum()), int((right_ref & ~right).sum()),
                  100.0 * float(right.sum()) / int(known.sum()), 100.0 * float(right_ref.sum()) / int(known.sum()))


@torch.inference_mode()
def predict(model: nn.Module, batches: Iterable[torch.Tensor], count_macs: bool = False
            ) -> Tuple[torch.Tensor, List[float]]:
    """(top-1 classes (n,) on the CPU, MACs per image of each batch: empty unless count_macs) of model over batches
    of images (B, 3, H, W), each already on the model's device."""
    classes, macs = [], []
    for x in batches:
        if count_macs:
            out, counted = forward_counting(model, x)
            macs.append(counted / len(x))
        else:
            out = model(x)
        classes.append(class_scores(out).argmax(dim=-1).cpu())
    return torch.cat(classes), macs


class NonFiniteScores(ValueError):
    """Class scores holding NaN or inf: the command that knows the weights' file names it."""


def class_scores(out: Any) -> torch.Tensor:
    """A model's class scores (B, classes): a timm model's output itself, a transformers classifier's logits.
    ValueError for a model that returns features (transformers' ViTModel, Dinov2Model, CLIP / SigLIP encoders), and
    for scores holding NaN or inf (every image's top-1 would be class 0: agreement that means nothing)."""
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if logits is None:
        raise ValueError(f"the model returns {type(out).__name__} (features, no class scores): top-1 and agreement "
                         "need a classifier, such as transformers' ViTForImageClassification; time it without --data")
    if not torch.isfinite(logits).all():
        raise NonFiniteScores(f"the model's class scores hold NaN or inf on a batch of {len(logits)} images: broken "
                         "weights, or a precision that overflows (top-1 and agreement would mean nothing)")
    return logits


def check_classifier(model: nn.Module, device: str) -> None:
    """ValueError (class_scores) unless model returns class scores: one forward of a blank image at the input size of
    its data config, before a command writes anything."""
    import timm

    size = timm.data.resolve_model_data_config(model)["input_size"]
    with torch.no_grad():
        class_scores(model(torch.zeros(1, *size, device=device)))


def chunks(images: torch.Tensor, batch: int) -> List[torch.Tensor]:
    """images (n, 3, H, W) in batches of at most `batch`."""
    return [images[i:i + batch] for i in range(0, len(images), batch)]


@dataclass
class Evaluation:
    """Per model: top-1 and agreement with the first model (percent), MACs per image (mean over all images, and
    the standard deviation of the per-batch means), and agrees: (images,) bool, whether each image's top-1 class is
    the first model's."""

    top1: Dict[str, float]
    agreement: Dict[str, float]
    macs: Dict[str, float]
    macs_std: Dict[str, float]
    agrees: Dict[str, torch.Tensor]


def evaluate(models: Dict[str, nn.Module], loader: Iterable, device: str, show_progress: bool) -> Evaluation:
    """Top-1 (0 for unlabeled images, label -1), agreement with the first model, and MACs per image counted on
    every batch, in one forward per model and batch (the images are loaded once for all models)."""
    preds: Dict[str, List[torch.Tensor]] = {k: [] for k in models}
    batch_macs: Dict[str, List[float]] = {k: [] for k in models}
    labels, sizes = [], []
    bar = tqdm(total=len(loader.dataset), desc="evaluate", unit="img", disable=not show_progress, file=sys.stderr)
    for x, y in loader:
        x = x.to(device)
        for name, model in models.items():
            classes, macs = predict(model, [x], count_macs=True)
            preds[name].append(classes)
            batch_macs[name] += macs
        labels.append(y.cpu())
        sizes.append(len(y))
        bar.update(len(y))
    bar.close()
    seen = sum(sizes)
    if seen == 0:
        raise ValueError("--data: the dataset holds no images")
    y = torch.cat(labels)
    classes = {k: torch.cat(v) for k, v in preds.items()}
    reference = next(iter(classes.values()))
    flags = {k: v == reference for k, v in classes.items()}
    return Evaluation({k: 100.0 * float((v == y).sum()) / seen for k, v in classes.items()},
                      {k: 100.0 * float(v.sum()) / seen for k, v in flags.items()},
                      {k: sum(m * n for m, n in zip(v, sizes)) / seen for k, v in batch_macs.items()},
                      {k: statistics.pstdev(v) for k, v in batch_macs.items()}, flags)


def paired_flags(new: torch.Tensor, old: torch.Tensor) -> Tuple[int, int, float]:
    """(gained, lost, exact McNemar p) of two (n,) bool flags of the same images (e.g. agreement with the plain
    model): images true in new and not old, the reverse, and the p of that split."""
    gained, lost = int((new & ~old).sum()), int((old & ~new).sum())
    return gained, lost, mcnemar_exact_p(gained, lost)
