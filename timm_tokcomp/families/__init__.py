"""The model families timm_tokcomp serves, one adapter each (what differs: embedding, attention with the log-size
bias and rotary positions, pooling); the reducing loop they share is timm_tokcomp.reducing. A new family is one
module here with its Family and a line in FAMILIES. Hugging Face transformers' vision encoders (families.hf) are
served where transformers is installed, their adapter imported on first use."""
from typing import Optional, Tuple

from .base import Family
from .eva import EVA
from .vit import VIT

FAMILIES: Tuple[Family, ...] = (VIT, EVA)


def family_of(model_class: type) -> Optional[Family]:
    """The family serving this model class (plain or patched), or None."""
    for family in FAMILIES:
        if family.serves(model_class):
            return family
    if model_class.__module__.startswith(("transformers.", f"{__name__}.hf")):
        from .hf import HF  # a transformers model: transformers is installed

        if HF.serves(model_class):
            return HF
    return None


def served_classes() -> str:
    """The served classes, for error messages."""
    timm_classes = ", ".join(f"{c.__name__} ({c.__module__})" for family in FAMILIES for c in family.models)
    return f"{timm_classes} and transformers' {HF_CLASSES}"


HF_CLASSES = ("ViTModel, ViTForImageClassification, Dinov2Model, Dinov2WithRegistersModel, CLIPVisionModel, "
              "SiglipVisionModel")
