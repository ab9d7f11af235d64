"""open_clip's towers and transformers' encoders through every command at the real configuration of their smallest
released architecture (tests/commands/real_configs.py): open_clip's ViT-B-32 (12 heads: nn.MultiheadAttention's
fused inference path), transformers' ViT-B/16 classifier, DINOv2-S (registers too), CLIP-B/32 and SigLIP-B/16 (the
attention-pool head), saved with save_pretrained and an image processor config, random weights. Commands without
--hf-model refuse the folder in one line; analyze refuses open_clip towers by name."""
import json

import pytest

from real_configs import COMMANDS, RealConfig, check, run_command

pytestmark = pytest.mark.slow
OPEN_CLIP = RealConfig(("open_clip:ViT-B-32",), refused=(("analyze", "analyze records timm models"),))
NO_HF = "unrecognized arguments: --hf-model"
HF_REFUSED = (("calibrate", NO_HF), ("analyze", NO_HF), ("export", NO_HF))
PROCESSOR = {"do_resize": True, "size": {"height": 224, "width": 224}, "resample": 3, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3}
# the processor class each released folder names (a folder without one is refused for other model types)
PROCESSOR_TYPE = {"vit_base_classifier": "ViTImageProcessor", "dinov2_small": "BitImageProcessor",
                  "dinov2_small_registers": "BitImageProcessor", "clip_base_32": "CLIPImageProcessor",
                  "siglip_base_16": "SiglipImageProcessor"}


def hf_configs():
    """name -> (class, config) of the released architectures (their hub configs' sizes)."""
    transformers = pytest.importorskip("transformers")
    return {
        "vit_base_classifier": (transformers.ViTForImageClassification, transformers.ViTConfig(num_labels=1000)),
        "dinov2_small": (transformers.Dinov2Model, transformers.Dinov2Config(
            hidden_size=384, num_attention_heads=6, image_size=518, patch_size=14)),
        "dinov2_small_registers": (transformers.Dinov2WithRegistersModel, transformers.Dinov2WithRegistersConfig(
            hidden_size=384, num_attention_heads=6, image_size=518, patch_size=14, num_register_tokens=4)),
        "clip_base_32": (transformers.CLIPVisionModel, transformers.CLIPVisionConfig(patch_size=32)),
        "siglip_base_16": (transformers.SiglipVisionModel, transformers.SiglipVisionConfig()),
    }


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    import torch

    folders = {}
    for name, (cls, config) in hf_configs().items():
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(name)
        cls(config).save_pretrained(folder)
        processor = {**PROCESSOR, "image_processor_type": PROCESSOR_TYPE[name]}
        (folder / "preprocessor_config.json").write_text(json.dumps(processor))
        folders[name] = folder
    return folders


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_serves_open_clips_smallest_vit(command, unlabelled_folder, tmp_path, capsys):
    pytest.importorskip("open_clip")
    code, err = run_command(command, OPEN_CLIP, unlabelled_folder, tmp_path, capsys)
    check(command, OPEN_CLIP, code, err)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_serves_or_refuses_the_transformers_vit(command, hf_folders, unlabelled_folder, tmp_path,
                                                             capsys):
    config = RealConfig(("--hf-model", str(hf_folders["vit_base_classifier"])), refused=HF_REFUSED)
    code, err = run_command(command, config, unlabelled_folder, tmp_path, capsys)
    check(command, config, code, err)


@pytest.mark.parametrize("name", ["dinov2_small", "dinov2_small_registers", "clip_base_32", "siglip_base_16"])
@pytest.mark.parametrize("command", ["bench", "speed"])
def test_each_transformers_class_counts_and_times_at_its_real_configuration(name, command, hf_folders,
                                                                           unlabelled_folder, tmp_path, capsys):
    config = RealConfig(("--hf-model", str(hf_folders[name])), methods=("tome_r2", "tome_r4"), classifier=False)
    code, err = run_command(command, config, unlabelled_folder, tmp_path, capsys)
    check(command, config, code, err)
