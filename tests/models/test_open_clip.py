"""open_clip's image towers (its VisionTransformer with ResidualAttentionBlock layers and nn.MultiheadAttention):
small random-weight towers of each head kind, a timm ViT's weights carried into one (the reduced tower then equals
timm's reduced model), and DeiT-Tiny's real weights giving DeiT-Tiny's predictions."""
import copy

import pytest
import timm
import torch

import timm_tokcomp
from conftest import check_edges, real_model_and_images

open_clip = pytest.importorskip("open_clip", reason="open_clip is not installed (pip install 'timm-tokcomp[openclip]')")
from open_clip.transformer import VisionTransformer  # noqa: E402

from timm_tokcomp.families.openclip import mha_attention  # noqa: E402

HEADS = {
    "tok": dict(),
    "avg": dict(pool_type="avg"),
    "avg_ln_after_pool": dict(pool_type="avg", final_ln_after_pool=True),
    "attentional_pool": dict(attentional_pool=True, attn_pooler_queries=4, attn_pooler_heads=2),
    "layerscale_tokens": dict(ls_init_value=0.1, output_tokens=True),
}


def tower(seed: int = 0, image_size: int = 64, **kwargs) -> VisionTransformer:
    torch.manual_seed(seed)
    return VisionTransformer(image_size=image_size, patch_size=16, width=32, layers=3, heads=2, mlp_ratio=4.,
                             output_dim=24, **kwargs).eval()


