"""Gemma 3 (transformers' Gemma3ForConditionalGeneration), reduced after the connector. Its projector average-pools
the SigLIP tower's square grid of patches (64 x 64 at 896 pixels) to mm_tokens_per_image tokens (16 x 16), so it
needs every patch: the method is `visionzip` over the pooled tokens. A pooled token's importance is the mean
attention its patches receive at the named tower block (SigLIP has no class token: the mean over all queries and
heads), pooled as the projector pools; its key is that block's key, averaged over heads and pooled likewise. The kept
tokens stay in raster order.

Positions (1-D RoPE): renumbered contiguously, as for LLaVA, since a prompt shorter by the tokens taken away is what
Gemma saw in training. token_type_ids (1 on image tokens: the language model lets them attend to each other both
ways) are cut with the placeholders, so the kept tokens of one image stay one bidirectional block."""
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Gemma3ForConditionalGeneration, Gemma3Model
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..runtime.state import state_of
from .connector import ConnectorAdapter, SavesPlain, block_input, queries_keys, received, select, tower_layers
from .llava import pad_id
from .placeholders import cut_runs, with_prompt


class ReducingGemma3Model(Gemma3Model):
    """Gemma3Model whose image features are the kept pooled tokens of each image."""

    def reduced_image_features(self, pixel_values: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """pixel_values (B, 3, S, S) -> per image the features (K, D) the language model reads and kept (K,): the
        pooled token (raster index) each stands at."""
        zip_ = state_of(self).reducer
        attn = tower_layers(self.vision_tower)[zip_.block].self_attn
        with block_input(attn) as seen:
            pooled = self.get_image_features(pixel_values, return_dict=True).pooler_output  # (B, G, D)
        projector = self.multi_modal_projector
        side, kernel = projector.patches_per_image, projector.kernel_size
        with torch.no_grad():
            q, k = queries_keys(attn, seen["x"])
            B, N = q.shape[:2]
            importance = torch.stack([received(q[b], k[b], attn.scale, [0, N]) for b in range(B)])  # (B, N)
            importance = F.avg_pool2d(importance.view(B, 1, side, side), kernel).flatten(1)  # (B, G)
            keys = k.float().mean(dim=2).transpose(1, 2).reshape(B, -1, side, side)
            keys = F.avg_pool2d(keys, kernel).flatten(2).transpose(1, 2)  # (B, G, d)
        chosen = [select(pooled[b], importance[b], keys[b], zip_.dominant, zip_.contextual) for b in range(B)]
        return [features for features, _ in chosen], [kept for _, kept in chosen]


class ReducingGemma3ForConditionalGeneration(SavesPlain, Gemma3ForConditionalGeneration):
    """The Gemma 3 whose language model reads only the kept image tokens, in forward and generate."""

    def _cut(self, input_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
             pixel_values: torch.Tensor, token_type_ids: Optional[torch.Tensor], kwargs: dict):
        """-> (the encoder output to hand over, the cut, and the cut input_ids, attention_mask, token_type_ids)."""
        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError("pixel_values with inputs_embeds: a reduced Gemma 3 cuts the placeholder runs of "
                             "input_ids; give input_ids")
        features, kept = self.model.reduced_image_features(pixel_values)
        cut = cut_runs(input_ids, attention_mask, self.config.image_token_id, self.config.mm_tokens_per_image, kept)
        mask = cut.apply(torch.ones_like(input_ids) if attention_mask is None else attention_mask, 0)
        encoded = BaseModelOutputWithPooling(last_hidden_state=None, pooler_output=torch.cat(features)[None])
        types = None if token_type_ids is None else cut.apply(token_type_ids, 0)
        return encoded, cut, cut.apply(input_ids, pad_id(self)), mask if attention_mask is not None else None, types

    def forward(self, input_ids: Optional[torch.Tensor] = None, pixel_values: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None,
                **kwargs: Any):
        """As Gemma 3's, the placeholder runs cut to the kept tokens: the logits (B, L', V) cover the shortened
        rows. labels and position_ids, where given, are cut with them (positions renumbered contiguously)."""
        if pixel_values is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                   **kwargs)
        encoded, cut, ids, mask, types = self._cut(input_ids, attention_mask, pixel_values, token_type_ids, kwargs)
        if kwargs.get("labels") is not None:
            kwargs["labels"] = cut.apply(kwargs["labels"], -100)
        if kwargs.get("position_ids") is not None:
            real = cut.apply(torch.ones_like(input_ids) if attention_mask is None else attention_mask, 0)
            kwargs["position_ids"] = (real.cumsum(dim=1) - 1).clamp(min=0)
        return super().forward(input_ids=ids, attention_mask=mask, token_type_ids=types,
                               mm_encoder_outputs={"image": encoded}, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: Optional[torch.Tensor] = None, pixel_values: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None,
                 **kwargs: Any):
        """As Gemma 3's generate; the language model prefills the kept image tokens only. The sequences returned
        start with the given input_ids (all placeholders), then the new tokens, as the plain model's do."""
        if pixel_values is None:
            return super().generate(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                    **kwargs)
        encoded, _, short, mask, types = self._cut(input_ids, attention_mask, pixel_values, token_type_ids, kwargs)
        out = super().generate(input_ids=short, attention_mask=mask, token_type_ids=types,
                               mm_encoder_outputs={"image": encoded}, **kwargs)
        return with_prompt(out, input_ids, short.shape[1])


class Gemma3Adapter(ConnectorAdapter):
    """Gemma 3: a SigLIP tower's square grid average-pooled to mm_tokens_per_image tokens."""

    CLASSES = {Gemma3ForConditionalGeneration: (ReducingGemma3ForConditionalGeneration, Gemma3Model,
                                                ReducingGemma3Model)}
    CONNECTOR = "a square grid average-pooled to mm_tokens_per_image tokens"

    @staticmethod
    def tower_depth(model: nn.Module) -> int:
        return len(tower_layers(model.model.vision_tower))

    @staticmethod
    def default_image_size(model: nn.Module) -> Tuple[int, int]:
        """The size Gemma 3's processor gives every image (and every pan-and-scan crop): the tower's."""
        size = model.config.vision_config.image_size
        return size, size

    @classmethod
    def plain_tokens(cls, model: nn.Module, image_size: Tuple[int, int]) -> int:
        """mm_tokens_per_image, for an image of the tower's size (the only size the processor gives)."""
        if tuple(image_size) != cls.default_image_size(model):
            raise ValueError(f"image_size {tuple(image_size)}: Gemma 3's processor resizes every image to the "
                             f"tower's {cls.default_image_size(model)}")
        return model.config.mm_tokens_per_image

    @classmethod
    def example_inputs(cls, model: nn.Module, image_size: Tuple[int, int], text: torch.Tensor,
                       generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """One random image before text (1, T) ids, as Gemma 3's processor lays them out: <start_of_image>, the
        placeholder run, <end_of_image>, the text; token_type_ids 1 on the placeholders."""
        config = model.config
        run = torch.full((1, cls.plain_tokens(model, image_size)), config.image_token_id)
        ids = torch.cat([torch.tensor([[config.boi_token_id]]), run, torch.tensor([[config.eoi_token_id]]), text],
                        dim=1)
        return dict(input_ids=ids, pixel_values=torch.randn(1, 3, *image_size, generator=generator),
                    token_type_ids=(ids == config.image_token_id).long())


ReducingGemma3ForConditionalGeneration.adapter = Gemma3Adapter

__all__ = ["Gemma3Adapter", "ReducingGemma3ForConditionalGeneration"]
