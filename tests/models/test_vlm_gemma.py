"""Gemma 3 (docs/vlm.md), reduced after its average-pool connector: Gemma 3-4B's SigLIP tower layout (so400m: 1152
wide, 16 heads, patch 14, 896 pixels: 64 x 64 patches pooled to 16 x 16 = 256 tokens) in 2 layers, and its text
attention layout (2560 wide, 8 heads, 4 KV heads, head_dim 256, a sliding and a full layer) in 2 layers; random
weights. Keep-all is the plain model bit for bit; K tokens reach the language model as one bidirectional block;
batch rows equal each run alone; the importance equals a reference computed from the attention probabilities;
set_params, save / load, remove; the refusals."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import timm_tokcomp  # noqa: E402
from timm_tokcomp import vlm  # noqa: E402
from timm_tokcomp.runtime.state import state_of  # noqa: E402
from timm_tokcomp.vlm.connector import tower_layers  # noqa: E402
from timm_tokcomp.vlm.placeholders import image_runs  # noqa: E402

IMAGE, BOI, EOI, PAD = 1000, 1001, 1002, 0


def gemma(seed: int = 0) -> torch.nn.Module:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=1024, hidden_size=2560, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4, head_dim=256, sliding_window=1024,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=PAD)
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=2, num_attention_heads=16,
                  image_size=896, patch_size=14, vision_use_head=False)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256,
                                                        image_token_index=IMAGE, boi_token_index=BOI,
                                                        eoi_token_index=EOI)).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = PAD
    return model


def prompt(before: int, after: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    image = torch.cat([torch.tensor([[BOI]]), torch.full((1, 256), IMAGE), torch.tensor([[EOI]])], dim=1)
    return torch.cat([torch.randint(3, 999, (1, before), generator=g), image,
                      torch.randint(3, 999, (1, after), generator=g)], dim=1)


def inputs(rows, seeds):
    """Rows left padded as the processor pads for generation, one random 896 x 896 image each."""
    n = max(r.shape[1] for r in rows)
    ids = torch.cat([torch.cat([torch.full((1, n - r.shape[1]), PAD), r], dim=1) for r in rows])
    mask = torch.cat([torch.cat([torch.zeros(1, n - r.shape[1], dtype=torch.long), torch.ones_like(r)], dim=1)
                      for r in rows])
    pixels = torch.cat([torch.randn(1, 3, 896, 896, generator=torch.Generator().manual_seed(s)) for s in seeds])
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=(ids == IMAGE).long())


@pytest.fixture(scope="module")
def model():
    return gemma()


@pytest.fixture(scope="module")
def one():
    return inputs([prompt(4, 24)], [0])


@pytest.fixture(scope="module")
def plain(model, one):
    with torch.no_grad():
        logits = model(**one).logits
    return logits, model.generate(**one, max_new_tokens=4, do_sample=False)


@pytest.mark.slow  # a 4096-patch SigLIP tower, several forwards
def test_keeping_every_token_gives_the_plain_logits_and_tokens_bit_for_bit(model, one, plain):
    timm_tokcomp.apply(model, "visionzip", dominant=250, contextual=6)  # 256: every pooled token
    try:
        with torch.no_grad():
            assert torch.equal(model(**one).logits, plain[0])
        assert torch.equal(model.generate(**one, max_new_tokens=4, do_sample=False), plain[1])
    finally:
        timm_tokcomp.remove(model)


@pytest.mark.slow
def test_k_tokens_reach_the_language_model_as_one_bidirectional_block(model, one, plain):
    timm_tokcomp.apply(model, "visionzip", dominant=40, contextual=8)
    try:
        assert timm_tokcomp.tokens_for(model, (896, 896)) == 48 and vlm.plain_tokens(model, (896, 896)) == 256
        _, _, ids, _, types = model._cut(one["input_ids"], one["attention_mask"], one["pixel_values"],
                                         one["token_type_ids"], {})
        (start, _), = image_runs(one["input_ids"][0], IMAGE)
        assert image_runs(ids[0], IMAGE) == [(start, 48)] and torch.equal(types, (ids == IMAGE).long())
        assert ids[0, start - 1] == BOI and ids[0, start + 48] == EOI
        with torch.no_grad():
            assert model(**one).logits.shape[1] == plain[0].shape[1] - 208
        tokens = model.generate(**one, max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens[:, :one["input_ids"].shape[1]], one["input_ids"]) and tokens.shape == plain[1].shape
    finally:
        timm_tokcomp.remove(model)


@pytest.mark.slow
def test_batch_rows_equal_each_row_run_alone(model):
    rows = [prompt(3, 20, seed=1), prompt(9, 7, seed=2)]
    timm_tokcomp.apply(model, "visionzip", dominant=30, contextual=6)
    try:
        batch = model.generate(**inputs(rows, [1, 2]), max_new_tokens=4, do_sample=False)
        for b, row in enumerate(rows):
            alone = model.generate(**inputs([row], [b + 1]), max_new_tokens=4, do_sample=False)
            assert torch.equal(batch[b, -4:], alone[0, -4:])
    finally:
        timm_tokcomp.remove(model)


def test_the_importance_is_the_pooled_attention_each_patch_receives():
    """The dominant tokens are the pooled tokens whose 4 x 4 patches receive the most attention at the block, the
    attention computed here from the softmax of q kᵀ itself (the probabilities, whole)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)  # a 224-pixel tower (16 x 16 patches pooled to 4 x 4) keeps this test quick
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=1024, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32),
        vision_config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=224, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=16, image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)).eval()
    pixels = torch.randn(1, 3, 224, 224)
    attn = tower_layers(model.model.vision_tower)[0].self_attn
    seen = {}
    handle = attn.register_forward_pre_hook(lambda m, a, k: seen.update(x=a[0] if a else k["hidden_states"]),
                                            with_kwargs=True)
    timm_tokcomp.apply(model, "visionzip", dominant=5, contextual=2, block=0)
    with torch.no_grad():
        _, kept = model.model.reduced_image_features(pixels)
        handle.remove()
        x = seen["x"][0]
        q = attn.q_proj(x).view(256, 4, 16).transpose(0, 1)
        k = attn.k_proj(x).view(256, 4, 16).transpose(0, 1)
        probs = (q @ k.transpose(1, 2) * 16 ** -0.5).softmax(-1)  # (H, N, N)
        patch = probs.mean(dim=(0, 1)).view(16, 16)
        pooled = patch.view(4, 4, 4, 4).permute(0, 2, 1, 3).reshape(16, 16).mean(-1)  # (4 x 4 pooled tokens)
    dominant = set(pooled.argsort(descending=True, stable=True)[:5].tolist())
    assert dominant <= set(kept[0].tolist()) and len(kept[0]) == 7


