"""Vision-language models: a method applied to the VLM reduces its visual tokens where its connector allows, and the
language model prefills only the kept ones (docs/vlm.md). One adapter per family (llava.py); transformers is
imported on first use.

    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder)
    timm_tokcomp.apply(model, "visionzip", dominant=108, contextual=20)  # 128 of LLaVA-1.5's 576 image tokens
    timm_tokcomp.tokens_for(model, (336, 336))                           # 128: before any image is encoded
    model.generate(**processor(images=image, text=prompt, return_tensors="pt"))
"""
import weakref
from typing import Any, Dict, Tuple

import torch
from torch import nn

from .. import core
from ..runtime.state import state_of

SERVED = ("LlavaForConditionalGeneration",)  # the plain classes an adapter serves, by name
_TOKENS: "weakref.WeakKeyDictionary[nn.Module, Dict[Any, int]]" = weakref.WeakKeyDictionary()  # tokens_for's counts


def looks_like_vlm(model: Any) -> bool:
    """Whether model is a transformers vision-language model (served or not): its class is a transformers
    *ForConditionalGeneration with a vision tower, or one of the served adapters' reducing classes."""
    module = type(model).__module__
    return isinstance(model, nn.Module) and module.startswith(("transformers.", "timm_tokcomp.vlm")) and (
        type(model).__name__.endswith("ForConditionalGeneration") and any(
            hasattr(getattr(model, "model", model), name) for name in ("vision_tower", "visual", "vision_model")))


def adapter_of(model: nn.Module) -> Any:
    """The model's VLM adapter; TypeError naming the served classes for a VLM no adapter serves."""
    from .llava import LlavaAdapter, ReducingLlavaForConditionalGeneration

    if type(model) in (*LlavaAdapter.plain_classes, ReducingLlavaForConditionalGeneration):  # no subclass: restore
        return LlavaAdapter                                                                # gives the plain class
    raise TypeError(f"{type(model).__name__} is a vision-language model timm_tokcomp does not serve yet; it serves "
                    f"{', '.join(SERVED)} (docs/vlm.md). Its vision tower alone can be reduced where its family is "
                    f"served (timm_tokcomp.apply(model.model.vision_tower, ...)), but its language model would then "
                    f"refuse the changed token count")


def is_reduced(model: nn.Module) -> bool:
    from .llava import ReducingLlavaForConditionalGeneration

    return isinstance(model, ReducingLlavaForConditionalGeneration)


def apply(model: nn.Module, method: str = "visionzip", **params: Any) -> nn.Module:
    """Reduce a VLM's visual tokens with `method` (in place; returns it): inside its vision tower up to the feature
    layer the projector reads, the schedule laid over those layers. 'none' removes a method applied before. All or
    nothing: a refused method or parameter leaves the model as it was."""
    adapter = adapter_of(model)
    adapter.check(model)
    if method == core.NO_REDUCTION:
        if params:
            raise ValueError(f"method 'none' takes no parameters, got {sorted(params)}")
        return remove(model)
    tower = adapter.tower(model)
    state = state_of(tower, create=True)
    before = state.depth
    state.depth = adapter.depth(model)  # read by patch: the schedule spans the layers up to the feature layer
    try:
        core.apply(tower, method, **params)
    except Exception:
        state.depth = before
        raise
    if not is_reduced(model):
        adapter.swap(model)
    _TOKENS.pop(model, None)
    return model


def set_params(model: nn.Module, **params: Any) -> nn.Module:
    """Change the method's parameters on a reduced VLM, as set_params does on a ViT."""
    adapter = adapter_of(model)
    if not is_reduced(model):
        raise ValueError(f"{type(model).__name__} is not reduced; apply a method first")
    core.set_params(adapter.tower(model), **params)
    _TOKENS.pop(model, None)
    return model


def remove(model: nn.Module) -> nn.Module:
    """The plain VLM again (its classes and its tower's); a VLM without a method is returned unchanged."""
    adapter = adapter_of(model)
    if is_reduced(model):
        core.remove(adapter.tower(model))
        adapter.restore(model)
    _TOKENS.pop(model, None)
    return model


def tokens_for(model: nn.Module, image_size: Tuple[int, int]) -> int:
    """The image tokens a reduced VLM gives its language model for one image of image_size (H, W), known before any
    image is encoded (what a serving engine sizes its placeholders by). Counted once per size and method from a
    blank image (the count of a fixed-count method does not depend on the pixels); ValueError for a method whose
    count depends on the image (atm, dymu, ats, ...): it is known only when the encoder has run."""
    adapter = adapter_of(model)
    if not is_reduced(model):
        raise ValueError(f"{type(model).__name__} is not reduced: its processor's count is the count")
    tower = adapter.tower(model)
    reducer = core.get_reducer(tower)
    if reducer.spec.data_dependent or reducer.spec.masks_by_size:
        raise ValueError(f"{reducer.name} keeps a count that depends on each image; it is known only once the encoder "
                         f"ran (generate cuts the placeholder runs then). A fixed-count method (visionzip, tome, evit, "
                         f"topk) has a count known before")
    key = (id(reducer), tuple(int(v) for v in image_size))
    counts = _TOKENS.setdefault(model, {})
    if key not in counts:
        from .llava import tower_tokens

        param = next(tower.parameters())
        blank = torch.zeros(1, 3, *key[1], device=param.device, dtype=param.dtype)
        with torch.no_grad():
            counts[key] = tower_tokens(tower, blank, model.config.vision_feature_select_strategy)[0].shape[0]
    return counts[key]


def plain_tokens(model: nn.Module, image_size: Tuple[int, int]) -> int:
    """The image tokens the plain VLM gives its language model per image of image_size (its processor's count)."""
    from .llava import plain_count

    adapter_of(model)
    return plain_count(model, tuple(image_size))


__all__ = ["SERVED", "adapter_of", "apply", "is_reduced", "looks_like_vlm", "plain_tokens", "remove", "set_params",
           "tokens_for"]

