"""The engine on timm's VisionTransformer: equivalence at r=0, token counts, features kept, refusals."""
import pytest
import timm
import torch
from timm.models.vision_transformer import Block, ResPostBlock, VisionTransformer

import timm_tokcomp
from timm_tokcomp.runtime.state import ReductionStats
from timm_tokcomp.measure.counting import count_macs
from conftest import SMALL, VARIANTS, make_model

N_PATCH = (SMALL["img_size"] // SMALL["patch_size"]) ** 2


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "manual"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("method", ["tome", "evit"])
def test_r0_is_bit_identical_to_timm(variant, fused, method, images):
    if method == "evit" and variant == "avgpool_noclass":
        pytest.skip("EViT needs a class token")
    model = make_model(variant, fused)
    with torch.no_grad():
        expected = model(images)
        timm_tokcomp.apply(model, method, r=0)
        got = model(images)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_remove_restores_plain_model(variant, images):
    model = make_model(variant)
    keys = list(model.state_dict())
    with torch.no_grad():
        expected = model(images)
        timm_tokcomp.apply(model, "tome", r=5)
        assert list(model.state_dict()) == keys
        reduced = model(images)
        timm_tokcomp.remove(model)
        got = model(images)
    assert not torch.equal(reduced, expected)
    assert torch.equal(got, expected)
    assert type(model) is type(make_model(variant))
    assert all(type(b) is Block for b in model.blocks)
    assert not timm_tokcomp.is_reduced(model)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("method", ["tome", "evit"])
def test_token_counts_follow_constant_r(variant, method, images):
    if method == "evit" and variant == "avgpool_noclass":
        pytest.skip("EViT needs a class token")
    model = timm_tokcomp.apply(make_model(variant), method, r=6)
    with torch.no_grad():
        model(images)
    stats = timm_tokcomp.last_stats(model)
    n0 = N_PATCH + model.num_prefix_tokens
    assert stats.tokens_per_block == [n0 - 6 * i for i in range(SMALL["depth"])]
    assert stats.tokens_out == n0 - 6 * SMALL["depth"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefix_tokens_never_reduced(variant, images):
    model = timm_tokcomp.apply(make_model(variant), "tome", r=20, trace_source=True)
    with torch.no_grad():
        model(images)
    stats = timm_tokcomp.last_stats(model)
    p = model.num_prefix_tokens
    eye = torch.eye(stats.source.shape[-1])[:p]
    assert torch.equal(stats.source[:, :p], eye.expand(len(images), -1, -1))
    assert torch.equal(stats.size[:, :p], torch.ones(len(images), p, 1))
    # every original patch is held by exactly one token, and sizes count them
    assert torch.equal(stats.source.sum(1), torch.ones(len(images), stats.source.shape[-1]))
    assert torch.equal(stats.size[..., 0], stats.source.sum(-1))


def test_r_is_clamped_never_an_error(images):
    model = timm_tokcomp.apply(make_model("distilled"), "tome", r=1000)
    with torch.no_grad():
        model(images)
    counts = timm_tokcomp.last_stats(model).tokens_per_block
    assert counts[0] == N_PATCH + 2 and counts[1] == 2 + N_PATCH // 2
    assert timm_tokcomp.last_stats(model).tokens_out >= 3


def test_schedules_per_block_list_and_inflection(images):
    model = timm_tokcomp.apply(make_model("cls"), "tome", r=[0, 10, 3, 1])
    with torch.no_grad():
        model(images)
    assert timm_tokcomp.last_stats(model).tokens_per_block == [65, 65, 55, 52]
    timm_tokcomp.set_params(model, r=(8, -1.0))  # decreasing: 16, 10, 5, 0
    with torch.no_grad():
        model(images)
    assert timm_tokcomp.last_stats(model).tokens_per_block == [65, 49, 39, 34]


@pytest.mark.parametrize("ratio", [1.6, 2.0])  # this 4-block model reaches at most about 2.04  # F/f >= 2: merges per block do not increase
def test_flops_ratio_schedule_reaches_target(ratio, images):
    model = make_model("cls")
    plain_macs = count_macs(model, images)
    timm_tokcomp.apply(model, "tome", flops_ratio=ratio)
    measured = plain_macs / count_macs(model, images)
    counts = timm_tokcomp.last_stats(model).tokens_per_block
    assert counts[0] > counts[-1]
    assert 0.95 * ratio < measured < 1.1 * ratio


def test_flops_ratio_out_of_reach_is_a_clear_error_at_apply():
    model = make_model("cls")
    with pytest.raises(ValueError, match="out of reach"):
        timm_tokcomp.apply(model, "tome", flops_ratio=5.0)  # 4 blocks, 64 patches: at most ~3.0
    assert not timm_tokcomp.is_reduced(model)
    timm_tokcomp.apply(model, "tome", flops_ratio=2.0)
    with pytest.raises(ValueError, match="out of reach"):
        timm_tokcomp.set_params(model, flops_ratio=5.0)
    assert timm_tokcomp.get_reducer(model).flops_ratio == 2.0


def test_set_params_matches_fresh_apply(images):
    model = timm_tokcomp.apply(make_model("cls"), "tome", r=2)
    timm_tokcomp.set_params(model, r=7)
    fresh = timm_tokcomp.apply(make_model("cls"), "tome", r=7)
    with torch.no_grad():
        assert torch.equal(model(images), fresh(images))
    assert timm_tokcomp.get_reducer(model).r == 7


def test_deterministic(images):
    model = timm_tokcomp.apply(make_model("registers"), "tome", r=9)
    with torch.no_grad():
        assert torch.equal(model(images), model(images))


def test_forward_features_direct_call(images):
    model = timm_tokcomp.apply(make_model("cls"), "tome", r=4)
    with torch.no_grad():
        feats = model.forward_features(images)
        assert feats.shape == (3, 65 - 16, SMALL["embed_dim"])
        assert torch.equal(model.forward_head(feats), model(images))


def test_avg_pool_is_size_weighted(images):
    model = timm_tokcomp.apply(make_model("avgpool_noclass"), "tome", r=7)
    assert model._tokcomp.prop_attn is False  # MAE-style default
    with torch.no_grad():
        feats = model.forward_features(images)
        size = timm_tokcomp.last_stats(model).size
        expected = (feats * size).sum(1) / size.sum(1)
        assert torch.allclose(model.pool(feats), expected)
        assert not torch.allclose(expected, feats.mean(1))


def test_max_pools_never_take_a_padding_token():
    """Tokens of size 0 (the padding of ATS / LTMP, whose rows are copies of other tokens, and of a NaFlex batch)
    are never the maximum of 'max' / 'avgmax', whatever their values; 'avg' weighs them 0."""
    model = timm_tokcomp.apply(make_model("avgpool_noclass"), "tome", r=4)
    torch.manual_seed(0)
    feats = torch.randn(2, 5, SMALL["embed_dim"])
    size = torch.tensor([[2.0, 1.0, 3.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 2.0]]).unsqueeze(-1)
    feats[0, 3:] = 10.0  # padding holding the largest values
    model._register_features(feats, ReductionStats(size=size))
    real = feats[:, :3].amax(dim=1)
    real[1] = feats[1].amax(dim=0)
    mean = (feats * size).sum(1) / size.sum(1)
    assert torch.equal(model.pool(feats, "max"), real)
    torch.testing.assert_close(model.pool(feats, "avgmax"), 0.5 * (real + mean))
    torch.testing.assert_close(model.pool(feats, "avg"), mean)


def test_backward_through_merges_and_grad_checkpointing(images):
    model = timm_tokcomp.apply(make_model("layerscale_qknorm"), "tome", r=6).train()
    grads = []
    for ckpt in (False, True):
        model.set_grad_checkpointing(ckpt)
        model.zero_grad()
        model(images).logsumexp(-1).sum().backward()
        g = model.blocks[0].attn.qkv.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        grads.append(g.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("method", ["tome", "evit"])
def test_autocast(method, dtype, images):
    model = timm_tokcomp.apply(make_model("cls"), method, r=5, prop_attn=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        out = model(images)
    assert torch.isfinite(out.float()).all()
    assert timm_tokcomp.last_stats(model).tokens_out == 65 - 20


def test_patched_block_refuses_direct_calls(images):
    model = timm_tokcomp.apply(make_model("cls"), "tome", r=2)
    with pytest.raises(RuntimeError, match="forward_features"):
        model.blocks[0](torch.randn(1, 65, SMALL["embed_dim"]))
    with pytest.raises(ValueError, match="attn_mask"):
        model.forward_features(images, attn_mask=torch.zeros(65, 65))


def test_unsupported_models_refused_and_left_untouched(images):
    respost = VisionTransformer(block_fn=ResPostBlock, **SMALL)
    with pytest.raises(TypeError, match="ResPostBlock"):
        timm_tokcomp.apply(respost, "tome", r=2)
    assert type(respost) is VisionTransformer and not timm_tokcomp.is_reduced(respost)
    with pytest.raises(TypeError, match="features_only"):
        timm_tokcomp.apply(timm.create_model("deit_tiny_patch16_224", features_only=True), "tome", r=2)
    with pytest.raises(TypeError, match="ResNet"):
        timm_tokcomp.apply(timm.create_model("resnet18"), "tome", r=2)
    gemma4 = timm.create_model("gemma4_vit_167m_enc", depth=1)
    with pytest.raises(TypeError, match=r"Gemma4VitEncoder is Gemma 4's vision encoder.*Gemma4VisionPooler.*k\^2"):
        timm_tokcomp.apply(gemma4, "tome", r=2)
    assert not timm_tokcomp.is_reduced(gemma4)
    with pytest.raises(ValueError, match="class token"):
        timm_tokcomp.apply(make_model("avgpool_noclass"), "evit", r=2)


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(r=-1), "r must be an integer >= 0"),
        (dict(r="8"), "r must be an int"),
        (dict(r=[1, 2]), r"per-block list needs one entry per block \(4\)"),
        (dict(r=(8, 2.0)), r"inflection must be in \[-1, 1\]"),
        (dict(flops_ratio=0.5), "flops_ratio must be a finite number > 1"),
        (dict(r=4, flops_ratio=2.0), "give one of r, flops_ratio, keep_rate"),
        (dict(prop_attn="yes"), "prop_attn must be True, False, None"),
    ],
)
def test_bad_parameters_raise_clear_errors(params, match):
    model = make_model("cls")
    with pytest.raises(ValueError, match=match):
        timm_tokcomp.apply(model, "tome", **params)
    assert not timm_tokcomp.is_reduced(model)


def test_bad_method_and_unknown_parameter():
    with pytest.raises(ValueError, match="method must be one of"):
        timm_tokcomp.apply(make_model("cls"), "tomee", r=2)
    with pytest.raises(TypeError, match="unknown parameter"):
        timm_tokcomp.apply(make_model("cls"), "tome", ratio=2)
    with pytest.raises(ValueError, match="not patched"):
        timm_tokcomp.set_params(make_model("cls"), r=2)


def test_remove_on_a_plain_model_returns_it_unchanged():
    model = make_model("cls")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert timm_tokcomp.remove(model) is model and type(model).__name__ == "VisionTransformer"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
