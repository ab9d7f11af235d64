"""LLaVA-NeXT (transformers' LlavaNextForConditionalGeneration), reduced after packing. Its tower encodes a base view
and a grid of crops of each image; the crops' tokens are packed into one grid, cut back to the image's aspect
(unpadded), with an image_newline token closing every row. That packing needs each crop's whole grid, so the method
is `visionzip` over the packed tokens of each image. A token's importance is the attention the class token of its
own view gives it at the named tower block (the last one the feature layer reads, by default); SigLIP towers, with
no class token, take the mean attention received. Its key is that block's key, averaged over heads. Both are packed
as the features are, so they stand at the same places.

An image of more than dominant + contextual packed tokens keeps that many: the dominant ones in packed order (base
view first), then the contextual ones. Its newline tokens go: they close rows, and the kept tokens form none. An
image of at most that many keeps every token, newlines too, unchanged. The count is min(plain, dominant +
contextual), known from the image's size before the encoder runs.

Positions (1-D RoPE): renumbered contiguously, as for LLaVA."""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from transformers import LlavaNextForConditionalGeneration, LlavaNextModel
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

from ..runtime.state import state_of
from .connector import ConnectorAdapter, SavesPlain, block_input, queries_keys, received, select, tower_layers
from .llava import feature_blocks, pad_id
from .placeholders import cut_runs, with_prompt


def has_class_token(tower: nn.Module) -> bool:
    """Whether the tower's embeddings start with a class token (CLIP), not SigLIP."""
    return hasattr(getattr(tower, "vision_model", tower).embeddings, "class_embedding")


class ReducingLlavaNextModel(LlavaNextModel):
    """LlavaNextModel whose image features are each image's kept packed tokens."""

    def crop_metric(self, x: torch.Tensor, attn: nn.Module, prefix: int) -> torch.Tensor:
        """x (V, N, C) the block's input for V views -> (V, N - prefix, 2 + d): per token the channels packed beside
        the features: 1 (a real token; a newline packs as 0), its importance, its key averaged over heads."""
        q, k = queries_keys(attn, x)
        if has_class_token(self.vision_tower):
            scores = torch.einsum("vhd,vnhd->vhn", q[:, 0].float(), k.float()) * attn.scale
            importance = scores.softmax(dim=-1).mean(dim=1)  # (V, N): the class token's attention
        else:
            importance = torch.stack([received(q[v], k[v], attn.scale, [0, x.shape[1]]) for v in range(x.shape[0])])
        keys = k.float().mean(dim=2)
        return torch.cat([torch.ones_like(importance)[..., None], importance[..., None], keys], dim=-1)[:, prefix:]

    def reduced_image_features(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor, strategy: str
                               ) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[int]]:
        """pixel_values (B, V, 3, S, S) or (sum V_i, 3, S, S), image_sizes (B, 2) -> per image the features (K, D)
        the language model reads, kept (K,) the packed token each stands at, and its plain packed count."""
        zip_ = state_of(self).reducer
        depth = LlavaNextAdapter.tower_depth(self)
        attn = tower_layers(self.vision_tower)[zip_.block % depth].self_attn
        with block_input(attn) as seen:
            packed = self.get_image_features(pixel_values, image_sizes, vision_feature_select_strategy=strategy,
                                             return_dict=True).pooler_output  # B tensors (L_i, D)
        pinpoints, side = self.config.image_grid_pinpoints, self.config.vision_config.image_size
        views = [image_size_to_num_patches(size, pinpoints, side) for size in image_sizes]
        with torch.no_grad():
            metric = self.crop_metric(seen["x"], attn, 1 if strategy == "default" else 0)
            metrics, _ = self.pack_image_features(list(metric.split(views)), image_sizes, strategy,
                                                  image_newline=metric.new_zeros(metric.shape[-1]))
        features, kept = [], []
        for feats, meta in zip(packed, metrics):
            if feats.shape[0] <= zip_.dominant + zip_.contextual:
                features.append(feats)
                kept.append(torch.arange(feats.shape[0], device=feats.device))
                continue
            real = (meta[:, 0] > 0.5).nonzero().flatten()
            chosen, at = select(feats[real], meta[real, 1], meta[real, 2:], zip_.dominant, zip_.contextual)
            features.append(chosen)
            kept.append(real[at])
        return features, kept, [f.shape[0] for f in packed]


