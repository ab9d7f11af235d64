"""timm's SAM encoders (VisionTransformerSAM, samvit_*): windowed and global blocks with relative positions, the
(B, H, W, C) grid and the neck. Small random-weight versions of samvit_base's layout (14 x 14 windows, global blocks
between them); the unreduced model checked bit for bit at SAM's own 1024 px."""
import copy

import pytest
import timm
import torch
from timm.models.vision_transformer_sam import VisionTransformerSAM

import timm_tokcomp
from timm_tokcomp.measure.counting import count_macs
from timm_tokcomp.methods.cubist import CubistSetting, grid_merge
from timm_tokcomp.plans import gather_tokens
from conftest import check_edges

SMALL = dict(embed_dim=32, depth=4, num_heads=2, global_attn_indexes=(1, 3), neck_chans=16, num_classes=10)


def sam(img_size: int = 224, seed: int = 0, **overrides) -> VisionTransformerSAM:
    torch.manual_seed(seed)
    model = timm.create_model("samvit_base_patch16", img_size=img_size, **{**SMALL, **overrides}).eval()
    with torch.no_grad():  # timm starts the relative-position tables at zero: give them values to get wrong
        for name, p in model.named_parameters():
            if "rel_pos" in name:
                p.normal_(std=0.5)
    return model


def images(n: int = 2, size: int = 224, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(n, 3, size, size)


def reference(model: VisionTransformerSAM, x: torch.Tensor, setting: CubistSetting, layer: int) -> torch.Tensor:
    """CubistMerge on SAM written over timm's own blocks: blocks before `layer` on the full grid, the grid merge,
    the rest of timm's blocks on the smaller (B, H', W', C) grid (windows and relative positions as timm makes them),
    every patch given its cell, the neck."""
    t = model.patch_embed(x) + model.pos_embed
    for blk in model.blocks[:layer]:
        t = blk(t)
    B, H, W, C = t.shape
    plan = grid_merge(t.reshape(B, H * W, C), setting, 0)
    merged, _, _ = plan.apply(t.reshape(B, H * W, C), None, None)
    t = merged.reshape(B, *plan.shape, C)
    for blk in model.blocks[layer:]:
        t = blk(t)
    full = gather_tokens(t.reshape(B, -1, C), plan.group).reshape(B, H, W, C)
    return model.neck(full.permute(0, 3, 1, 2))


def test_nothing_reduced_is_timms_model_bit_for_bit_at_1024_px():
    plain = sam(1024, depth=2, global_attn_indexes=(1,))
    x = images(1, 1024)
    with torch.no_grad():
        features, logits = plain.forward_features(x), plain(x)
        inter = plain.forward_intermediates(x, indices=2)
        for method, params in (("cubist", dict(r_rows=0, r_cols=0)), ("dense_tome", dict(r=0))):
            model = timm_tokcomp.apply(copy.deepcopy(plain), method, **params)
            assert torch.equal(model.forward_features(x), features), method
            assert torch.equal(model(x), logits), method
            got = model.forward_intermediates(x, indices=2)
            assert torch.equal(got[0], inter[0]) and all(torch.equal(a, b) for a, b in zip(got[1], inter[1]))
            assert torch.equal(timm_tokcomp.remove(model)(x), logits)


@pytest.mark.parametrize("r_rows,r_cols,layer", [(2, 3, 1), (4, 4, 2), (1, 0, 3)])
def test_cubist_equals_timms_blocks_on_the_merged_grid(r_rows, r_cols, layer):
    plain = sam(256)  # 16 x 16 patches: 14 x 14 windows with padding, global blocks between
    x = images(2, 256)
    model = timm_tokcomp.apply(copy.deepcopy(plain), "cubist", r_rows=r_rows, r_cols=r_cols, layer=layer)
    with torch.no_grad():
        got = model.forward_features(x)
        expected = reference(plain, x, CubistSetting(16, 16, r_rows, r_cols), layer)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(x), plain.forward_head(expected), atol=1e-5, rtol=1e-5)
    stats = timm_tokcomp.last_stats(model)
    merged = (16 - r_rows) * (16 - r_cols)
    assert stats.tokens_per_block == [256] * layer + [merged] * (4 - layer)
    assert (stats.positions.height, stats.positions.width) == (16 - r_rows, 16 - r_cols)
    assert stats.size.sum(dim=1).eq(256).all()


def test_a_grid_shrunk_to_whole_windows_cuts_fewer_windows():
    """64 x 64 patches pad to 5 x 5 windows of 14; merged to 56 x 56 they fill 4 x 4 exactly: the windowed blocks run
    16 windows, not 25 (counted from the run)."""
    plain = sam(1024, depth=2, global_attn_indexes=())
    model = timm_tokcomp.apply(copy.deepcopy(plain), "cubist", r_rows=8, r_cols=8, layer=1)
    x = images(1, 1024)
    seen, attn = [], model.blocks[1].attn
    run = attn.forward_reduce
    attn.forward_reduce = lambda h, *args: seen.append(h.shape) or run(h, *args)
    with torch.no_grad():
        plain_macs, macs = count_macs(plain, x), count_macs(model, x)
        model(x)
    assert seen[-1][:3] == (16, 14, 14)
    assert macs < 0.9 * plain_macs  # one of two blocks on 3136 tokens in 16 windows; the embedding and neck as they were


