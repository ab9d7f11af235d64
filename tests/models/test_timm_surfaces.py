"""Registered names behave as timm models wherever timm users reach them: cfg lookup by name, forward at the
cfg's input size, backward with a new head, features_only backbones, forward_intermediates on the full patch
grid, forward_head(pre_logits=True), and TorchScript / FX refused with a message naming what works."""
import copy

import pytest
import timm
import torch

import timm_tokcomp
from timm_tokcomp.ops.matching import bipartite_soft_matching
from timm_tokcomp.methods import listed_tags

pytestmark = [pytest.mark.slow]  # every timm surface on real architectures

LISTED_TAGS = listed_tags()

# one plain, one distilled, one with register tokens (and a class token: 5 prefix tokens)
ARCHS = ("deit_tiny_patch16_224", "deit_tiny_distilled_patch16_224", "vit_small_patch14_reg4_dinov2")
CASES = [(arch, tag) for arch in ARCHS for tag in LISTED_TAGS + ("dense_tome_r8",)]
# DINOv2 at its cfg's 518 px (1,374 tokens) with 4 of its 12 blocks: the model checks read blocks 1 and 3 at most
DEPTH = {"vit_small_patch14_reg4_dinov2": {"depth": 4}}


def _build(name, **kwargs):
    torch.manual_seed(0)
    return timm.create_model(name, **kwargs)


def _input(name, batch=2):
    return torch.randn(batch, *timm.get_pretrained_cfg_value(name, "input_size"))


@pytest.mark.parametrize("arch, tag", CASES)
def test_timm_model_checks(arch, tag):
    name = f"{arch}.{tag}"
    # cfg lookup by name agrees with the base model's and with create_model
    assert timm.get_pretrained_cfg_value(name, "input_size") == timm.get_pretrained_cfg_value(arch, "input_size")
    assert timm.get_pretrained_cfg(name).mean == timm.get_pretrained_cfg(arch).mean
    assert timm.is_model_pretrained(name) == timm.is_model_pretrained(arch)
    x = _input(name, batch=1)
    model = _build(name, num_classes=42, **DEPTH.get(arch, {})).train()
    assert timm_tokcomp.is_reduced(model)
    model(x).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient reaches {missing}"

    model.eval()
    with torch.no_grad():
        assert model(x).shape == (1, 42)
        assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (1, model.embed_dim)
        grid = model.patch_embed.dynamic_feat_size(x.shape[-2:])
        last, inter = model.forward_intermediates(x, indices=[1, 3], output_fmt="NCHW")
        assert [t.shape for t in inter] == [(1, model.embed_dim, *grid)] * 2
        assert last.shape[0] == 1 and last.shape[2] == model.embed_dim
        nlc = model.forward_intermediates(x, indices=2, output_fmt="NLC", intermediates_only=True,
                                          return_prefix_tokens=True)
        assert [(s.shape, p.shape) for s, p in nlc] == [
            ((1, grid[0] * grid[1], model.embed_dim), (1, model.num_prefix_tokens, model.embed_dim))] * 2

    backbone = _build(name, features_only=True, out_indices=(1, 3), **DEPTH.get(arch, {})).eval()
    with torch.no_grad():
        features = backbone(x)
    info = backbone.feature_info
    assert [f.shape[1] for f in features] == info.channels()
    assert [x.shape[-1] // f.shape[-1] for f in features] == info.reduction()

    with pytest.raises(RuntimeError, match="TorchScript is not supported.*torch.compile"):
        torch.jit.script(model)
    with pytest.raises(RuntimeError, match="fx symbolic tracing is not supported.*torch.export"):
        torch.fx.symbolic_trace(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_intermediates_at_r0_equal_the_unpatched_model_bit_for_bit(arch):
    base = _build(arch).eval()
    model = timm_tokcomp.apply(copy.deepcopy(base), "tome", r=0)
    x = _input(arch)
    with torch.no_grad():
        for kwargs in (dict(indices=[0, 5, 11], norm=True), dict(indices=2, output_fmt="NLC", return_prefix_tokens=True),
                       dict(indices=[4], stop_early=True, intermediates_only=True)):
            want, got = base.forward_intermediates(x, **kwargs), model.forward_intermediates(x, **kwargs)
            if not kwargs.get("intermediates_only"):
                assert torch.equal(want[0], got[0])
                want, got = want[1], got[1]
            for w, g in zip(want, got):
                w, g = (w, g) if isinstance(w, torch.Tensor) else (torch.cat([w[0], w[1]], 1), torch.cat([g[0], g[1]], 1))
                assert torch.equal(w, g)
        want = base.forward_intermediates(x, indices=[3], output_dict=True)
        got = model.forward_intermediates(x, indices=[3], output_dict=True)
        assert want.keys() == got.keys() and torch.equal(want["image_features"], got["image_features"])


def test_intermediates_put_a_merged_tokens_features_at_every_patch_it_holds():
    """One merge in block 0, computed by hand from timm's own block pieces."""
    torch.manual_seed(0)
    base = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2,
                                                            num_heads=3, num_classes=0).eval()
    model = timm_tokcomp.apply(copy.deepcopy(base), "tome", r=[1, 0], prop_attn=False)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        got = model.forward_intermediates(x, indices=[0], output_fmt="NLC", intermediates_only=True)[0][0]
        blk = base.blocks[0]
        h = base.norm_pre(base._pos_embed(base.patch_embed(x)))  # (1, 17, 48): class token + 16 patches
        y = blk.norm1(h)
        k = blk.attn.qkv(y).reshape(1, 17, 3, 3, 16).permute(2, 0, 3, 1, 4)[1]
        h = h + blk.attn(y)
        plan = bipartite_soft_matching(k.mean(dim=1), 1, num_prefix=1)
        src = 1 + 2 * plan.src_idx.item() + 1  # A: even non-prefix positions (the class token is position 0)
        dst = 1 + 2 * plan.dst_idx.item()      # B: odd ones
        merged = (h[:, src] + h[:, dst]) / 2
        h[:, src] = merged
        h[:, dst] = merged
        want = (h + blk.mlp(blk.norm2(h)))[0, 1:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[src - 1], got[dst - 1])


def test_features_only_keeps_the_full_models_schedule_after_pruning():
    """timm prunes the blocks after the last out_index; ATM's depth-dependent thresholds must not move."""
    x = _input("deit_tiny_patch16_224")
    full = _build("deit_tiny_patch16_224.atm").eval()
    backbone = _build("deit_tiny_patch16_224.atm", features_only=True, out_indices=(2, 7)).eval()
    assert len(backbone.model.blocks) == 8
    with torch.no_grad():
        want = full.forward_intermediates(x, indices=[2, 7], intermediates_only=True)
        got = backbone(x)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert timm_tokcomp.last_stats(backbone.model).tokens_per_block == \
        timm_tokcomp.last_stats(full).tokens_per_block[:8]


def test_features_only_with_hook_feature_classes_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="feature_cls='getter'"):
        timm.create_model("deit_tiny_patch16_224.tome_r8", features_only=True, feature_cls="hook")


