"""torch.compile of a reduced model by regions: its repeated block is compiled once, for every block and every batch.

Compiled whole, a reduced model is one graph whose blocks each have another token count (197, 181, ... for ToMe
r16), so the compiler generates each block's kernels again, and again for each batch size. Compiled as a region,
the blocks' shared `forward_reduce` is traced with the batch and the token count symbolic: one graph serves every
block whose guards hold (a last block that keeps only the prefix tokens gets its own), a new batch size or a new r
(`set_params`) reuses them. The embedding (patch convolution, position embedding or rope table, prefix tokens) and
the end (final norm, pooling with the sizes, head) are regions of their own, so no op of the forward runs outside a
compiled graph; the embedding also hands the first block what the later blocks take (sizes of one, their log,
rotary coordinates: regions.UnitSizes), so that block runs their graph: three graphs in all for ToMe or EViT. Each
compiled model gets its own copy of the regions' code, so the compiler's per-function limit on cached graphs counts
that model's graphs only, however many models a process compiles. torch.compile(model) takes the same path: the
reduced forward, traced whole, hands itself to its regions with torch.compile's backend, mode and options, CUDA
graphs ('reduce-overhead') as the 'cudagraph' mode below captures them (handoff.forward_by_region).
A batch of 1 compiles its own graphs once (torch specialises dimensions of size 1); a data-dependent method (ATM,
ATS, LTMP) breaks the graph where it reads its count from the data; a method whose plan reads a per-block Python
value (TokenReducer.compiles_by_region False) is compiled whole. ToMe's step runs as one custom operator
(kernels.library), the Triton kernels inside it where its backend resolves to 'triton'.

    fast = timm_tokcomp.compile(model)        # model: a reduced timm model, unchanged; fast(images) -> logits
    fast = torch.compile(model)               # the same regions; mode="reduce-overhead": as mode="cudagraph"
"""
from typing import Any, Callable

import torch
from torch import nn

from .graphs import GraphedByShape
from .loop import ReducingModel
from .handoff import traced_whole
from .regions import compile_regions, running
from ..utils.checks import check_choice

__all__ = ["COMPILE_MODES", "RegionallyCompiled", "by_region", "compile", "traced_whole"]

COMPILE_MODES = {"compile": None, "cudagraph": "reduce-overhead"}  # package mode -> torch.compile's mode


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


def by_region(model: nn.Module) -> bool:
    """Whether compile() compiles model by regions: a reduced model of a family and a method that compile by region
    (ReducingModel.compiles_by_region, TokenReducer.compiles_by_region)."""
    return isinstance(model, ReducingModel) and model.compiles_by_region and model._tokcomp.reducer.compiles_by_region


def compile(model: nn.Module, mode: str = "compile", backend: str = "inductor"
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """model as torch.compile runs it: images (B, 3, H, W) -> outputs. mode: 'compile' (Inductor) or 'cudagraph'
    (CUDA graphs too); backend: torch.compile's ('eager' traces without generating code: a check of what is
    captured). A reduced model is compiled by regions (RegionallyCompiled: its embedding, blocks and end, no op of the
    forward outside them), in 'cudagraph' mode with its whole
    forward captured in one CUDA graph per input shape (graphs.GraphedByShape); a plain or dense one, and one whose
    method does not compile by region (TokenReducer.compiles_by_region), whole with static shapes
    (torch.compile(model, dynamic=False), in 'cudagraph' mode with Inductor's CUDA graphs, 'reduce-overhead'): the
    fastest plain model at each batch size."""
    check_choice("mode", mode, COMPILE_MODES)
    if by_region(model):
        if mode == "cudagraph":  # the regions compiled plainly, the whole forward captured once per input shape
            return GraphedByShape(model, RegionallyCompiled(model, backend=backend))
        return RegionallyCompiled(model, backend=backend)
    kwargs = {"backend": backend} if backend != "inductor" else {"mode": COMPILE_MODES[mode]}
    return torch.compile(model, dynamic=False, **kwargs)
