"""A reduced model's eager forward captured in one CUDA graph, for small batches on a GPU.

At batch 1-32 a ViT forward is bound by the CPU launching its kernels, and token reduction adds launches. A CUDA
graph replays the whole forward's kernels with one launch. It needs static shapes and no host synchronisation
inside the forward: every fixed-count method (ToMe, EViT, Top-K, ... at a fixed r, either `kernel`), not ATM or
ATS, whose counts are read from the data. Capturing runs a few eager forwards: no compilation.

    graphed = timm_tokcomp.runtime.graphs.GraphedForward(model.eval().cuda(), example)   # example: (B, 3, H, W)
    logits = graphed(images)                                                     # images: example's shape
"""
import contextlib
import threading
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..measure.counting import OpCounter
from ..utils.checks import check_int
from .state import state_of


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
    compile there). forward: what is captured, model's forward by default (e.g. a regionally compiled model, whose
    Inductor kernels then replay as one graph); the capturability check runs model eagerly. The graph reads the
    weights in place: it holds model, unless forward is given (then forward's owner keeps model alive)."""

    def __init__(self, model: nn.Module, example: torch.Tensor, warmup: int = 3,
                 forward: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        check_int("warmup", warmup, 1)
        if not example.is_cuda:
            raise ValueError(f"example must be a CUDA tensor (CUDA graphs replay GPU work), got {example.device}")
        check_capturable(model, example)
        self.model = model if forward is None else None
        forward = model if forward is None else forward
        self._replaying = threading.Lock()  # one input and output buffer: calls from several threads take turns
        with torch.inference_mode(False):  # a normal tensor: calls may copy into it inside or outside inference mode
            self.static_input = example.detach().clone()
        self._rope_tables: Dict[int, Dict[str, torch.Tensor]] = {}  # read by every replay: kept as long as the graph
        side = torch.cuda.Stream(device=example.device)
        side.wait_stream(torch.cuda.current_stream(example.device))
        with fixed_rope_tables(model, self._rope_tables):
            with torch.no_grad(), _uncached_autocast(), torch.cuda.stream(side):
                for _ in range(warmup):
                    forward(self.static_input)
            torch.cuda.current_stream(example.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), _uncached_autocast(), torch.cuda.graph(self.graph):
                self.static_output = forward(self.static_input)

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
            return tree_map_only(torch.Tensor, torch.clone, self.static_output)  # a tensor, or a transformers output


class GraphedByShape:
    """forward (images (B, 3, H, W) on CUDA -> outputs) replayed from one CUDA graph per input shape, dtype and
    device, each captured (GraphedForward, its capturability checked on model) on the first call with that shape.
    What compiling.compile's 'cudagraph' mode runs for a regionally compiled model: Inductor's own CUDA graphs
    ('reduce-overhead') start a new generation at each compiled call, so the blocks' outputs, passed from one block's
    call to the next, would be overwritten (an H200 run failed so); one capture of the whole forward replays the
    embedding, every compiled block and the head with one launch. A reduced model's method changed since a capture
    (set_params, apply: a new method instance) is captured again, so a replay never runs the old r. Holds model
    weakly (forward's owner keeps it)."""

    def __init__(self, model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.model = weakref.ref(model)
        self.forward = forward
        self.graphs: Dict[tuple, Tuple[object, GraphedForward]] = {}  # key -> (the method captured, its graph)
        self._capturing = threading.Lock()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, H, W), a CUDA tensor -> model's output for x."""
        model = self.model()
        method = getattr(state_of(model), "reducer", None)
        key = (tuple(x.shape), x.dtype, x.device, torch.is_autocast_enabled("cuda"),
               torch.get_autocast_dtype("cuda"))
        with self._capturing:
            captured, graphed = self.graphs.get(key, (None, None))
            if graphed is None or captured is not method:
                graphed = GraphedForward(model, x, forward=self.forward)
                self.graphs[key] = (method, graphed)
        return graphed(x)


@contextlib.contextmanager
def fixed_rope_tables(model: nn.Module, tables: Dict[int, Dict[str, torch.Tensor]]):
    """Inside: each rope module's get_embed(...) (timm's rotary tables, (H * W, 2 * dim)) returns the table its
    first call with the same arguments made, kept in tables (module id -> {arguments: table}). timm's DINOv3 rope
    builds its grid on the CPU and copies it to the device in every forward, a copy a CUDA graph cannot capture; in
    eval mode, for one input shape, the table is a constant, so the warm-up forwards make it and the capture reads
    it. Modules in training mode (coordinate augmentation) are left alone."""
    wrapped = []
    for module in model.modules():
        get_embed = getattr(module, "get_embed", None)
        if module.training or not callable(get_embed) or "get_embed" in vars(module):
            continue
        memo = tables.setdefault(id(module), {})

        def fixed(*args, _get_embed=get_embed, _memo=memo, **kwargs):
            key = repr((args, sorted(kwargs.items())))
            if key not in _memo:
                _memo[key] = _get_embed(*args, **kwargs)
            return _memo[key]

        module.get_embed = fixed  # an instance attribute in front of the class's method
        wrapped.append(module)
    try:
        yield
    finally:
        for module in wrapped:
            del module.get_embed


def _uncached_autocast():
    """The CUDA autocast in force (its dtype baked into the graph), without the weight-cast cache, whose tensors
    a captured graph must not outlive (torch's CUDA graph notes); a no-op outside autocast."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
