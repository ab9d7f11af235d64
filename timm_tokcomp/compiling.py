"""torch.compile of a reduced model by regions: its repeated block is compiled once, for every block and every batch.

Compiled whole, a reduced model is one graph whose blocks each have another token count (197, 181, ... for ToMe
r16), so the compiler generates each block's kernels again, and again for each batch size. Compiled as a region,
the blocks' shared `forward_reduce` is traced with the batch and the token count symbolic: one graph serves every
block whose guards hold (the first block, whose tokens have no sizes yet, and a last block that keeps only the
prefix tokens get their own), a new batch size or a new r (`set_params`) reuses them, and the embedding, final norm
and head run eagerly around them. Each compiled model gets its own copy of the block's code, so the compiler's
per-function limit on cached graphs counts that model's graphs only, however many models a process compiles.
A batch of 1 compiles its own graphs once (torch specialises dimensions of size 1); a data-dependent method (ATM,
ATS, LTMP) breaks the graph where it reads its count from the data; a method whose plan reads a per-block Python
value (TokenReducer.compiles_by_region False) is compiled whole. ToMe's step runs as one custom operator
(kernels.library), the Triton kernels inside it where its backend resolves to 'triton'.

    fast = timm_tokcomp.compile(model)        # model: a reduced timm model, unchanged; fast(images) -> logits
"""
import contextlib
import types
from typing import Callable

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from .graphs import GraphedByShape
from .reducing import COMPILED_BLOCKS, ReducingBlockMixin, ReducingModel

COMPILE_MODES = {"compile": None, "cudagraph": "reduce-overhead"}  # package mode -> torch.compile's mode


def _own_copy(fn: Callable) -> Callable:
    """fn with a code object of its own: the compiler keeps its graphs and their limit per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class RegionallyCompiled:
    """model (a ReducingModel) with its blocks' forward_reduce compiled once, batch and token count dynamic.
    Calling it runs model's forward; the model itself stays eager for every other caller."""

    def __init__(self, model: nn.Module, **compile_kwargs):
        self.model = model
        self.forward_reduce = torch.compile(_own_copy(ReducingBlockMixin.forward_reduce), dynamic=True,
                                            **compile_kwargs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, H, W) -> model(x)."""
        with self.active():
            return self.model(x)

    @contextlib.contextmanager
    def active(self):
        """Within it, every forward of the model (forward_features, forward_intermediates too) runs compiled blocks."""
        token = COMPILED_BLOCKS.set((self.model, self.forward_reduce))
        try:  # no duck sizing: a batch of 2 is not the 2 of a rope model's (x, y) coordinates
            with fx_config.patch(use_duck_shape=False):
                yield
        finally:
            COMPILED_BLOCKS.reset(token)


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
