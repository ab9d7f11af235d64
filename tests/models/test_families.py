"""The model families beyond timm's VisionTransformer ViTs of 2021: SigLIP / SigLIP2 (attention-pool 'map' head) and
timm's Eva class (EVA02, DINOv3, PE-Core, RoPE-ViT: rotary positions), as small random-weight versions of the real
architectures; plus DeiT-Tiny's real weights run through the Eva path."""
import warnings

import pytest
import timm
import torch
from timm.models.eva import Eva
from torch import nn

import timm_tokcomp
from timm_tokcomp.plans import ClusterPlan
from timm_tokcomp.methods import METHODS
from timm_tokcomp.ops.rope import TokenPositions, grid_coords, rope_rows
from conftest import (FAMILY_MODELS, FAMILY_SMALL, TOKEN_METHODS, eva_from_deit, family_model, positions_seen,
                      real_model_and_images, reducing_params)

ROPE_MODELS = [name for name in FAMILY_MODELS if name not in ("siglip_map", "siglip2_map")]


@pytest.fixture
def images():
    torch.manual_seed(1)
    return torch.randn(2, 3, 32, 32)


@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_reducing_nothing_is_the_plain_model_bit_for_bit(name, images):
    plain = family_model(name)
    with torch.no_grad():
        expected = plain(images)
        for method, params in (("tome", dict(r=0)), ("tome", dict(r=0, rope_merge="centroid")),
                               ("kmedoids", dict(keep_rate=1.0, stages=(2, 3)))):
            model = timm_tokcomp.apply(family_model(name), method, **params)
            assert torch.equal(model(images), expected), (method, params)
            assert torch.equal(timm_tokcomp.remove(model)(images), expected)


@pytest.mark.parametrize("method", TOKEN_METHODS)
@pytest.mark.parametrize("name", ["pe_core_rope_map", "dinov3_registers", "siglip_map"])
def test_every_method_reduces_every_family(name, method, images):
    if METHODS[method].spec.needs_class_token and family_model(name).cls_token is None:
        pytest.skip("ranks by class attention; this model has no class token")
    if METHODS[method].spec.place == "before_attention" and name != "siglip_map":  # MCTF: timm's ViT blocks only
        with pytest.raises(ValueError, match="reduce before attention .mctf. serve timm's VisionTransformer blocks"):
            timm_tokcomp.apply(family_model(name), method, **reducing_params(method, len(family_model(name).blocks)))
        return
    model = timm_tokcomp.apply(family_model(name), method, trace_source=True, **reducing_params(method, len(family_model(name).blocks)))
    with torch.no_grad():
        out = model(images)
        assert out.shape == (2, 10) and torch.isfinite(out).all()
        assert torch.equal(out, model(images))  # deterministic
        for i in range(2 if not METHODS[method].spec.batch_adaptive else 0):  # batch results equal per-image results
            torch.testing.assert_close(model(images[i:i + 1]), out[i:i + 1], atol=1e-4, rtol=1e-4)
    stats = timm_tokcomp.last_stats(model)
    assert stats.tokens_out < stats.tokens_per_block[0]
    assert stats.rope_merge == (None if name == "siglip_map" else "dst")


def _kept_after_each_block(model, images):
    """For a dropping pruner: per block, (B, N0) bool of the original tokens still present after it."""
    kept = []
    timm_tokcomp.patch.trace_blocks(model, images, lambda i, tokens, source, positions: kept.append(source.sum(1) > 0.5))
    return kept


def _masked_plain_logits(plain, images, kept):
    """The plain Eva with the tokens dropped after block i masked out of attention from block i + 1 on."""
    x = plain.patch_embed(images)
    x, rope = plain._pos_embed(x)
    x = plain.norm_pre(x)
    mask = None
    for i, blk in enumerate(plain.blocks):
        block_rope = rope[i] if plain.rope_mixed else rope
        x = blk(x, rope=block_rope, attn_mask=mask)
        mask = torch.zeros(kept[i].shape, dtype=x.dtype).masked_fill(~kept[i], float("-inf"))[:, None, None, :]
    return plain.forward_head(plain.norm(x))


