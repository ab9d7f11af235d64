"""open_clip models as a command's MODEL (`tokcomp bench / speed / tune / calibrate / export open_clip:ViT-B-32`):
the image tower of open_clip's architecture ARCH, with its weights from --checkpoint (random without), classifying
ImageNet-1k zero-shot, so that top-1 and agreement mean what they mean for a timm classifier.

The head is CLIP's zero-shot classifier: each class's text embedding of "a photo of a {class name}." from the
model's own text tower and tokenizer, computed once at loading; a forward hook on the tower turns its image
embedding (B, D) into class scores (B, 1000) = logit_scale * cos(image, class). The hook survives `apply` /
`remove`, compiling and ONNX export (it is part of the tower's call). The tower keeps its preprocessing as timm's
data config (`pretrained_cfg`: open_clip resizes the short side, center-crops, normalises with its mean / std)."""
import contextlib
import logging
import math
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.extras import require
from ..files.userfiles import load_weights

PREFIX = "open_clip:"
TEMPLATE = "a photo of a {}."


def is_open_clip_name(name: Any) -> bool:
    """Whether a command's MODEL names an open_clip architecture ('open_clip:ARCH')."""
    return isinstance(name, str) and name.startswith(PREFIX)


class ZeroShotHead(nn.Module):
    """Image embeddings (B, D) -> class scores (B, classes): scale * cosine with each class's text embedding."""

    def __init__(self, class_embeddings: torch.Tensor, scale: float):
        super().__init__()
        self.register_buffer("class_embeddings", class_embeddings)  # (classes, D), unit rows
        self.scale = scale

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.scale * F.normalize(embeddings, dim=-1) @ self.class_embeddings.to(embeddings.dtype).T


def _zero_shot_scores(tower: nn.Module, inputs: Any, embeddings: torch.Tensor) -> torch.Tensor:
    """The tower's forward hook: its embeddings become class scores."""
    return tower.zero_shot(embeddings)


def load_open_clip(name: str, checkpoint: Optional[str], pretrained: bool, seed: int) -> nn.Module:
    """The image tower of open_clip's architecture name[len('open_clip:'):] classifying ImageNet-1k zero-shot: its
    weights from checkpoint (an open_clip state dict of the whole model, e.g. the Hub's open_clip_pytorch_model
    file), else open_clip's random initialisation drawn from seed. ValueError naming MODEL / --pretrained for an
    unknown architecture, one that is not a ViT, or --pretrained (open_clip's weights come by --checkpoint), and
    naming --checkpoint for text-tower weights whose class embeddings are not finite."""
    open_clip = require("open_clip", "openclip", f"MODEL {name}")
    from open_clip.transformer import VisionTransformer
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    arch = name[len(PREFIX):]
    if arch not in open_clip.list_models():
        raise ValueError(f"MODEL {name!r}: open_clip has no architecture {arch!r} (open_clip.list_models() lists "
                         "them, e.g. open_clip:ViT-B-32)")
    if pretrained:
        raise ValueError(f"MODEL {name!r} takes its weights from --checkpoint FILE, not --pretrained: give the "
                         "open_clip state dict (open_clip_pytorch_model.bin / .safetensors from the Hub, or "
                         "torch.save(model.state_dict()) of open_clip.create_model(ARCH, pretrained=TAG))")
    with torch.random.fork_rng(devices=[]), _unsaid(RANDOM_INIT_NOTE) if checkpoint else contextlib.nullcontext():
        torch.manual_seed(seed)
        model = open_clip.create_model(arch)
    if not isinstance(model.visual, VisionTransformer):
        raise ValueError(f"MODEL {name!r}: its image tower is open_clip's {type(model.visual).__name__}; timm_tokcomp "
                         "serves open_clip's VisionTransformer towers")
    if checkpoint:
        load_weights(model, checkpoint, "--checkpoint")
    model.eval()
    with torch.no_grad():
        classes = open_clip.build_zero_shot_classifier(model, open_clip.get_tokenizer(arch), IMAGENET_CLASSNAMES,
                                                       (TEMPLATE,), num_classes_per_batch=100, device="cpu")
        scale = float(model.logit_scale.exp())
    if not (torch.isfinite(classes).all() and math.isfinite(scale)):  # the tower's own weights: build_base_model
        raise ValueError(f"--checkpoint {checkpoint}: the text tower's class embeddings or logit scale hold NaN or "
                         "inf; the weights are broken (the zero-shot scores would mean nothing)")
    tower = model.visual
    tower.zero_shot = ZeroShotHead(classes.T.contiguous(), scale)
    tower.register_forward_hook(_zero_shot_scores)
    tower.num_classes = len(IMAGENET_CLASSNAMES)
    tower.pretrained_cfg = {"architecture": name, **data_config(tower.preprocess_cfg)}
    return tower


RANDOM_INIT_NOTE = "No pretrained weights loaded"  # open_clip's warning for a model built without its weights


@contextlib.contextmanager
def _unsaid(note: str):
    """Within it, the root logger drops records whose message holds note (open_clip logs there): a note that the
    --checkpoint loaded right after create_model makes untrue."""
    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return note not in record.getMessage()

    drop = Drop()
    logging.getLogger().addFilter(drop)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(drop)


def data_config(preprocess: Dict[str, Any]) -> Dict[str, Any]:
    """timm's data config of open_clip's preprocess_cfg: the short side resized to the size, center-cropped."""
    size = preprocess["size"]
    height, width = (size, size) if isinstance(size, int) else size
    return dict(input_size=(3, height, width), interpolation=preprocess.get("interpolation", "bicubic"),
                mean=tuple(preprocess["mean"]), std=tuple(preprocess["std"]), crop_pct=1.0, crop_mode="center")
