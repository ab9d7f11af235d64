"""Dense variant: Triton kernels against the torch reference (in Triton's CPU interpreter), the dense
block against plain timm and an independent computation, shapes, backends, and the paper's GMACs."""
import pytest
import timm
import torch

import timm_tokcomp
from timm_tokcomp.ops import dense_merge as ops
from timm_tokcomp.plans.merge import group_index
from timm_tokcomp.kernels import resolve_backend, triton_dense
from timm_tokcomp.ops.matching import bipartite_soft_matching
from timm_tokcomp.measure.counting import MacCounter
from conftest import SMALL, VARIANTS, make_model


def _groups(batch, tokens, num_prefix, k, seed=0, one_destination=False):
    """A group index from a real bipartite plan; one_destination: every source merges into one B token."""
    g = torch.Generator().manual_seed(seed)
    metric = torch.randn(batch, tokens, 8, generator=g)
    if one_destination:  # A tokens near v, the first B token exactly v, the other B tokens random
        a_start, v = num_prefix % 2, torch.randn(8, generator=g)
        rest = metric[:, num_prefix:]
        rest[:, a_start::2] = v + 0.01 * rest[:, a_start::2]
        rest[:, 1 - a_start] = v
    plan = bipartite_soft_matching(metric, k, num_prefix)
    return group_index(plan, tokens)


def _layer_norm(channels, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    ln = torch.nn.LayerNorm(channels, eps=1e-6).to(dtype)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(channels, generator=g))
        ln.bias.copy_(torch.randn(channels, generator=g))
    return ln


CASES = [  # (batch, tokens, prefix, k, one_destination)
    (1, 9, 1, 3, False),
    (3, 37, 1, 11, False),  # odd token count, batch > 1
    (2, 40, 2, 0, False),  # k = 0: every group is one token
    (2, 41, 1, 20, False),  # the maximum k
    (2, 33, 0, 16, True),  # many sources into one destination
]


