"""Base models and devices, below everything that builds a model (bench, speed, tune, analysis, training):
the plain timm model with its weights, and the device a command runs on, both checked with the flag in the error."""
import contextlib
from pathlib import Path
from typing import Optional

import timm
import torch
from torch import nn

from .core import is_reduced
from .precision import check_device
from .userfiles import hub_access, hub_error, load_weights


def build_base_model(model_name: str, checkpoint: Optional[str], pretrained: bool, device: str,
                     seed: int = 0) -> nn.Module:
    """The unmodified timm model, with weights from checkpoint (safetensors / torch file) or timm; without either,
    timm's random initialisation drawn from `seed` (the caller's random stream left as it was), so every command
    that resumes (tune, analyze, finetune, train-tocom) meets the same random weights again.
    Raises ValueError / FileNotFoundError naming the argument for an unknown model, a missing checkpoint
    or a device this machine does not have."""
    check_device(device)
    if checkpoint and not Path(checkpoint).is_file():
        raise FileNotFoundError(f"--checkpoint {checkpoint} not found")
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
    return model.to(device).eval()
