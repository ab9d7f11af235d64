"""The model families timm_tokcomp serves, one adapter each (what differs: embedding, attention with the log-size
bias and rotary positions, pooling); the reducing loop they share is timm_tokcomp.reducing. A new family is one
module here with its Family and a line in FAMILIES. Hugging Face transformers' vision encoders (families.hf) are
served where transformers is installed, their adapter imported on first use."""
from typing import Optional, Tuple

from .base import Family
from .eva import EVA
from .naflex import NAFLEX
from .vit import VIT

FAMILIES: Tuple[Family, ...] = (VIT, EVA, NAFLEX)


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
    return f"{timm_classes} and transformers' {', '.join(HF_CLASSES)}"


# the transformers classes families.hf serves, by name (for messages and loaders without importing transformers;
# tests/models/test_hf.py checks them against hf.MODELS)
HF_CLASSES = ("ViTModel", "ViTForImageClassification", "Dinov2Model", "Dinov2WithRegistersModel", "CLIPVisionModel",
              "SiglipVisionModel")


# timm model modules none of whose architectures is served, and why (a method tag on their names, and apply on
# their models, say so)
UNSERVED_MODULES = {
    "gemma4_vit": "Gemma 4's vision encoder, which timm_tokcomp does not serve: its output pools every patch into a "
                  "fixed cell of the patch grid (Gemma4VisionPooler: N / k^2 soft tokens for the language model, each "
                  "the mean of exactly k^2 patches found by their grid positions), a contract a reduced token count "
                  "breaks; its blocks (clipped linears, its own 2D rope) are not timm's Block or EvaBlock either",
}


def unserved_reason(model_class: type) -> Optional[str]:
    """Why a model class of an unserved timm module is not served, or None."""
    module = model_class.__module__.rsplit(".", 1)[-1]
    return UNSERVED_MODULES.get(module) if model_class.__module__.startswith("timm.") else None