def test_methods_that_break_the_grid_are_refused_by_name():
    plain = sam()
    for method, params in (("tome", dict(r=8)), ("evit", dict(keep_rate=0.7)), ("topk", dict(keep_rate=0.7))):
        with pytest.raises(ValueError, match=f"{method} does not keep the patch tokens a complete grid.*use cubist"):
            timm_tokcomp.apply(plain, method, **params)
        assert type(plain) is VisionTransformerSAM  # untouched
    with pytest.raises(ValueError, match="tome does not keep the patch tokens a complete grid"):
        timm.create_model("samvit_base_patch16.tome_r8", img_size=224, **SMALL)
    assert not [n for n in timm.list_models("samvit*", pretrained=True) if "tome" in n]


def test_rotary_sam_and_patch_dropout_in_training_are_refused():
    with pytest.raises(TypeError, match="rotary positions"):
        timm.create_model("samvit_base_patch16.cubist_r2", img_size=224, **{**SMALL, "use_rel_pos": False},
                          use_rope=True)
    model = timm_tokcomp.apply(sam(patch_drop_rate=0.5), "cubist", r_rows=2, r_cols=2)
    with pytest.raises(ValueError, match="patch_drop_rate=0"):
        model.train()(images())
    model.eval()(images())  # evaluation keeps every patch


def test_registered_names_forward_intermediates_and_features_only():
    model = timm.create_model("samvit_base_patch16.cubist_r2", img_size=224, **SMALL).eval()
    assert isinstance(timm_tokcomp.get_reducer(model), timm_tokcomp.METHODS["cubist"])
    x = images()
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, indices=[0, 2], norm=True)
        assert final.shape == (2, 16, 14, 14) and [t.shape for t in inter] == [(2, 16, 14, 14)] * 2
        assert torch.equal(final, model.forward_features(x))
        only = model.forward_intermediates(x, indices=[3], intermediates_only=True)
        assert [t.shape for t in only] == [(2, 32, 14, 14)]
        with pytest.raises(ValueError, match="output_fmt must be 'NCHW'"):
            model.forward_intermediates(x, output_fmt="NLC")
    features = timm.create_model("samvit_base_patch16.cubist_r2", img_size=224, features_only=True,
                                 out_indices=(1, 3), **SMALL).eval()
    with torch.no_grad():
        maps = features(x)
    assert [m.shape for m in maps] == [(2, 32, 14, 14)] * 2
    assert not torch.equal(maps[1], timm_tokcomp.remove(features.model).forward_intermediates(
        x, indices=[3], intermediates_only=True)[0])  # the last map was reduced (merged cells)


@pytest.mark.parametrize("method,params", [("cubist", dict(r_rows=2, r_cols=2)),
                                           ("cubist", dict(r_rows=2, r_cols=2, prop_attn=True)),
                                           ("dense_tome", dict(r=2))])
def test_batch_is_its_images_and_edge_sizes(method, params):
    model = timm_tokcomp.apply(sam(), method, **params)
    x = images(3)
    out = check_edges(model, x, (0, 10), bf16_within=0.5)
    with torch.no_grad():
        assert torch.isfinite(out).all()
        for i in range(3):
            torch.testing.assert_close(model(x[i:i + 1]), out[i:i + 1], atol=1e-5, rtol=1e-5)
        one = sam(16)  # one patch: nothing to merge
        assert torch.equal(timm_tokcomp.apply(copy.deepcopy(one), method, **params)(images(2, 16)),
                           one(images(2, 16)))


def test_proportional_attention_adds_log_sizes_to_the_relative_position_bias():
    """With prop_attn the merged cells weigh by their sizes; windows pad with size 1 (timm attends its padding)."""
    plain = sam(256)
    x = images(2, 256)
    on = timm_tokcomp.apply(copy.deepcopy(plain), "cubist", r_rows=3, r_cols=3, prop_attn=True)
    off = timm_tokcomp.apply(copy.deepcopy(plain), "cubist", r_rows=3, r_cols=3)
    with torch.no_grad():
        a, b = on(x), off(x)
    assert not torch.allclose(a, b)
    sizes = timm_tokcomp.last_stats(off).size
    with torch.no_grad():  # sizes all 1 (nothing merged) add nothing: the bias is exactly the relative one
        ones = timm_tokcomp.apply(copy.deepcopy(plain), "cubist", r_rows=0, r_cols=0, prop_attn=True)
        assert torch.equal(ones(x), plain(x))
    assert sizes.max() > 1


def test_speed_times_sam_without_a_limit_that_would_break_the_grid():
    """tokcomp speed's limit (the schedule with no matching) drops tokens, which SAM's grid cannot take: no limit row
    for it there; the method itself is timed."""
    from timm_tokcomp.deployment.specs import parse_methods
    from timm_tokcomp.commands.speed import LIMIT_SUFFIX, _models

    models = _models(sam(), parse_methods("cubist_r2,dense_tome_r2"), images(1), static=False)
    assert sorted(models) == ["cubist_r2", "dense_tome_r2", "none"]
    assert not any(name.endswith(LIMIT_SUFFIX) for name in models)


def test_sam_compiles_whole():
    """timm's windows read the grid as Python ints: timm_tokcomp.compile traces a SAM encoder whole (static shapes),
    not by region, and gets the eager outputs."""
    from timm_tokcomp.runtime.compile import by_region

    model = timm_tokcomp.apply(sam(), "cubist", r_rows=2, r_cols=3)
    assert not by_region(model)
    x = images()
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(timm_tokcomp.compile(model, backend="eager")(x), expected, atol=1e-5, rtol=1e-5)
