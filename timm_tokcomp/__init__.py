"""timm_tokcomp: token reduction (ToMe, EViT, ATM, PYRA, the "Which Tokens to Use?" methods, dense ToMe) for timm
Vision Transformers.

    import timm, timm_tokcomp
    model = timm.create_model("deit_small.tome_r16")          # registered names (also "deit_small.atm")
    timm_tokcomp.apply(plain_model, method="tome", r=16)        # or patch a model you have
    timm_tokcomp.set_params(model, r=8)                         # change r on the live model
    timm_tokcomp.remove(model)                                  # back to the plain timm model
    fast = timm_tokcomp.compile(model)                          # torch.compile, its block compiled once
"""
from typing import Any

from .runtime.compile import compile
from .deployment.deploy import deploy
from .deployment.presets import load_preset
from .core import NO_REDUCTION, __version__, apply, get_reducer, is_reduced, last_stats, remove, set_params
from .methods import METHODS
from ._moved import install as _install_moved_paths
from .models.timm_names import register_all as _register_all
from .runtime.state import ReductionStats

__all__ = ["apply", "remove", "set_params", "compile", "get_reducer", "last_stats", "is_reduced", "load_preset", "deploy", "tune", "METHODS",
           "ReductionStats", "NO_REDUCTION", "__version__"]


def tune(*args: Any, **kwargs: Any):
    """Measure the candidates on this device and choose the fastest within an accuracy budget, or none
    (timm_tokcomp.commands.tune.tune; its docstring lists the arguments)."""
    from .commands.tune import tune as _tune

    return _tune(*args, **kwargs)


_install_moved_paths()  # the old module paths, one release, with a DeprecationWarning
_register_all()
