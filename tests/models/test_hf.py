"""transformers' vision encoders (timm_tokcomp.families.hf): ViTModel, ViTForImageClassification, Dinov2Model (with
registers too), CLIPVisionModel and SiglipVisionModel, small random configurations in both attention implementations
('sdpa', 'eager'); and DeiT-Tiny's real weights converted into transformers' ViT."""
import copy
import re

import pytest
import torch

import timm_tokcomp
from timm_tokcomp.measure.counting import count_macs
from timm_tokcomp.methods import METHODS
from conftest import DATA, require_data

transformers = pytest.importorskip("transformers")

SMALL = dict(image_size=32, patch_size=4, hidden_size=48, num_hidden_layers=4, num_attention_heads=3)
CONFIGS = {
    "vit_classifier": lambda: (transformers.ViTForImageClassification,
                               transformers.ViTConfig(intermediate_size=96, num_labels=5, **SMALL)),
    "vit": lambda: (transformers.ViTModel, transformers.ViTConfig(intermediate_size=96, **SMALL)),
    "dinov2": lambda: (transformers.Dinov2Model, transformers.Dinov2Config(mlp_ratio=2, layerscale_value=0.5, **SMALL)),
    "dinov2_registers": lambda: (transformers.Dinov2WithRegistersModel, transformers.Dinov2WithRegistersConfig(
        mlp_ratio=2, num_register_tokens=4, **SMALL)),
    "clip": lambda: (transformers.CLIPVisionModel, transformers.CLIPVisionConfig(intermediate_size=96, **SMALL)),
    "siglip": lambda: (transformers.SiglipVisionModel, transformers.SiglipVisionConfig(intermediate_size=96, **SMALL)),
}
PREFIX = {"vit_classifier": 1, "vit": 1, "dinov2": 1, "dinov2_registers": 5, "clip": 1, "siglip": 0}


def hf_model(name, impl="sdpa", seed=0):
    cls, config = CONFIGS[name]()
    config._attn_implementation = impl
    torch.manual_seed(seed)
    return cls(config).eval()


def _images(batch=2, seed=1, size=32):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _fields(out):
    return {k: v for k, v in out.items() if v is not None}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_r0_is_the_plain_model_bit_for_bit_and_remove_restores_it(name, impl):
    model = hf_model(name, impl)
    keys = list(model.state_dict())
    x = _images()
    with torch.no_grad():
        plain = model(x)
        timm_tokcomp.apply(model, "tome", r=0)
        assert timm_tokcomp.is_reduced(model) and list(model.state_dict()) == keys
        reduced = model(x)
        assert type(reduced) is type(plain) and reduced.keys() == plain.keys()
        for key, value in _fields(plain).items():
            assert torch.equal(reduced[key], value), key
        timm_tokcomp.remove(model)
        assert type(model) is CONFIGS[name]()[0] and not timm_tokcomp.is_reduced(model)
        for key, value in _fields(plain).items():
            assert torch.equal(model(x)[key], value), key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tome_reduces_every_class_and_set_params_last_stats_count_macs_follow(name):
    model = timm_tokcomp.apply(hf_model(name), "tome", r=8)
    x = _images()
    p = PREFIX[name]
    with torch.no_grad():
        out = model(x)
    stats = timm_tokcomp.last_stats(model)
    assert stats.tokens_per_block == [64 + p, 56 + p, 48 + p, 40 + p] and stats.tokens_out == 32 + p
    assert stats.size.shape == (2, 32 + p, 1) and torch.all(stats.size.sum(1) == 64 + p)
    assert out[0].shape[0] == 2 and all(torch.isfinite(v).all() for v in _fields(out).values())
    macs = count_macs(model, x)
    timm_tokcomp.set_params(model, r=4)
    with torch.no_grad():
        model(x)
    assert timm_tokcomp.last_stats(model).tokens_out == 48 + p
    assert count_macs(model, x) > macs
    plain_macs = count_macs(timm_tokcomp.remove(model), x)
    assert plain_macs > count_macs(timm_tokcomp.apply(model, "tome", r=4), x)


