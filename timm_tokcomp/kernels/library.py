"""The reduction steps as torch custom operators (torch.library), for compiled models: torch.compile keeps each
step as one opaque call with a fake implementation that gives its output shapes from its input shapes, so the
compiler neither re-derives the matching for every block nor guards on each block's token count, and the fused
Triton kernels run inside the compiled graph (and its CUDA graphs) where the backend says 'triton'.

    x, size, log_size = torch.ops.timm_tokcomp.tome_merge(metric, x, size, r, num_prefix, "torch")
    x, size, log_size, coords = torch.ops.timm_tokcomp.tome_merge_rope(metric, x, size, coords, r, num_prefix, "dst",
                                                                       "triton")
    x, size, log_size = torch.ops.timm_tokcomp.evit_prune(q, k, attn_bias, scale, x, size, r, num_prefix, "triton")
    x, size, log_size, coords = torch.ops.timm_tokcomp.evit_prune_rope(q, k, attn_bias, scale, x, size, coords, r,
                                                                       num_prefix, "dst", "triton")

Each step also returns the log of the sizes it returns (size.log(), in size's dtype): the next block's
proportional-attention bias, which the merge kernel writes beside the sizes, so that block launches nothing for it.

Where Triton compiles the kernels (not under TRITON_INTERPRET=1), the 'triton' backend of each step is also
registered as a torch.library.triton_op, `<name>_launched`, which compiled_step calls instead: torch.compile sees
inside it, and Inductor launches its kernels from its generated code, with no Python dispatch per call. Under the
interpreter the custom operators run the kernels (a traced interpreted kernel would meet fake tensors).

Eager forwards call the same steps directly (kernels.tome_merge, or the method's plan): the operators add nothing
there. No backward: a forward that needs gradients traces the torch plan instead (uses_library_op), and so does
an ONNX export (ONNX has no translation of these operators).

Each operator clamps r as its plan does (merged_count, pruned_count: shape facts only), so its fake implementation
states the real output's shape for every (N, num_prefix, r), and returns fresh contiguous tensors (storage offset 0),
as the fake's new_empty does."""
import importlib.util
import inspect
import os
from typing import Callable, Dict, Optional, Tuple

import torch

from ..ops.matching import attentive_pruning, bipartite_soft_matching, class_attention, max_merges


def merged_count(num_tokens: int, num_prefix: int, r: int) -> int:
    """The merges ToMe's step makes: r clamped to [0, matching.max_merges(num_tokens, num_prefix)]."""
    return max(min(r, max_merges(num_tokens, num_prefix)), 0)


def pruned_count(num_tokens: int, num_prefix: int, r: int) -> int:
    """The tokens EViT's step removes: r clamped so that at least one patch token remains
    (matching.attentive_pruning)."""
    return max(min(r, num_tokens - num_prefix - 1), 0)


