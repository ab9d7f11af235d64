"""Base models and devices, below everything that builds a model (bench, speed, tune, analysis, training):
the plain timm model with its weights, and the device a command runs on, both checked with the flag in the error."""
import contextlib
import math
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import timm
import torch
from torch import nn

from ..utils.checks import is_int, is_real
from ..core import is_reduced
from ..utils.extras import require
from ..families import HF_CLASSES
from ..measure.precision import check_device
from ..files.hub import hub_access, hub_error
from ..runtime.state import state_of
from .open_clip import is_open_clip_name, load_open_clip
from ..files.userfiles import (check_declared_size, load_weights, numel, read_json, safetensors_shapes,
                              torch_file_shapes)


class HFFolder(str):
    """A transformers model folder given as one (`--hf-model`): loaded as such even where its name is a timm name."""


def is_hf_folder(name: str) -> bool:
    """Whether name is a folder saved by transformers' save_pretrained (it holds a config.json), given as one
    (HFFolder) or by a path that is not a timm model name: a folder in the working directory named like a timm
    architecture never shadows it."""
    if not (Path(name).is_dir() and (Path(name) / "config.json").is_file()):
        return False
    return isinstance(name, HFFolder) or not timm.is_model(name)


# PIL's resampling codes in transformers' preprocessor configs, as timm names them
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


class ProcessorTransform:
    """A transformers image processor as an image transform: PIL image -> pixel_values (3, H, W), the processor's
    own resize, crop, rescale and normalisation (so its pixels exactly)."""

    def __init__(self, processor: Any):
        self.processor = processor

    def __call__(self, image: Any) -> torch.Tensor:
        return self.processor(image, return_tensors="pt")["pixel_values"][0]


def eval_transform(model: nn.Module) -> Callable[[Any], torch.Tensor]:
    """The transform a model's images are evaluated with: a transformers folder's own image processor (load_hf_model),
    else timm's eval transform of the model's data config."""
    state = state_of(model)
    own = None if state is None else state.eval_transform
    return own if own is not None else timm.data.create_transform(**timm.data.resolve_model_data_config(model))


def hf_data_config(folder: Path, image_size: int) -> Dict[str, Any]:
    """timm's data config (input_size, interpolation, mean, std, crop_pct) of a transformers model folder, read from
    its preprocessor_config.json (resize to size or shortest_edge, then an optional center crop); without one,
    transformers' ViT defaults (resize to image_size, bilinear, mean and std 0.5), with a warning."""
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        warnings.warn(f"--hf-model {folder} has no preprocessor_config.json: images are resized to {image_size} px "
                      "(bilinear) and normalised with mean and std 0.5, transformers' ViT defaults; save the image "
                      "processor beside the model (processor.save_pretrained(folder)) for its own", stacklevel=3)
        return dict(input_size=(3, image_size, image_size), interpolation="bilinear", mean=(0.5,) * 3,
                    std=(0.5,) * 3, crop_pct=1.0, crop_mode="center")
    pre = _folder_json(folder, "preprocessor_config.json")
    size = pre.get("size") or {"height": image_size, "width": image_size}
    size = {"height": size, "width": size} if isinstance(size, int) else size
    crop = pre.get("crop_size") if pre.get("do_center_crop") else None
    crop = {"height": crop, "width": crop} if isinstance(crop, int) else crop
    mean, std = pre.get("image_mean", (0.5,) * 3), pre.get("image_std", (0.5,) * 3)
    try:
        if crop is not None:
            resized = size.get("shortest_edge", size.get("height"))
            input_size, crop_pct = (3, crop["height"], crop["width"]), crop["height"] / resized
        else:
            side = size.get("shortest_edge")
            input_size, crop_pct = (3, side or size["height"], side or size["width"]), 1.0
        ok = all(is_int(v) and v > 0 for v in input_size) and 0 < crop_pct <= 1 and len(mean) == len(std) == 3 \
            and all(is_real(m) and math.isfinite(m) for m in mean) and all(is_real(s) and 0 < s < math.inf for s in std)
    except (AttributeError, KeyError, TypeError, ZeroDivisionError):
        ok = False
    if not ok:
        raise ValueError(f"--hf-model {folder}: preprocessor_config.json must give size and crop_size as a positive "
                         "int, {height, width} or {shortest_edge} (the crop within the resize), and image_mean / "
                         f"image_std as three finite numbers (std > 0); got size {size!r}, crop_size {crop!r}, "
                         f"image_mean {mean!r}, image_std {std!r}")
    return dict(input_size=input_size, interpolation=_RESAMPLE.get(pre.get("resample", 2), "bilinear"),
                mean=tuple(mean), std=tuple(std), crop_pct=crop_pct, crop_mode="center")


