"""The fast-path chooser: for a model, device, dtype and method setting, which kernel, proportional-attention
implementation and execution mode can run it, and which of them the method's defaults ('auto') pick. tune's
candidates are these paths; `tokcomp speed` and the docs read the same answer."""
import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import kernels
from ..core import apply, get_reducer
from ..methods import method_class
from ..families import facade, resolve
from ..measure.precision import DTYPES, check_device, check_dtype
from ..runtime.loop import resolve_prop_attn
from ..deployment.modes import TORCH_MODES, check_mode

COMPILED_MODES = ("compile", "cudagraph")  # torch.compile: the reduction steps run as custom operators


@dataclass(frozen=True)
class FastPath:
    """One way to run a setting. kernel: 'torch' or 'triton', None for a method without a kernel choice;
    prop_attn: the implementation (attention.PROP_ATTN_IMPLS), False where the setting weighs no token sizes."""

    mode: str
    kernel: Optional[str]
    prop_attn: Union[bool, str]

    def params(self, method: str, params: Dict[str, Any]) -> Dict[str, Any]:
        """params with this path's kernel and prop_attn written in, where the method takes them."""
        out = dict(params)
        if "prop_attn" in method_class(method).param_names():
            out["prop_attn"] = self.prop_attn
        if self.kernel is not None:
            out["kernel"] = self.kernel
        return out


def _applied(model: nn.Module, method: str, params: Dict[str, Any]) -> Tuple[Any, Union[bool, str]]:
    """(the setting's reducer on a copy of model, its proportional attention: False, True or an implementation);
    every refusal of this model is raised here."""
    reducer = get_reducer(apply(copy.deepcopy(model), method, **params))
    if "prop_attn" not in method_class(method).param_names():
        return reducer, False
    return reducer, reducer.prop_attn if reducer.prop_attn is not None else reducer.default_prop_attn(facade(model).global_pool)


def fast_paths(model: nn.Module, method: str, params: Dict[str, Any], device: str,
               modes: Sequence[str] = ("eager",)) -> List[FastPath]:
    """Every path this device offers for the setting (method, params) on model (a plain timm model), mode by
    mode: the Triton kernels on CUDA for methods with fused kernels (compiled too, as custom operators:
    kernels.library; the dense variant's merge kernels in eager mode only); 'mask' and 'fold' wherever the setting weighs token sizes, 'fold_qkv' where the attention allows it (Family.fold_qkv_refusal),
    'flex' compiled on CUDA (on the CPU its compiled form falls back to the mask); data-dependent methods in eager
    mode only."""
    check_device(device)
    for mode in modes:
        check_mode(mode, device, allowed=TORCH_MODES)
    cls = method_class(method)
    prop = _applied(model, method, params)[1] is not False
    cuda = torch.device(device).type == "cuda"
    out = []
    for mode in modes:
        if cls.spec.data_dependent and mode != "eager":
            continue
        compiled = mode in COMPILED_MODES
        kernel_choices: List[Optional[str]] = [None]
        if cls.has_kernel_choice():
            kernel_choices = ["torch"] + (["triton"] if cuda and not (compiled and cls.spec.dense) else [])
        impls: List[Union[bool, str]] = [False]
        if prop:
            impls = ["mask", "fold"] + (["fold_qkv"] if resolve(model).fold_qkv_refusal(model) is None else [])
            impls += ["flex"] if compiled and cuda else []
        out += [FastPath(mode, kernel, impl) for kernel in kernel_choices for impl in impls]
    return out


def default_path(model: nn.Module, method: str, params: Dict[str, Any], device: str, dtype: str = "fp32") -> FastPath:
    """What the setting runs in eager inference on this device and precision when its kernel and prop_attn are
    left to their defaults ('auto' resolved by the measured device table, timm_tokcomp.measure.device_table)."""
    check_device(device)
    check_dtype(dtype)
    reducer, prop = _applied(model, method, params)
    probe = torch.empty(0, device=device, dtype=DTYPES[dtype])
    kernel = kernels.resolve_backend(reducer.kernel, probe) if reducer.has_kernel_choice() else None
    impl = False if prop is False else resolve_prop_attn("auto" if prop is True else prop, probe)
    return FastPath("eager", kernel, impl)

