"""Vision-language models (docs/vlm.md): LLaVA-1.5's real vision configuration (CLIP-L/336, patch 14, 24 layers, 16
heads, read at layer -2 with the 'default' select strategy, 576 image tokens) before a small Llama, random weights.
r = 0 is the plain model bit for bit; K tokens reach the language model; batch rows equal each run alone; remove,
save / load; and the refusals."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import timm_tokcomp  # noqa: E402
from timm_tokcomp.vlm.placeholders import cut_runs, image_runs  # noqa: E402

IMAGE = 32000  # LLaVA-1.5's image token id
PAD = 32001


def llava(vision_layers: int = 24, seed: int = 0, **config) -> torch.nn.Module:
    """LLaVA-1.5-7B's vision tower and connector (CLIPVisionConfig of CLIP-L/336) before a 2-layer Llama."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=32064, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048, pad_token_id=PAD)
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=vision_layers,
                              num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE,
                      **{"vision_feature_layer": -2, "vision_feature_select_strategy": "default", **config})
    model = LlavaForConditionalGeneration(cfg).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = PAD
    return model


def prompt(before: int, after: int, seed: int = 0) -> torch.Tensor:
    """(1, before + 576 + after) ids: text, the image's 576 placeholders, text."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(2, 30000, (1, before), generator=g), torch.full((1, 576), IMAGE),
                      torch.randint(2, 30000, (1, after), generator=g)], dim=1)


def left_padded(rows):
    """Rows of ids padded on the left as LLaVA's processor pads for generation -> (input_ids, attention_mask)."""
    n = max(r.shape[1] for r in rows)
    ids = torch.cat([torch.cat([torch.full((1, n - r.shape[1]), PAD), r], dim=1) for r in rows])
    mask = torch.cat([torch.cat([torch.zeros(1, n - r.shape[1], dtype=torch.long), torch.ones_like(r)], dim=1)
                      for r in rows])
    return ids, mask


# ------------------------------------------------------------------ the placeholder cut (no model)


def test_a_cut_shortens_each_run_and_pads_the_rows_as_they_were_padded():
    ids = torch.tensor([[0, 0, 5, 9, 9, 9, 9, 6], [7, 9, 9, 9, 9, 8, 3, 3]])  # 9: placeholders, 0: padding
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    assert image_runs(ids[0], 9) == [(3, 4)]
    cut = cut_runs(ids, mask, 9, 4, [2, 1])
    assert cut.apply(ids, 0).tolist() == [[0, 5, 9, 9, 6], [7, 9, 8, 3, 3]]
    assert cut.apply(mask, 0).tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    right = cut_runs(ids[1:], None, 9, 4, [4])  # nothing cut: the rows as they were
    assert torch.equal(right.apply(ids[1:], 0), ids[1:])
    with pytest.raises(ValueError, match="a run of 4 image placeholder tokens; the plain model reads 5"):
        cut_runs(ids, mask, 9, 5, [2, 1])
    with pytest.raises(ValueError, match="2 image placeholder runs for 3 images"):
        cut_runs(ids, mask, 9, 4, [2, 1, 1])


# ------------------------------------------------------------------ LLaVA-1.5's vision configuration


@pytest.fixture(scope="module")
def plain_llava():
    model = llava()
    ids = prompt(5, 32)  # a 32-token prompt after the image, as the benchmark's
    pixels = torch.randn(1, 3, 336, 336, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels).logits
        tokens = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=6, do_sample=False)
    return model, ids, pixels, logits, tokens


@pytest.fixture
def model(plain_llava):
    model = plain_llava[0]
    yield model
    timm_tokcomp.remove(model)


def _llm_lengths(model):
    """A hook list: the sequence length of every language-model call."""
    seen = []
    handle = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["inputs_embeds"].shape[1]), with_kwargs=True)
    return seen, handle


@pytest.mark.slow  # a CLIP-L/336 tower, several forwards
@pytest.mark.parametrize("method,params", [("tome", dict(r=0)), ("visionzip", dict(dominant=575, contextual=1))])
def test_reducing_nothing_gives_the_plain_logits_and_tokens_bit_for_bit(model, plain_llava, method, params):
    _, ids, pixels, logits, tokens = plain_llava
    timm_tokcomp.apply(model, method, **params)
    assert timm_tokcomp.is_reduced(model) and timm_tokcomp.tokens_for(model, (336, 336)) == 576
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, pixel_values=pixels).logits, logits)
        assert torch.equal(model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=6, do_sample=False),
                           tokens)