def test_intermediates_errors_name_the_argument():
    model = timm.create_model("deit_tiny_patch16_224.tome_r8")
    with pytest.raises(ValueError, match="output_fmt"):
        model.forward_intermediates(torch.randn(1, 3, 224, 224), output_fmt="NHWC")
    with pytest.raises(ValueError, match="attn_mask"):
        model.forward_intermediates(torch.randn(1, 3, 224, 224), attn_mask=torch.ones(1, 1, 197, 197))


def test_intermediates_of_a_dropping_pruner_are_zero_where_patches_were_dropped():
    model = _build("deit_tiny_patch16_224.topk_k50").eval()
    with torch.no_grad():
        before, after = model.forward_intermediates(_input("deit_tiny_patch16_224", 1), indices=[1, 3],
                                                    output_fmt="NLC", intermediates_only=True)
    assert (before.abs().sum(-1) > 0).all()  # block 2: nothing dropped yet
    assert int((after.abs().sum(-1) > 0).sum()) == 98  # after block 3 the first stage keeps 98 of 196


@pytest.mark.parametrize("method, params", [("atm", {}), ("tome", {"r": 8, "prefix_only_last_block": True}),
                                            ("tome", {"r": 8}), ("evit", {"r": 8})])
def test_final_features_of_forward_intermediates_are_forward_features(method, params):
    """Whatever the last block keeps (only the class token for ATM's default), forward_intermediates' final
    features are forward_features' tokens, and the head gives the same logits on both."""
    torch.manual_seed(0)
    model = timm_tokcomp.apply(timm.create_model("deit_tiny_patch16_224").eval(), method, **params)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        features = model.forward_features(x)
        final, _ = model.forward_intermediates(x, indices=[3, 11])
        assert final.shape == features.shape
        torch.testing.assert_close(final, features, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.forward_head(final), model.forward_head(features), rtol=1e-4, atol=1e-5)
