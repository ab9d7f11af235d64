"""Qwen2-VL / Qwen2.5-VL (docs/vlm.md), reduced after the merger: Qwen2-VL-2B's vision width, heads, patch, temporal
patch and 2x2 merge (1280 wide, 16 heads, patch 14), the processor's real packing of a 448 x 336 image (32 x 24
patches, 192 merged tokens), and Qwen2-VL-2B's text attention layout (1536 wide, 12 heads, 2 KV heads, M-RoPE
sections 16/24/24) in 2 layers; random weights, 4 tower blocks (the path does not depend on the depth). Keep-all is
the plain model bit for bit; K tokens reach the language model with the plain model's M-RoPE ids; batch rows equal
each run alone; Qwen2.5-VL's window order is undone; remove, save / load; the refusals."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import timm_tokcomp  # noqa: E402
from timm_tokcomp.runtime.state import state_of  # noqa: E402
from timm_tokcomp.vlm.placeholders import image_runs  # noqa: E402

IMAGE, START, END, PAD = 1000, 1001, 1002, 1004


def qwen(v25: bool = False, seed: int = 0) -> torch.nn.Module:
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    torch.manual_seed(seed)
    text = dict(vocab_size=1024, hidden_size=1536, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=12,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                                                        "rope_theta": 1e6}, pad_token_id=PAD)
    ids = dict(image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=1003)
    if v25:  # Qwen2.5-VL-3B's tower: RMSNorm, SwiGLU, 112-pixel windows, full attention at the last block
        vision = dict(depth=4, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=1536,
                      fullatt_block_indexes=[1, 3], window_size=112)
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))
    else:
        vision = dict(depth=4, embed_dim=1280, hidden_size=1536, num_heads=16)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **ids))
    model.eval().set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = PAD
    return model


def image(h: int, w: int, seed: int = 0):
    """The processor's pixel_values (h/14 * w/14, 1176) and image_grid_thw (1, 3) of a random h x w image."""
    from transformers import Qwen2VLImageProcessor

    pixels = (np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")
    out = Qwen2VLImageProcessor()(images=[pixels], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def prompt(before: int, after: int, grid: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """(1, L) ids as the processor writes them: text, <|vision_start|>, one placeholder per merged token,
    <|vision_end|>, text."""
    g = torch.Generator().manual_seed(seed)
    n = int(grid.prod()) // 4
    return torch.cat([torch.randint(2, 999, (1, before), generator=g), torch.tensor([[START]]),
                      torch.full((1, n), IMAGE), torch.tensor([[END]]), torch.randint(2, 999, (1, after), generator=g)],
                     dim=1)


def inputs(rows, pixels, grids):
    """Rows of ids, left padded as the processor pads for generation -> the processor's keyword arguments."""
    n = max(r.shape[1] for r in rows)
    ids = torch.cat([torch.cat([torch.full((1, n - r.shape[1]), PAD), r], dim=1) for r in rows])
    mask = torch.cat([torch.cat([torch.zeros(1, n - r.shape[1], dtype=torch.long), torch.ones_like(r)], dim=1)
                      for r in rows])
    return dict(input_ids=ids, attention_mask=mask, pixel_values=torch.cat(pixels), image_grid_thw=torch.cat(grids),
                mm_token_type_ids=(ids == IMAGE).long())


@pytest.fixture(scope="module")
def model():
    return qwen()


@pytest.fixture(scope="module")
def one():
    pixels, grid = image(448, 336)
    return inputs([prompt(5, 32, grid)], [pixels], [grid])


@pytest.fixture(scope="module")
def plain(model, one):
    with torch.no_grad():
        logits = model(**one).logits
    tokens = model.generate(**one, max_new_tokens=6, do_sample=False)
    return logits, tokens


@pytest.mark.slow  # a 1280-wide tower on 768 patches, several forwards
def test_keeping_every_token_gives_the_plain_logits_and_tokens_bit_for_bit(model, one, plain):
    timm_tokcomp.apply(model, "visionzip", dominant=180, contextual=12)  # 192: every merged token
    try:
        with torch.no_grad():
            assert torch.equal(model(**one).logits, plain[0])
        assert torch.equal(model.generate(**one, max_new_tokens=6, do_sample=False), plain[1])
    finally:
        timm_tokcomp.remove(model)


@pytest.mark.slow
def test_k_tokens_reach_the_language_model_with_the_plain_models_mrope_ids(model, one, plain):
    full, _ = model.model.get_rope_index(one["input_ids"], mm_token_type_ids=one["mm_token_type_ids"],
                                         image_grid_thw=one["image_grid_thw"], attention_mask=one["attention_mask"])
    timm_tokcomp.apply(model, "visionzip", dominant=40, contextual=8)
    try:
        assert timm_tokcomp.tokens_for(model, (448, 336)) == 48
        assert timm_tokcomp.tokens_for(model, (112, 112)) == 16  # an image of 16 merged tokens keeps them all
        features, kept = model.model.reduced_image_features(one["pixel_values"], one["image_grid_thw"])
        assert [f.shape for f in features] == [(48, 1536)] and kept[0].tolist() == sorted(set(kept[0].tolist()))
        _, ids, _, types, positions, _ = model._cut(**{k: one[k] for k in ("input_ids", "attention_mask",
                                                                         "pixel_values", "image_grid_thw",
                                                                         "mm_token_type_ids")}, kwargs={})
        (start, length), = image_runs(one["input_ids"][0], IMAGE)
        assert ids.shape[1] == one["input_ids"].shape[1] - 144 and image_runs(ids[0], IMAGE) == [(start, 48)]
        assert torch.equal(types, (ids == IMAGE).long())
        assert torch.equal(positions[:, 0, :start], full[:, 0, :start])  # the text before
        assert torch.equal(positions[:, 0, start:start + 48], full[:, 0, start + kept[0]])  # each kept token's (t,h,w)
        assert torch.equal(positions[:, 0, start + 48:], full[:, 0, start + length:])  # the text after keeps its ids
        with torch.no_grad():
            logits = model(**one).logits
        assert logits.shape[1] == plain[0].shape[1] - 144
        tokens = model.generate(**one, max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens[:, :one["input_ids"].shape[1]], one["input_ids"]) and tokens.shape == plain[1].shape
    finally:
        timm_tokcomp.remove(model)


@pytest.mark.slow
def test_batch_rows_of_different_image_sizes_equal_each_row_run_alone(model):
    (p1, g1), (p2, g2) = image(448, 336, seed=1), image(336, 336, seed=2)  # 192 and 144 merged tokens
    rows = [prompt(3, 20, g1, seed=1), prompt(9, 7, g2, seed=2)]
    timm_tokcomp.apply(model, "visionzip", dominant=30, contextual=6)
    try:
        batch = model.generate(**inputs(rows, [p1, p2], [g1, g2]), max_new_tokens=5, do_sample=False)
        for b, (row, p, g) in enumerate(zip(rows, (p1, p2), (g1, g2))):
            alone = model.generate(**inputs([row], [p], [g]), max_new_tokens=5, do_sample=False)
            assert torch.equal(batch[b, -5:], alone[0, -5:])
    finally:
        timm_tokcomp.remove(model)


@pytest.mark.slow
def test_set_params_remove_and_save_load(model, one, plain, tmp_path):
    timm_tokcomp.apply(model, "visionzip", dominant=40, contextual=8)
    timm_tokcomp.set_params(model, dominant=20)
    assert timm_tokcomp.tokens_for(model, (448, 336)) == 28 and timm_tokcomp.is_reduced(model)
    model.save_pretrained(tmp_path)
    assert type(model).__name__ == "ReducingQwen2VLForConditionalGeneration"
    loaded = transformers.Qwen2VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert type(loaded) is transformers.Qwen2VLForConditionalGeneration and not timm_tokcomp.is_reduced(loaded)
    timm_tokcomp.remove(model)
    assert type(model) is transformers.Qwen2VLForConditionalGeneration
    assert type(model.model) is transformers.Qwen2VLModel and state_of(model.model) is None
    with torch.no_grad():
        assert torch.equal(model(**one).logits, plain[0])


def test_qwen25_window_order_is_undone_before_selection():
    """2.5's blocks hold the merged tokens in window order: the importance read there, put back in raster order,
    equals the attention each token receives computed on the raster-ordered tokens."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision
    from transformers.vision_utils import get_vision_window_index

    from timm_tokcomp.vlm.qwen2_vl import received_attention

    model = qwen(v25=True)
    pixels, grid = image(224, 336)  # 16 x 24 patches: several 112-pixel windows, one cut short
    visual = model.model.visual
    attn = visual.blocks[-1].attn
    seen = {}
    handle = attn.register_forward_pre_hook(lambda m, a, k: seen.update(x=a[0], **k), with_kwargs=True)
    with torch.no_grad():
        visual(pixels, grid_thw=grid)
    handle.remove()
    window, _ = get_vision_window_index(grid, spatial_merge_size=2, window_size=112, patch_size=14)
    back = torch.argsort(window)
    raster = lambda t: t.reshape(-1, 4, *t.shape[1:])[back].reshape(t.shape)  # noqa: E731
    with torch.no_grad():
        ours, _ = received_attention(attn, seen["x"], seen["cu_seqlens"], seen["position_embeddings"],
                                     apply_rotary_pos_emb_vision)
        reference, _ = received_attention(attn, raster(seen["x"]), seen["cu_seqlens"],
                                          tuple(raster(t) for t in seen["position_embeddings"]),
                                          apply_rotary_pos_emb_vision)
    assert not torch.allclose(ours, reference)  # the orders differ: the test can tell them apart
    assert torch.allclose(raster(ours), reference, atol=1e-6)
    timm_tokcomp.apply(model, "visionzip", dominant=20, contextual=4)
    with torch.no_grad():
        _, kept = model.model.reduced_image_features(pixels, grid)
        imp = reference.view(-1, 4).mean(dim=1)
    dominant = set(imp.argsort(descending=True, stable=True)[:20].tolist())
    assert dominant <= set(kept[0].tolist())


@pytest.mark.slow
def test_qwen25_keeping_every_token_is_the_plain_model_and_k_tokens_reach_it():
    model = qwen(v25=True)
    pixels, grid = image(224, 336)
    batch = inputs([prompt(4, 12, grid)], [pixels], [grid])
    with torch.no_grad():
        plain = model(**batch).logits
        timm_tokcomp.apply(model, "visionzip", dominant=90, contextual=6)  # all 96 merged tokens
        assert torch.equal(model(**batch).logits, plain)
        timm_tokcomp.set_params(model, dominant=20, contextual=4)
        assert model(**batch).logits.shape[1] == plain.shape[1] - 72
    assert model.generate(**batch, max_new_tokens=3, do_sample=False).shape[1] == batch["input_ids"].shape[1] + 3


def test_other_methods_and_parameters_are_refused_by_name():
    model = qwen()
    with pytest.raises(ValueError, match="'tome'.*visionzip"):
        timm_tokcomp.apply(model, "tome", r=8)
    with pytest.raises(ValueError, match=r"\['prop_attn'\]"):
        timm_tokcomp.apply(model, "visionzip", prop_attn=True)
    with pytest.raises(ValueError, match="dominant"):
        timm_tokcomp.apply(model, "visionzip", dominant=0)
    with pytest.raises(ValueError, match="block"):
        timm_tokcomp.apply(model, "visionzip", block=4)
    assert type(model) is transformers.Qwen2VLForConditionalGeneration  # all or nothing
    timm_tokcomp.apply(model, "visionzip")
    with pytest.raises(ValueError, match="multiples of 28"):
        timm_tokcomp.tokens_for(model, (448, 330))
    pixels, grid = image(112, 112)
    batch = inputs([prompt(2, 2, grid)], [pixels], [grid])
    with pytest.raises(ValueError, match="position_ids"):
        model(**batch, position_ids=torch.zeros(3, 1, batch["input_ids"].shape[1], dtype=torch.long))
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        model(**{**batch, "mm_token_type_ids": None})
