"""The custom operators' fake implementations agree with the operators for every shape the reducing loop can make:
torch.library.opcheck (fake tensors, schema, autograd registration) over small token counts, both prefix counts, r up
to and past what the step allows, and batches of one and two, on the torch plan and the Triton kernels. A fake that
disagrees with the kernel is what Inductor trips on."""
import itertools

import pytest
import torch

import timm_tokcomp.kernels.library  # noqa: F401 (registers torch.ops.timm_tokcomp)
from timm_tokcomp.kernels.library import merged_count, pruned_count

pytestmark = [pytest.mark.slow]  # torch.library.opcheck over many shapes

SHAPES = [(b, n, p, r) for b, n, p, r in itertools.product((1, 2), range(1, 6), (0, 1), (1, 3)) if n > p]
# the fake-tensor check over the range (the schema and autograd checks do not depend on the shape: the operators'
# other opcheck tests run them)
FAKE = ("test_faketensor",)


def _tensors(b, n, seed=0, channels=4, heads=2):
    g = torch.Generator().manual_seed(seed)
    return {"metric": torch.randn(b, n, 3, generator=g), "x": torch.randn(b, n, channels, generator=g),
            "size": torch.rand(b, n, 1, generator=g) + 0.5, "q": torch.randn(b, heads, n, 4, generator=g),
            "k": torch.randn(b, heads, n, 4, generator=g), "bias": torch.rand(b, 1, 1, n, generator=g).log()}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tome_operators_fake_shapes_match_for_every_small_shape(backend):
    for b, n, p, r in SHAPES:
        t = _tensors(b, n)
        coords = torch.rand(b, n - p, 2) * 4
        for metric, size in ((t["metric"], t["size"]), (t["metric"], None), (t["k"], t["size"])):  # k: ToMe's keys
            torch.library.opcheck(torch.ops.timm_tokcomp.tome_merge, (metric, t["x"], size, r, p, backend),
                                  test_utils=FAKE)
        for metric, coords_merge in ((t["metric"], "dst"), (t["metric"], "centroid"), (t["k"], "dst")):
            torch.library.opcheck(torch.ops.timm_tokcomp.tome_merge_rope,
                                  (metric, t["x"], t["size"], coords, r, p, coords_merge, backend),
                                  test_utils=FAKE)
        out, size, log_size = torch.ops.timm_tokcomp.tome_merge(t["metric"], t["x"], None, r, p, backend)
        assert out.shape[1] == n - merged_count(n, p, r)
        torch.testing.assert_close(log_size, size.log())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_evit_operators_fake_shapes_match_for_every_small_shape(backend):
    for b, n, p, r in SHAPES:
        if p == 0:  # EViT ranks by the class token's attention: a class token always leads
            continue
        t = _tensors(b, n)
        for bias, size in ((t["bias"], t["size"]), (None, None)):
            torch.library.opcheck(torch.ops.timm_tokcomp.evit_prune,
                                  (t["q"], t["k"], bias, 0.5, t["x"], size, r, p, backend), test_utils=FAKE)
        coords = torch.rand(b, n - p, 2) * 4
        for coords_merge in ("dst", "centroid"):
            torch.library.opcheck(torch.ops.timm_tokcomp.evit_prune_rope,
                                  (t["q"], t["k"], t["bias"], 0.5, t["x"], t["size"], coords, r, p, coords_merge,
                                   backend), test_utils=FAKE)
        out, size, log_size = torch.ops.timm_tokcomp.evit_prune(t["q"], t["k"], None, 0.5, t["x"], None, r, p,
                                                                backend)
        assert out.shape[1] == n - pruned_count(n, p, r)
        torch.testing.assert_close(log_size, size.log())


def test_operators_in_bf16_return_the_sizes_and_their_log_in_the_tokens_dtype():
    """bf16 (the GPU's autocast dtype; the torch plan here, the interpreter has no bf16): every operator's fake
    agrees with it over the small shapes, and its sizes and their log come back in the tokens' dtype."""
    for b, n, p, r in SHAPES:
        if p == 0:
            continue
        t = {k: v.to(torch.bfloat16) for k, v in _tensors(b, n).items()}
        coords = torch.rand(b, n - p, 2) * 4
        ops = torch.ops.timm_tokcomp
        for op, args in ((ops.tome_merge, (t["k"], t["x"], t["size"], r, p, "torch")),
                         (ops.tome_merge_rope, (t["k"], t["x"], t["size"], coords, r, p, "dst", "torch")),
                         (ops.evit_prune, (t["q"], t["k"], t["bias"], 0.5, t["x"], t["size"], r, p, "torch")),
                         (ops.evit_prune_rope, (t["q"], t["k"], t["bias"], 0.5, t["x"], t["size"], coords, r, p,
                                                "dst", "torch"))):
            torch.library.opcheck(op, args, test_utils=FAKE)
            _, size, log_size = op(*args)[:3]
            assert size.dtype == log_size.dtype == torch.bfloat16
            torch.testing.assert_close(log_size, size.log(), rtol=0, atol=0)
