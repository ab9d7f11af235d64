"""The package's core API: make a timm ViT reduce tokens, change or undo it, and read what its last forward did.
The face (`timm_tokcomp/__init__.py`) re-exports these; modules inside the package import them from here."""
from typing import Any, Optional

import torch
from torch import nn

from . import patch as _patch
from .families import patched_family, resolve
from .methods import make_reducer, method_class
from .methods.base import TokenReducer
from .runtime.state import ReductionStats

__version__ = "0.2.0"
NO_REDUCTION = "none"  # the plain model as a method choice (a tune preset that found nothing faster within budget)


def apply(model: nn.Module, method: str = "tome", **params: Any) -> nn.Module:
    """Make a timm ViT reduce tokens inside its blocks (in place; returns the model).

    method: one of METHODS ('tome', 'evit', 'atm', 'pyra', 'topk', ..., 'dense_tome'), or 'none' (no parameters: the
    plain model, removing a method applied before; a tune preset may choose it). params of tome / evit: r (int,
    per-block list, or (r, inflection) tuple) or flops_ratio (> 1, solves a decreasing r schedule);
    of atm: alpha, beta, theta_min, split_layer, preset (fills the thresholds not given); these three
    also take prop_attn, trace_source, prefix_only_last_block. dense_tome (keeps every token): r
    (k = 32 r merges per block), k, kernel ('auto', 'torch', 'triton'). Applying to an already reduced model replaces its method.
    Raises TypeError for unsupported models and ValueError for bad parameters, leaving the model
    untouched.
    """
    family = resolve(model)  # the model's family, found and checked once; patch is handed it
    if method == NO_REDUCTION:  # a tune preset that chose the plain model
        if params:
            raise ValueError(f"method 'none' takes no parameters, got {sorted(params)}")
        return remove(model)
    params = method_class(method).resolve_params(family.facade(model), params)
    _patch.patch(model, make_reducer(method, **params), family)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Restore the plain timm model (same classes, same weights); returns it. A model without a method is returned
    unchanged."""
    if patched_family(model) is not None:
        _patch.unpatch(model)
    return model


def set_params(model: nn.Module, **params: Any) -> nn.Module:
    """Change the current method's parameters on a reduced model, e.g. set_params(model, r=8).
    Parameters not given keep their values; giving flops_ratio clears r and vice versa, giving an
    ATM preset replaces the thresholds not given."""
    reducer = _patch.reducer_of(model)
    family = patched_family(model)
    cls = type(reducer)
    merged = cls.resolve_params(family.facade(model), cls.update_params(reducer.params_for_update(params), params))
    _patch.patch(model, make_reducer(reducer.name, **merged), family)
    return model


def get_reducer(model: nn.Module) -> TokenReducer:
    """The method instance of a reduced model."""
    return _patch.reducer_of(model)


def is_reduced(model: nn.Module) -> bool:
    """Whether `model` runs a token reduction method (apply / a method name); False for a plain timm model,
    and again after remove."""
    return patched_family(model) is not None


def last_stats(model: nn.Module, features: Optional[torch.Tensor] = None) -> Optional[ReductionStats]:
    """Token counts per block, final sizes and source map of this thread's last eager forward of the model (None
    before one; a compiled forward keeps none), or, given `features` (a tensor forward_features returned), of the
    call that produced them. Calls from several threads at once each keep their own."""
    return _patch.stats_of(model, features)
