"""LLaVA (transformers' LlavaForConditionalGeneration, LLaVA-1.5 and its kin): the vision tower (CLIP or SigLIP, a
family timm_tokcomp serves) reduces inside its layers up to the feature layer the projector reads
(config.vision_feature_layer, -2 for LLaVA-1.5); the layers after it, which LLaVA computes and throws away, are not
run. The projector then sees the kept tokens (the class token dropped under the 'default' select strategy), and the
placeholder runs are cut to their count before the language model runs (placeholders.cut_runs), so it prefills only
those. generate(**processor(images=..., text=...)) works unchanged and returns the user's prompt ids followed by the
new tokens, as the plain model does."""
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from transformers import LlavaForConditionalGeneration, LlavaModel
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .. import core
from ..families.base import PatchGrid
from ..runtime.loop import patch_grid
from ..runtime.state import state_of
from .placeholders import cut_runs, with_prompt

_TOKENS: "weakref.WeakKeyDictionary[nn.Module, Dict[Any, int]]" = weakref.WeakKeyDictionary()  # tokens_for's counts


def feature_blocks(config: Any) -> List[int]:
    """The tower layers each feature layer reads the output of: hidden_states[layer] is the output of `layer` layers
    (the embeddings are hidden_states[0]). ValueError for a layer that runs no block."""
    layers, depth = config.vision_feature_layer, config.vision_config.num_hidden_layers
    blocks = []
    for layer in layers if isinstance(layers, (list, tuple)) else [layers]:
        blocks.append(layer if layer >= 0 else depth + 1 + layer)
        if not 1 <= blocks[-1] <= depth:
            raise ValueError(f"vision_feature_layer {layer} reads no layer of the {depth}-layer vision tower")
    return blocks


def feature_depth(config: Any) -> int:
    """The tower layers whose output the projector reads. ValueError for a list of layers (concatenated: every
    listed layer would need the same kept tokens) or a layer that runs no block."""
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r} lists several layers, whose hidden states LLaVA concatenates "
                         f"token by token; a reduced tower keeps different tokens at each. timm_tokcomp reduces a "
                         f"LLaVA that reads one layer (LLaVA-1.5: -2); set config.vision_feature_layer to one of "
                         f"them, or run it plain")
    return feature_blocks(config)[0]


