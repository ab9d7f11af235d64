"""A reduced model's eager forward captured in one CUDA graph, for small batches on a GPU.

At batch 1-32 a ViT forward is bound by the CPU launching its kernels, and token reduction adds launches. A CUDA
graph replays the whole forward's kernels with one launch. It needs static shapes and no host synchronisation
inside the forward: every fixed-count method (ToMe, EViT, Top-K, ... at a fixed r, either `kernel`), not ATM or
ATS, whose counts are read from the data. Capturing runs a few eager forwards: no compilation.

    graphed = timm_tokcomp.graphs.GraphedForward(model.eval().cuda(), example)   # example: (B, 3, H, W)
    logits = graphed(images)                                                     # images: example's shape
"""
import contextlib
import threading
from typing import Dict

import torch
from torch import nn

from .measure import OpCounter
from .checks import check_int


def host_syncs(model: nn.Module, example: torch.Tensor) -> Dict[str, int]:
    """The ops of one forward of example (B, 3, H, W) that make the host wait for the device, with their calls
    (e.g. {'aten._local_scalar_dense.default': 10}): empty when the forward can be captured in a CUDA graph. Counted
    on a second forward: a first one may build caches once (index tables made from host data), as the warm-up
    forwards before a capture do too."""
    with torch.no_grad():
        model(example)
        with OpCounter() as ops:
            model(example)
    return ops.sync_counts


def check_capturable(model: nn.Module, example: torch.Tensor) -> None:
    """ValueError unless model (in eval mode) runs example (B, 3, H, W) without waiting for the device."""
    if model.training:
        raise ValueError("model must be in eval mode (model.eval()): a CUDA graph replays inference forwards")
    syncs = host_syncs(model, example)
    if syncs:
        raise ValueError(f"this forward waits for the device {sum(syncs.values())} times ({syncs}): its token "
                         "counts are read from the data (ATM, ATS), so it cannot be replayed from a CUDA graph; "
                         "use a fixed-count method or eager mode")


class GraphedForward:
    """model(x) replayed from a CUDA graph captured on example (B, 3, H, W), a CUDA tensor. Calls take tensors
    of example's shape, dtype and device and return a new tensor each (the model's output, cloned). The model
    must not change afterwards: its weights are read in place, but a new method, r or kernel needs a new
    capture. Built under torch.autocast, the graph keeps that autocast dtype. Calls from several threads take
    turns on the one pair of buffers. warmup: eager forwards on a side stream before the capture (Triton kernels
    compile there)."""

    def __init__(self, model: nn.Module, example: torch.Tensor, warmup: int = 3) -> None:
        check_int("warmup", warmup, 1)
        if not example.is_cuda:
            raise ValueError(f"example must be a CUDA tensor (CUDA graphs replay GPU work), got {example.device}")
        check_capturable(model, example)
        self.model = model
        self._replaying = threading.Lock()  # one input and output buffer: calls from several threads take turns
        with torch.inference_mode(False):  # a normal tensor: calls may copy into it inside or outside inference mode
            self.static_input = example.detach().clone()
        side = torch.cuda.Stream(device=example.device)
        side.wait_stream(torch.cuda.current_stream(example.device))
        with torch.no_grad(), _uncached_autocast(), torch.cuda.stream(side):
            for _ in range(warmup):
                model(self.static_input)
        torch.cuda.current_stream(example.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), _uncached_autocast(), torch.cuda.graph(self.graph):
            self.static_output = model(self.static_input)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, H, W) as the example -> the model's output for x."""
        want = self.static_input
        if x.shape != want.shape or x.dtype != want.dtype or x.device != want.device:
            raise ValueError(f"x must match the captured example: shape {tuple(want.shape)}, {want.dtype} on "
                             f"{want.device}; got {tuple(x.shape)}, {x.dtype} on {x.device} (capture another "
                             "GraphedForward for another batch size)")
        with self._replaying:
            self.static_input.copy_(x)
            self.graph.replay()
            return self.static_output.clone()


def _uncached_autocast():
    """The CUDA autocast in force (its dtype baked into the graph), without the weight-cast cache, whose tensors
    a captured graph must not outlive (torch's CUDA graph notes); a no-op outside autocast."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
