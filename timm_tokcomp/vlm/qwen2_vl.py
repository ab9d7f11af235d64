"""Qwen2-VL and Qwen2.5-VL (transformers' Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration),
reduced after the connector. Their tower packs every image into one sequence with 2-D rotary positions (2.5 adds
window attention) and their merger joins each 2x2 patch group into one token, so no in-tower method serves it: the
method is `visionzip` over the merged tokens. The importance of a merged token is the attention its patches receive
at the named tower block (mean over that image's queries and heads, on the keys that block attends to); the keys
are that block's, averaged over heads and the group's patches. The kept tokens stay in raster order.

Positions (M-RoPE): the plain sequence's (t, h, w) ids from get_rope_index, cut with the placeholders: a kept token
keeps its ids, a contextual token takes its target's, and the text after an image keeps its ids (a gap where tokens
left), as the issue's rule asks and as the model saw them in training."""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from transformers import (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLModel, Qwen2VLForConditionalGeneration,
                          Qwen2VLModel)
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.vision_utils import get_vision_window_index

from ..runtime.state import state_of
from .connector import ConnectorAdapter, SavesPlain, received, select
from .llava import pad_id
from .placeholders import cut_runs, with_prompt


def received_attention(attn: nn.Module, x: torch.Tensor, cu_seqlens: torch.Tensor,
                       position_embeddings: Tuple[torch.Tensor, torch.Tensor],
                       rotary: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    """The attention each patch receives at this attention module, x (N, C) its (normed) input in block order:
    -> received (N,) float32 (softmax over each segment of cu_seqlens, mean over its queries and the heads), keys
    (N, d) averaged over heads."""
    N = x.shape[0]
    q, k, _ = attn.qkv(x).reshape(N, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = rotary(q, k, *position_embeddings)  # (N, H, d)
    return received(q, k, attn.scaling, cu_seqlens.tolist()), k.mean(dim=1)


class ReducingQwenVLModel:
    """Mixed into Qwen2VLModel / Qwen2_5_VLModel: the reduced image features and which merged tokens they stand at."""

    def reduced_image_features(self, pixel_values: torch.Tensor,
                               image_grid_thw: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """pixel_values (sum t*h*w, C*tp*p*p) as the processor packs them, image_grid_thw (I, 3) -> per image the
        features (K_i, D) the language model reads, and kept_i (K_i,) the merged token (raster index) each stands
        at. An image of at most dominant + contextual merged tokens keeps them all, unchanged."""
        zip_ = state_of(self).reducer
        visual = self.visual
        attn = visual.blocks[zip_.block].attn
        seen: Dict[str, Any] = {}

        def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen.update(x=args[0] if args else kwargs["hidden_states"], cu_seqlens=kwargs["cu_seqlens"],
                        position_embeddings=kwargs["position_embeddings"])

        handle = attn.register_forward_pre_hook(capture, with_kwargs=True)
        try:
            merged = visual(pixel_values.type(visual.dtype), grid_thw=image_grid_thw).pooler_output  # (G, D) raster
        finally:
            handle.remove()
        unit = visual.spatial_merge_size ** 2
        with torch.no_grad():
            received, keys = received_attention(attn, seen["x"], seen["cu_seqlens"], seen["position_embeddings"],
                                                self._rotary)
            importance = received.view(-1, unit).mean(dim=1)  # (G,) in the tower's order of merged tokens
            keys = keys.view(-1, unit, keys.shape[-1]).mean(dim=1)
            raster = self._raster_order(image_grid_thw)
            if raster is not None:
                importance, keys = importance[raster], keys[raster]
        sizes = (image_grid_thw.prod(-1) // unit).tolist()
        chosen = [select(feats, imp, key, zip_.dominant, zip_.contextual)
                  for feats, imp, key in zip(merged.split(sizes), importance.split(sizes), keys.split(sizes))]
        return [features for features, _ in chosen], [kept for _, kept in chosen]

    def _raster_order(self, image_grid_thw: torch.Tensor) -> Optional[torch.Tensor]:
        """Where the tower's blocks hold the merged tokens in another order than raster (2.5's windows): the index
        that puts them back; None where they are in raster order."""
        return None


class ReducingQwen2VLModel(ReducingQwenVLModel, Qwen2VLModel):
    _rotary = staticmethod(modeling_qwen2_vl.apply_rotary_pos_emb_vision)


class ReducingQwen2_5_VLModel(ReducingQwenVLModel, Qwen2_5_VLModel):
    _rotary = staticmethod(modeling_qwen2_5_vl.apply_rotary_pos_emb_vision)

    def _raster_order(self, image_grid_thw: torch.Tensor) -> Optional[torch.Tensor]:
        visual = self.visual
        window_index, _ = get_vision_window_index(image_grid_thw, spatial_merge_size=visual.spatial_merge_size,
                                                  window_size=visual.window_size, patch_size=visual.patch_size)
        return torch.argsort(window_index)


class ReducingQwenVL(SavesPlain):
    """Mixed into the ForConditionalGeneration classes: forward and generate with the placeholder runs, the masks,
    mm_token_type_ids and the M-RoPE ids cut to the kept tokens."""

    def _cut(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], pixel_values: torch.Tensor,
             image_grid_thw: Optional[torch.Tensor], mm_token_type_ids: Optional[torch.Tensor], kwargs: dict):
        """-> (the encoder output to hand over, and the cut input_ids, attention_mask, mm_token_type_ids and
        position_ids (3, B, L'))."""
        for name in ("pixel_values_videos", "position_ids", "inputs_embeds"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} with pixel_values: a reduced {type(self).__name__} cuts the image "
                                 f"placeholder runs of input_ids and computes the kept tokens' M-RoPE ids itself; "
                                 f"give input_ids, images only (timm_tokcomp.remove serves the rest plain)")
        if input_ids is None or image_grid_thw is None or mm_token_type_ids is None:
            raise ValueError("a reduced Qwen2-VL needs input_ids, image_grid_thw and mm_token_type_ids with "
                             "pixel_values, as its processor returns them")
        features, kept = self.model.reduced_image_features(pixel_values, image_grid_thw)
        plain = (image_grid_thw.prod(-1) // self.model.visual.spatial_merge_size ** 2).tolist()
        cut = cut_runs(input_ids, attention_mask, self.config.image_token_id, plain, kept)
        positions, _ = self.model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids,
                                                 image_grid_thw=image_grid_thw, attention_mask=attention_mask)
        mask = cut.apply(torch.ones_like(input_ids) if attention_mask is None else attention_mask, 0)
        positions = cut.apply(positions.permute(1, 2, 0), 0).permute(2, 0, 1).contiguous()  # (3, B, L')
        self.model.rope_deltas = (positions.amax(dim=(0, 2)) + 1 - mask.sum(dim=1)).unsqueeze(1)
        encoded = BaseModelOutputWithPooling(last_hidden_state=None, pooler_output=tuple(features))
        return (encoded, cut.apply(input_ids, pad_id(self)), mask if attention_mask is not None else None,
                cut.apply(mm_token_type_ids, 0), positions, cut)

    def forward(self, input_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                pixel_values: Optional[torch.Tensor] = None, image_grid_thw: Optional[torch.Tensor] = None,
                mm_token_type_ids: Optional[torch.Tensor] = None, **kwargs: Any):
        """As the plain forward, the image placeholder runs cut to the kept tokens: the logits (B, L', V) cover the
        shortened rows; labels, where given, are cut with them."""
        if pixel_values is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, image_grid_thw=image_grid_thw,
                                   mm_token_type_ids=mm_token_type_ids, **kwargs)
        encoded, ids, mask, types, positions, cut = self._cut(input_ids, attention_mask, pixel_values, image_grid_thw,
                                                              mm_token_type_ids, kwargs)
        if kwargs.get("labels") is not None:
            kwargs["labels"] = cut.apply(kwargs["labels"], -100)
        return super().forward(input_ids=ids, attention_mask=mask, position_ids=positions,
                               image_grid_thw=image_grid_thw, mm_token_type_ids=types,
                               mm_encoder_outputs={"image": encoded}, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 pixel_values: Optional[torch.Tensor] = None, image_grid_thw: Optional[torch.Tensor] = None,
                 mm_token_type_ids: Optional[torch.Tensor] = None, **kwargs: Any):
        """As the plain generate; the language model prefills the kept image tokens only. The sequences returned
        start with the given input_ids (all placeholders), then the new tokens, as the plain model's do."""
        if pixel_values is None:
            return super().generate(input_ids=input_ids, attention_mask=attention_mask, image_grid_thw=image_grid_thw,
                                    mm_token_type_ids=mm_token_type_ids, **kwargs)
        encoded, short, mask, types, positions, _ = self._cut(input_ids, attention_mask, pixel_values, image_grid_thw,
                                                              mm_token_type_ids, kwargs)
        out = super().generate(input_ids=short, attention_mask=mask, position_ids=positions,
                               image_grid_thw=image_grid_thw, mm_token_type_ids=types,
                               mm_encoder_outputs={"image": encoded}, **kwargs)
        return with_prompt(out, input_ids, short.shape[1])


class ReducingQwen2VLForConditionalGeneration(ReducingQwenVL, Qwen2VLForConditionalGeneration):
    pass


class ReducingQwen2_5_VLForConditionalGeneration(ReducingQwenVL, Qwen2_5_VLForConditionalGeneration):
    pass


CLASSES = {  # plain class -> (reducing class, the plain inner model's class, its reducing class)
    Qwen2VLForConditionalGeneration: (ReducingQwen2VLForConditionalGeneration, Qwen2VLModel, ReducingQwen2VLModel),
    Qwen2_5_VLForConditionalGeneration: (ReducingQwen2_5_VLForConditionalGeneration, Qwen2_5_VLModel,
                                         ReducingQwen2_5_VLModel),
}


class QwenVLAdapter(ConnectorAdapter):
    """Qwen2-VL / Qwen2.5-VL: packed images, 2-D rotary positions, a 2x2 merger."""

    CLASSES = CLASSES
    CONNECTOR = "packed images, 2-D rotary positions, 2x2 merger"

    @staticmethod
    def tower_depth(model: nn.Module) -> int:
        return len(model.model.visual.blocks)

    @classmethod
    def plain_tokens(cls, model: nn.Module, image_size: Tuple[int, int]) -> int:
        """image_size (H, W): pixels as the processor resized them (multiples of patch size x merge size)."""
        vision = model.config.vision_config
        unit = vision.patch_size * vision.spatial_merge_size
        if any(v <= 0 or v % unit for v in image_size):
            raise ValueError(f"image_size {image_size}: {type(model).__name__}'s processor resizes images to positive "
                             f"multiples of {unit} pixels (patch size {vision.patch_size} x merge size "
                             f"{vision.spatial_merge_size}); give the resized size (image_grid_thw[1:] x "
                             f"{vision.patch_size})")
        return (image_size[0] // unit) * (image_size[1] // unit)

    @staticmethod
    def default_image_size(model: nn.Module) -> Tuple[int, int]:
        """A 448 x 448 image (256 merged tokens): Qwen2-VL's processor keeps an image's own size, within its pixel
        bounds, so no size is the model's."""
        return (448, 448)

    @classmethod
    def example_inputs(cls, model: nn.Module, image_size: Tuple[int, int], text: torch.Tensor,
                       generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """One random image of image_size (multiples of patch x merge size) before text (1, T) ids, packed by
        transformers' Qwen2-VL image processor at the model's patch sizes and laid out as its processor lays them:
        <|vision_start|>, the placeholder run, <|vision_end|>, the text."""
        from transformers import Qwen2VLImageProcessor

        vision, config = model.config.vision_config, model.config
        count = cls.plain_tokens(model, image_size)
        pixels = torch.randint(0, 256, (*image_size, 3), generator=generator, dtype=torch.uint8).numpy()
        processor = Qwen2VLImageProcessor(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                          temporal_patch_size=vision.temporal_patch_size,
                                          min_pixels=image_size[0] * image_size[1],
                                          max_pixels=image_size[0] * image_size[1])
        packed = processor(images=[pixels], return_tensors="pt")
        ids = torch.cat([torch.tensor([[config.vision_start_token_id]]), torch.full((1, count), config.image_token_id),
                         torch.tensor([[config.vision_end_token_id]]), text], dim=1)
        return dict(input_ids=ids, pixel_values=packed["pixel_values"], image_grid_thw=packed["image_grid_thw"],
                    mm_token_type_ids=(ids == config.image_token_id).long())


ReducingQwenVL.adapter = QwenVLAdapter

__all__ = ["QwenVLAdapter", "ReducingQwen2VLForConditionalGeneration", "ReducingQwen2_5_VLForConditionalGeneration",
           "received_attention"]