@pytest.mark.parametrize("name", ["rope_split_qkv_layerscale", "rope_grouped_query", "ropevit_mixed", "dinov3_registers"])
@pytest.mark.parametrize("method, params", [("topk", dict(keep_rate=0.5, stages=(2, 3))),
                                            ("l2", dict(keep_rate=0.7, stages=(2, 3)))])
def test_pruning_is_the_plain_model_with_the_pruned_tokens_masked(name, method, params, images):
    """A dropping pruner on a rope model: every kept token keeps its own rope row, so the output is the plain
    model's with the pruned tokens masked out of attention from the next block on (their rows are never read)."""
    plain = family_model(name, depth=4, global_pool="token")
    model = timm_tokcomp.apply(family_model(name, depth=4, global_pool="token"), method, **params)
    with torch.no_grad():
        kept = _kept_after_each_block(model, images)
        assert kept[-1].sum() < kept[0].numel()  # something was pruned
        torch.testing.assert_close(model(images), _masked_plain_logits(plain, images, kept), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["siglip_map", "map_eva_no_positions"])
def test_map_head_pools_a_merged_pair_as_the_two_identical_tokens(name):
    """No position embedding: two identical patches stay identical tokens in every block. ToMe merging just that
    pair in the first block (one token of size 2, log size in every later attention and in the attention pool)
    changes nothing."""
    if name == "siglip_map":
        make = lambda: family_model("siglip_map", pos_embed="none", depth=3)  # noqa: E731
    else:
        def make():
            torch.manual_seed(0)
            return Eva(**FAMILY_SMALL, global_pool="map", use_abs_pos_emb=False, use_rot_pos_emb=False).eval()
    torch.manual_seed(3)
    images = torch.randn(2, 3, 32, 32)
    images[:, :, :8, 8:16] = images[:, :, :8, :8]  # patches 0 and 1 (A and B of ToMe's split) identical
    plain = make()
    model = timm_tokcomp.apply(make(), "tome", r=[1, 0, 0], prop_attn=True, trace_source=True)
    with torch.no_grad():
        expected = plain(images)
        out = model(images)
    stats = timm_tokcomp.last_stats(model)
    p = model.num_prefix_tokens
    assert stats.tokens_out == stats.tokens_per_block[0] - 1
    assert torch.all(stats.source[:, :, p + 0] == stats.source[:, :, p + 1])  # the identical pair merged
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_map_head_weighs_a_token_by_its_size():
    model = timm_tokcomp.apply(family_model("siglip_map"), "tome", r=2)
    pool = model.attn_pool
    torch.manual_seed(0)
    tokens = torch.randn(1, 5, 64)
    twice = torch.cat([tokens, tokens[:, 2:3]], dim=1)
    size = torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0]).view(1, 5, 1)
    with torch.no_grad():
        torch.testing.assert_close(pool(tokens, attn_mask=size.log().view(1, 1, 1, 5)), pool(twice))


