"""Triton helpers shared by the fused reduction kernels."""
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
