"""The base of the methods whose step has fused Triton kernels and a custom operator (ToMe, EViT): the kernel
parameter, and the one call that runs the step as the forward needs it (operator when compiled, kernels in eager
inference, each with the rotary positions moved inside on a rope model)."""
from typing import Callable, Optional, Sequence, Tuple

import torch

from .. import kernels
from ..kernels import library
from .base import ScheduledReducer
from .params import COMMON, SCHEDULE, kernel_choice


class FusedScheduledReducer(ScheduledReducer):
    """A ScheduledReducer with fused Triton kernels for its reduction step (ToMe, EViT; see reduce_fused).
    kernel: 'auto' (default: Triton for CUDA tensors when no gradient is needed, unless the device table says
    torch), 'triton' or 'torch'. The Triton path serves inference outside torch.compile / export and without
    trace_source, and falls back to torch elsewhere under 'auto'. It is the default since an H200 timed it faster
    than the torch path for ToMe and EViT at every batch (1 to 256), eager and in CUDA graphs (docs/speed.md)."""

    spec = ScheduledReducer.spec.but(
        params=(*SCHEDULE, *COMMON, kernel_choice("auto")),
    )

    def run_step(self, step: str, eager: Callable, inputs: Sequence, x: torch.Tensor, size: Optional[torch.Tensor],
                 r: int, num_prefix: int, positions=None) -> Tuple:
        """The step on x (B, N, C), size (B, N, 1) or None, r > 0 already clamped, after its own inputs (ToMe: the
        keys; EViT: q, k, bias, scale): compiled (library.uses_library_op), the operator `step`, or `<step>_rope`
        with the rotary positions moved inside it, on the resolved backend (library.compiled_step); in eager
        inference `eager` (kernels.tome_merge / evit_prune) with the positions' coordinates -> reduce_fused's
        (x, size, None, positions, log size)."""
        rope = positions is not None
        if library.uses_library_op(x):
            backend = kernels.resolve_backend(self.kernel, x)
            if rope:
                out = library.compiled_step(f"{step}_rope", *inputs, x, size, positions.coords, r, num_prefix,
                                            positions.merge, backend=backend)
            else:
                out = library.compiled_step(step, *inputs, x, size, r, num_prefix, backend=backend)
        else:
            out = eager(*inputs, x, size, r, num_prefix, *((positions.coords, positions.merge) if rope else ()))
        return out[0], out[1], None, positions.moved(out[3]) if rope else None, out[2]