class ReducingLlavaNextForConditionalGeneration(SavesPlain, LlavaNextForConditionalGeneration):
    """The LLaVA-NeXT whose language model reads only the kept image tokens, in forward and generate."""

    def _cut(self, input_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
             pixel_values: torch.Tensor, image_sizes: Optional[torch.Tensor], kwargs: dict):
        """-> (the encoder output to hand over, the cut, and the cut input_ids and attention_mask)."""
        if input_ids is None or kwargs.get("inputs_embeds") is not None or image_sizes is None:
            raise ValueError("a reduced LLaVA-NeXT needs input_ids and image_sizes with pixel_values, as its processor "
                             "returns them (it cuts the placeholder runs of input_ids)")
        if kwargs.pop("vision_feature_layer", None) not in (None, self.config.vision_feature_layer):
            raise ValueError("vision_feature_layer: a reduced LLaVA-NeXT reads the config's layer")
        strategy = kwargs.pop("vision_feature_select_strategy", None) or self.config.vision_feature_select_strategy
        features, kept, plain = self.model.reduced_image_features(pixel_values, image_sizes, strategy)
        cut = cut_runs(input_ids, attention_mask, self.config.image_token_id, plain, kept)
        mask = cut.apply(torch.ones_like(input_ids) if attention_mask is None else attention_mask, 0)
        encoded = BaseModelOutputWithPooling(last_hidden_state=None, pooler_output=features)
        return encoded, cut, cut.apply(input_ids, pad_id(self)), mask if attention_mask is not None else None

    def forward(self, input_ids: Optional[torch.Tensor] = None, pixel_values: Optional[torch.Tensor] = None,
                image_sizes: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any):
        """As LLaVA-NeXT's, the placeholder runs cut to the kept tokens: the logits (B, L', V) cover the shortened
        rows. labels and position_ids, where given, are cut with them (positions renumbered contiguously)."""
        if pixel_values is None:
            return super().forward(input_ids=input_ids, image_sizes=image_sizes, attention_mask=attention_mask,
                                   **kwargs)
        encoded, cut, ids, mask = self._cut(input_ids, attention_mask, pixel_values, image_sizes, kwargs)
        if kwargs.get("labels") is not None:
            kwargs["labels"] = cut.apply(kwargs["labels"], -100)
        if kwargs.get("position_ids") is not None:
            real = cut.apply(torch.ones_like(input_ids) if attention_mask is None else attention_mask, 0)
            kwargs["position_ids"] = (real.cumsum(dim=1) - 1).clamp(min=0)
        return super().forward(input_ids=ids, attention_mask=mask, mm_encoder_outputs={"image": encoded}, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: Optional[torch.Tensor] = None, pixel_values: Optional[torch.Tensor] = None,
                 image_sizes: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 **kwargs: Any):
        """As LLaVA-NeXT's generate; the language model prefills the kept image tokens only. The sequences returned
        start with the given input_ids (all placeholders), then the new tokens, as the plain model's do."""
        if pixel_values is None:
            return super().generate(input_ids=input_ids, image_sizes=image_sizes, attention_mask=attention_mask,
                                    **kwargs)
        encoded, _, short, mask = self._cut(input_ids, attention_mask, pixel_values, image_sizes, kwargs)
        out = super().generate(input_ids=short, attention_mask=mask, mm_encoder_outputs={"image": encoded}, **kwargs)
        return with_prompt(out, input_ids, short.shape[1])