def _folder_json(folder: Path, name: str) -> Dict[str, Any]:
    """The JSON object in folder/name (bounded: bytes, nesting, digits), or UserFileError naming --hf-model and the
    file."""
    return read_json(folder / name, "--hf-model")


def load_hf_model(folder: str) -> nn.Module:
    """The transformers model saved in folder (save_pretrained), loaded offline in the class config.json names (one
    of the served: families.HF_CLASSES), with attn_implementation 'sdpa' and its data config as timm's
    pretrained_cfg (hf_data_config), so the commands' image transforms and input sizes follow it."""
    transformers = require("transformers", "hf", f"--hf-model {folder}")
    path = Path(folder)
    names = _folder_json(path, "config.json").get("architectures") or []
    if len(names) != 1 or names[0] not in HF_CLASSES:
        raise ValueError(f"--hf-model {folder}: its config.json names the architectures {names}; timm_tokcomp serves "
                         f"one of transformers' {', '.join(HF_CLASSES)}")
    _check_declared_size(transformers, names[0], path)
    try:
        model = getattr(transformers, names[0]).from_pretrained(str(path), local_files_only=True,
                                                               attn_implementation="sdpa")
    except RuntimeError as e:  # transformers' loading report: keys missing or of another shape than config.json's
        raise ValueError(f"--hf-model {folder}: its weights do not fit the {names[0]} its config.json describes "
                         f"(keys missing or of another shape, as transformers' report says: {e})") from None
    except (OSError, pickle.UnpicklingError) as e:  # a weights file transformers cannot read (weights_only refused)
        raise ValueError(f"--hf-model {folder}: its weights cannot be read ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''})") from None
    model.pretrained_cfg = {"architecture": str(folder), **hf_data_config(path, model.config.image_size)}
    processor = _image_processor(transformers, path, model.config.image_size)
    state_of(model, create=True).eval_transform = ProcessorTransform(processor)
    return model


