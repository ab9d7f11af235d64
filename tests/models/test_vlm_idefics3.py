"""Idefics3 / SmolVLM (docs/vlm.md), reduced after the pixel-shuffle connector: SmolVLM-256M's tower layout (SigLIP
768 wide, 12 heads, patch 16, 512-pixel views, scale factor 4: 64 tokens a view) in 2 layers, views made by
transformers' Idefics3 image processor at SmolVLM's sizes (longest edge 2048, 512-pixel crops and a global view),
input_ids laid out as its processor writes them, and SmolLM2-135M's attention layout (576 wide, 9 heads, 3 KV heads)
in 2 layers; random weights. Keep-all is the plain model bit for bit (Idefics3 and SmolVLM); every view's run is
cut to K; rows of different view counts equal each run alone; the importance is the attention received, pooled by
the shuffle's groups, padded patches receiving none; the counts are the image processor's; set_params, save /
load, remove; the refusals."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import timm_tokcomp  # noqa: E402
from timm_tokcomp import vlm  # noqa: E402
from timm_tokcomp.runtime.state import state_of  # noqa: E402
from timm_tokcomp.vlm.connector import tower_layers  # noqa: E402
from timm_tokcomp.vlm.idefics3 import shuffle_groups  # noqa: E402
from timm_tokcomp.vlm.placeholders import image_runs  # noqa: E402

IMAGE, FAKE, NEWLINE, GLOBAL, PAD = 1000, 1001, 1002, 1003, 0


def smolvlm(smol: bool = False, width: int = 768, heads: int = 12, seed: int = 0) -> torch.nn.Module:
    """Idefics3ForConditionalGeneration at SmolVLM-256M's layout (SmolVLMForConditionalGeneration with smol)."""
    torch.manual_seed(seed)
    vision = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=2, num_attention_heads=heads,
                  patch_size=16, image_size=512)
    text = dict(model_type="llama", vocab_size=2048, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                num_attention_heads=9, num_key_value_heads=3, pad_token_id=PAD)
    names = ("SmolVLMConfig", "SmolVLMForConditionalGeneration") if smol else ("Idefics3Config",
                                                                              "Idefics3ForConditionalGeneration")
    config = getattr(transformers, names[0])(vision_config=vision, text_config=text, scale_factor=4,
                                             image_token_id=IMAGE)
    model = getattr(transformers, names[1])(config).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = PAD
    return model


def processor():
    from transformers import Idefics3ImageProcessor

    return Idefics3ImageProcessor(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512})


def prompt(size, before: int, after: int) -> torch.Tensor:
    """(1, L) ids as Idefics3's processor writes one image of size (H, W) between text: per crop
    <fake_token_around_image> <row_r_col_c> and 64 placeholders, a newline after each row of crops, then a newline,
    <fake_token_around_image> <global-img>, 64 placeholders, <fake_token_around_image>."""
    _, rows, cols = processor().get_number_of_image_patches(*size, {})
    run = [IMAGE] * 64
    ids = []
    for r in range(rows):
        for c in range(cols):
            ids += [FAKE, 1100 + 8 * r + c] + run
        ids += [NEWLINE]
    ids += [NEWLINE, FAKE, GLOBAL] + run + [FAKE]
    g = torch.Generator().manual_seed(100 * before + after)
    return torch.cat([torch.randint(3, 999, (1, before), generator=g), torch.tensor([ids]),
                      torch.randint(3, 999, (1, after), generator=g)], dim=1)


def inputs(sizes, texts):
    """One random image a row, rows left padded; pixel_values (B, V, 3, 512, 512) padded with blank views."""
    images = [[(np.random.RandomState(h * w).rand(h, w, 3) * 255).astype("uint8")] for h, w in sizes]
    rows = [prompt(size, *text) for size, text in zip(sizes, texts)]
    n = max(r.shape[1] for r in rows)
    ids = torch.cat([torch.cat([torch.full((1, n - r.shape[1]), PAD), r], dim=1) for r in rows])
    mask = torch.cat([torch.cat([torch.zeros(1, n - r.shape[1], dtype=torch.long), torch.ones_like(r)], dim=1)
                      for r in rows])
    return dict(input_ids=ids, attention_mask=mask, **processor()(images=images, return_tensors="pt"))