def _fresh(*tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Each tensor contiguous, with its own storage from offset 0 (what a fake's new_empty states)."""
    return tuple(t if t.storage_offset() == 0 and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
                 for t in tensors)


def _unreduced(x: torch.Tensor, size: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step with nothing to reduce: copies of x and size (ones where None) and the sizes' log, never aliases of the
    inputs."""
    size = x.new_ones(*x.shape[:2], 1) if size is None else size.clone()
    return x.clone(), size, size.log()


def _head_mean(metric: torch.Tensor) -> torch.Tensor:
    """A metric (B, N, D) as it is; keys (B, H, N, D) averaged over heads."""
    return metric.mean(dim=1) if metric.dim() == 4 else metric


def uses_library_op(x: torch.Tensor) -> bool:
    """Whether a method runs its step as the custom operator on x: while compiling, with no gradient to carry, and
    not for ONNX (which has no translation of the operators; the plan's aten ops export)."""
    return (torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad)
            and not torch.onnx.is_in_onnx_export())


def _tome_merge(metric: torch.Tensor, x: torch.Tensor, size: Optional[torch.Tensor], r: int, num_prefix: int,
                backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ToMe's step: bipartite matching of r merges on metric (B, N, D), or keys (B, H, N, D) averaged over heads,
    (0 < r <= matching.max_merges(N, num_prefix)) and the size-weighted merge of x (B, N, C), size (B, N, 1) or None
    (all ones) -> x (B, N - r, C), size (B, N - r, 1), log size (B, N - r, 1). backend: 'triton'
    (kernels.tome_merge's two launches) or 'torch' (the plan)."""
    r = merged_count(x.shape[1], num_prefix, r)
    if r == 0:
        return _unreduced(x, size)
    if backend == "triton":
        from . import triton_tome

        merged, merged_size, log_size = triton_tome.tome_merge(metric, x, size, r, num_prefix)
    else:
        merged, merged_size, _ = bipartite_soft_matching(_head_mean(metric), r, num_prefix).apply(x, size, None)
        log_size = merged_size.log()
    return _fresh(merged, merged_size, log_size)


tome_merge = torch.library.custom_op("timm_tokcomp::tome_merge", _tome_merge, mutates_args=())


@tome_merge.register_fake
def _(metric, x, size, r, num_prefix, backend):
    B, N, C = x.shape
    r = merged_count(N, num_prefix, r)
    return x.new_empty(B, N - r, C), x.new_empty(B, N - r, 1), x.new_empty(B, N - r, 1)


def _tome_merge_rope(metric: torch.Tensor, x: torch.Tensor, size: Optional[torch.Tensor], coords: torch.Tensor,
                     r: int, num_prefix: int, coords_merge: str, backend: str
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tome_merge (metric (B, N, D) or keys (B, H, N, D)) on a rope model: also the patch tokens' rotary
    coordinates coords (B, N - num_prefix, 2), float32, moved by the same plan (coords_merge 'dst': each merged token
    at its destination's; 'centroid': at the size-weighted centroid, rope.moved_coords) -> x (B, N - r, C),
    size (B, N - r, 1), log size (B, N - r, 1), coords (B, N - r - num_prefix, 2). backend: 'triton'
    (kernels.tome_merge with coords) or 'torch' (the plan)."""
    r = merged_count(x.shape[1], num_prefix, r)
    if r == 0:
        return (*_unreduced(x, size), coords.clone())
    if backend == "triton":
        from . import triton_tome

        merged, merged_size, log_size, moved = triton_tome.tome_merge_with_coords(metric, x, size, r, num_prefix,
                                                                                   coords, coords_merge)
    else:
        from ..ops.rope import moved_coords

        plan = bipartite_soft_matching(_head_mean(metric), r, num_prefix)
        merged, merged_size, _ = plan.apply(x, size, None)
        log_size = merged_size.log()
        moved = moved_coords(plan, coords, size, num_prefix, coords_merge)
    return _fresh(merged, merged_size, log_size, moved)


tome_merge_rope = torch.library.custom_op("timm_tokcomp::tome_merge_rope", _tome_merge_rope, mutates_args=())


@tome_merge_rope.register_fake
def _(metric, x, size, coords, r, num_prefix, coords_merge, backend):
    B, N, C = x.shape
    r = merged_count(N, num_prefix, r)
    return (x.new_empty(B, N - r, C), x.new_empty(B, N - r, 1), x.new_empty(B, N - r, 1),
            coords.new_empty(B, coords.shape[1] - r, 2))


def _evit_prune(q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float, x: torch.Tensor,
                size: Optional[torch.Tensor], r: int, num_prefix: int, backend: str
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EViT's step: the class token's attention from q, k (B, H, N, d), attn_bias (B, 1, 1, N) or None, the r + 1
    least attended patch tokens of x (B, N, C) fused into one (0 < r <= N - num_prefix - 1), size (B, N, 1) or None
    -> x (B, N - r, C), size (B, N - r, 1), log size (B, N - r, 1). backend: 'triton' (kernels.evit_prune's two
    launches) or 'torch'."""
    r = pruned_count(x.shape[1], num_prefix, r)
    if r == 0:
        return _unreduced(x, size)
    if backend == "triton":
        from . import triton_evit

        pruned, pruned_size, log_size = triton_evit.evit_prune(q, k, attn_bias, scale, x, size, r, num_prefix)
    else:
        plan = attentive_pruning(class_attention(q, k, attn_bias, scale).mean(dim=1), r, num_prefix)
        pruned, pruned_size, _ = plan.apply(x, size, None)
        log_size = pruned_size.log()
    return _fresh(pruned, pruned_size, log_size)


evit_prune = torch.library.custom_op("timm_tokcomp::evit_prune", _evit_prune, mutates_args=())


@evit_prune.register_fake
def _(q, k, attn_bias, scale, x, size, r, num_prefix, backend):
    B, N, C = x.shape
    r = pruned_count(N, num_prefix, r)
    return x.new_empty(B, N - r, C), x.new_empty(B, N - r, 1), x.new_empty(B, N - r, 1)


def _evit_prune_rope(q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float,
                     x: torch.Tensor, size: Optional[torch.Tensor], coords: torch.Tensor, r: int, num_prefix: int,
                     coords_merge: str, backend: str
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """evit_prune on a rope model: also the patch tokens' rotary coordinates coords (B, N - num_prefix, 2), float32,
    moved by the same plan (rope.moved_coords: the kept tokens keep theirs, the fused token sits at the weighted mean
    of what it holds, under either coords_merge) -> x (B, N - r, C), size (B, N - r, 1), log size (B, N - r, 1),
    coords (B, N - r - num_prefix, 2). backend: 'triton' (kernels.evit_prune with coords) or 'torch' (the plan)."""
    r = pruned_count(x.shape[1], num_prefix, r)
    if r == 0:
        return (*_unreduced(x, size), coords.clone())
    if backend == "triton":
        from . import triton_evit

        return _fresh(*triton_evit.evit_prune_with_coords(q, k, attn_bias, scale, x, size, r, num_prefix, coords))
    from ..ops.rope import moved_coords

    plan = attentive_pruning(class_attention(q, k, attn_bias, scale).mean(dim=1), r, num_prefix)
    pruned, pruned_size, _ = plan.apply(x, size, None)
    moved = moved_coords(plan, coords, size, num_prefix, coords_merge)
    return _fresh(pruned, pruned_size, pruned_size.log(), moved)


evit_prune_rope = torch.library.custom_op("timm_tokcomp::evit_prune_rope", _evit_prune_rope, mutates_args=())


@evit_prune_rope.register_fake
def _(q, k, attn_bias, scale, x, size, coords, r, num_prefix, coords_merge, backend):
    B, N, C = x.shape
    r = pruned_count(N, num_prefix, r)
    return (x.new_empty(B, N - r, C), x.new_empty(B, N - r, 1), x.new_empty(B, N - r, 1),
            coords.new_empty(B, coords.shape[1] - r, 2))


# Inductor launches the kernels itself where Triton compiles them (a GPU build, not the interpreter)
LAUNCHED_BY_INDUCTOR = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") != "1"
_LAUNCHED: Dict[str, Callable] = {}


def _register_launched(name: str, step: Callable) -> None:
    """step's 'triton' backend (its last argument) as the triton_op timm_tokcomp::<name>_launched, with step's
    signature less that argument (the schema torch infers from it)."""
    from .triton_common import launches_in_graph

    signature = inspect.signature(step)
    *args, backend = signature.parameters.values()
    if backend.name != "backend":
        raise AssertionError(f"{name}: the backend must be the last argument, got {backend.name}")

    def run(*args):
        with launches_in_graph():
            return step(*args, "triton")

    run.__signature__ = signature.replace(parameters=args)
    _LAUNCHED[name] = torch.library.triton_op(f"timm_tokcomp::{name}_launched", run, mutates_args=())


if LAUNCHED_BY_INDUCTOR:
    for _name, _step in (("tome_merge", _tome_merge), ("tome_merge_rope", _tome_merge_rope),
                         ("evit_prune", _evit_prune), ("evit_prune_rope", _evit_prune_rope)):
        _register_launched(_name, _step)


def compiled_step(name: str, *args, backend: str):
    """A compiled forward's step: timm_tokcomp::<name>(*args, backend), or, on the 'triton' backend where Inductor
    launches the kernels, its triton_op <name>_launched(*args)."""
    if backend == "triton" and name in _LAUNCHED:
        return _LAUNCHED[name](*args)
    return getattr(torch.ops.timm_tokcomp, name)(*args, backend)