@pytest.mark.parametrize("batch, tokens, num_prefix, k, one_dst", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_kernel_matches_reference(batch, tokens, num_prefix, k, one_dst, dtype):
    group, num_groups = _groups(batch, tokens, num_prefix, k, one_destination=one_dst)
    assert num_groups == tokens - k
    if one_dst:
        assert torch.bincount(group[0]).max() > 10
    channels = 24
    x = torch.randn(batch, channels, tokens).to(dtype).transpose(1, 2)  # non-contiguous input
    ln = _layer_norm(channels, dtype)
    expected = ops.group_mean(ln(x), group, num_groups)
    got = triton_dense.merge(x, group, num_groups, ln.weight, ln.bias, ln.eps)
    plain = triton_dense.merge(x, group, num_groups)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
        torch.testing.assert_close(plain, ops.group_mean(x, group, num_groups), rtol=0, atol=1e-6)
    else:  # the reference rounds LayerNorm's output to fp16 before averaging, the kernel does not
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=4e-3)
        torch.testing.assert_close(plain, ops.group_mean(x, group, num_groups), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("batch, tokens, num_prefix, k, one_dst", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layerscale", [True, False])
def test_unmerge_add_kernel_matches_reference(batch, tokens, num_prefix, k, one_dst, dtype, layerscale):
    group, num_groups = _groups(batch, tokens, num_prefix, k, one_destination=one_dst)
    x = torch.randn(batch, tokens, 20).to(dtype)
    y = torch.randn(batch, 20, num_groups).to(dtype).transpose(1, 2)  # non-contiguous
    gamma = torch.randn(20).to(dtype) if layerscale else None
    expected = ops.unmerge_add(x.float(), y.float(), group, None if gamma is None else gamma.float())
    got = triton_dense.unmerge_add(x, y, group, gamma)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    else:  # one fp16 rounding of the fp32 result
        torch.testing.assert_close(got.float(), expected.half().float(), rtol=0, atol=0)


def test_merge_kernel_is_deterministic():
    group, num_groups = _groups(2, 65, 1, 30, one_destination=True)
    x = torch.randn(2, 65, 32)
    first = triton_dense.merge(x, group, num_groups)
    assert all(torch.equal(first, triton_dense.merge(x, group, num_groups)) for _ in range(3))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dense_r0_is_bit_identical_and_shapes_are_kept(variant, images):
    model = make_model(variant)
    with torch.no_grad():
        expected = model(images)
        expected_features = model.forward_features(images)
        timm_tokcomp.apply(model, "dense_tome", r=0)
        assert torch.equal(model(images), expected)
        timm_tokcomp.set_params(model, k=12)
        assert model.forward_features(images).shape == expected_features.shape
        assert not torch.equal(model(images), expected)


def _dense_block_by_hand(blk, x, k, num_prefix):
    """One dense block computed from timm's modules and an explicit python loop over the groups."""
    attn = blk.attn
    B, N, C = x.shape
    h = blk.norm1(x)
    qkv = attn.qkv(h).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    keys = attn.k_norm(qkv[1])
    x = x + blk.ls1(blk.attn(h))
    group, num_groups = group_index(bipartite_soft_matching(keys.mean(dim=1), k, num_prefix), N)
    normed = blk.norm2(x)
    out = x.clone()
    for b in range(B):
        for m in range(num_groups):
            members = (group[b] == m).nonzero().flatten()
            branch = blk.ls2(blk.mlp(normed[b, members].mean(dim=0)))
            out[b, members] = x[b, members] + branch
    return out


@pytest.mark.parametrize("variant", ["cls", "registers", "layerscale_qknorm"])
def test_dense_block_equals_an_independent_computation(variant):
    model = make_model(variant)
    torch.manual_seed(5)
    x = torch.randn(2, 65 + model.num_prefix_tokens, SMALL["embed_dim"])
    with torch.no_grad():
        expected = _dense_block_by_hand(model.blocks[0], x, 20, model.num_prefix_tokens)
        timm_tokcomp.apply(model, "dense_tome", k=20)
        got = model.blocks[0](x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_triton_and_torch_paths_give_the_same_model_output(images):
    model = timm_tokcomp.apply(make_model("layerscale_qknorm"), "dense_tome", k=16, kernel="torch")
    with torch.no_grad():
        expected = model(images)
        timm_tokcomp.set_params(model, kernel="triton")
        got = model(images)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_intermediates_and_other_input_sizes():
    model = timm.create_model("vit_small_patch16_224", dynamic_img_size=True, depth=3, num_classes=5).eval()
    timm_tokcomp.apply(model, "dense_tome", r=2)  # 64 merges per block
    with torch.no_grad():
        for size in ((224, 224), (160, 288)):
            x = torch.randn(2, 3, *size)
            final, inter = model.forward_intermediates(x, indices=2)
            assert [t.shape for t in inter] == [(2, 384, size[0] // 16, size[1] // 16)] * 2
            assert model(x).shape == (2, 5)


def test_backend_choice_and_errors(monkeypatch):
    x = torch.randn(2, 3)
    assert resolve_backend("auto", x) == "torch"
    assert resolve_backend("auto", x.requires_grad_()) == "torch"
    with pytest.raises(ValueError, match="inference-only"):
        resolve_backend("triton", x)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_backend("triton", torch.randn(2))
    with pytest.raises(ValueError, match="kernel must be one of"):
        timm_tokcomp.apply(make_model("cls"), "dense_tome", r=1, kernel="cuda")
    with pytest.raises(ValueError, match="r must be an integer >= 0"):
        timm_tokcomp.apply(make_model("cls"), "dense_tome", r=-1)


def test_dense_trains_through_the_torch_path(images):
    model = timm_tokcomp.apply(make_model("cls").train(), "dense_tome", k=10)
    model(images).sum().backward()
    assert model.blocks[0].mlp.fc1.weight.grad is not None


def test_dense_names_in_timm():
    model = timm.create_model("deit_small.dense_tome_r8")
    assert timm_tokcomp.get_reducer(model).merges == 256


@pytest.mark.parametrize("r, paper", [(0, 106.2), (8, 91.8), (12, 84.5), (16, 77.3)])
def test_encoder_gmacs_reproduce_the_paper_table_11(r, paper):
    """DeiT-B/16-384 at 512x512 (N = 1025), transformer blocks only (matching included), counted on the
    meta device from the ops the blocks run."""
    with torch.device("meta"):
        model = timm.create_model("deit_base_patch16_384", img_size=512)
    timm_tokcomp.apply(model, "dense_tome", r=r)
    with MacCounter() as counter, torch.no_grad():
        model.forward_features(torch.empty(1, 3, 512, 512, device="meta"))
    block_gmacs = counter.by_module["Sequential"] / 1e9
    assert block_gmacs == pytest.approx(paper, abs=0.5)