def _check_declared_size(transformers: Any, architecture: str, folder: Path) -> None:
    """The model config.json describes holds no more parameters than the folder's weights files (their headers:
    safetensors, or a mapped torch file), before transformers builds it: a few bytes of config must not allocate
    gigabytes. At least layers x (4 width^2 + 2 width x MLP width) parameters; a quarter more, or 16M, is left for
    parts a load may initialise itself (a new head)."""
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ValueError(f"--hf-model {folder}: holds no weights file (*.safetensors or pytorch_model.bin)")
    held = numel(shape for f in files for shape in (safetensors_shapes(f, "--hf-model") if f.suffix == ".safetensors"
                                                    else torch_file_shapes(f, "--hf-model")).values())
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"--hf-model {folder}: config.json does not make a transformers config ({e})") from None
    sizes = {name: getattr(config, name, None) for name in ("num_hidden_layers", "hidden_size")}
    if not all(is_int(v) and v >= 1 for v in sizes.values()):
        raise ValueError(f"--hf-model {folder}: config.json's {sizes} must be integers >= 1")
    layers, width = sizes["num_hidden_layers"], sizes["hidden_size"]
    mlp = getattr(config, "intermediate_size", None)
    mlp = mlp if is_int(mlp) and mlp >= 1 else int(width * float(getattr(config, "mlp_ratio", 4) or 4))
    declared = layers * (4 * width * width + 2 * width * mlp)
    check_declared_size(declared, held, f"a {architecture} ({layers} layers of width {width})", folder / "config.json",
                        f"its weights ({', '.join(f.name for f in files)})", "--hf-model",
                        slack=max(held // 4, 16_000_000))


def _image_processor(transformers: Any, folder: Path, image_size: int) -> Any:
    """The folder's image processor (its preprocessor_config.json), or transformers' ViT defaults at image_size."""
    if not (folder / "preprocessor_config.json").is_file():
        return transformers.ViTImageProcessor(size={"height": image_size, "width": image_size})
    try:
        return transformers.AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"--hf-model {folder}: preprocessor_config.json does not make a transformers image "
                         f"processor ({e})") from None


def build_base_model(model_name: str, checkpoint: Optional[str], pretrained: bool, device: str,
                     seed: int = 0, trains: Optional[str] = None) -> nn.Module:
    """The unmodified timm model, with weights from checkpoint (safetensors / torch file) or timm (model_name a
    folder saved by transformers: its model, load_hf_model; 'open_clip:ARCH': open_clip's image tower with a
    zero-shot head, load_open_clip); without either, the random initialisation drawn from `seed` (the caller's
    random stream left as it was), so every command that resumes (tune, analyze, finetune, train-tocom) meets the
    same random weights again. trains: the training command asking (it refuses open_clip towers).
    Raises ValueError / FileNotFoundError naming the argument for an unknown model, a missing checkpoint
    or a device this machine does not have."""
    check_device(device)
    if trains and is_open_clip_name(model_name):
        raise ValueError(f"MODEL {model_name}: {trains} does not train open_clip towers (their attention's "
                         "in_proj is no Linear for LoRA, and they have no classifier to train); they serve bench, "
                         "speed, tune, calibrate and export")
    if is_hf_folder(model_name):
        if checkpoint or pretrained:
            raise ValueError(f"--hf-model {model_name} holds its own weights: give no --checkpoint or --pretrained")
        return check_finite_parameters(load_hf_model(model_name), weights_source(model_name, None, False)).to(
            device).eval()
    if checkpoint and not Path(checkpoint).is_file():
        raise FileNotFoundError(f"--checkpoint {checkpoint} not found")
    if is_open_clip_name(model_name):
        return check_finite_parameters(load_open_clip(model_name, checkpoint, pretrained, seed),
                                       weights_source(model_name, checkpoint, pretrained)).to(device).eval()
    try:
        with hub_access() if pretrained else contextlib.nullcontext(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = timm.create_model(model_name, pretrained=pretrained)
    except RuntimeError as e:
        if "Unknown model" not in str(e):
            raise
        raise ValueError(f"MODEL {model_name!r} is not a timm model name (timm.list_models('*vit*') lists them)") from None
    except OSError as e:  # huggingface_hub's download errors (offline, not cached, unknown repo) are OSErrors
        raise hub_error(e, model_name, "--pretrained") from None
    if is_reduced(model):
        raise ValueError(f"MODEL {model_name!r} already carries a method tag; give the plain architecture "
                         f"and list methods with --methods")
    if checkpoint:
        load_weights(model, checkpoint, "--checkpoint")
    return check_finite_parameters(model, weights_source(model_name, checkpoint, pretrained)).to(device).eval()


def weights_source(model_name: str, checkpoint: Optional[str], pretrained: bool) -> str:
    """Where build_base_model's weights come from, as an error names it: '--checkpoint FILE', '--hf-model FOLDER',
    timm's pretrained weights or the random initialisation."""
    if is_hf_folder(model_name):
        return f"--hf-model {model_name}"
    if checkpoint:
        return f"--checkpoint {checkpoint}"
    if is_open_clip_name(model_name):
        return f"open_clip's random weights of {model_name!r}"
    return f"timm's {'pretrained' if pretrained else 'random'} weights of {model_name!r}"


def check_finite_parameters(model: nn.Module, source: str) -> nn.Module:
    """model, or ValueError naming source (the weights' file or origin) and the first parameter holding NaN or inf;
    buffers may hold inf (attention masks). A model with NaN weights would predict class 0 for every image, its
    reduced twin too: 100 % agreement that means nothing."""
    for name, parameter in model.named_parameters():
        if parameter.is_floating_point() and not torch.isfinite(parameter).all():
            raise ValueError(f"{source}: parameter {name!r} holds NaN or inf; the weights are broken (the accuracy "
                             f"and agreement figures of such a model mean nothing)")
    return model
