"""What a run's inputs are, by content, so that a resumed run (`tune --resume`, `finetune` / `train-tocom
--resume`) continues only on the weights and images it started on, however their paths are spelled: the same
folder given as a relative or an absolute path is the same input, another folder behind the same relative path is
not, and neither is another checkpoint or module of the same architecture. Computed once, before any work."""
import hashlib
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from .bounded import MAX_TEXT_BYTES, fail, read_bounded
from .data import IMAGE_SUFFIXES

DIGEST_CHARS = 16  # of the sha256 hex digest: what a settings file records and an error message shows
_LISTED_TEXT = (".csv", ".txt")  # labels and class lists: read whole


def weights_digest(model: nn.Module) -> str:
    """sha256 of `model`'s state_dict (every entry's name, dtype, shape and bytes, in name order), shortened."""
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        _update(h, name, value)
    return h.hexdigest()[:DIGEST_CHARS]


def _update(h: "hashlib._Hash", name: str, value: Any) -> None:
    """Feed one state_dict entry to h: a tensor by dtype, shape and bytes (a quantised one by its integers, scales
    and zero points), a tuple or list (a quantised Linear's packed parameters) item by item, anything else by repr."""
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            _update(h, f"{name}[{i}]", item)
    elif torch.is_tensor(value) and value.is_quantized:
        scheme = value.qscheme()
        per_channel = scheme in (torch.per_channel_affine, torch.per_channel_symmetric)
        parts = [value.int_repr()] + ([value.q_per_channel_scales(), value.q_per_channel_zero_points()] if per_channel
                                      else [torch.tensor(value.q_scale()), torch.tensor(value.q_zero_point())])
        for i, part in enumerate(parts):
            _update(h, f"{name}.{scheme}.{i}", part)
    elif torch.is_tensor(value):
        t = value.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(value.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().data)
    else:
        h.update(f"{name}|{value!r}|".encode())


def data_digest(path: Union[str, Path], flag: str = "--data") -> str:
    """sha256 of the images under `path` (a folder, or a labels .csv and the folder it lies in; a folder with a
    labels.csv is that file, as timm_tokcomp.files.data reads it), shortened: every
    image file's path relative to that folder and its size in bytes, and the whole text of every .csv / .txt (the
    labels). Hidden files and folders are left out. FileNotFoundError naming `flag` when `path` does not exist."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{flag}: {path} not found")
    if path.is_dir() and (path / "labels.csv").is_file():  # what the loaders read for such a folder
        path = path / "labels.csv"
    root = path.parent if path.is_file() else path
    h = hashlib.sha256()
    if path.is_file():
        h.update(f"file {path.name}|".encode() + read_bounded(path, flag, MAX_TEXT_BYTES, "labels file"))
    resolved = root.resolve()
    for file in sorted(root.rglob("*")):
        relative = file.relative_to(root)
        if any(part.startswith(".") for part in relative.parts) or not file.is_file():
            continue
        suffix = file.suffix.lower()
        if suffix in IMAGE_SUFFIXES:
            h.update(f"{relative.as_posix()}|{file.stat().st_size}|".encode())
        elif suffix in _LISTED_TEXT:
            if not file.resolve().is_relative_to(resolved):
                raise fail(flag, file, f"is a symbolic link leading outside {root}: nothing outside the folder is "
                                       "read")
            h.update(f"{relative.as_posix()}|".encode() + read_bounded(file, flag, MAX_TEXT_BYTES, "text file"))
    return h.hexdigest()[:DIGEST_CHARS]
