"""timm's NaFlexVit (families/naflex.py): small random versions of its real configurations (SigLIP2 NaFlex, the gap
NaFlexViT with registers, C-RADIO, and timm's ViT / EVA02 / DINOv3 / RoPE-ViT built with use_naflex=True), on images
and on NaFlex batches that mix aspect ratios with padding."""
import warnings

import pytest
import timm
import torch
from timm.data.naflex_dataset import NaFlexCollator
from timm.data.naflex_transforms import Patchify
from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg
from timm.models.vision_transformer import ParallelScalingBlock

import timm_tokcomp
from timm_tokcomp.families.base import BuildArgs
from timm_tokcomp.families.naflex import _arch_refusal, naflex_groups
from timm_tokcomp.methods import METHODS
from timm_tokcomp.methods.patchmerger import PatchMerger
from timm_tokcomp.patch import trace_blocks
from conftest import TOKEN_METHODS, real_model_and_images, reducing_params

SMALL = dict(depth=3, embed_dim=64, num_heads=2, patch_size=8, num_classes=10)
# name -> (timm architecture, its own arguments): each a configuration timm ships
NAFLEX_MODELS = {
    "gap_registers": ("naflexvit_base_patch16_gap", {}),
    "siglip2_map": ("naflexvit_base_patch16_siglip", {}),
    "radio_token_registers": ("naflexvit_base_patch16_radio_v3", {}),
    "vit_class_token": ("vit_small_patch16_224", dict(use_naflex=True, img_size=32)),
    "eva02_rope": ("eva02_small_patch14_224", dict(use_naflex=True, img_size=32)),
    "dinov3_rope": ("vit_small_patch16_dinov3", dict(use_naflex=True, img_size=32)),
    "ropevit_mixed": ("vit_small_patch16_rope_mixed_224", dict(use_naflex=True, img_size=32)),
}
ROPE = ("eva02_rope", "dinov3_rope", "ropevit_mixed")
# four images, three aspect ratios: 3 x 5 patches twice, 4 x 2 and 5 x 3 once (15, 8, 15 and 15 valid patches),
# padded to 20
SHAPES = ((24, 40), (32, 16), (24, 40), (40, 24))
WIDTH = 20


def naflex_model(name, **overrides):
    arch, extra = NAFLEX_MODELS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = timm.create_model(arch, **{**SMALL, **extra, **overrides}).eval()
    assert type(model) is NaFlexVit
    for p in model.parameters():  # LayerScale / head inits near zero would hide differences
        if p.dim() == 1 and torch.all(p == p.flatten()[0]):
            p.data.normal_(1.0 if p.flatten()[0] != 0 else 0.0, 0.1)
    return model


def naflex_batch(images, patch=8, width=WIDTH):
    """images (each (3, H, W)) -> the batch timm's NaFlex pipeline makes of them (its Patchify and NaFlexCollator):
    patches (B, width, P*P*3), patch_coord (B, width, 2) (row, col), patch_valid (B, width), each image's patches
    first in row-major order, padding after them."""
    return NaFlexCollator(max_seq_len=width)([(Patchify(patch)(image), 0) for image in images])[0]


@pytest.fixture
def images():
    torch.manual_seed(1)
    return [torch.randn(3, h, w) for h, w in SHAPES]


