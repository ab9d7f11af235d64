"""torch.compile of a reduced model by regions: its repeated block is compiled once, for every block and every batch.

Compiled whole, a reduced model is one graph whose blocks each have another token count (197, 181, ... for ToMe
r16), so the compiler generates each block's kernels again, and again for each batch size. Compiled as a region,
the blocks' shared `forward_reduce` is traced with the batch and the token count symbolic: one graph serves every
block whose guards hold (the first block, whose tokens have no sizes yet, and a last block that keeps only the
prefix tokens get their own), a new batch size or a new r (`set_params`) reuses them. The embedding (patch
convolution, position embedding or rope table, prefix tokens) and the end (final norm, pooling with the sizes, head)
are regions of their own, so no op of the forward runs outside a compiled graph. Each compiled model gets its own
copy of the regions' code, so the compiler's per-function limit on cached graphs counts that model's graphs only,
however many models a process compiles. torch.compile(model) takes the same path: the reduced forward, traced
whole, hands itself to its regions (reducing.compiled_whole).
A batch of 1 compiles its own graphs once (torch specialises dimensions of size 1); a data-dependent method (ATM,
ATS, LTMP) breaks the graph where it reads its count from the data; a method whose plan reads a per-block Python
value (TokenReducer.compiles_by_region False) is compiled whole. ToMe's step runs as one custom operator
(kernels.library), the Triton kernels inside it where its backend resolves to 'triton'.

    fast = timm_tokcomp.compile(model)        # model: a reduced timm model, unchanged; fast(images) -> logits
    fast = torch.compile(model)               # the same regions (torch.compile's mode and backend aside)
"""
import contextlib
import types
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from .graphs import GraphedByShape
from .reducing import COMPILED_REGIONS, ReducingBlockMixin, ReducingModel, Regions

COMPILE_MODES = {"compile": None, "cudagraph": "reduce-overhead"}  # package mode -> torch.compile's mode
TORCH_COMPILE_NOTE = (
    "torch.compile(model) on a model reduced by timm_tokcomp runs it compiled by regions, as "
    "timm_tokcomp.compile(model) does (Inductor, each region compiled once for every block, batch size and r); "
    "torch.compile's mode and backend do not reach the regions: for CUDA graphs call "
    "timm_tokcomp.compile(model, mode='cudagraph'), for another backend timm_tokcomp.compile(model, backend=...)")


def _own_copy(fn: Callable) -> Callable:
    """fn with a code object of its own: the compiler keeps its graphs and their limit per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_regions(model: nn.Module, **compile_kwargs: Any) -> Regions:
    """model's embedding, block (ReducingBlockMixin.forward_reduce) and end (_finish) compiled, each on its own copy of
    the code, the batch and the token count dynamic. Holds no reference to model."""
    def compiled(fn: Callable) -> Callable:
        return torch.compile(_own_copy(fn), dynamic=True, **compile_kwargs)

    cls = type(model)
    return Regions(compiled(cls._embed), compiled(ReducingBlockMixin.forward_reduce), compiled(cls._finish))


@contextlib.contextmanager
def running(model: nn.Module, regions: Regions):
    """Within it, every forward of model in this thread (forward_features, forward_intermediates too) runs its
    compiled regions."""
    token = COMPILED_REGIONS.set((model, regions))
    try:  # no duck sizing: a batch of 2 is not the 2 of a rope model's (x, y) coordinates; a float (a scale, a rope
        # temperature) is a constant of the graph, not an input that each call would wrap in a tensor first
        with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(specialize_float=True):
            yield
    finally:
        COMPILED_REGIONS.reset(token)


class RegionallyCompiled:
    """model (a ReducingModel) with its embedding, blocks and end compiled by region (compile_regions). Calling it
    runs model's forward; the model itself stays eager for every other caller."""

    def __init__(self, model: nn.Module, **compile_kwargs: Any):
        self.model = model
        self.regions = compile_regions(model, **compile_kwargs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, H, W) -> model(x)."""
        with self.active():
            return self.model(x)

    def active(self):
        """Within it, every forward of the model (forward_features, forward_intermediates too) runs compiled."""
        return running(self.model, self.regions)


# model -> its regions compiled for torch.compile(model) (compiled_forward); the regions hold no reference to it
_BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, Regions]" = weakref.WeakKeyDictionary()


def compiled_forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """model.forward(*args, **kwargs) with its regions compiled: what torch.compile(model) runs for a reduced model
    (reducing.forward_by_region). The regions are compiled on model's first such call, which says so once."""
    if model not in _BY_MODEL:
        warnings.warn(TORCH_COMPILE_NOTE, stacklevel=3)
        _BY_MODEL[model] = compile_regions(model)
    with running(model, _BY_MODEL[model]):
        return model.forward(*args, **kwargs)


def by_region(model: nn.Module) -> bool:
    """Whether compile() compiles model by regions: a reduced model whose method compiles_by_region."""
    return isinstance(model, ReducingModel) and model._tokcomp_reducer.compiles_by_region


def compile(model: nn.Module, mode: str = "compile", backend: str = "inductor"
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """model as torch.compile runs it: images (B, 3, H, W) -> outputs. mode: 'compile' (Inductor) or 'cudagraph'
    (CUDA graphs too); backend: torch.compile's ('eager' traces without generating code: a check of what is
    captured). A reduced model is compiled by regions (RegionallyCompiled), in 'cudagraph' mode with its whole
    forward captured in one CUDA graph per input shape (graphs.GraphedByShape); a plain or dense one, and one whose
    method does not compile by region (TokenReducer.compiles_by_region), whole with static shapes
    (torch.compile(model, dynamic=False), in 'cudagraph' mode with Inductor's CUDA graphs, 'reduce-overhead'): the
    fastest plain model at each batch size."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if by_region(model):
        if mode == "cudagraph":  # the regions compiled plainly, the whole forward captured once per input shape
            return GraphedByShape(model, RegionallyCompiled(model, backend=backend))
        return RegionallyCompiled(model, backend=backend)
    kwargs = {"backend": backend} if backend != "inductor" else {"mode": COMPILE_MODES[mode]}
    return torch.compile(model, dynamic=False, **kwargs)
