"""Saving and loading a learned method's parameters (the module a method attaches as model.tokcomp[<method>]):
`<method>.safetensors` with its state_dict and `<method>_config.json` with the shape its class rebuilds."""
import json
from pathlib import Path
from typing import Union

from safetensors.torch import save_file
import torch
from torch import nn

from ..utils.checks import is_version
from . import method_class
from ..files.outputs import replacing, write_text
from ..files.userfiles import read_json, read_safetensors, safetensors_shapes

FORMAT_VERSION = 1


def weights_file(method: str) -> str:
    return f"{method}.safetensors"


def config_file(method: str) -> str:
    return f"{method}_config.json"


def save_learned(module: nn.Module, method: str, folder: Union[str, Path]) -> None:
    """Write the parameters and their config into folder (weights first, config last, each renamed into place)."""
    folder = Path(folder)
    with replacing(folder / weights_file(method)) as tmp:
        save_file({k: v.detach().float().cpu().contiguous() for k, v in module.state_dict().items()}, str(tmp))
    config = {"format_version": FORMAT_VERSION, "method": method, **module.config()}
    write_text(folder / config_file(method), json.dumps(config, indent=2) + "\n")


def load_learned(method: str, folder: Union[str, Path]) -> nn.Module:
    """The parameters saved by save_learned in folder. Raises FileNotFoundError / ValueError saying what is
    missing or does not fit; whether they fit a model is checked when the method is applied with them."""
    folder = Path(folder)
    cls = method_class(method).spec.learned_class
    if cls is None:
        raise ValueError(f"method {method!r} has no learned parameters")
    config_path, weights_path = folder / config_file(method), folder / weights_file(method)
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: not a folder with saved {method} parameters")
    config = read_json(config_path)
    if not is_version(config.get("format_version"), FORMAT_VERSION) or config.get("method") != method:
        raise ValueError(f"{config_path}: expected format_version {FORMAT_VERSION} and method {method!r}, got "
                         f"{config.get('format_version')!r} / {config.get('method')!r}")
    try:
        with torch.device("meta"):  # the sizes the config declares, allocating nothing
            expected = {k: tuple(v.shape) for k, v in cls.from_config(config).state_dict().items()}
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    shapes = safetensors_shapes(weights_path)  # from the header: compared before anything is built
    wrong = sorted(k for k in set(expected) | set(shapes) if shapes.get(k) != expected.get(k))
    if wrong:
        described = ", ".join(f"{k} {shapes[k] if k in shapes else 'missing'} (expected "
                              f"{expected[k] if k in expected else 'none'})" for k in wrong[:5])
        raise ValueError(f"{weights_path} does not match {config_path} (missing, extra or mis-shaped: "
                         f"{described}{', ...' if len(wrong) > 5 else ''})")
    module = cls.from_config(config)
    tensors = read_safetensors(weights_path)  # finite, or refused naming the tensor
    module.load_state_dict(tensors)
    return module
