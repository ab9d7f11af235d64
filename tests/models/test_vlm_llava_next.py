"""LLaVA-NeXT (docs/vlm.md), reduced after packing: LLaVA-v1.6-Mistral-7B's tower layout (CLIP-L/336: 1024 wide, 16
heads, patch 14, the class token dropped under 'default', feature layer -2) in 3 layers, its grid points, images
made by transformers' LLaVA-NeXT image processor (a 300 x 700 image: the base view and 3 crops, unpadded), and
Mistral-7B's attention layout (4096 wide, 32 heads, 8 KV heads) in 2 layers; random weights. Keep-all is the plain
model bit for bit; K tokens reach the language model; rows of different image sizes equal each run alone; the
importance is the class token's attention, packed as the features are; the counts are the processor's; set_params,
save / load, remove; the refusals."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import timm_tokcomp  # noqa: E402
from timm_tokcomp import vlm  # noqa: E402
from timm_tokcomp.runtime.state import state_of  # noqa: E402
from timm_tokcomp.vlm.connector import tower_layers  # noqa: E402
from timm_tokcomp.vlm.placeholders import image_runs  # noqa: E402

IMAGE, PAD = 1000, 0
POINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def llava_next(width: int = 1024, heads: int = 16, text_width: int = 4096, seed: int = 0) -> torch.nn.Module:
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(model_type="clip_vision_model", hidden_size=width, intermediate_size=4 * width,
                  num_hidden_layers=3, num_attention_heads=heads, image_size=336, patch_size=14, projection_dim=768)
    text = dict(model_type="mistral", vocab_size=1024, hidden_size=text_width, intermediate_size=1024,
                num_hidden_layers=2, num_attention_heads=text_width // 128,
                num_key_value_heads=max(1, text_width // 512), pad_token_id=PAD)
    model = LlavaNextForConditionalGeneration(LlavaNextConfig(vision_config=vision, text_config=text,
                                                              image_grid_pinpoints=POINTS, image_token_index=IMAGE))
    model.eval().set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = PAD
    return model


def images(*sizes):
    """transformers' LLaVA-NeXT image processor on random images of sizes (H, W): pixel_values (B, V, 3, 336, 336),
    views padded with zeros, and image_sizes (B, 2)."""
    from transformers import LlavaNextImageProcessor

    processor = LlavaNextImageProcessor(image_grid_pinpoints=POINTS, size={"shortest_edge": 336},
                                        crop_size={"height": 336, "width": 336})
    pixels = [(np.random.RandomState(h * w).rand(h, w, 3) * 255).astype("uint8") for h, w in sizes]  # one per size
    return dict(processor(images=pixels, return_tensors="pt"))


def inputs(model, sizes, texts):
    """One image per row, its placeholder run after `before` text ids and before `after`, rows left padded."""
    rows = []
    for size, (before, after) in zip(sizes, texts):
        g = torch.Generator().manual_seed(100 * before + after)  # a row's text is the same in any batch
        rows.append(torch.cat([torch.randint(3, 999, (1, before), generator=g),
                               torch.full((1, vlm.plain_tokens(model, size)), IMAGE),
                               torch.randint(3, 999, (1, after), generator=g)], dim=1))
    n = max(r.shape[1] for r in rows)
    ids = torch.cat([torch.cat([torch.full((1, n - r.shape[1]), PAD), r], dim=1) for r in rows])
    mask = torch.cat([torch.cat([torch.zeros(1, n - r.shape[1], dtype=torch.long), torch.ones_like(r)], dim=1)
                      for r in rows])
    return dict(input_ids=ids, attention_mask=mask, **images(*sizes))


@pytest.fixture(scope="module")
def model():
    return llava_next()


@pytest.fixture(scope="module")
def one(model):
    return inputs(model, [(300, 700)], [(4, 20)])


@pytest.fixture(scope="module")
def plain(model, one):
    with torch.no_grad():
        logits = model(**one).logits
    return logits, model.generate(**one, max_new_tokens=4, do_sample=False)


def test_the_counts_are_the_processors():
    """plain_tokens counts by the model's own packing; LLaVA-NeXT's processor counts by its formula: they agree."""
    from transformers import LlavaNextProcessor

    model = llava_next(width=64, heads=4, text_width=128)
    processor = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=POINTS), patch_size=14,
                                num_additional_image_tokens=1)
    processor._get_unpadded_features = LlavaNextProcessor._get_unpadded_features.__get__(processor)
    for size in [(336, 336), (300, 700), (700, 300), (336, 672), (672, 672), (500, 400), (1000, 333), (40, 900)]:
        count = LlavaNextProcessor._get_number_of_features(processor, *size, 336, 336) - 1  # 'default': no CLS
        assert vlm.plain_tokens(model, size) == count, size
    timm_tokcomp.apply(model, "visionzip", dominant=500, contextual=40)
    assert timm_tokcomp.tokens_for(model, (672, 672)) == 540 and vlm.plain_tokens(model, (672, 672)) == 2928
    assert timm_tokcomp.tokens_for(model, (30, 30)) == 540  # the base view alone packs 577: more than 540


@pytest.mark.slow  # a 3-layer CLIP-L/336 over 4 views, a 4096-wide language model over 1,960 tokens
def test_keeping_every_token_gives_the_plain_logits_and_tokens_bit_for_bit(model, one, plain):
    timm_tokcomp.apply(model, "visionzip", dominant=4000, contextual=8)  # more than the 1944 packed tokens
    try:
        with torch.no_grad():
            assert torch.equal(model(**one).logits, plain[0])
        assert torch.equal(model.generate(**one, max_new_tokens=4, do_sample=False), plain[1])
    finally:
        timm_tokcomp.remove(model)


@pytest.mark.slow
def test_k_tokens_reach_the_language_model(model, one, plain):
    timm_tokcomp.apply(model, "visionzip", dominant=200, contextual=24)
    try:
        assert timm_tokcomp.tokens_for(model, (300, 700)) == 224
        _, _, ids, _ = model._cut(one["input_ids"], one["attention_mask"], one["pixel_values"], one["image_sizes"], {})
        (start, _), = image_runs(one["input_ids"][0], IMAGE)
        assert image_runs(ids[0], IMAGE) == [(start, 224)]
        with torch.no_grad():
            assert model(**one).logits.shape[1] == plain[0].shape[1] - (1944 - 224)
        tokens = model.generate(**one, max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens[:, :one["input_ids"].shape[1]], one["input_ids"]) and tokens.shape == plain[1].shape
    finally:
        timm_tokcomp.remove(model)


@pytest.mark.slow
def test_rows_of_different_image_sizes_equal_each_run_alone(model):
    sizes, texts = [(300, 700), (336, 672)], [(3, 12), (9, 4)]  # 4 views and 1944 tokens; 3 views and 1752
    timm_tokcomp.apply(model, "visionzip", dominant=100, contextual=12)
    try:
        batch = model.generate(**inputs(model, sizes, texts), max_new_tokens=4, do_sample=False)
        for b in range(2):
            alone = model.generate(**inputs(model, sizes[b:b + 1], texts[b:b + 1]), max_new_tokens=4,
                                   do_sample=False)
            assert torch.equal(batch[b, -4:], alone[0, -4:])
    finally:
        timm_tokcomp.remove(model)


def test_the_importance_is_the_class_tokens_attention_packed_as_the_features():
    """The dominant tokens are the packed tokens the class token of their own view attends to most at the block,
    the attention read from the tower's eager probabilities and packed here by hand: the base view's 576, then the
    48 x 48 grid of the 2 x 2 crops of a 672 x 672 image, row by row, each row closed by a newline."""
    model = llava_next(width=64, heads=4, text_width=128)
    sample = images((672, 672))
    timm_tokcomp.apply(model, "visionzip", dominant=40, contextual=8, block=0)
    with torch.no_grad():
        _, kept, plain = model.model.reduced_image_features(sample["pixel_values"], sample["image_sizes"], "default")
        tower = model.model.vision_tower
        tower.set_attn_implementation("eager")
        probs = tower(sample["pixel_values"][0], output_attentions=True).attentions[0]  # (5, H, 577, 577)
        cls = probs[:, :, 0, 1:].mean(dim=1)  # (5, 576)
    grid = cls[1:].view(2, 2, 24, 24).permute(0, 2, 1, 3).reshape(48, 48)  # crops in raster, rows of 48
    newline = torch.full((48, 1), -1.0)
    packed = torch.cat([cls[0], torch.cat([grid, newline], dim=1).flatten()])  # newlines never dominant
    assert plain == [packed.shape[0]] == [2928]
    dominant = set(packed.argsort(descending=True, stable=True)[:40].tolist())
    assert dominant <= set(kept[0].tolist()) and len(kept[0]) == 48
    assert not set(kept[0].tolist()) & set(range(576 + 48, 2928, 49))  # no newline kept
    assert len(tower_layers(tower)) == 3


def test_set_params_remove_save_load_and_the_refusals(tmp_path):
    model = llava_next(width=64, heads=4, text_width=128)
    sample = inputs(model, [(300, 700)], [(2, 3)])
    with torch.no_grad():
        before = model(**sample).logits
    with pytest.raises(ValueError, match="'tome'.*visionzip"):
        timm_tokcomp.apply(model, "tome", r=8)
    with pytest.raises(ValueError, match="block"):
        timm_tokcomp.apply(model, "visionzip", block=2)  # feature layer -2 of 3 layers reads 2
    model.config.vision_feature_select_strategy = "full"
    with pytest.raises(ValueError, match="'full'"):
        timm_tokcomp.apply(model, "visionzip")
    model.config.vision_feature_select_strategy = "default"
    assert type(model) is transformers.LlavaNextForConditionalGeneration  # all or nothing
    timm_tokcomp.apply(model, "visionzip", dominant=100, contextual=8, block=1)
    timm_tokcomp.set_params(model, dominant=50)
    assert timm_tokcomp.tokens_for(model, (300, 700)) == 58 and state_of(model.model).reducer.block == 1
    with pytest.raises(ValueError, match="image_sizes"):
        model(input_ids=sample["input_ids"], pixel_values=sample["pixel_values"])
    model.save_pretrained(tmp_path)
    assert type(model).__name__ == "ReducingLlavaNextForConditionalGeneration"
    loaded = transformers.LlavaNextForConditionalGeneration.from_pretrained(tmp_path)
    assert type(loaded) is transformers.LlavaNextForConditionalGeneration and not timm_tokcomp.is_reduced(loaded)
    timm_tokcomp.remove(model)
    assert type(model) is transformers.LlavaNextForConditionalGeneration and state_of(model.model) is None
    with torch.no_grad():
        assert torch.equal(model(**sample).logits, before)
