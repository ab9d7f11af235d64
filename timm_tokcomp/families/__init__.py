"""The model families timm_tokcomp serves, one adapter each (what differs: embedding, attention with the log-size
bias and rotary positions, pooling); the reducing loop they share is timm_tokcomp.runtime.loop. A new family is one
module here with its Family and a line in FAMILIES. Hugging Face transformers' vision encoders (families.hf) and
open_clip's image towers (families.openclip) are served where their library is installed: their entries are
LazyFamily, the adapter imported on first use."""
from importlib import import_module
from typing import Any, NamedTuple, Optional, Tuple, Union

from torch import nn

from .base import Family
from .eva import EVA
from .naflex import NAFLEX
from .sam import SAM
from .vit import VIT


class LazyFamily(NamedTuple):
    """A family for another library's models, its adapter (module.attr) imported on first use, so the library stays
    an optional extra: it serves classes of library_modules named class_names (for messages, read without
    importing the library)."""

    module: str
    attr: str
    library: str
    library_modules: Tuple[str, ...]
    class_names: Tuple[str, ...]
    timm_modules: Tuple[str, ...] = ()  # no timm names take its tags

    def serves(self, model_class: type) -> bool:
        return model_class.__module__.startswith((*self.library_modules, f"{__name__}{self.module}")) and \
            self.load().serves(model_class)

    def load(self) -> Family:
        return getattr(import_module(self.module, __name__), self.attr)

    def served(self) -> str:
        owner = f"{self.library}'" if self.library.endswith("s") else f"{self.library}'s"
        return f"{owner} {', '.join(self.class_names)}"


# tests/models/test_hf.py checks class_names against hf.MODELS
HF_ENTRY = LazyFamily(".hf", "HF", "transformers", ("transformers.",), (
    "ViTModel", "ViTForImageClassification", "Dinov2Model", "Dinov2WithRegistersModel", "CLIPVisionModel",
    "SiglipVisionModel"))
HF_CLASSES = HF_ENTRY.class_names
OPEN_CLIP_ENTRY = LazyFamily(".openclip", "OPEN_CLIP", "open_clip", ("open_clip.",), ("VisionTransformer",))
FAMILIES: Tuple[Union[Family, LazyFamily], ...] = (VIT, EVA, NAFLEX, SAM, HF_ENTRY, OPEN_CLIP_ENTRY)


def family_of(model_class: type) -> Optional[Family]:
    """The family serving this model class (plain or patched), or None. A patched model's class names its family
    (patched_family): no search."""
    found = getattr(model_class, "tokcomp_family", None)
    if found is not None:
        return found
    return next((family.load() for family in FAMILIES if family.serves(model_class)), None)


def patched_family(model: nn.Module) -> Optional[Family]:
    """The family whose patched classes model runs (set on those classes by their Family), or None for a plain model."""
    return getattr(type(model), "tokcomp_family", None)


def resolve(model: nn.Module) -> Family:
    """The family serving model, checked: raises TypeError explaining why the model cannot be reduced."""
    family = family_of(type(model))
    if family is None:
        served = f"timm_tokcomp reduces tokens in timm's {served_classes()}"
        inner = getattr(model, "model", None)
        if hasattr(model, "feature_info") and inner is not None and family_of(type(inner)) is not None:
            raise TypeError(f"{served}; this is timm's features_only wrapper {type(model).__name__} around one: pass "
                            f"the method in the name instead, e.g. timm.create_model('vit_small_patch16_224."
                            f"dense_tome_r8', features_only=True)")
        why = unserved_reason(type(model))
        if why is not None:
            raise TypeError(f"{type(model).__name__} is {why}. {served}")
        raise TypeError(f"{served}, got {type(model).__name__} from {type(model).__module__}, which it does not "
                        f"serve yet")
    family.check_blocks(model)
    family.check(model)
    return family


def facade(model: nn.Module) -> Any:
    """What the methods and patch read of a served model, under timm's attribute names (Family.facade)."""
    family = family_of(type(model))
    return model if family is None else family.facade(model)


def served_classes() -> str:
    """The served classes, for error messages."""
    parts = [family.served() for family in FAMILIES]
    return f"{', '.join(parts[:-1])} and {parts[-1]}"


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