@pytest.fixture(scope="module")
def model():
    return smolvlm()


@pytest.fixture(scope="module")
def one():
    return inputs([(1000, 200)], [(4, 12)])  # 4 x 1 crops and the global view: 5 views, 320 tokens


@pytest.fixture(scope="module")
def plain(model, one):
    with torch.no_grad():
        logits = model(**one).logits
    return logits, model.generate(**one, max_new_tokens=4, do_sample=False)


def test_the_counts_are_the_image_processors(model):
    for size in [(480, 640), (300, 300), (1000, 200), (2000, 1500), (512, 512)]:
        views, rows, cols = processor().get_number_of_image_patches(*size, {})
        resized = (max(rows, 1) * 512, max(cols, 1) * 512)
        assert vlm.plain_tokens(model, resized) == 64 * max(views, 1), size
    assert vlm.plain_tokens(model, (300, 400)) == 64  # no splitting: one view
    timm_tokcomp.apply(model, "visionzip", dominant=12, contextual=4)
    try:
        assert timm_tokcomp.tokens_for(model, (1536, 2048)) == 13 * 16
        with pytest.raises(ValueError, match="multiples of 512"):
            timm_tokcomp.tokens_for(model, (1000, 200))
    finally:
        timm_tokcomp.remove(model)


def test_keeping_every_token_gives_the_plain_logits_and_tokens_bit_for_bit(model, one, plain):
    timm_tokcomp.apply(model, "visionzip", dominant=60, contextual=4)  # 64: every token of every view
    try:
        with torch.no_grad():
            assert torch.equal(model(**one).logits, plain[0])
        assert torch.equal(model.generate(**one, max_new_tokens=4, do_sample=False), plain[1])
    finally:
        timm_tokcomp.remove(model)


@pytest.mark.slow  # several forwards over 5 views
def test_smolvlm_keeps_every_token_bit_for_bit_and_cuts_its_runs():
    model = smolvlm(smol=True)
    sample = inputs([(1000, 200)], [(2, 5)])
    with torch.no_grad():
        before = model(**sample).logits
        timm_tokcomp.apply(model, "visionzip", dominant=63, contextual=1)
        assert torch.equal(model(**sample).logits, before)
        timm_tokcomp.set_params(model, dominant=10, contextual=2)
        assert model(**sample).logits.shape[1] == before.shape[1] - 5 * (64 - 12)
    assert type(model).__name__ == "ReducingSmolVLMForConditionalGeneration"
    timm_tokcomp.remove(model)
    assert type(model) is transformers.SmolVLMForConditionalGeneration


@pytest.mark.slow
def test_every_views_run_is_cut_to_k(model, one, plain):
    timm_tokcomp.apply(model, "visionzip", dominant=12, contextual=4)
    try:
        assert timm_tokcomp.tokens_for(model, (2048, 512)) == 5 * 16
        _, _, ids, _ = model._cut(one["input_ids"], one["attention_mask"], one["pixel_values"],
                                  one["pixel_attention_mask"], {})
        runs = image_runs(ids[0], IMAGE)
        assert [length for _, length in runs] == [16] * 5
        assert all(ids[0, start - 1] in (GLOBAL, *range(1100, 1132)) for start, _ in runs)
        with torch.no_grad():
            assert model(**one).logits.shape[1] == plain[0].shape[1] - 5 * 48
        tokens = model.generate(**one, max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens[:, :one["input_ids"].shape[1]], one["input_ids"]) and tokens.shape == plain[1].shape
    finally:
        timm_tokcomp.remove(model)


@pytest.mark.slow  # 18 views of 1024 patches
def test_rows_of_different_view_counts_equal_each_run_alone(model):
    sizes, texts = [(1000, 200), (480, 640)], [(3, 9), (7, 2)]  # 5 views; 13 views
    timm_tokcomp.apply(model, "visionzip", dominant=8, contextual=4)
    try:
        batch = model.generate(**inputs(sizes, texts), max_new_tokens=4, do_sample=False)
        for b in range(2):
            alone = model.generate(**inputs(sizes[b:b + 1], texts[b:b + 1]), max_new_tokens=4, do_sample=False)
            assert torch.equal(batch[b, -4:], alone[0, -4:])
    finally:
        timm_tokcomp.remove(model)