class LlavaNextAdapter(ConnectorAdapter):
    """LLaVA-NeXT: a base view and a grid of crops, packed into one unpadded grid with newline tokens."""

    CLASSES = {LlavaNextForConditionalGeneration: (ReducingLlavaNextForConditionalGeneration, LlavaNextModel,
                                                   ReducingLlavaNextModel)}
    CONNECTOR = "crops packed into one unpadded grid with image_newline tokens"

    @staticmethod
    def check(model: nn.Module) -> None:
        """The feature layers run blocks; 'full' selection only on a tower without a class token (LLaVA-NeXT's
        packing reshapes each view's tokens to its grid)."""
        feature_blocks(model.config)
        strategy = model.config.vision_feature_select_strategy
        if strategy not in ("default", "full") or (strategy == "full" and has_class_token(model.model.vision_tower)):
            raise ValueError(f"vision_feature_select_strategy {strategy!r}: LLaVA-NeXT packs each view's patch grid, "
                             f"so it is 'default' (the class token dropped), or 'full' on a tower without one")

    @staticmethod
    def tower_depth(model: nn.Module) -> int:
        """The tower layers the deepest feature layer reads (model: the VLM or its inner model): visionzip's block
        counts among them."""
        return max(feature_blocks(model.config))

    @staticmethod
    def default_image_size(model: nn.Module) -> Tuple[int, int]:
        """The largest square grid point (672 x 672 for LLaVA-NeXT: 4 crops and the base view)."""
        side = max(min(point) for point in model.config.image_grid_pinpoints)
        return side, side

    @staticmethod
    def plain_tokens(model: nn.Module, image_size: Tuple[int, int]) -> int:
        """What LLaVA-NeXT packs for an image of image_size (H, W), its own size as image_sizes gives it: counted
        by its own packing of blank views."""
        config, vision = model.config, model.config.vision_config
        if any(v <= 0 for v in image_size):
            raise ValueError(f"image_size {image_size}: give an image's (height, width) in pixels, both positive")
        views = image_size_to_num_patches(list(image_size), config.image_grid_pinpoints, vision.image_size)
        side = vision.image_size // vision.patch_size
        blank = torch.zeros(views, side * side, 1)
        packed, _ = model.model.pack_image_features([blank], torch.tensor([image_size]),
                                                    config.vision_feature_select_strategy, image_newline=torch.zeros(1))
        return packed[0].shape[0]

    @classmethod
    def example_inputs(cls, model: nn.Module, image_size: Tuple[int, int], text: torch.Tensor,
                       generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """One random image of image_size (its views: the base and the grid's crops) before text (1, T) ids, as
        LLaVA-NeXT's processor lays them out: the placeholder run, then the text."""
        config = model.config
        side = config.vision_config.image_size
        views = image_size_to_num_patches(list(image_size), config.image_grid_pinpoints, side)
        run = torch.full((1, cls.plain_tokens(model, image_size)), config.image_token_id)
        return dict(input_ids=torch.cat([run, text], dim=1),
                    pixel_values=torch.randn(1, views, 3, side, side, generator=generator),
                    image_sizes=torch.tensor([image_size]))

    @staticmethod
    def limit_generate(model: nn.Module, inputs: Dict[str, torch.Tensor], count: int, **generate: Any) -> Any:
        """The plain LLaVA-NeXT's generate with each placeholder run cut to its first `count` and the packed
        features cut with it: what the language model costs at `count` tokens with no reduction work."""
        ids, sizes = inputs["input_ids"], inputs["image_sizes"]
        features = model.model.get_image_features(inputs["pixel_values"], sizes, return_dict=True).pooler_output
        cut = cut_runs(ids, inputs.get("attention_mask"), model.config.image_token_id,
                       [f.shape[0] for f in features], [count] * len(features))
        encoded = BaseModelOutputWithPooling(pooler_output=[f[:count] for f in features])
        return model.generate(input_ids=cut.apply(ids, pad_id(model)), mm_encoder_outputs={"image": encoded},
                              **generate)


ReducingLlavaNextForConditionalGeneration.adapter = LlavaNextAdapter

__all__ = ["LlavaNextAdapter", "ReducingLlavaNextForConditionalGeneration", "ReducingLlavaNextModel"]
