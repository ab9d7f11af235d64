"""timm_tokcomp: token reduction (ToMe, EViT, ATM, PYRA, the "Which Tokens to Use?" methods, dense ToMe) for timm
Vision Transformers.

    import timm, timm_tokcomp
    model = timm.create_model("deit_small.tome_r16")          # registered names (also "deit_small.atm")
    timm_tokcomp.apply(plain_model, method="tome", r=16)        # or patch a model you have
    timm_tokcomp.set_params(model, r=8)                         # change r on the live model
    timm_tokcomp.remove(model)                                  # back to the plain timm model
    fast = timm_tokcomp.compile(model)                          # torch.compile, its block compiled once
    timm_tokcomp.apply(llava, "visionzip")                      # a VLM: fewer image tokens into its LLM (vlm)
"""
from typing import Any

from .runtime.compile import compile
from .deployment.deploy import deploy
from .deployment.presets import load_preset
from . import core as _core, vlm as _vlm
from .core import NO_REDUCTION, __version__, get_reducer, last_stats
from .vlm import tokens_for
from .methods import METHODS
from ._moved import install as _install_moved_paths
from .models.timm_names import register_all as _register_all
from .runtime.state import ReductionStats

__all__ = ["apply", "remove", "set_params", "compile", "get_reducer", "last_stats", "is_reduced", "load_preset", "deploy",
           "tune", "METHODS", "ReductionStats", "NO_REDUCTION", "tokens_for", "__version__"]


def apply(model: Any, method: str = "tome", **params: Any) -> Any:
    """Reduce tokens in a timm ViT (core.apply; its docstring lists the methods and parameters) or, for a
    vision-language model, its visual tokens before the language model (vlm.apply, docs/vlm.md)."""
    return (_vlm.apply if _vlm.looks_like_vlm(model) else _core.apply)(model, method, **params)


def set_params(model: Any, **params: Any) -> Any:
    """Change the current method's parameters (core.set_params; a VLM: vlm.set_params)."""
    return (_vlm.set_params if _vlm.looks_like_vlm(model) else _core.set_params)(model, **params)


def remove(model: Any) -> Any:
    """The plain model again (core.remove; a VLM: vlm.remove)."""
    return (_vlm.remove if _vlm.looks_like_vlm(model) else _core.remove)(model)


def is_reduced(model: Any) -> bool:
    """Whether the model (a ViT, or a VLM) runs a token reduction method."""
    return _vlm.is_reduced(model) if _vlm.looks_like_vlm(model) else _core.is_reduced(model)


def tune(*args: Any, **kwargs: Any):
    """Measure the candidates on this device and choose the fastest within an accuracy budget, or none
    (timm_tokcomp.commands.tune.tune; its docstring lists the arguments)."""
    from .commands.tune import tune as _tune

    return _tune(*args, **kwargs)


_install_moved_paths()  # the old module paths, one release, with a DeprecationWarning
_register_all()