@pytest.mark.parametrize("method, params", [("evit", dict(r=6)), ("topk", dict(keep_rate=0.7, stages=(2, 3))),
                                            ("atm", dict(alpha=0.2, beta=0.0, theta_min=0.2)), ("pitome", dict(r=4)),
                                            ("dct", dict(r=4)), ("kmedoids", dict(keep_rate=0.7, stages=(2, 3)))])
@pytest.mark.parametrize("name", ["vit_classifier", "dinov2_registers", "siglip"])
def test_training_free_methods_run_on_transformers_models(name, method, params):
    if METHODS[method].spec.needs_class_token and name == "siglip":
        with pytest.raises(ValueError, match="class token"):
            timm_tokcomp.apply(hf_model(name), method, **params)
        return
    model = timm_tokcomp.apply(hf_model(name), method, **params)
    x = _images()
    with torch.no_grad():
        out = model(x)
        for i in range(0 if METHODS[method].spec.batch_adaptive else 2):  # per image, the same result
            torch.testing.assert_close(model(x[i:i + 1])[0], out[0][i:i + 1], atol=1e-4, rtol=1e-4)
    assert timm_tokcomp.last_stats(model).tokens_out < 64 + PREFIX[name]


def _masked_plain(model, x, kept):
    """The plain transformers ViT classifier with the tokens dropped after layer i masked out of attention from
    layer i + 1 on."""
    h = model.vit.embeddings(x)
    mask = None
    for i, layer in enumerate(model.vit.layers):
        h = layer(h, mask)
        mask = torch.zeros(kept[i].shape, dtype=h.dtype).masked_fill(~kept[i], float("-inf"))[:, None, None, :]
    return model.classifier(model.vit.layernorm(h)[:, 0])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_pruning_is_the_plain_model_with_the_pruned_tokens_masked(impl):
    plain = hf_model("vit_classifier", impl)
    model = timm_tokcomp.apply(copy.deepcopy(plain), "topk", keep_rate=0.5, stages=(2, 3))
    x = _images()
    kept = []
    with torch.no_grad():
        timm_tokcomp.patch.trace_blocks(model, x, lambda i, tokens, source, positions: kept.append(source.sum(1) > 0.5))
        assert kept[-1].sum() < kept[0].numel()
        torch.testing.assert_close(model(x).logits, _masked_plain(plain, x, kept), atol=1e-5, rtol=1e-5)


def test_siglip_head_pools_a_merged_pair_as_the_two_identical_tokens():
    """No position embedding: two identical patches stay identical tokens. ToMe merging that pair in the first
    layer (one token of size 2, log size in every later attention and in the attention-pool head) changes nothing."""
    plain = hf_model("siglip")
    with torch.no_grad():
        plain.embeddings.position_embedding.weight.zero_()
    model = timm_tokcomp.apply(copy.deepcopy(plain), "tome", r=[1, 0, 0, 0], trace_source=True)
    torch.manual_seed(3)
    x = torch.randn(2, 3, 32, 32)
    x[:, :, :4, 4:8] = x[:, :, :4, :4]  # patches 0 and 1 (A and B of ToMe's split) identical
    with torch.no_grad():
        expected, out = plain(x), model(x)
    stats = timm_tokcomp.last_stats(model)
    assert stats.tokens_out == 63 and torch.all(stats.source[:, :, 0] == stats.source[:, :, 1])
    torch.testing.assert_close(out.pooler_output, expected.pooler_output, atol=1e-5, rtol=1e-5)


def test_what_a_reduced_model_cannot_serve_is_refused_by_name():
    model = timm_tokcomp.apply(hf_model("vit"), "tome", r=4)
    x = _images()
    for name in ("output_attentions", "output_hidden_states", "bool_masked_pos", "attention_mask"):
        with pytest.raises(ValueError, match=f"{name} is not supported while tokens are reduced"):
            model(x, **{name: torch.ones(2, 64, dtype=torch.bool) if name == "bool_masked_pos" else True})
    with pytest.raises(TypeError, match=r"unexpected arguments \['other'\]"):
        model(x, other=1)
    with pytest.raises(ValueError, match=r"B >= 1 .*empty batch.*\(0, 3, 32, 32\)"):
        model(x[:0])
    assert isinstance(model(x, return_dict=False), tuple)
    with pytest.raises(ValueError, match="mctf"):
        timm_tokcomp.apply(hf_model("vit"), "mctf", r=4)
    with pytest.raises(TypeError, match="dense methods serve timm's models"):
        timm_tokcomp.apply(hf_model("vit"), "dense_tome", r=1)
    flash = hf_model("vit")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation 'flash_attention_2' cannot take the token sizes"):
        timm_tokcomp.apply(flash, "tome", r=4)
    assert not timm_tokcomp.is_reduced(flash)