def images(n: int = 2, size: int = 64, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(n, 3, size, size)


def pooled(out):
    return out[0] if isinstance(out, tuple) else out


def from_timm(vit: torch.nn.Module) -> VisionTransformer:
    """An open_clip tower carrying a timm ViT's weights (class-token head, no pre-norm): its output, with proj the
    identity, is timm's pre-logits; the patch embedding's bias moves into the patch rows of the position embedding
    (open_clip's conv has none)."""
    from functools import partial

    from open_clip.transformer import LayerNorm

    width, grid = vit.embed_dim, vit.patch_embed.grid_size
    visual = VisionTransformer(image_size=grid[0] * vit.patch_embed.patch_size[0],
                               patch_size=vit.patch_embed.patch_size[0], width=width, layers=len(vit.blocks),
                               heads=vit.blocks[0].attn.num_heads, mlp_ratio=vit.blocks[0].mlp.fc1.out_features / width,
                               output_dim=width, no_ln_pre=True, norm_layer=partial(LayerNorm, eps=1e-6)).eval()
    with torch.no_grad():
        visual.conv1.weight.copy_(vit.patch_embed.proj.weight)
        visual.class_embedding.copy_(vit.cls_token[0, 0])
        pos = vit.pos_embed[0].clone()
        pos[1:] += vit.patch_embed.proj.bias
        visual.positional_embedding.copy_(pos)
        for ours, theirs in zip(visual.transformer.resblocks, vit.blocks):
            ours.ln_1.load_state_dict(theirs.norm1.state_dict())
            ours.ln_2.load_state_dict(theirs.norm2.state_dict())
            ours.attn.in_proj_weight.copy_(theirs.attn.qkv.weight)
            ours.attn.in_proj_bias.copy_(theirs.attn.qkv.bias)
            ours.attn.out_proj.load_state_dict(theirs.attn.proj.state_dict())
            ours.mlp.c_fc.load_state_dict(theirs.mlp.fc1.state_dict())
            ours.mlp.c_proj.load_state_dict(theirs.mlp.fc2.state_dict())
        visual.ln_post.load_state_dict(vit.norm.state_dict())
        visual.proj.copy_(torch.eye(width))
    return visual


def test_attention_through_sdpa_is_multihead_attentions():
    attn = tower().transformer.resblocks[0].attn
    x = torch.randn(3, 17, 32)
    expected = attn(x, x, x, need_weights=False)[0]  # with gradients on: nn.MultiheadAttention's own path
    torch.testing.assert_close(mha_attention(attn, x, None, None)[0], expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("head", sorted(HEADS))
def test_nothing_reduced_is_open_clips_tower_and_remove_restores_it(head):
    plain = tower(**HEADS[head])
    x = images()
    with torch.no_grad():
        expected = plain(x)
        model = timm_tokcomp.apply(copy.deepcopy(plain), "tome", r=0)
        got = model(x)
        for a, b in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else
                        (expected,)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        inter, plain_inter = model.forward_intermediates(x, indices=2), plain.forward_intermediates(x, indices=2)
        torch.testing.assert_close(inter["image_features"], plain_inter["image_features"], atol=1e-5, rtol=1e-5)
        for a, b in zip(inter["image_intermediates"], plain_inter["image_intermediates"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert list(model.state_dict()) == list(plain.state_dict())
    timm_tokcomp.remove(model)
    assert type(model) is VisionTransformer
    assert all(type(b) is type(p) for b, p in zip(model.transformer.resblocks, plain.transformer.resblocks))


@pytest.mark.parametrize("method, params", [("tome", dict(r=3)), ("evit", dict(keep_rate=0.7, stages=[2])),
                                            ("topk", dict(keep_rate=0.7, stages=[2])),
                                            ("cubist", dict(r_rows=1, r_cols=1))])
def test_a_timm_vits_weights_reduce_in_open_clip_as_in_timm(method, params):
    vit = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=3, num_classes=0).eval()
    visual = from_timm(vit)
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(visual(x), vit(x), atol=1e-5, rtol=1e-5)
        ours = timm_tokcomp.apply(visual, method, **params)(x)
        theirs = timm_tokcomp.apply(vit, method, **params)(x)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert timm_tokcomp.last_stats(visual).tokens_per_block == timm_tokcomp.last_stats(vit).tokens_per_block


@pytest.mark.realdata
def test_deit_tiny_in_open_clip_gives_deit_tinys_predictions_plain_and_reduced():
    deit, x = real_model_and_images("deit_tiny_patch16_224", 16)
    visual = from_timm(deit)
    head = deit.get_classifier()
    with torch.no_grad():
        for r in (0, 8, 16):
            ours = timm_tokcomp.apply(copy.deepcopy(deit), "tome", r=r)(x)
            theirs = head(timm_tokcomp.apply(visual, "tome", r=r)(x))
            torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
            assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


@pytest.mark.parametrize("head", sorted(HEADS))
def test_every_head_pools_with_the_token_sizes(head):
    """A batch is its images; output_tokens gives the reduced tokens; the attentional pooler's and the average's
    weights follow the sizes (a pair of identical tokens merged pools as the pair did)."""
    model = timm_tokcomp.apply(tower(**HEADS[head]), "tome", r=3)
    x = images(3)
    with torch.no_grad():
        out = model(x)
        for i in range(3):
            torch.testing.assert_close(pooled(model(x[i:i + 1])), pooled(out)[i:i + 1], atol=1e-5, rtol=1e-5)
    if HEADS[head].get("output_tokens"):
        assert out[1].shape == (3, timm_tokcomp.last_stats(model).tokens_out - 1, 32)


def test_a_merged_pair_pools_as_the_identical_pair():
    """Two identical patch tokens (size 1 each) and their merge (size 2) give the same average and attention pool."""
    from timm_tokcomp.families.openclip import pooler_with_sizes

    visual = tower(**HEADS["attentional_pool"])
    torch.manual_seed(3)
    x = torch.randn(1, 4, 32)
    pair = torch.cat([x, x[:, 3:]], dim=1)
    merged = pooler_with_sizes(visual.attn_pool, x, torch.tensor([[[1.], [1.], [1.], [2.]]]))
    torch.testing.assert_close(merged, pooler_with_sizes(visual.attn_pool, pair, None), atol=1e-5, rtol=1e-5)
    avg = timm_tokcomp.apply(tower(**HEADS["avg"]), "tome", r=0)
    torch.testing.assert_close(avg._sized_global_pool(x, torch.tensor([[[1.], [1.], [1.], [2.]]]))[0],
                               avg._sized_global_pool(pair, None)[0], atol=1e-6, rtol=1e-6)


def test_encode_image_of_an_open_clip_model_reduces():
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(0)
    model = CLIP(embed_dim=24, vision_cfg=CLIPVisionCfg(layers=2, width=32, head_width=16, patch_size=16,
                                                        image_size=64),
                 text_cfg=CLIPTextCfg(context_length=8, vocab_size=100, width=32, heads=2, layers=1)).eval()
    x = images()
    with torch.no_grad():
        plain = model.encode_image(x)
        timm_tokcomp.apply(model.visual, "tome", r=4)
        reduced = model.encode_image(x)
    assert reduced.shape == plain.shape and not torch.allclose(reduced, plain)
    assert timm_tokcomp.last_stats(model.visual).tokens_per_block == [17, 13]


def test_what_open_clip_towers_cannot_serve_is_refused_by_name():
    with pytest.raises(TypeError, match="CustomResidualAttentionBlock, not served"):
        timm_tokcomp.apply(tower(qk_norm=True), "tome", r=2)
    with pytest.raises(TypeError, match="dense methods serve timm's models, not open_clip's"):
        timm_tokcomp.apply(tower(), "dense_tome", r=2)
    with pytest.raises(ValueError, match="reduce before attention .mctf. serve timm's VisionTransformer blocks"):
        timm_tokcomp.apply(tower(), "mctf", r=2)
    dropping = tower(patch_dropout=0.5)
    model = timm_tokcomp.apply(dropping, "cubist", r_rows=1, r_cols=1).train()
    with pytest.raises(ValueError, match="cubist reads the patch grid, which patch dropout .training. breaks"):
        model(images())
    timm_tokcomp.apply(model, "tome", r=2)
    model(images()).sum().backward()  # patch dropout and ToMe train together: the class token stays first


def test_edge_sizes_bf16_and_torch_save():
    check_edges(timm_tokcomp.apply(tower(), "tome", r=3), images(), (0, 24), bf16_within=0.25)
    one = tower(image_size=16)
    with torch.no_grad():
        torch.testing.assert_close(timm_tokcomp.apply(copy.deepcopy(one), "tome", r=3)(images(2, 16)),
                                   one(images(2, 16)), atol=1e-5, rtol=1e-5)  # one patch: nothing to merge


def test_forward_intermediates_spread_merged_tokens_over_the_grid():
    model = timm_tokcomp.apply(tower(), "tome", r=3)
    x = images()
    with torch.no_grad():
        out = model.forward_intermediates(x, indices=[0, 2], output_extra_tokens=True)
        assert [t.shape for t in out["image_intermediates"]] == [(2, 32, 4, 4)] * 2
        assert [t.shape for t in out["image_intermediates_prefix"]] == [(2, 1, 32)] * 2
        torch.testing.assert_close(out["image_features"], model(x), atol=1e-6, rtol=1e-6)
        nlc = model.forward_intermediates(x, indices=1, output_fmt="NLC", intermediates_only=True)
        assert list(nlc) == ["image_intermediates"] and nlc["image_intermediates"][0].shape == (2, 16, 32)