@pytest.mark.parametrize("name", ["eva02_cat_swiglu", "dinov3_registers", "ropevit_mixed"])
def test_rope_rows_from_coordinates_are_timms_table(name):
    """The rows recomputed from grid coordinates equal the rope module's own table (all three 2-D types), and a
    centroid's rows are the rows of the grid point it lands on: the coordinates are what the angles are linear in."""
    model = family_model(name)
    rope, shape = model.rope, tuple(model.patch_embed.grid_size)
    coords = grid_coords(rope, shape, torch.device("cpu"))[None]  # (1, 16, 2)
    table = rope.get_embed() if rope.feat_shape is not None else rope.get_embed(shape)
    for block in (0, 2):
        rows = rope_rows(rope, coords, block, table.dtype)
        expected = table[block] if model.rope_mixed else table
        torch.testing.assert_close(rows[0] if model.rope_mixed else rows[0, 0], expected, atol=1e-6, rtol=1e-6)
    # centroid of grid points (0, 0) and (0, 2), sizes 1 and 1 -> the rows of (0, 1); (1, 1) with itself -> (1, 1)
    def centroid(rows, sizes):
        pair = TokenPositions(rope, coords[:, rows], None, "centroid")
        plan = ClusterPlan(0, torch.zeros(1, 2, dtype=torch.long), 1)
        return pair.reduced(plan, torch.tensor(sizes).view(1, 2, 1), 0).coords

    torch.testing.assert_close(centroid([0, 2], [1.0, 1.0]), coords[:, 1:2])
    torch.testing.assert_close(rope_rows(rope, centroid([0, 2], [1.0, 1.0]), 0, table.dtype),
                               rope_rows(rope, coords[:, 1:2], 0, table.dtype))
    torch.testing.assert_close(centroid([5, 5], [1.0, 3.0]), coords[:, 5:6])


@pytest.mark.parametrize("rope_merge", ["dst", "centroid"])
def test_merged_tokens_sit_at_their_destination_or_their_centroid(rope_merge, images):
    model = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=3, trace_source=True,
                               rope_merge=rope_merge)
    seen = positions_seen(model, images)
    assert len(seen) == 3
    grid = seen[0][1]
    final = seen[-1][2]
    source = timm_tokcomp.last_stats(model).source[:, model.num_prefix_tokens:, model.num_prefix_tokens:]
    centroid = (source @ grid) / source.sum(-1, keepdim=True)  # (B, n', 2) centroid of each token's patches
    if rope_merge == "centroid":
        torch.testing.assert_close(final, centroid)
    else:  # a grid point among the token's own patches
        held = (grid[:, None, :, :] == final[:, :, None, :]).all(-1) & (source > 0)
        assert held.any(-1).all()
        assert not torch.allclose(final, centroid)


def test_dense_variant_and_refusals_on_eva(images):
    model = timm_tokcomp.apply(family_model("dinov3_registers"), "dense_tome", k=4)
    plain = family_model("dinov3_registers")
    with torch.no_grad():
        assert model.forward_features(images).shape == plain.forward_features(images).shape
        assert torch.equal(timm_tokcomp.apply(family_model("dinov3_registers"), "dense_tome", k=0)(images),
                           plain(images))
    with pytest.raises(ValueError, match="fold_qkv.*EvaAttention.*'fold'"):
        timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=2, prop_attn="fold_qkv")
    with pytest.raises(ValueError, match="rope_merge must be one of dst, centroid"):
        timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=2, rope_merge="mean")
    with pytest.raises(TypeError, match="AttentionPoolPrr"):
        timm_tokcomp.apply(family_model("siglip_map", global_pool="prr"), "tome", r=2)


def test_forward_intermediates_and_features_only_on_a_rope_model(images):
    model = timm_tokcomp.apply(family_model("dinov3_registers"), "tome", r=3)
    with torch.no_grad():
        final, maps = model.forward_intermediates(images, indices=2)
    assert [tuple(m.shape) for m in maps] == [(2, 64, 4, 4)] * 2
    assert final.shape[1] < 5 + 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backbone = timm.create_model("vit_small_patch16_dinov3.tome_r2", features_only=True, out_indices=(1, 2),
                                     **{k: v for k, v in FAMILY_SMALL.items() if k != "num_classes"})
    with torch.no_grad():
        assert [tuple(f.shape) for f in backbone(images)] == [(2, 64, 4, 4)] * 2


def test_compile_runs_a_rope_model(images):
    model = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=3)
    with torch.no_grad():
        expected = model(images)
        torch.testing.assert_close(torch.compile(model, backend="eager")(images), expected)


