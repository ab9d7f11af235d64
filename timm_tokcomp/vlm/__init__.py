"""Vision-language models: a method applied to the VLM reduces its visual tokens where its connector allows, and the
language model prefills only the kept ones (docs/vlm.md). One adapter per family (llava.py, llava_next.py,
qwen2_vl.py, gemma3.py, idefics3.py; connector.py holds what the after-connector ones share), each holding what its
family reads and changes; transformers is imported on first use.

    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder)
    timm_tokcomp.apply(model, "visionzip", dominant=108, contextual=20)  # 128 of LLaVA-1.5's 576 image tokens
    timm_tokcomp.tokens_for(model, (336, 336))                           # 128: before any image is encoded
    model.generate(**processor(images=image, text=prompt, return_tensors="pt"))
"""
from typing import Any, Optional, Tuple

from torch import nn

from .. import core

# the plain classes the adapters serve, by name
SERVED = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration", "Qwen2VLForConditionalGeneration",
          "Qwen2_5_VLForConditionalGeneration", "Gemma3ForConditionalGeneration", "Idefics3ForConditionalGeneration",
          "SmolVLMForConditionalGeneration")


def looks_like_vlm(model: Any) -> bool:
    """Whether model is a transformers vision-language model (served or not): its class is a transformers
    *ForConditionalGeneration with a vision tower, or one of the served adapters' reducing classes."""
    module = type(model).__module__
    return isinstance(model, nn.Module) and module.startswith(("transformers.", "timm_tokcomp.vlm")) and (
        type(model).__name__.endswith("ForConditionalGeneration") and any(
            hasattr(getattr(model, "model", model), name) for name in ("vision_tower", "visual", "vision_model")))


def served_by(model: nn.Module) -> Optional[Any]:
    """The adapter that serves model, or None."""
    from .gemma3 import Gemma3Adapter
    from .idefics3 import Idefics3Adapter
    from .llava import LlavaAdapter
    from .llava_next import LlavaNextAdapter
    from .qwen2_vl import QwenVLAdapter

    adapters = (LlavaAdapter, LlavaNextAdapter, QwenVLAdapter, Gemma3Adapter, Idefics3Adapter)
    return next((adapter for adapter in adapters if adapter.serves(model)), None)


def adapter_of(model: nn.Module) -> Any:
    """The model's VLM adapter; TypeError naming the served classes for a VLM no adapter serves."""
    adapter = served_by(model)
    if adapter is not None:
        return adapter
    raise TypeError(f"{type(model).__name__} is a vision-language model timm_tokcomp does not serve yet; it serves "
                    f"{', '.join(SERVED)} (docs/vlm.md). Its vision tower alone can be reduced where its family is "
                    f"served (timm_tokcomp.apply(model.model.vision_tower, ...)), but its language model would then "
                    f"refuse the changed token count")


def is_reduced(model: nn.Module) -> bool:
    """Whether a method reduces the VLM's visual tokens (False for a VLM no adapter serves)."""
    adapter = served_by(model)
    return adapter is not None and adapter.is_reduced(model)


def apply(model: nn.Module, method: str = "visionzip", **params: Any) -> nn.Module:
    """Reduce a VLM's visual tokens with `method` (in place; returns it), where its adapter reduces (LLaVA: inside
    its vision tower up to the feature layer the projector reads; LLaVA-NeXT, Qwen2-VL, Gemma 3, Idefics3 / SmolVLM:
    after the connector). 'none'
    removes a method applied before. All or nothing: a refused method or parameter leaves the model as it was."""
    adapter = adapter_of(model)
    adapter.check(model)
    if method == core.NO_REDUCTION:
        if params:
            raise ValueError(f"method 'none' takes no parameters, got {sorted(params)}")
        return remove(model)
    adapter.apply(model, method, params)
    return model


def set_params(model: nn.Module, **params: Any) -> nn.Module:
    """Change the method's parameters on a reduced VLM, as set_params does on a ViT."""
    adapter = adapter_of(model)
    if not adapter.is_reduced(model):
        raise ValueError(f"{type(model).__name__} is not reduced; apply a method first")
    adapter.set_params(model, params)
    return model


def remove(model: nn.Module) -> nn.Module:
    """The plain VLM again (its classes and its tower's); a VLM without a method is returned unchanged."""
    adapter = adapter_of(model)
    if adapter.is_reduced(model):
        adapter.remove(model)
    return model


def tokens_for(model: nn.Module, image_size: Tuple[int, int]) -> int:
    """The image tokens a reduced VLM gives its language model for one image of image_size (H, W) pixels as its
    processor hands them to the model, known before any image is encoded (what a serving engine sizes its
    placeholders by). ValueError for a method whose count depends on the image (atm, dymu, ats, ...): it is known
    only when the encoder has run."""
    adapter = adapter_of(model)
    if not adapter.is_reduced(model):
        raise ValueError(f"{type(model).__name__} is not reduced: its processor's count is the count")
    return adapter.tokens_for(model, tuple(int(v) for v in image_size))


def plain_tokens(model: nn.Module, image_size: Tuple[int, int]) -> int:
    """The image tokens the plain VLM gives its language model per image of image_size (its processor's count)."""
    return adapter_of(model).plain_tokens(model, tuple(int(v) for v in image_size))


__all__ = ["SERVED", "adapter_of", "apply", "is_reduced", "looks_like_vlm", "plain_tokens", "remove", "set_params",
           "tokens_for"]