def test_interpolated_position_encoding_runs_on_a_larger_image():
    model = timm_tokcomp.apply(hf_model("vit_classifier"), "tome", r=8)
    with torch.no_grad():
        out = model(_images(size=48), interpolate_pos_encoding=True)
    assert out.logits.shape == (2, 5) and timm_tokcomp.last_stats(model).tokens_per_block[0] == 145


def test_labels_give_the_classifiers_loss():
    model = timm_tokcomp.apply(hf_model("vit_classifier"), "tome", r=8)
    out = model(_images(), labels=torch.tensor([1, 3]))
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, torch.tensor([1, 3])))


def deit_tiny_as_transformers_vit(state):
    """timm's DeiT-Tiny state dict -> transformers' ViTForImageClassification with the same weights (layer-norm
    eps 1e-6, GELU, class-token pooling)."""
    config = transformers.ViTConfig(image_size=224, patch_size=16, hidden_size=192, num_hidden_layers=12,
                                    num_attention_heads=3, intermediate_size=768, layer_norm_eps=1e-6,
                                    hidden_act="gelu", qkv_bias=True, num_labels=1000)
    config._attn_implementation = "sdpa"
    model = transformers.ViTForImageClassification(config).eval()
    mapped = {"vit.embeddings.cls_token": state["cls_token"], "vit.embeddings.position_embeddings": state["pos_embed"],
              "vit.embeddings.patch_embeddings.projection.weight": state["patch_embed.proj.weight"],
              "vit.embeddings.patch_embeddings.projection.bias": state["patch_embed.proj.bias"],
              "vit.layernorm.weight": state["norm.weight"], "vit.layernorm.bias": state["norm.bias"],
              "classifier.weight": state["head.weight"], "classifier.bias": state["head.bias"]}
    for i in range(12):
        timm_block, layer = f"blocks.{i}.", f"vit.layers.{i}."
        for part in ("weight", "bias"):
            for timm_name, hf_name in (("norm1", "layernorm_before"), ("norm2", "layernorm_after"),
                                       ("attn.proj", "attention.o_proj"), ("mlp.fc1", "mlp.fc1"),
                                       ("mlp.fc2", "mlp.fc2")):
                mapped[f"{layer}{hf_name}.{part}"] = state[f"{timm_block}{timm_name}.{part}"]
            for j, qkv in enumerate(state[f"{timm_block}attn.qkv.{part}"].chunk(3)):
                mapped[f"{layer}attention.{'qkv'[j]}_proj.{part}"] = qkv
    model.load_state_dict(mapped, strict=True)
    return model


