"""The one reader per kind of file a user hands the package (image folders and labels are in `data`): each checks
the file at the door and raises UserFileError, a ValueError whose message names the flag and the file, instead of
a traceback from deep inside a library. Hugging Face Hub access (snapshots, offline advice): timm_tokcomp.files.hub.

Every file is opened through `bounded` (regular files only, bytes, JSON digits and nesting, zip members by their
declared sizes). A file is data (docs/guarantees.md, "Files you did not make"): torch files are read with
weights_only=True (no code runs), a path read from a file stays inside its folder (inside), and the sizes a file
declares are compared with the tensors a weights file holds, read from its header, before anything is built
(safetensors_shapes, check_declared_size)."""
import math
import pickle
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch
from torch import nn

from ..utils.checks import is_version
from .bounded import UserFileError, check_torch_zip, fail, read_json, regular_file  # noqa: F401 (imported from here)

PathLike = Union[str, Path]


def read_versioned_json(folder: PathLike, name: str, version: int, what: str, flag: Optional[str] = None) -> dict:
    """folder/name, which marks a complete folder of `what`, with format_version `version`."""
    path = Path(folder) / name
    if not path.exists():  # a FIFO or device of that name is refused by read_json, naming what it is
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

    regular_file(path, flag)
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise fail(flag, path, f"cannot be read as safetensors ({e})") from None
    if finite:
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise fail(flag, path, f"holds NaN or inf in tensor {name!r}")
    return tensors


def read_torch(path: PathLike, flag: Optional[str] = None) -> Any:
    """What torch.save wrote to a file, read with weights_only=True: tensors and plain values (dict, list, tuple,
    str, numbers, None) only, so unpickling runs no code; a file holding other objects, or a truncated or foreign
    one, is refused naming the flag and the file, and so is a zip whose members would unpack beyond the file
    (bounded.check_torch_zip). The package's only torch.load."""
    check_torch_zip(path, flag)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused_pickle(e, path, flag) from None
    except Exception as e:  # zip / pickle errors of a truncated or foreign file
        raise fail(flag, path, f"cannot be read as a torch checkpoint ({type(e).__name__}: {e})") from None


def _refused_pickle(error: pickle.UnpicklingError, path: PathLike, flag: Optional[str]) -> UserFileError:
    """The refusal of a torch file that weights_only=True would not unpickle (an object, or a broken pickle)."""
    last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    return fail(flag, path, f"holds more than tensors and plain values, or is a broken pickle; it is read with "
                            f"torch.load(weights_only=True) and nothing in it was run ({last[:200]}). Save the "
                            f"weights alone (torch.save(model.state_dict(), ...) or safetensors)")


def torch_file_shapes(path: PathLike, flag: Optional[str] = None) -> Dict[str, Tuple[int, ...]]:
    """The shape of every tensor of a torch state-dict file, mapped rather than read (torch.load(mmap=True,
    weights_only=True)): what safetensors_shapes is for a .safetensors file. Refused as read_torch refuses."""
    check_torch_zip(path, flag)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise _refused_pickle(e, path, flag) from None
    except Exception as e:  # a truncated or foreign file, or an old (not zip) format that cannot be mapped
        raise fail(flag, path, f"cannot be read as a torch state dict ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise fail(flag, path, "holds no state dict of tensors (model weights)")
    return {key: tuple(value.shape) for key, value in state.items()}


def inside(folder: PathLike, name: Any, source: PathLike, flag: Optional[str] = None) -> Path:
    """folder/name for a name read from the file `source`: a relative path that stays inside folder once resolved
    (no absolute name, no '..', no symbolic link leading out), else refused naming the file and the name."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise fail(flag, source, f"names {name!r}, which is not a file name")
    parts = Path(name).parts
    if Path(name).is_absolute() or name.startswith("~") or ".." in parts:
        raise fail(flag, source, f"names {name!r}, outside {folder}: names in it must be relative paths inside "
                                 f"its folder (no absolute path, no '..')")
    root = Path(folder).resolve()
    target = (Path(folder) / name).resolve()
    if not target.is_relative_to(root):
        raise fail(flag, source, f"names {name!r}, which leads outside {folder} through a symbolic link")
    return Path(folder) / name


def safetensors_shapes(path: PathLike, flag: Optional[str] = None) -> Dict[str, Tuple[int, ...]]:
    """The shape of every tensor of a .safetensors file, from its header alone (no tensor is read); a truncated
    or corrupt file is refused (the check for files another library then loads: peft's adapter)."""
    from safetensors import safe_open

    regular_file(path, flag)
    try:
        with safe_open(str(path), "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise fail(flag, path, f"cannot be read as safetensors ({e})") from None


def numel(shapes: Iterable[Tuple[int, ...]]) -> int:
    """The number of elements of tensors of these shapes."""
    return sum(math.prod(shape) for shape in shapes)


def check_declared_size(declared: int, held: int, what: str, source: PathLike, weights: str,
                        flag: Optional[str] = None, slack: int = 0) -> None:
    """Refuse, before anything is built, a config (source) that declares `declared` elements of `what` where its
    weights (named `weights`) hold `held` (+ slack for parts a load may initialise itself): a few bytes of
    config must not make the package allocate what no file holds."""
    if declared > held + slack:
        raise fail(flag, source, f"describes {what} of {declared:,} elements ({declared * 4 / 2**30:.2f} GiB in "
                                 f"float32), but {weights} holds {held:,}: refused before building it (they must "
                                 f"agree)")


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