@pytest.mark.parametrize("name", ROPE_MODELS)
def test_rope_models_compiled_by_region_match_eager(name, images):
    """ToMe's and EViT's compiled steps move the rotary coordinates inside their operators (tome_merge_rope,
    evit_prune_rope): the compiled model gives the eager model's output on every rope family."""
    from timm_tokcomp.runtime import compile as compiling

    for method in ("tome", "evit"):
        model = family_model(name)
        if method == "evit" and getattr(model, "cls_token", None) is None:
            continue  # EViT reads the class token's attention
        model = timm_tokcomp.apply(model, method, r=3)
        with torch.no_grad():
            torch.testing.assert_close(compiling.compile(model, backend="eager")(images), model(images),
                                       rtol=1e-5, atol=1e-5)


# DeiT-Tiny's real weights in an Eva configured to match it: every part of the Eva path except rope, with real weights


@pytest.mark.realdata
def test_deit_tiny_weights_through_the_eva_path_give_deit_tinys_figures():
    deit, images = real_model_and_images("deit_tiny_patch16_224", 48)
    eva = eva_from_deit(deit)
    with torch.no_grad():
        torch.testing.assert_close(eva(images), deit(images), atol=1e-5, rtol=1e-5)
        for r in (8, 16):
            timm_tokcomp.apply(deit, "tome", r=r)
            timm_tokcomp.apply(eva, "tome", r=r)
            a, b = eva(images), deit(images)
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
            assert timm_tokcomp.last_stats(eva).tokens_per_block == timm_tokcomp.last_stats(deit).tokens_per_block


def test_an_adapter_around_evas_fused_qkv_runs(images):
    """timm's Eva calls F.linear on qkv.weight, which would skip a peft LoRA layer wrapped around qkv; the reducing
    attention runs the module itself. A wrapper adding 0.5 to every output equals 0.5 more on the q, k, v biases."""
    class Shifted(nn.Module):  # stands for an adapter layer around the Linear
        def __init__(self, base):
            super().__init__()
            self.base, self.weight = base, base.weight

        def forward(self, x):
            return self.base(x) + 0.5

    wrapped = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=2)
    shifted = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=2)
    for a, b in zip(wrapped.blocks, shifted.blocks):
        a.attn.qkv = Shifted(a.attn.qkv)
        b.attn.q_bias.data += 0.5
        b.attn.k_bias += 0.5
        b.attn.v_bias.data += 0.5
    def pre_logits(model):
        return model.forward_head(model.forward_features(images), pre_logits=True)

    with torch.no_grad():
        out = pre_logits(wrapped)
        torch.testing.assert_close(out, pre_logits(shifted), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out, pre_logits(family_model("eva02_cat_swiglu")), atol=1e-3)


def test_tocom_refuses_split_qkv_projections():
    from conftest import _random_compensator
    from timm_tokcomp.tocom import attach

    with pytest.raises(ValueError, match=r"fused qkv projection; blocks\[0\].attn \(AttentionRope\) has split"):
        attach(family_model("rope_split_qkv_layerscale"), _random_compensator(depth=3, dim=64, attn_dim=64))


def test_an_adapter_that_plain_eva_would_skip_is_named():
    """timm's own Eva forward skips a LoRA layer on qkv (F.linear on the weight): finetune / load_finetuned(merge=False)
    refuse that case and say to run it reduced (tome_r0 for the unreduced model), which runs the module."""
    from timm_tokcomp.patch import adapter_skip

    plain = family_model("eva02_cat_swiglu")
    assert "skips a LoRA adapter on qkv" in adapter_skip(plain) and "tome_r0" in adapter_skip(plain)
    assert adapter_skip(timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=0)) is None
    assert adapter_skip(family_model("siglip_map")) is None  # timm's Attention calls its qkv module
    assert adapter_skip(family_model("rope_split_qkv_layerscale")) is None  # split projections: modules called


@pytest.mark.parametrize("name", ["pe_core_rope_map", "rope_grouped_query", "siglip_map"])
def test_an_empty_batch_gives_an_empty_output_on_every_family(name):
    model = timm_tokcomp.apply(family_model(name), "tome", r=2)
    with torch.no_grad():
        assert model(torch.zeros(0, 3, 32, 32)).shape == (0, 10)