def _alone(model, images):
    """Each image as a NaFlex batch of one, without padding."""
    return torch.cat([model(naflex_batch([image], width=(image.shape[1] // 8) * (image.shape[2] // 8)))
                      for image in images])


@pytest.mark.parametrize("name", sorted(NAFLEX_MODELS))
def test_reducing_nothing_is_the_plain_model(name, images):
    plain = naflex_model(name)
    batch, square = naflex_batch(images), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected, expected_images = plain(batch), plain(square)
        model = timm_tokcomp.apply(naflex_model(name), "tome", r=0)
        assert torch.equal(model(square), expected_images)  # images: the shared loop, bit for bit
        # a NaFlex batch: each group without padding where timm masks it, the same up to float rounding
        torch.testing.assert_close(model(batch), expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(timm_tokcomp.remove(model)(batch), expected)


def _check_padding(model, batch, features):
    """No padding token holds anything: each image's real tokens come first (size > 0) and the padding after them
    (size 0, holding no input token), the returned patch_valid marks the real ones, the traced source never
    reaches a padding position of the input, and the first block counts each image's valid patches."""
    stats = timm_tokcomp.last_stats(model)
    p = model.num_prefix_tokens
    valid_in = torch.cat([torch.ones(len(stats.size), p, dtype=torch.bool), batch["patch_valid"]], dim=1)
    assert not stats.source.sum(dim=1)[~valid_in].any()
    real = stats.size[..., 0] > 0
    assert torch.equal(real, torch.arange(real.shape[1]) < real.sum(dim=1, keepdim=True))  # real first
    assert not stats.source[~real].any()
    assert torch.equal(features["patch_valid"], real[:, p:])
    assert torch.equal(stats.real_tokens_per_block[0], valid_in.sum(dim=1))
    return real.sum(dim=1)


@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_every_method_reduces_each_image_of_a_mixed_batch_as_alone(method, images):
    """Two aspect ratios and padding in one batch: every image's logits and token counts are those it has alone,
    and no padding token is ever merged, kept or a destination."""
    model = timm_tokcomp.apply(naflex_model("vit_class_token"), method, trace_source=True,
                               **reducing_params(method, SMALL["depth"]))
    batch = naflex_batch(images)
    if issubclass(METHODS[method], PatchMerger):  # its learned layer fits the model's default token count only
        with pytest.raises(ValueError, match="fits one input size"):
            model(batch)
        return
    with torch.no_grad():
        out = model(batch)
        features = model.forward_features(batch["patches"], batch["patch_coord"], batch["patch_valid"])
        assert torch.equal(model.forward_head(**features), out)
        stats = timm_tokcomp.last_stats(model)
        assert stats.tokens_out < stats.tokens_per_block[0]
        counts_out = _check_padding(model, batch, features)
        if not METHODS[method].spec.batch_adaptive:
            torch.testing.assert_close(_alone(model, images), out, atol=1e-5, rtol=1e-5)
            assert timm_tokcomp.last_stats(model).tokens_out == int(counts_out[-1])  # the last image, alone


@pytest.mark.parametrize("name", sorted(NAFLEX_MODELS))
@pytest.mark.parametrize("method, params", [("tome", dict(r=3)), ("l2", dict(keep_rate=0.5, stages=(2, 3)))])
def test_every_configuration_reduces_each_image_as_alone(name, method, params, images):
    model = timm_tokcomp.apply(naflex_model(name), method, trace_source=True, **params)
    batch = naflex_batch(images)
    with torch.no_grad():
        out = model(batch)
        features = model.forward_features(batch["patches"], batch["patch_coord"], batch["patch_valid"])
        stats = timm_tokcomp.last_stats(model)
        assert stats.tokens_out < stats.tokens_per_block[0]
        _check_padding(model, batch, features)
        torch.testing.assert_close(_alone(model, images), out, atol=1e-5, rtol=1e-5)
        # images: the same model reduces the square batch too, rope rows from its grid
        square = model(torch.randn(2, 3, 32, 32))
        assert square.shape == (2, 10) and torch.isfinite(square).all()
    assert stats.rope_merge == ("dst" if name in ROPE else None)


@pytest.mark.parametrize("name, method, params", [("vit_class_token", "tome", dict(r=3)),
                                                  ("vit_class_token", "ats", dict(keep_rate=0.5, stages=(2, 3))),
                                                  ("eva02_rope", "evit", dict(r=3))])
def test_a_naflex_batch_runs_under_bf16_autocast(name, method, params, images):
    """The groups' bf16 outputs and sizes pad back into one batch (sizes kept in float32), padding holding nothing."""
    model = timm_tokcomp.apply(naflex_model(name), method, trace_source=True, **params)
    batch = naflex_batch(images)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        out = model(batch)
        features = model.forward_features(batch["patches"], batch["patch_coord"], batch["patch_valid"])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert timm_tokcomp.last_stats(model).size.dtype == torch.float32
    _check_padding(model, batch, features)


@pytest.mark.parametrize("pool", ["avg", "avgmax", "max", "token"])
def test_each_pool_ignores_the_padding(pool, images):
    model = naflex_model("vit_class_token")
    model.reset_classifier(10, pool)
    timm_tokcomp.apply(model, "tome", r=3)
    with torch.no_grad():
        torch.testing.assert_close(_alone(model, images), model(naflex_batch(images)), atol=1e-5, rtol=1e-5)


def _masked_plain_logits(plain, batch, kept):
    """timm's NaFlexVit on the batch, with the padding and the tokens pruned after block i masked out of attention
    from block i + 1 on. kept: per block, (B, N0) bool over the padded input's tokens."""
    x, _ = plain.embeds(batch["patches"], patch_coord=batch["patch_coord"], patch_valid=batch["patch_valid"])
    p = plain.num_prefix_tokens
    valid = torch.cat([torch.ones(x.shape[0], p, dtype=torch.bool), batch["patch_valid"]], dim=1)
    keys = valid
    for i, blk in enumerate(plain.blocks):
        mask = torch.zeros(keys.shape).masked_fill(~keys, float("-inf"))[:, None, None, :]
        x = blk(x, attn_mask=mask)
        keys = valid & kept[i]
    return plain.forward_head(plain.norm(x), patch_valid=batch["patch_valid"])


def test_pruning_is_the_plain_model_with_the_padding_and_the_pruned_tokens_masked(images):
    """A dropping pruner on a padded NaFlex batch: each kept token is computed as in timm's model with the pruned
    tokens (and the padding) masked out of attention from the next block on."""
    plain = naflex_model("vit_class_token")
    model = timm_tokcomp.apply(naflex_model("vit_class_token"), "topk", keep_rate=0.5, stages=(2, 3))
    batch = naflex_batch(images)
    p = model.num_prefix_tokens
    with torch.no_grad():
        kept = [torch.zeros(len(images), p + WIDTH, dtype=torch.bool) for _ in model.blocks]
        for i, image in enumerate(images):  # each image's kept tokens per block, traced on the image itself
            n = (image.shape[1] // 8) * (image.shape[2] // 8)
            seen = []
            trace_blocks(model, image[None], lambda b, tokens, source, positions: seen.append(source.sum(dim=1)[0] > 0.5))
            for block, mask in enumerate(seen):
                kept[block][i, :p + n] = mask
        assert kept[-1].sum() < kept[0].sum()  # something was pruned
        torch.testing.assert_close(model(batch), _masked_plain_logits(plain, batch, kept), atol=1e-5, rtol=1e-5)


def test_images_of_one_count_run_together_unless_their_grid_is_read(images):
    """For a method whose settings do not read the grid, the 3 x 5 and 5 x 3 images (15 patches each) run as one
    group (on a rope model each with its own rotary rows); FPET's checkerboard reads the grid: there they run
    apart."""
    batch = naflex_batch(images)
    groups = naflex_groups(batch["patch_valid"], batch["patch_coord"], by_grid=True)
    assert groups == [([0, 2], 15, [(3, 5), (3, 5)]), ([1], 8, [(4, 2)]), ([3], 15, [(5, 3)])]
    assert naflex_groups(batch["patch_valid"], batch["patch_coord"], by_grid=False) == [
        ([0, 2, 3], 15, [(3, 5), (3, 5), (5, 3)]), ([1], 8, [(4, 2)])]
    seen = []
    for name, method, params in (("vit_class_token", "tome", dict(r=2)), ("eva02_rope", "tome", dict(r=2)),
                                 ("vit_class_token", "fpet", {})):
        model = timm_tokcomp.apply(naflex_model(name), method, **params)
        runs = []
        original = model._reduce_blocks
        model._reduce_blocks = lambda x, *args, **kwargs: runs.append(x.shape[0]) or original(x, *args, **kwargs)
        with torch.no_grad():
            model(batch)
        seen.append(runs)
    assert seen == [[3, 1], [3, 1], [2, 1, 1]]


@pytest.mark.parametrize("name", ["vit_class_token", "dinov3_rope"])
def test_intermediates_of_a_naflex_batch_are_timms_and_each_images_alone(name, images):
    """forward_intermediates on a NaFlex batch ('NLC', timm's forms): while nothing is reduced, timm's intermediates
    at every valid position; reduced, each position carries the token holding it, as for the image alone, padding
    zeros; the final features are forward_features' padded tokens."""
    plain = naflex_model(name)
    model = timm_tokcomp.apply(naflex_model(name), "tome", r=0)
    batch = naflex_batch(images)
    real = batch["patch_valid"].unsqueeze(-1)
    with torch.no_grad():
        expected = plain.forward_intermediates(batch, indices=(0, 2), output_fmt="NLC", output_dict=True,
                                               return_prefix_tokens=True)
        got = model.forward_intermediates(batch, indices=(0, 2), output_fmt="NLC", output_dict=True,
                                          return_prefix_tokens=True)
        assert torch.equal(got["patch_valid"], batch["patch_valid"])
        for a, b in zip(got["image_intermediates"], expected["image_intermediates"]):
            torch.testing.assert_close(a * real, b * real, atol=1e-5, rtol=1e-5)
            assert not a[~batch["patch_valid"]].any()
        for a, b in zip(got["image_intermediates_prefix"], expected["image_intermediates_prefix"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        timm_tokcomp.set_params(model, r=3)
        final, spatial = model.forward_intermediates(batch, indices=2, output_fmt="NLC", norm=True)
        assert torch.equal(model.forward_head(final), model(batch))  # the padded tokens with their sizes
        for i, image in enumerate(images):
            n = (image.shape[1] // 8) * (image.shape[2] // 8)
            alone = model.forward_intermediates(naflex_batch([image], width=n), indices=2, output_fmt="NLC",
                                                intermediates_only=True, norm=True)
            for a, b in zip(spatial, alone):
                torch.testing.assert_close(a[i, :n], b[0], atol=1e-5, rtol=1e-5)
                assert not a[i, n:].any()


def test_refusals_name_what_a_naflex_batch_cannot_take(images):
    model = timm_tokcomp.apply(naflex_model("eva02_rope"), "tome", r=2)
    batch = naflex_batch(images)
    with pytest.raises(ValueError, match="attn_mask is not supported"):
        model({**batch, "attn_mask": torch.zeros(3, 1, 21, 21)})
    with pytest.raises(ValueError, match="patch_valid .B, N. is required"):
        model(batch["patches"], patch_coord=batch["patch_coord"])
    with pytest.raises(ValueError, match="output_fmt must be 'NLC' for a NaFlex batch"):
        model.forward_intermediates(batch)
    for rows, cols in ((slice(0, 0), slice(None)), (slice(None), slice(0, 0))):
        with pytest.raises(ValueError, match=r"at least one image and one patch \(patch_valid of shape"):
            model({key: batch[key][rows, cols] for key in ("patches", "patch_coord", "patch_valid")})
    empty = {**batch, "patch_valid": batch["patch_valid"].clone()}
    empty["patch_valid"][1] = False
    with pytest.raises(ValueError, match="no patch of image 1"):
        model(empty)
    holes = {**batch, "patch_valid": batch["patch_valid"].clone()}
    holes["patch_valid"][0, 3] = False  # 14 valid patches spanning a 3 x 5 grid
    with pytest.raises(ValueError, match=r"marks 14 patches of image 0 valid, its patch_coord spans a 3 x 5 grid"):
        model(holes)
    with pytest.raises(TypeError, match="dense methods serve timm's VisionTransformer and Eva classes, not NaFlexVit"):
        timm_tokcomp.apply(naflex_model("gap_registers"), "dense_tome", r=2)
    for key in ("patch_coord", "patches"):
        with pytest.raises(ValueError, match=f"needs the keys patches, patch_coord and patch_valid; {key} missing"):
            model({k: v for k, v in batch.items() if k != key})


@pytest.mark.parametrize("name", ROPE)
def test_a_rope_model_refuses_patches_that_do_not_come_row_by_row(name, images):
    """timm's NaFlex rope gives the k-th valid patch the k-th row-major cell: an image whose patches come column by
    column, each with its own patch_coord, would be reduced with other cells' rope rows."""
    model = timm_tokcomp.apply(naflex_model(name), "tome", r=2)
    batch = naflex_batch(images)
    n = int(batch["patch_valid"][0].sum())
    rows, cols = (int(v) + 1 for v in batch["patch_coord"][0, :n].amax(dim=0))
    by_column = torch.arange(n).view(rows, cols).t().flatten()  # the same patches, column by column
    swapped = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
    for key in ("patches", "patch_coord"):
        swapped[key][0, :n] = batch[key][0, by_column]
    with pytest.raises(ValueError, match="image 0's valid patches out of row-major order"):
        model(swapped)
    with torch.no_grad():  # the same batch in timm's order runs, and a model without rope takes any order
        assert model(batch).shape == (len(images), 10)
        assert timm_tokcomp.apply(naflex_model("siglip2_map"), "tome", r=2)(swapped).shape == (len(images), 10)
    intermediates = model.forward_intermediates(torch.randn(2, 3, 32, 32), indices=1, output_fmt="NCHW")[1]
    assert intermediates[0].shape == (2, 64, 4, 4)  # images: the shared loop's intermediates


def test_classes_it_cannot_serve_are_refused_by_name():
    mrope = NaFlexVitCfg(rope_type="mrope", rope_mrope_section=(2, 3, 3))
    assert "rope_type='mrope'" in _arch_refusal(BuildArgs(NaFlexVit, {"cfg": mrope}))
    parallel = BuildArgs(NaFlexVit, {"cfg": NaFlexVitCfg(), "block_fn": ParallelScalingBlock})
    assert "ParallelScalingBlock" in _arch_refusal(parallel)
    assert "DiffAttention" in _arch_refusal(BuildArgs(NaFlexVit, {"cfg": NaFlexVitCfg(attn_layer="diff")}))
    assert _arch_refusal(BuildArgs(NaFlexVit, {"cfg": NaFlexVitCfg(rope_type="dinov3")})) is None
    with pytest.raises(TypeError, match="RotaryEmbeddingMRope"):
        timm_tokcomp.apply(NaFlexVit(NaFlexVitCfg(rope_type="mrope", rope_mrope_section=(2, 3, 3), rope_rotate_half=True,
                                                  **{k: v for k, v in SMALL.items() if k != "num_classes"})),
                           "tome", r=1)


def test_a_naflex_batch_trains_and_compiles(images):
    """Gradients reach every block through the groups and the padding; the package's compiled model (its blocks
    compiled by region) equals the eager one on a NaFlex batch (images: as every family, tests/models/test_families)."""
    from torch._dynamo.utils import counters

    from timm_tokcomp.runtime import compile as compiling

    model = timm_tokcomp.apply(naflex_model("eva02_rope"), "tome", r=2).train()
    batch = naflex_batch(images)
    model(batch).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.blocks.parameters())
    model.eval()
    compiled = compiling.compile(model)
    assert compiling.by_region(model)
    with torch.no_grad():  # groups of different counts: the regionally compiled blocks take them all
        torch.testing.assert_close(compiled(batch), model(batch), atol=1e-5, rtol=1e-5)
        graphs = counters["stats"]["unique_graphs"]
        other = naflex_batch([torch.randn(3, 40, 40), torch.randn(3, 16, 40)], width=25)  # 25 and 10 patches
        torch.testing.assert_close(compiled(other), model(other), atol=1e-5, rtol=1e-5)
        assert counters["stats"]["unique_graphs"] == graphs  # new counts compile nothing new


@pytest.mark.realdata
def test_deit_tiny_weights_in_a_naflexvit_give_deit_tinys_logits_and_reductions():
    """DeiT-Tiny's real weights in timm's NaFlexVit (vit_tiny_patch16_224 with use_naflex=True, timm's own weight
    conversion) on imagenet-val-1300: DeiT-Tiny's logits and, with ToMe r8 / r16, its predictions and token counts,
    as images and as a NaFlex batch; a batch whose images are cropped to two aspect ratios gives each image's
    logits alone."""
    from timm.models.naflexvit import checkpoint_filter_fn

    deit, images = real_model_and_images("deit_tiny_patch16_224", 32)
    naflex = timm.create_model("vit_tiny_patch16_224", use_naflex=True).eval()
    naflex.load_state_dict(checkpoint_filter_fn({k: v.clone() for k, v in deit.state_dict().items()}, naflex))
    batch = naflex_batch(list(images), patch=16, width=196)
    with torch.no_grad():
        torch.testing.assert_close(naflex(images), deit(images), atol=1e-4, rtol=1e-4)
        for r in (8, 16):
            timm_tokcomp.apply(deit, "tome", r=r)
            timm_tokcomp.apply(naflex, "tome", r=r)
            expected = deit(images)
            for logits in (naflex(images), naflex(batch)):
                torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
                assert torch.equal(logits.argmax(-1), expected.argmax(-1))
                assert timm_tokcomp.last_stats(naflex).tokens_per_block == timm_tokcomp.last_stats(deit).tokens_per_block
        mixed = [image if i % 2 else image[:, :, 16:208] for i, image in enumerate(images[:8])]  # 14 x 12 patches
        alone = torch.cat([naflex(naflex_batch([image], patch=16, width=image.shape[1] * image.shape[2] // 256))
                           for image in mixed])
        torch.testing.assert_close(naflex(naflex_batch(mixed, patch=16, width=196)), alone, atol=1e-4, rtol=1e-4)
