"""The one reader per kind of file a user hands the package (image folders and labels are in `data`): each checks
the file at the door and raises UserFileError, a ValueError whose message names the flag and the file, instead of
a traceback from deep inside a library. Hugging Face Hub access (snapshots, offline advice): timm_tokcomp.hub."""
import json
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from torch import nn

from .checks import is_version

PathLike = Union[str, Path]


class UserFileError(ValueError):
    """A file given by the user that cannot be used: '<flag> <file> <what is wrong>'."""


def fail(flag: Optional[str], path: PathLike, problem: str) -> UserFileError:
    """'<flag> <path> <problem>': problem reads on from the file's name ('is not an image', ', line 3: ...')."""
    return UserFileError(f"{flag + ' ' if flag else ''}{path}{'' if problem.startswith(',') else ' '}{problem}")


def read_json(path: PathLike, flag: Optional[str] = None) -> dict:
    """A JSON object from a text file."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{path} is missing") from None
    except UnicodeDecodeError:
        raise fail(flag, path, "is not a text file (expected JSON)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise fail(flag, path, f"is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise fail(flag, path, f"must hold a JSON object, got {type(data).__name__}")
    return data


def read_versioned_json(folder: PathLike, name: str, version: int, what: str, flag: Optional[str] = None) -> dict:
    """folder/name, which marks a complete folder of `what`, with format_version `version`."""
    path = Path(folder) / name
    if not path.is_file():
        raise fail(flag, folder, f"has no {name}: not {what}")
    data = read_json(path, flag)
    if not is_version(data.get("format_version"), version):
        raise fail(flag, path, f"format_version {data.get('format_version')!r} is not supported (this version "
                               f"reads {version})")
    return data


def read_safetensors(path: PathLike, flag: Optional[str] = None, finite: bool = True) -> Dict[str, torch.Tensor]:
    """Every tensor of a .safetensors file; truncated or corrupt files are refused, and so (finite=True: learned
    parameters, adapters) is a floating-point tensor holding NaN or inf, named with its file."""
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{path} is missing")
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise fail(flag, path, f"cannot be read as safetensors ({e})") from None
    if finite:
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise fail(flag, path, f"holds NaN or inf in tensor {name!r}")
    return tensors


def check_safetensors(path: PathLike, flag: Optional[str] = None) -> None:
    """Refuse a truncated or corrupt .safetensors file from its header (which must cover the whole file), without
    reading its tensors: for files another library then loads (peft's adapter)."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{path} is missing")
    try:
        with safe_open(str(path), "pt"):
            pass
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise fail(flag, path, f"cannot be read as safetensors ({e})") from None


def read_torch(path: PathLike, flag: Optional[str] = None) -> Any:
    """What torch.save wrote to a file (full unpickling: for checkpoints this package wrote, or the user's own
    weights); truncated or foreign files are refused."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # zip / pickle errors of a truncated or foreign file
        raise fail(flag, path, f"cannot be read as a torch checkpoint ({type(e).__name__}: {e})") from None


def read_state_dict(path: PathLike, flag: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """A model's weights from a .safetensors or torch file (a bare state dict, or one under 'state_dict' / 'model' /
    'state_dict_ema', a 'module.' prefix removed, as timm's checkpoints hold them)."""
    if str(path).endswith(".safetensors"):
        return read_safetensors(path, flag, finite=False)  # a model's own buffers may hold inf (attention masks)
    state = read_torch(path, flag)
    if isinstance(state, dict):
        for key in ("state_dict", "model", "state_dict_ema"):
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict) or not state or not all(torch.is_tensor(v) for v in state.values()):
        raise fail(flag, path, "holds no state dict of tensors (model weights)")
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


def load_weights(model: nn.Module, path: PathLike, flag: str = "--checkpoint") -> None:
    """Load the weights file into model, every key and shape matching (strict)."""
    state = read_state_dict(path, flag)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mis_shaped = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or mis_shaped:
        parts = [f"{len(keys)} {what} (e.g. {', '.join(keys[:3])})" for keys, what in
                 ((missing, "missing keys"), (unexpected, "unexpected keys"), (mis_shaped, "keys of another shape"))
                 if keys]
        raise fail(flag, path, f"holds weights of another model than {type(model).__name__}: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)
