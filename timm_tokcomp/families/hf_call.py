"""How a reduced transformers model takes a call: bound as its plain class's forward binds it (positional arguments,
the plain class's TypeError), return_dict and output_attentions / output_hidden_states read from the call, else the
config (as transformers' decorators read them), and what a reduced model cannot serve refused by name. No
transformers import: families.hf hands the plain class and the config in."""
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

REFUSED = {
    "output_attentions": "the attention maps of a reduced model have a different token count in every layer",
    "output_hidden_states": "the hidden states of a reduced model have a different token count in every layer",
    "attention_mask": "a mask over the input tokens does not follow the tokens as they merge",
    "bool_masked_pos": "masked-image-modelling tokens do not follow the tokens as they merge",
    "head_mask": "head masks are not applied by a reduced model",
}


@functools.lru_cache(maxsize=None)
def forward_signature(plain: type) -> inspect.Signature:
    """The signature of a transformers class's forward (read once per class: calls bind to it)."""
    return inspect.signature(plain.forward)


@dataclass(frozen=True)
class Call:
    """A reduced model's call: pixel_values (B, 3, H, W), labels (a classifier's) or None, interpolate_pos_encoding
    as given (None: the model's default), return_dict resolved (False: the plain class's tuple)."""

    pixel_values: torch.Tensor
    labels: Optional[torch.Tensor]
    interpolate_pos_encoding: Optional[bool]
    return_dict: bool


def _named(plain: type, model: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The call's arguments by name, bound as plain.forward binds them; the extra keyword arguments transformers'
    forwards take in **kwargs (return_dict, output_attentions, ...) among them."""
    signature = forward_signature(plain)
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{plain.__name__}.forward: {e}") from None
    named = dict(bound.arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
    named.pop(next(iter(signature.parameters)))  # self
    return named


def bind_call(plain: type, model: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Call:
    """The call of model (a reduced `plain`, with its config) as `plain` takes it; ValueError for empty or missing
    pixel_values and for what REFUSED names, TypeError for an argument the reduced model does not take."""
    named = _named(plain, model, args, kwargs)
    takes_labels = "labels" in forward_signature(plain).parameters
    pixel_values, labels = named.pop("pixel_values", None), named.pop("labels", None) if takes_labels else None
    interpolate_pos_encoding, return_dict = named.pop("interpolate_pos_encoding", None), named.pop("return_dict", None)
    if pixel_values is None or pixel_values.shape[0] == 0:
        shape = None if pixel_values is None else tuple(pixel_values.shape)
        raise ValueError("pixel_values must be given, (B, 3, H, W) images with B >= 1 (transformers' attention "
                         f"functions cannot reshape an empty batch), got {shape}")
    for name, why in REFUSED.items():
        default = getattr(model.config, name, False) if name.startswith("output_") else None
        given = named.pop(name) if name in named else default
        if given is not None and given is not False:
            raise ValueError(f"{name} is not supported while tokens are reduced: {why}; call "
                             "timm_tokcomp.remove(model) for them")
    if named:
        raise TypeError(f"unexpected arguments {sorted(named)} for a reduced {type(model).__name__}")
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    return Call(pixel_values, labels, interpolate_pos_encoding, bool(return_dict))
