"""`tokcomp vlm` on a small LLaVA saved with its processor (a word-level tokenizer, CLIP's image processor and a chat
template, all built offline): the rows, the counts, greedy-answer agreement on a folder of images, --random-weights
from config.json alone, and the refusals at the door. The adapters' own checks at real configurations are in
tests/models/test_vlm*.py."""
import json
import shutil

import numpy as np
import pytest
from PIL import Image

transformers = pytest.importorskip("transformers")

from timm_tokcomp.cli import main  # noqa: E402
from timm_tokcomp.commands.vlm import Setting, parse_settings  # noqa: E402

IMAGE, PAD, BOS = 203, 201, 202
TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}"
            "{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %} w9{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A LLaVA (CLIP tower 56 px, patch 14: 16 image tokens under 'default'; 2 Llama layers) and its processor."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

    path = tmp_path_factory.mktemp("llava")
    vocab = {f"w{i}": i for i in range(200)}
    vocab.update({"<unk>": 200, "<pad>": PAD, "<s>": BOS, "<image>": IMAGE})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", extra_special_tokens={"image_token": "<image>"})
    images = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, image_token="<image>", chat_template=TEMPLATE).save_pretrained(path)
    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=204, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, pad_token_id=PAD)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                              image_size=56, patch_size=14)
    LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE,
                                              vision_feature_layer=-2,
                                              vision_feature_select_strategy="default")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    path = tmp_path_factory.mktemp("images")
    rng = np.random.RandomState(0)
    for i in range(3):
        Image.fromarray((rng.rand(70 + 10 * i, 64, 3) * 255).astype("uint8")).save(path / f"{i}.png")
    return path


def rows(out: str) -> dict:
    """setting -> its table cells."""
    lines = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith(("| setting", "| ---"))]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def test_settings_are_parsed_with_the_plain_model_first_and_malformed_ones_named():
    assert parse_settings("tome:r=4,visionzip:dominant=8:contextual=2") == [
        Setting("none", "none"), Setting("tome:r=4", "tome", {"r": 4}),
        Setting("visionzip:dominant=8:contextual=2", "visionzip", {"dominant": 8, "contextual": 2})]
    for bad, words in (("tome:r", "METHOD:NAME=VALUE"), ("none:r=1", "takes no parameters"),
                       ("tome:r=2,tome:r=2", "twice"), (":r=2", "METHOD:NAME=VALUE")):
        with pytest.raises(ValueError, match=words):
            parse_settings(bad)


def test_the_table_counts_tokens_and_answers_agree_where_every_token_is_kept(folder, images, capsys):
    code = main(["vlm", str(folder), "--data", str(images), "--prompt", "w1 w2", "--answer-tokens", "4", "--rounds",
                 "2", "--decode", "2", "--no-progress",
                 "--methods", "none,visionzip:dominant=15:contextual=1,visionzip:dominant=3:contextual=1"])
    out = capsys.readouterr().out
    assert code == 0, out
    table = rows(out)
    assert list(table) == ["none", "visionzip:dominant=15:contextual=1", "visionzip:dominant=3:contextual=1",
                           "limit K=4"]
    assert [cells[0] for cells in table.values()] == ["16 -> 16", "16 -> 16", "16 -> 4", "16 -> 4"]
    assert table["none"][-1].startswith("3/3") and table["visionzip:dominant=15:contextual=1"][-1].startswith("3/3")
    assert "answers: 3 images x 4 greedy tokens" in out
    gmacs = {name: float(cells[1]) for name, cells in table.items()}
    assert gmacs["visionzip:dominant=3:contextual=1"] < gmacs["none"]


def test_random_weights_build_from_config_json_alone(folder, tmp_path, capsys):
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    assert main(["vlm", str(tmp_path), "--random-weights", "--text-layers", "1", "--rounds", "1", "--decode", "1",
                 "--no-progress", "--no-limit", "--methods", "tome:r=2"]) == 0
    out = capsys.readouterr().out
    assert "(1 language-model layers, random weights)" in out
    assert [cells[0] for cells in rows(out).values()] == ["16 -> 16", "16 -> 10"]  # 3 layers to layer -2, r = 2


@pytest.mark.parametrize("change, flags, words", [
    (None, [], "holds no weights file"),
    ({"architectures": ["ViTModel"]}, ["--random-weights"], "names the architectures"),
    ({"text_config": {"num_hidden_layers": 10 ** 6}}, ["--random-weights"], "more than this machine's"),
    (None, ["--random-weights", "--text-layers", "3"], "--text-layers must be an integer in"),
    (None, ["--random-weights", "--data", "."], "--data: answering needs FOLDER"),
])
def test_the_door_refuses_before_anything_is_built(folder, tmp_path, capsys, change, flags, words):
    config = json.loads((folder / "config.json").read_text())
    for key, value in (change or {}).items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["vlm", str(tmp_path), "--no-progress", *flags]) == 2
    assert words in capsys.readouterr().err