# DeiT-Tiny's eval transform (timm's data config) as a transformers image processor would save it
DEIT_PREPROCESSOR = {"do_resize": True, "size": {"shortest_edge": 248}, "do_center_crop": True,
                     "crop_size": {"height": 224, "width": 224}, "resample": 3,
                     "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    """(timm's DeiT-Tiny, the same weights in transformers' ViTForImageClassification, that model saved with its
    image processor's config in a folder)."""
    import json

    import timm
    from safetensors.torch import load_file

    data = require_data()
    timm_model = timm.create_model("deit_tiny_patch16_224",
                                   checkpoint_path=str(data / "deit_tiny_patch16_224.safetensors")).eval()
    hf = deit_tiny_as_transformers_vit(load_file(str(data / "deit_tiny_patch16_224.safetensors")))
    folder = tmp_path_factory.mktemp("hf_deit_tiny")
    hf.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(DEIT_PREPROCESSOR))
    return timm_model, hf, folder


def test_deit_tiny_converted_into_transformers_gives_timms_logits_plain_and_reduced(real_pair):
    import timm

    from timm_tokcomp.models.build import load_hf_model

    timm_model, hf, folder = real_pair
    cfg = timm.data.resolve_model_data_config(timm_model)
    loaded = load_hf_model(str(folder))
    assert {k: loaded.pretrained_cfg[k] for k in ("input_size", "interpolation", "mean", "std")} == \
        {k: cfg[k] for k in ("input_size", "interpolation", "mean", "std")}
    assert int(224 / loaded.pretrained_cfg["crop_pct"]) == int(224 / cfg["crop_pct"]) == 248  # the same resize
    dataset = timm.data.create_dataset("", root=str(DATA / "imagenet-val-1300" / "images"))
    transform = timm.data.create_transform(**cfg)
    x = torch.stack([transform(dataset[i][0].convert("RGB")) for i in range(16)])
    with torch.no_grad():
        for r in (0, 8, 16):
            ours = timm_tokcomp.apply(copy.deepcopy(timm_model), "tome", r=r) if r else timm_model
            theirs = timm_tokcomp.apply(hf, "tome", r=r) if r else hf
            torch.testing.assert_close(theirs(x).logits, ours(x), atol=1e-4, rtol=1e-4)
    timm_tokcomp.remove(hf)


def test_bench_on_the_transformers_folder_reproduces_deit_tinys_tome_figures(real_pair, tmp_path):
    """`tokcomp bench --hf-model FOLDER`: ToMe r8 / r16 on transformers' ViT with DeiT-Tiny's weights, on the pixels
    of the folder's own image processor (DeiT's resize and crop as transformers computes them: 0.09 mean absolute
    from timm's transform), give timm's DeiT-Tiny rows on the first 300 images of imagenet-val-1300, image for image
    (`tokcomp bench deit_tiny_patch16_224 --checkpoint deit_tiny_patch16_224.safetensors --data imagenet-val-1300
    --limit 300 --methods none,tome_r8,tome_r16 --no-timing --batch-size 100`: top-1 / agreement plain 78.67 / 100,
    r8 79.00 / 97.00, r16 78.33 / 91.67)."""
    import csv

    from timm_tokcomp.cli import main

    out = tmp_path / "bench.csv"
    assert main(["bench", "--hf-model", str(real_pair[2]), "--data", str(DATA / "imagenet-val-1300"), "--limit", "300",
                 "--methods", "none,tome_r8,tome_r16", "--no-timing", "--batch-size", "100", "--num-workers", "0", "--out",
                 str(out), "--no-progress"]) == 0
    rows = {row["method"]: row for row in csv.DictReader(out.open())}
    figures = {name: (round(float(row["top1"]), 2), round(float(row["agreement"]), 2)) for name, row in rows.items()}
    assert figures == {"none": (78.67, 100.0), "tome_r8": (79.00, 97.00), "tome_r16": (78.33, 91.67)}
    assert rows["tome_r16"]["model"] == str(real_pair[2])


@pytest.mark.parametrize("name", ["vit_classifier", "siglip"])
def test_speed_and_bench_take_a_transformers_folder(name, tmp_path, capsys, unlabelled_folder):
    from timm_tokcomp.cli import main

    folder = tmp_path / name
    hf_model(name).save_pretrained(folder)
    with pytest.warns(UserWarning, match="no preprocessor_config.json"):
        assert main(["speed", "--hf-model", str(folder), "--methods", "tome_r8", "--batches", "2", "--rounds", "2",
                     "--no-progress"]) == 0
    assert "tome_r8" in capsys.readouterr().out
    with pytest.warns(UserWarning, match="no preprocessor_config.json"):
        assert main(["bench", "--hf-model", str(folder), "--methods", "none,tome_r8", "--rounds", "2",
                     "--latency-runs", "0", "--batch-size", "2", "--no-progress"]) == 0
    if name == "vit_classifier":  # tune: its weights are the folder's, not random ones
        with pytest.warns(UserWarning, match="no preprocessor_config.json"):
            assert main(["tune", "--hf-model", str(folder), "--data", str(unlabelled_folder), "--out",
                         str(tmp_path / "tune"), "--limit", "96", "--prune-images", "32", "--methods", "tome_r8",
                         "--rounds", "3", "--no-progress"]) == 0
        assert (tmp_path / "tune" / "preset.json").is_file() and "random weights" not in capsys.readouterr().err


def test_a_folder_that_is_not_a_served_transformers_model_is_refused_by_flag(tmp_path, capsys, unlabelled_folder):
    from timm_tokcomp.cli import main

    assert main(["speed", "--hf-model", str(tmp_path), "--no-progress"]) == 2
    assert f"--hf-model {tmp_path}: not a folder saved by save_pretrained" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    assert main(["speed", "--hf-model", str(tmp_path), "--no-progress"]) == 2
    assert "architectures ['BertModel']; timm_tokcomp serves one of transformers' ViTModel, " in \
        capsys.readouterr().err
    folder = tmp_path / "vit"
    hf_model("vit").save_pretrained(folder)
    with pytest.warns(UserWarning):
        code = main(["bench", "--hf-model", str(folder), "--data", str(unlabelled_folder), "--no-timing",
                     "--no-progress"])
    assert code == 2 and "features, no class scores" in capsys.readouterr().err


def test_a_reduced_transformers_model_compiles_by_region_without_graph_breaks():
    from torch._dynamo.utils import counters

    from timm_tokcomp.runtime import compile as compiling

    model = timm_tokcomp.apply(hf_model("vit_classifier"), "tome", r=8)
    torch._dynamo.reset()
    counters.clear()
    fast = compiling.compile(model, backend="eager")
    assert isinstance(fast, compiling.RegionallyCompiled)
    with torch.no_grad():
        for batch in (2, 3):
            x = _images(batch, seed=batch)
            torch.testing.assert_close(fast(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 3
    torch._dynamo.reset()


def test_save_pretrained_of_a_reduced_model_writes_the_plain_class(tmp_path):
    model = timm_tokcomp.apply(hf_model("vit_classifier"), "tome", r=8)
    model.save_pretrained(tmp_path)
    assert timm_tokcomp.is_reduced(model) and type(model).__name__ == "ReducingHFViTForImageClassification"
    loaded = transformers.ViTForImageClassification.from_pretrained(tmp_path).eval()
    assert loaded.config.architectures == ["ViTForImageClassification"] and not timm_tokcomp.is_reduced(loaded)
    x = _images()
    with torch.no_grad():
        torch.testing.assert_close(timm_tokcomp.apply(loaded, "tome", r=8)(x).logits, model(x).logits,
                                   rtol=0, atol=0)


def test_the_served_class_names_are_the_adapters_classes():
    from timm_tokcomp.families import HF_CLASSES
    from timm_tokcomp.families.hf import MODELS

    assert HF_CLASSES == tuple(cls.__name__ for cls in MODELS)


@pytest.mark.parametrize("text, match", [
    ("{", "preprocessor_config.json is not valid JSON"),
    ("[1]", "preprocessor_config.json must hold a JSON object, got list"),
    ('{"size": {"longest_edge": 32}}', r"must give size and crop_size .*got size \{'longest_edge': 32\}"),
    ('{"size": 32, "do_center_crop": true, "crop_size": 48}', r"crop_size \{'height': 48, 'width': 48\}"),
    ('{"size": 32, "image_std": [0.5, 0.5, 0]}', r"image_std \[0.5, 0.5, 0\]"),
    ('{"size": 32, "image_mean": [0.5, "a", 0.5]}', "image_mean"),
])
def test_a_bad_preprocessor_config_is_refused_naming_the_flag_and_file(text, match, tmp_path, capsys):
    from timm_tokcomp.cli import main

    hf_model("vit_classifier").save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(text)
    assert main(["speed", "--hf-model", str(tmp_path), "--batches", "1", "--rounds", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--hf-model {tmp_path}" in err and re.search(match, err), err


# (the plain ViTForImageClassification, Dinov2Model and Dinov2WithRegistersModel fail with config.return_dict = False
# in transformers 5: an inner module returns a tuple they read as an output object; return_dict=False in the call
# works for all, tested above)
@pytest.mark.parametrize("name", ["vit", "clip", "siglip"])
def test_a_reduced_model_answers_return_dict_and_output_switches_as_its_plain_class(name):
    """config.return_dict = False gives the plain class's tuple; an explicit output_attentions=False /
    output_hidden_states=False in the call wins over a config asking for them, as in transformers (whose config
    takes output_attentions with the 'eager' implementation only)."""
    model = hf_model(name, "eager")
    model.config.return_dict = False
    x = _images()
    with torch.no_grad():
        plain = model(x)
        reduced = timm_tokcomp.apply(model, "tome", r=0)(x)
        assert type(plain) is tuple and type(reduced) is tuple and len(reduced) == len(plain)
        for a, b in zip(reduced, plain):
            assert torch.equal(a, b)
        assert not isinstance(model(x, return_dict=True), tuple)
        model.config.return_dict = True
        model.config.output_attentions = model.config.output_hidden_states = True
        with pytest.raises(ValueError, match="output_attentions is not supported while tokens are reduced"):
            model(x)
        out = model(x, output_attentions=False, output_hidden_states=False)
        timm_tokcomp.remove(model)
        expected = model(x, output_attentions=False, output_hidden_states=False)
    assert type(out) is type(expected) and out.keys() == expected.keys()


def test_a_reduced_model_takes_the_plain_classes_positional_arguments():
    x = _images(size=48)
    with torch.no_grad():
        for name in ("clip", "siglip"):  # forward(pixel_values, interpolate_pos_encoding)
            model = hf_model(name)
            plain = model(x, True)
            reduced = timm_tokcomp.apply(model, "tome", r=0)(x, True)
            assert torch.equal(reduced.last_hidden_state, plain.last_hidden_state)
    model = timm_tokcomp.apply(hf_model("vit_classifier"), "tome", r=8)
    labels = torch.tensor([1, 3])
    assert model(_images(), labels).loss is not None  # forward(pixel_values, labels)
    with pytest.raises(TypeError, match=r"CLIPVisionModel.forward: .*labels|unexpected arguments \['labels'\]"):
        timm_tokcomp.apply(hf_model("clip"), "tome", r=8)(_images(), labels=labels)
    with pytest.raises(TypeError, match="ViTForImageClassification.forward: too many positional arguments"):
        model(_images(), labels, None, None, None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_pretrained_names_the_plain_class_of_every_served_model(name, tmp_path):
    model = timm_tokcomp.apply(hf_model(name), "tome", r=2)
    model.save_pretrained(tmp_path)
    plain = CONFIGS[name]()[0]
    assert transformers.AutoConfig.from_pretrained(tmp_path).architectures == [plain.__name__]
    assert type(model).__name__ == f"ReducingHF{plain.__name__}"


@pytest.mark.parametrize("processor", [
    lambda: transformers.ViTImageProcessor(size={"height": 32, "width": 32}, resample=1),  # squash, LANCZOS
    lambda: transformers.CLIPImageProcessor(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}),
], ids=["vit_squash_lanczos", "clip_shortest_edge_crop"])
def test_hf_model_images_get_the_folders_processor_pixels(processor, tmp_path):
    """--hf-model's image transform is transformers' own processor: a non-square photo gets its pixels exactly
    (timm's transform would keep the aspect and crop, and read LANCZOS as bilinear)."""
    import numpy as np
    from PIL import Image

    from timm_tokcomp.models.build import eval_transform, load_hf_model

    hf_model("vit_classifier").save_pretrained(tmp_path)
    processor().save_pretrained(tmp_path)
    photo = Image.fromarray((np.random.default_rng(0).random((45, 80, 3)) * 255).astype(np.uint8))
    theirs = type(processor()).from_pretrained(tmp_path)(photo, return_tensors="pt")["pixel_values"][0]
    model = load_hf_model(str(tmp_path))
    assert torch.equal(eval_transform(model)(photo), theirs)
    if isinstance(processor(), transformers.ViTImageProcessor):
        assert model.pretrained_cfg["interpolation"] == "lanczos"
