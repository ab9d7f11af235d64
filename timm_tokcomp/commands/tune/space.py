"""The search space: the candidates (every path and mode kit.paths offers for each setting), checked against the
model before any work; the reference path a setting's accuracy is measured on."""
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn

from ...deployment.modes import TORCH_MODES
from ..paths import fast_paths
from ...methods import method_class
from ...families import facade
from .rows import Candidate, label


def candidate_paths(method: str, params: Dict[str, Any], model: nn.Module, device: str,
                    modes: Sequence[str]) -> List[Candidate]:
    """Every way the device offers to run this setting (kit.paths.fast_paths: kernels, proportional-attention
    implementations, execution modes), as candidates."""
    out = []
    for path in fast_paths(model, method, params, device, modes):
        kw = path.params(method, params)
        out.append(Candidate(method, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items())),
                             path.mode))
    return out


def accuracy_twin(c: Candidate) -> Dict[str, Any]:
    """The candidate's params on the reference path (torch kernel, float mask): what screening runs."""
    kw = c.kwargs
    if "kernel" in kw:
        kw["kernel"] = "torch"
    if kw.get("prop_attn") not in (None, False):
        kw["prop_attn"] = "mask"
    return kw


def check_space(space: Sequence[Tuple[str, Dict[str, Any]]], model: nn.Module) -> None:
    """Raise ValueError / TypeError for an unknown method or parameter name in space. What depends on the model
    (a preset for another width, a class token needed) is left to candidate_paths, whose refusals become notes."""
    for entry in space:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[1], dict):
            raise TypeError(f"space must hold (method, params dict) pairs, got {entry!r}")
        method, params = entry
        cls = method_class(method)
        if cls.spec.dense:
            raise ValueError(f"--methods: {method} is refused by tune: the dense variant keeps every token (it merges "
                             f"before each MLP and unmerges after, for dense prediction), so tune's accuracy budget "
                             f"and speed-up would judge a model that reduces no token; time it with tokcomp speed")
        try:
            resolved = cls.resolve_params(facade(model), dict(params))
        except ValueError:
            continue
        unknown = sorted(set(resolved) - set(cls.param_names()))
        if unknown:
            raise TypeError(f"space: unknown parameter(s) {unknown} for method {method!r}; valid: "
                            f"{list(cls.param_names())}")


def default_modes(device: str) -> Tuple[str, ...]:
    """Eager on the CPU; on CUDA also the eager forward in a CUDA graph and torch.compile (without and with CUDA
    graphs)."""
    return TORCH_MODES if torch.device(device).type == "cuda" else ("eager",)


def applicable_candidates(space: Sequence[Tuple[str, Dict[str, Any]]], model: nn.Module, device: str,
                          modes: Sequence[str]) -> Tuple[List[Candidate], List[str]]:
    """Every candidate of the space on this model and device (candidate_paths), and a note per setting the model
    refuses (a class token needed, a preset for another width); ValueError when none is left."""
    if not space:
        raise ValueError("--methods: no candidate setting given (an empty list); leave --methods out for the "
                         "default space")
    candidates: List[Candidate] = []
    notes: List[str] = []
    for method, params in space:
        try:
            candidates += candidate_paths(method, params, model, device, modes)
        except (ValueError, TypeError) as e:
            notes.append(f"{label(method, params)}: not applicable ({e})")
    if not candidates:
        raise ValueError("--methods: no candidate applies to this model: " + "; ".join(notes))
    return candidates, notes