@pytest.mark.slow
def test_set_params_remove_save_load_and_the_refusals(model, one, plain, tmp_path):
    with pytest.raises(ValueError, match="'tome'.*visionzip"):
        timm_tokcomp.apply(model, "tome", r=8)
    with pytest.raises(ValueError, match=r"\['prop_attn'\]"):
        timm_tokcomp.apply(model, "visionzip", prop_attn=True)
    with pytest.raises(ValueError, match="block"):
        timm_tokcomp.apply(model, "visionzip", block=2)
    assert type(model) is transformers.Gemma3ForConditionalGeneration  # all or nothing
    timm_tokcomp.apply(model, "visionzip", dominant=40, contextual=8)
    timm_tokcomp.set_params(model, dominant=20)
    assert timm_tokcomp.tokens_for(model, (896, 896)) == 28
    with pytest.raises(ValueError, match="resizes every image"):
        timm_tokcomp.tokens_for(model, (448, 448))
    model.save_pretrained(tmp_path)
    assert type(model).__name__ == "ReducingGemma3ForConditionalGeneration"
    loaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path)
    assert type(loaded) is transformers.Gemma3ForConditionalGeneration and not timm_tokcomp.is_reduced(loaded)
    timm_tokcomp.remove(model)
    assert type(model) is transformers.Gemma3ForConditionalGeneration and state_of(model.model) is None
    with torch.no_grad():
        assert torch.equal(model(**one).logits, plain[0])