@pytest.mark.slow
def test_k_tokens_reach_the_language_model_and_the_count_is_known_before(model, plain_llava):
    _, ids, pixels, _, tokens = plain_llava
    timm_tokcomp.apply(model, "visionzip", dominant=108, contextual=20)
    assert timm_tokcomp.tokens_for(model, (336, 336)) == 128  # before any image
    seen, handle = _llm_lengths(model)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=pixels).logits
            out = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=6, do_sample=False)
    finally:
        handle.remove()
    assert logits.shape[1] == ids.shape[1] - 576 + 128
    assert seen[0] == seen[1] == ids.shape[1] - 448 and seen[2:] == [1] * 5  # the prefill, then one token a step
    assert out.shape == tokens.shape and torch.equal(out[:, :ids.shape[1]], ids)  # the user's prompt, then 6 new


@pytest.mark.slow
@pytest.mark.parametrize("method,params", [("visionzip", dict(dominant=54, contextual=10)), ("tome", dict(r=12))])
def test_batch_rows_equal_each_row_run_alone(model, method, params):
    """Two images, prompts of different lengths, left padded as the processor pads: each row's new tokens and last
    logits are those of that row alone."""
    timm_tokcomp.apply(model, method, **params)
    rows = [prompt(3, 10, seed=2), prompt(9, 30, seed=3)]
    pixels = torch.randn(2, 3, 336, 336, generator=torch.Generator().manual_seed(4))
    ids, mask = left_padded(rows)
    with torch.no_grad():
        batch = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, max_new_tokens=4,
                               do_sample=False)
        last = model(input_ids=ids, attention_mask=mask, pixel_values=pixels).logits[:, -1]
        for i, row in enumerate(rows):
            alone = model.generate(input_ids=row, pixel_values=pixels[i:i + 1], max_new_tokens=4, do_sample=False)
            assert torch.equal(batch[i, -4:], alone[0, -4:])
            torch.testing.assert_close(last[i], model(input_ids=row, pixel_values=pixels[i:i + 1]).logits[0, -1],
                                       atol=1e-4, rtol=1e-4)
    count = timm_tokcomp.tokens_for(model, (336, 336))
    assert count == (64 if method == "visionzip" else 576 - 12 * 23)  # ToMe r = 12 in each of the 23 layers read


@pytest.mark.slow
def test_set_params_remove_and_save_load(model, plain_llava, tmp_path):
    _, ids, pixels, logits, _ = plain_llava
    timm_tokcomp.apply(model, "visionzip", dominant=54, contextual=10)
    timm_tokcomp.set_params(model, dominant=108)
    assert timm_tokcomp.tokens_for(model, (336, 336)) == 118
    with torch.no_grad():
        reduced = model(input_ids=ids, pixel_values=pixels).logits
    model.save_pretrained(tmp_path)  # the plain classes' names: loads as the plain LLaVA, the method applied again
    loaded = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert type(loaded) is transformers.LlavaForConditionalGeneration
    loaded.set_attn_implementation("sdpa")
    timm_tokcomp.apply(loaded, "visionzip", dominant=108, contextual=10)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, pixel_values=pixels).logits, reduced)
    timm_tokcomp.remove(model)
    assert type(model) is transformers.LlavaForConditionalGeneration and not timm_tokcomp.is_reduced(model)
    assert type(model.model.vision_tower) is transformers.CLIPVisionModel
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, pixel_values=pixels).logits, logits)


@pytest.mark.slow
def test_a_data_dependent_method_cuts_at_forward_time_and_has_no_count_before(model, plain_llava):
    _, ids, pixels, _, _ = plain_llava
    timm_tokcomp.apply(model, "atm", alpha=0.5, beta=0.0, theta_min=0.5)
    with pytest.raises(ValueError, match="atm keeps a count that depends on each image"):
        timm_tokcomp.tokens_for(model, (336, 336))
    with torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 2)


@pytest.mark.slow
def test_a_failed_apply_leaves_the_vlm_as_it_was(model):
    with pytest.raises(ValueError):
        timm_tokcomp.apply(model, "visionzip", dominant=0)
    assert type(model) is transformers.LlavaForConditionalGeneration and not timm_tokcomp.is_reduced(model)


def test_a_feature_layer_list_and_an_unserved_vlm_are_refused_by_name():
    model = llava(vision_layers=3, vision_feature_layer=[-2, -1])
    with pytest.raises(ValueError, match=r"vision_feature_layer \[-2, -1\] lists several layers.*reads one layer"):
        timm_tokcomp.apply(model, "visionzip")
    assert type(model) is transformers.LlavaForConditionalGeneration
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaOnevisionConfig,
                              LlavaOnevisionForConditionalGeneration)

    text = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=14)
    onevision = LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(vision_config=vision, text_config=text,
                                                                            image_token_index=500))
    with pytest.raises(TypeError, match=r"LlavaOnevisionForConditionalGeneration is a vision-language model "
                                        r"timm_tokcomp does not serve yet; it serves LlavaForConditionalGeneration"):
        timm_tokcomp.apply(onevision, "tome", r=2)