class LlavaAdapter:
    """What vlm reads and changes of a LLaVA: its tower, the layers the projector reads, and its classes. The method
    runs inside the tower (any method timm_tokcomp serves CLIP or SigLIP with), its schedule over the layers up to
    the feature layer."""

    @staticmethod
    def serves(model: nn.Module) -> bool:
        """The plain class or its reducing one, not a subclass (remove restores the plain class)."""
        return type(model) in (LlavaForConditionalGeneration, ReducingLlavaForConditionalGeneration)

    @staticmethod
    def is_reduced(model: nn.Module) -> bool:
        return isinstance(model, ReducingLlavaForConditionalGeneration)

    @staticmethod
    def tower(model: nn.Module) -> nn.Module:
        return model.model.vision_tower

    @staticmethod
    def check(model: nn.Module) -> None:
        feature_depth(model.config)
        strategy = model.config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not LLaVA's 'default' or 'full'")

    @classmethod
    def apply(cls, model: nn.Module, method: str, params: Dict[str, Any]) -> None:
        tower = cls.tower(model)
        state = state_of(tower, create=True)
        before = state.depth
        state.depth = feature_depth(model.config)  # read by patch: the schedule spans the layers up to it
        try:
            core.apply(tower, method, **params)
        except Exception:
            state.depth = before
            raise
        cls.swap(model)
        _TOKENS.pop(model, None)

    @classmethod
    def set_params(cls, model: nn.Module, params: Dict[str, Any]) -> None:
        core.set_params(cls.tower(model), **params)
        _TOKENS.pop(model, None)

    @classmethod
    def remove(cls, model: nn.Module) -> None:
        core.remove(cls.tower(model))
        cls.restore(model)
        _TOKENS.pop(model, None)

    @staticmethod
    def swap(model: nn.Module) -> None:
        model.__class__, model.model.__class__ = ReducingLlavaForConditionalGeneration, ReducingLlavaModel

    @staticmethod
    def restore(model: nn.Module) -> None:
        model.__class__, model.model.__class__ = LlavaForConditionalGeneration, LlavaModel

    @classmethod
    def tokens_for(cls, model: nn.Module, image_size: Tuple[int, int]) -> int:
        """Counted once per size and method from a blank image (the count of a fixed-count method does not depend
        on the pixels)."""
        tower = cls.tower(model)
        reducer = core.get_reducer(tower)
        if reducer.spec.data_dependent or reducer.spec.masks_by_size:
            raise ValueError(f"{reducer.name} keeps a count that depends on each image; it is known only once the "
                             f"encoder ran (generate cuts the placeholder runs then). A fixed-count method (visionzip, "
                             f"tome, evit, topk) has a count known before")
        key = (id(reducer), image_size)
        counts = _TOKENS.setdefault(model, {})
        if key not in counts:
            param = next(tower.parameters())
            blank = torch.zeros(1, 3, *image_size, device=param.device, dtype=param.dtype)
            with torch.no_grad():
                counts[key] = tower_tokens(tower, blank, model.config.vision_feature_select_strategy)[0].shape[0]
        return counts[key]

    @staticmethod
    def plain_tokens(model: nn.Module, image_size: Tuple[int, int]) -> int:
        return plain_count(model, image_size)

    @staticmethod
    def default_image_size(model: nn.Module) -> Tuple[int, int]:
        """The size LLaVA's processor gives every image: the tower's."""
        size = model.config.vision_config.image_size
        return (size, size) if isinstance(size, int) else tuple(size)

    @staticmethod
    def example_inputs(model: nn.Module, image_size: Tuple[int, int], text: torch.Tensor,
                       generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """One random image of image_size before text (1, T) ids, as LLaVA's processor lays them out: the
        placeholder run, then the text."""
        run = torch.full((1, plain_count(model, image_size)), model.config.image_token_id)
        return dict(input_ids=torch.cat([run, text], dim=1),
                    pixel_values=torch.randn(1, 3, *image_size, generator=generator))

    @staticmethod
    def limit_generate(model: nn.Module, inputs: Dict[str, torch.Tensor], count: int, **generate: Any) -> Any:
        """The plain LLaVA's generate on inputs with each placeholder run cut to its first `count` and the tower's
        features cut with it: what the language model costs at `count` tokens with no reduction work."""
        ids, pixels = inputs["input_ids"], inputs["pixel_values"]
        features = model.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        cut = cut_runs(ids, inputs.get("attention_mask"), model.config.image_token_id,
                       plain_count(model, tuple(pixels.shape[-2:])), [count] * len(features))
        encoded = BaseModelOutputWithPooling(pooler_output=[f[:count] for f in features])
        return model.generate(input_ids=cut.apply(ids, pad_id(model)), mm_encoder_outputs={"image": encoded},
                              **generate)


def tower_tokens(tower: nn.Module, pixel_values: torch.Tensor, strategy: str) -> List[torch.Tensor]:
    """The reduced tower's tokens after its reducing depth (the feature layer), per image (N_i, C): the class token
    dropped under 'default', and for a method that pads with size-0 tokens (ATS) only each image's real ones."""
    tokens, positions, unit = tower._embedded(None, pixel_values, False)
    x, stats = tower._reduce_blocks(tokens, positions, final=False, grid=patch_grid(tower, pixel_values.shape[-2:]),
                                    unit_sizes=unit)
    size = stats.size
    if strategy == "default":
        prefix = tower.num_prefix_tokens
        x, size = x[:, prefix:], None if size is None else size[:, prefix:]
    if size is None or not tower._tokcomp.reducer.spec.masks_by_size:
        return list(x)
    return [row[s[:, 0] >= 0.5] for row, s in zip(x, size)]


class ReducingLlavaModel(LlavaModel):
    """LlavaModel whose image features come from the reduced tower: per image, as many as it keeps."""

    def get_image_features(self, pixel_values: torch.Tensor, vision_feature_layer: Any = None,
                           vision_feature_select_strategy: Optional[str] = None, image_sizes: Any = None,
                           **kwargs: Any) -> BaseModelOutputWithPooling:
        """pixel_values (B, 3, H, W) -> pooler_output: B tensors (N_i, D) of projected features."""
        layer = self.config.vision_feature_layer if vision_feature_layer is None else vision_feature_layer
        if layer != self.config.vision_feature_layer:
            raise ValueError(f"vision_feature_layer {layer!r}: the tower was reduced for the config's layer "
                             f"{self.config.vision_feature_layer!r} (apply again after changing the config)")
        if image_sizes is not None:
            raise ValueError("image_sizes: a reduced LLaVA takes whole images of the processor's size")
        strategy = vision_feature_select_strategy or self.config.vision_feature_select_strategy
        tokens = tower_tokens(self.vision_tower, pixel_values, strategy)
        if len({len(t) for t in tokens}) > 1:  # images that keep different counts (a data-dependent method)
            features = [self.multi_modal_projector(t.unsqueeze(0))[0] for t in tokens]
        else:
            features = list(self.multi_modal_projector(torch.stack(tokens)))
        return BaseModelOutputWithPooling(last_hidden_state=None, pooler_output=features)


class ReducingLlavaForConditionalGeneration(LlavaForConditionalGeneration):
    """The LLaVA whose language model reads only the kept image tokens, in forward and generate."""

    def _cut(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], pixel_values: torch.Tensor,
             kwargs: dict):
        """(features output, the cut, new input_ids, new attention_mask) for these inputs."""
        keys = ("vision_feature_layer", "vision_feature_select_strategy", "image_sizes")
        encoded = self.model.get_image_features(pixel_values, **{k: kwargs.pop(k) for k in keys if k in kwargs})
        counts = [f.shape[0] for f in encoded.pooler_output]
        cut = cut_runs(input_ids, attention_mask, self.config.image_token_id,
                       plain_count(self, tuple(pixel_values.shape[-2:])), counts)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return encoded, cut, cut.apply(input_ids, pad_id(self)), cut.apply(mask, 0)

    def forward(self, input_ids: Optional[torch.Tensor] = None, pixel_values: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, **kwargs: Any):
        """As LLaVA's, the placeholder runs cut to the kept tokens: the logits (B, L', V) cover the shortened rows.
        labels and position_ids, where given, are cut with them (positions renumbered contiguously)."""
        if pixel_values is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if input_ids is None:
            raise ValueError("pixel_values with inputs_embeds: a reduced LLaVA cuts the placeholder runs of input_ids; "
                             "give input_ids")
        encoded, cut, input_ids, new_mask = self._cut(input_ids, attention_mask, pixel_values, kwargs)
        if kwargs.get("labels") is not None:
            kwargs["labels"] = cut.apply(kwargs["labels"], -100)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = (new_mask.cumsum(dim=1) - 1).clamp(min=0)
        return super().forward(input_ids=input_ids, attention_mask=new_mask if attention_mask is not None else None,
                               mm_encoder_outputs={"image": encoded}, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: Optional[torch.Tensor] = None, pixel_values: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, **kwargs: Any):
        """As LLaVA's generate; the language model prefills the kept image tokens only. The sequences returned start
        with the given input_ids (all placeholders), then the new tokens, as the plain model's do."""
        if pixel_values is None:
            return super().generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        encoded, cut, short, new_mask = self._cut(input_ids, attention_mask, pixel_values, kwargs)
        out = super().generate(input_ids=short, attention_mask=new_mask if attention_mask is not None else None,
                               mm_encoder_outputs={"image": encoded}, **kwargs)
        return with_prompt(out, input_ids, short.shape[1])

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' save_pretrained, naming the plain classes: the folder loads as the plain LLaVA."""
        LlavaAdapter.restore(self)
        try:
            return self.save_pretrained(*args, **kwargs)
        finally:
            LlavaAdapter.swap(self)


def plain_count(model: nn.Module, image_size: Tuple[int, int]) -> int:
    """The image tokens the plain LLaVA gives the language model per image of image_size (H, W): what the processor
    expands `<image>` to."""
    rows, cols = PatchGrid.of(model.config.vision_config).dynamic_feat_size(image_size)
    full = model.config.vision_feature_select_strategy == "full"
    return rows * cols + (LlavaAdapter.tower(model).num_prefix_tokens if full else 0)


def pad_id(model: nn.Module) -> int:
    """The token the rows are padded with: the generation config's pad token, else the text config's, else 0."""
    for value in (getattr(model.generation_config, "pad_token_id", None),
                  getattr(model.config.text_config, "pad_token_id", None)):
        if isinstance(value, int):
            return value
    return 0


__all__ = ["LlavaAdapter", "ReducingLlavaForConditionalGeneration", "ReducingLlavaModel", "feature_blocks",
           "feature_depth"]