def test_the_importance_is_the_attention_received_pooled_by_the_shuffles_groups():
    """The dominant tokens of a view are those whose 4 x 4 patches receive the most attention at the block, read
    from the tower's eager probabilities; the shuffle's groups are the 4 x 4 squares of the 32 x 32 patch grid."""
    model = smolvlm(width=64, heads=4)
    groups = shuffle_groups(model.model.connector, 1024)
    square = torch.arange(1024).view(8, 4, 8, 4).permute(0, 2, 1, 3).reshape(64, 16)
    assert torch.equal(groups.sort(dim=1).values, square)
    sample = inputs([(1000, 200)], [(1, 1)])  # 5 views: the first one checked
    timm_tokcomp.apply(model, "visionzip", dominant=6, contextual=2, block=1)
    with torch.no_grad():
        _, kept = model.model.reduced_image_features(sample["pixel_values"], sample["pixel_attention_mask"])
        tower = model.model.vision_model
        tower.set_attn_implementation("eager")
        seen = {}
        handle = tower_layers(tower)[1].self_attn.register_forward_hook(lambda m, a, out: seen.update(p=out[1]))
        tower(pixel_values=sample["pixel_values"][0], patch_attention_mask=torch.ones(5, 32, 32, dtype=torch.bool))
        handle.remove()
    received = seen["p"][0].mean(dim=(0, 1))  # (1024,): mean over heads and queries
    pooled = received[square].mean(dim=1)
    dominant = set(pooled.argsort(descending=True, stable=True)[:6].tolist())
    assert len(kept) == 5 and dominant <= set(kept[0].tolist()) and len(kept[0]) == 8


def test_padded_patches_receive_no_importance():
    """A view whose right half is padding (pixel_attention_mask 0 there): its dominant tokens are in the left half,
    the received attention counted over the real patches only."""
    model = smolvlm(width=64, heads=4)
    sample = inputs([(300, 400)], [(1, 1)])
    pixels, mask = sample["pixel_values"][:, :1], sample["pixel_attention_mask"][:, :1].clone()
    mask[..., 256:] = False
    timm_tokcomp.apply(model, "visionzip", dominant=6, contextual=1)
    with torch.no_grad():
        _, kept = model.model.reduced_image_features(pixels, mask)
    left = [int(t) % 8 < 4 for t in kept[0]]  # token columns 0-3 of 8 hold patch columns 0-15 of 32
    assert len(left) == 7 and sum(left) >= 6


def test_set_params_remove_save_load_and_the_refusals(model, one, plain, tmp_path):
    with pytest.raises(ValueError, match="'tome'.*visionzip"):
        timm_tokcomp.apply(model, "tome", r=8)
    with pytest.raises(ValueError, match="block"):
        timm_tokcomp.apply(model, "visionzip", block=2)
    assert type(model) is transformers.Idefics3ForConditionalGeneration  # all or nothing
    timm_tokcomp.apply(model, "visionzip", dominant=20, contextual=4)
    timm_tokcomp.set_params(model, dominant=10)
    assert timm_tokcomp.tokens_for(model, (512, 512)) == 14 and state_of(model.model).reducer.contextual == 4
    model.save_pretrained(tmp_path)
    assert type(model).__name__ == "ReducingIdefics3ForConditionalGeneration"
    loaded = transformers.Idefics3ForConditionalGeneration.from_pretrained(tmp_path)
    assert type(loaded) is transformers.Idefics3ForConditionalGeneration and not timm_tokcomp.is_reduced(loaded)
    timm_tokcomp.remove(model)
    assert type(model) is transformers.Idefics3ForConditionalGeneration and state_of(model.model) is None
    with torch.no_grad():
        assert torch.equal(model(**one).logits, plain[0])
