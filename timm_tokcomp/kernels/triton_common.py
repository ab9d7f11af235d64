"""Triton helpers shared by the fused reduction kernels, and how they launch inside a traced operator."""
import contextlib
import threading
from typing import Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def descending_rank(values_ptr, ii, imask, n, lane, BLOCK: tl.constexpr):
    """Rank of the values at ii among values[0:n] (fp32 stored as int32 bits), descending, ties to the lower index
    (the position a stable descending sort gives): (BLOCK,) int32. ii, lane: (BLOCK,) int32; imask: ii < n."""
    vi = tl.load(values_ptr + ii, mask=imask, other=0).to(tl.float32, bitcast=True)
    ahead = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, n, BLOCK):
        jj = j0 + lane
        jmask = jj < n
        vj = tl.load(values_ptr + jj, mask=jmask, other=0).to(tl.float32, bitcast=True)
        before = (vj[None, :] > vi[:, None]) | ((vj[None, :] == vi[:, None]) & (jj[None, :] < ii[:, None]))
        ahead += tl.sum((before & jmask[None, :]).to(tl.int32), axis=1)
    return ahead


@triton.jit
def store_size(SIZE_OUT, LOG_OUT, offset, total):
    """Store an output token's size total (fp32 scalar) at SIZE_OUT + offset in its dtype, and the log of that stored
    value at LOG_OUT + offset (the next block's proportional-attention bias, as torch's size.log() gives it)."""
    size = total.to(SIZE_OUT.dtype.element_ty)
    tl.store(SIZE_OUT + offset, size)
    tl.store(LOG_OUT + offset, tl.log(size.to(tl.float32)).to(LOG_OUT.dtype.element_ty))


def contiguous_empty(shape: Tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty(shape) with its strides given as products of the sizes: what each tensor a kernel writes is made
    with. Traced with symbolic sizes, torch.empty states a stride as a product of Max(1, size)s (a size may be 0),
    which Inductor's own layout of the buffer lacks; torch 2.11's Inductor then copies a launch's output into a buffer
    that reads itself and fails in its scheduler (KeyError; tests/tensors/lower_regions_for_cuda.py)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * size
    return torch.empty_strided(tuple(shape), tuple(reversed(strides)), dtype=dtype, device=device)


_IN_GRAPH = threading.local()


@contextlib.contextmanager
def launches_in_graph():
    """Within: the package's kernels launch through torch.library.wrap_triton (launched), so that a triton_op body
    traced by torch.compile records each launch in its graph and Inductor makes it from its generated code; run
    eagerly, the wrapper calls the kernel as it is."""
    prior = getattr(_IN_GRAPH, "on", False)
    _IN_GRAPH.on = True
    try:
        yield
    finally:
        _IN_GRAPH.on = prior


# A traced launch is functionalized: the tensors it writes are copied and the copies returned, so a launch never passes
# a tensor it writes as another argument too (a placeholder for an unused pointer is an input it only reads).
def launched(kernel):
    """A @triton.jit kernel as launches_in_graph wants it (its wrap_triton wrapper), or itself outside."""
    return torch.library.wrap_triton(kernel) if getattr(_IN_GRAPH, "on", False) else kernel
