"""Idefics3 and SmolVLM (transformers' Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration), reduced
after the connector. Their processor splits an image into square crops of the tower's size plus a global view, and
the connector pixel-shuffles each view's square grid of SigLIP patches (scale_factor x scale_factor patches into one
token: 64 tokens for a 512-pixel view at patch 16, scale 4). That shuffle needs every patch, so the method is
`visionzip` over each view's shuffled tokens: every view keeps min(its tokens, dominant + contextual), so an image's
count is known from its (resized) size before the encoder runs. A token's importance is the mean attention its
patches receive at the named tower block (SigLIP has no class token: the mean over the view's real queries and the
heads, softmax over its real patches); its key is that block's, averaged over heads and the token's patches. Which
patches form a token is read from the connector's own shuffle.

Each view has its own run of placeholders in input_ids (between its <fake_token_around_image> and row/column
tokens), so each run is cut to its view's kept tokens. Positions (1-D RoPE): renumbered contiguously, as for
LLaVA."""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from transformers import (Idefics3ForConditionalGeneration, Idefics3Model, SmolVLMForConditionalGeneration,
                          SmolVLMModel)
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..runtime.state import state_of
from .connector import ConnectorAdapter, SavesPlain, block_input, queries_keys, received, select, tower_layers
from .llava import pad_id
from .placeholders import cut_runs, with_prompt


def shuffle_groups(connector: nn.Module, patches: int) -> torch.Tensor:
    """(G, s * s): the patches (raster index of the view's grid) each shuffled token gathers, read from the
    connector's own pixel shuffle of the patch indices."""
    index = torch.arange(patches, dtype=torch.float64).view(1, patches, 1)
    return connector.pixel_shuffle(index, connector.scale_factor)[0].long()


class ReducingViewsModel:
    """Mixed into Idefics3Model / SmolVLMModel: each view's kept shuffled tokens."""

    def reduced_image_features(self, pixel_values: torch.Tensor, pixel_attention_mask: Optional[torch.Tensor]
                               ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """pixel_values (B, V, 3, S, S) as the processor pads them -> per real view, in order, the features (K, D)
        the language model reads and kept (K,): the shuffled token (raster index) each stands at."""
        zip_ = state_of(self).reducer
        attn = tower_layers(self.vision_model)[zip_.block].self_attn
        masks: Dict[str, torch.Tensor] = {}

        def patch_mask(module: nn.Module, args: tuple, kwargs: dict) -> None:
            masks["patches"] = kwargs["patch_attention_mask"]

        handle = self.vision_model.register_forward_pre_hook(patch_mask, with_kwargs=True)
        try:
            with block_input(attn) as seen:
                encoded = self.get_image_features(pixel_values, pixel_attention_mask, return_dict=True)
        finally:
            handle.remove()
        with torch.no_grad():
            q, k = queries_keys(attn, seen["x"])  # (V, N, H, d)
            V, N = q.shape[:2]
            real = masks["patches"].view(V, N)
            importance = torch.zeros(V, N, device=q.device)
            for v in range(V):
                at = real[v].nonzero().flatten()
                importance[v, at] = received(q[v, at], k[v, at], attn.scale, [0, len(at)])
            groups = shuffle_groups(self.connector, N).to(q.device)  # (G, s * s)
            importance = importance[:, groups].mean(dim=-1)  # (V, G)
            keys = k.float().mean(dim=2)[:, groups].mean(dim=2)  # (V, G, d)
        views = torch.cat(list(encoded.pooler_output)).view(V, groups.shape[0], -1)  # (V, G, D)
        chosen = [select(views[v], importance[v], keys[v], zip_.dominant, zip_.contextual) for v in range(V)]
        return [features for features, _ in chosen], [kept for _, kept in chosen]


class ReducingIdefics3Model(ReducingViewsModel, Idefics3Model):
    pass


class ReducingSmolVLMModel(ReducingViewsModel, SmolVLMModel):
    pass


class ReducingViews(SavesPlain):
    """Mixed into the ForConditionalGeneration classes: forward and generate with each view's placeholder run cut
    to its kept tokens."""

    def _cut(self, input_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
             pixel_values: torch.Tensor, pixel_attention_mask: Optional[torch.Tensor], kwargs: dict):
        """-> (the encoder output to hand over, the cut, and the cut input_ids and attention_mask)."""
        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError(f"pixel_values with inputs_embeds: a reduced {type(self).__name__} cuts the placeholder "
                             f"runs of input_ids; give input_ids")
        features, kept = self.model.reduced_image_features(pixel_values, pixel_attention_mask)
        cut = cut_runs(input_ids, attention_mask, self.config.image_token_id, self.model.image_seq_len, kept)
        mask = cut.apply(torch.ones_like(input_ids) if attention_mask is None else attention_mask, 0)
        encoded = BaseModelOutputWithPooling(last_hidden_state=None, pooler_output=[torch.cat(features)])
        return encoded, cut, cut.apply(input_ids, pad_id(self)), mask if attention_mask is not None else None

    def forward(self, input_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                pixel_values: Optional[torch.Tensor] = None, pixel_attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any):
        """As the plain forward, each view's placeholder run cut to its kept tokens: the logits (B, L', V) cover the
        shortened rows. labels and position_ids, where given, are cut with them (positions renumbered
        contiguously)."""
        if pixel_values is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        encoded, cut, ids, mask = self._cut(input_ids, attention_mask, pixel_values, pixel_attention_mask, kwargs)
        if kwargs.get("labels") is not None:
            kwargs["labels"] = cut.apply(kwargs["labels"], -100)
        if kwargs.get("position_ids") is not None:
            real = cut.apply(torch.ones_like(input_ids) if attention_mask is None else attention_mask, 0)
            kwargs["position_ids"] = (real.cumsum(dim=1) - 1).clamp(min=0)
        return super().forward(input_ids=ids, attention_mask=mask, mm_encoder_outputs={"image": encoded}, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 pixel_values: Optional[torch.Tensor] = None, pixel_attention_mask: Optional[torch.Tensor] = None,
                 **kwargs: Any):
        """As the plain generate; the language model prefills the kept image tokens only. The sequences returned
        start with the given input_ids (all placeholders), then the new tokens, as the plain model's do."""
        if pixel_values is None:
            return super().generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        encoded, _, short, mask = self._cut(input_ids, attention_mask, pixel_values, pixel_attention_mask, kwargs)
        out = super().generate(input_ids=short, attention_mask=mask, mm_encoder_outputs={"image": encoded}, **kwargs)
        return with_prompt(out, input_ids, short.shape[1])


class ReducingIdefics3ForConditionalGeneration(ReducingViews, Idefics3ForConditionalGeneration):
    pass


class ReducingSmolVLMForConditionalGeneration(ReducingViews, SmolVLMForConditionalGeneration):
    pass


class Idefics3Adapter(ConnectorAdapter):
    """Idefics3 / SmolVLM: square crops and a global view, each pixel-shuffled into its own run of tokens."""

    CLASSES = {
        Idefics3ForConditionalGeneration: (ReducingIdefics3ForConditionalGeneration, Idefics3Model,
                                           ReducingIdefics3Model),
        SmolVLMForConditionalGeneration: (ReducingSmolVLMForConditionalGeneration, SmolVLMModel,
                                          ReducingSmolVLMModel),
    }
    CONNECTOR = "square views pixel-shuffled into tokens"

    @staticmethod
    def tower_depth(model: nn.Module) -> int:
        return len(tower_layers(model.model.vision_model))

    @staticmethod
    def views(model: nn.Module, image_size: Tuple[int, int]) -> int:
        """The views the processor makes of an image it resized to image_size (H, W): one where it fits the tower,
        else a crop per tower-sized tile and the global view. ValueError for a size the processor does not give."""
        side = model.config.vision_config.image_size
        H, W = image_size
        if H <= 0 or W <= 0 or (max(H, W) > side and (H % side or W % side)):
            raise ValueError(f"image_size {tuple(image_size)}: {type(model).__name__}'s processor hands over an image "
                             f"of at most {side} pixels a side, or one resized to multiples of {side} (its crops); "
                             f"give the resized size")
        return 1 if max(H, W) <= side else (H // side) * (W // side) + 1

    @classmethod
    def plain_tokens(cls, model: nn.Module, image_size: Tuple[int, int]) -> int:
        return cls.views(model, image_size) * model.model.image_seq_len

    @classmethod
    def tokens_for(cls, model: nn.Module, image_size: Tuple[int, int]) -> int:
        zip_ = state_of(model.model).reducer
        return cls.views(model, image_size) * min(model.model.image_seq_len, zip_.dominant + zip_.contextual)

    @staticmethod
    def default_image_size(model: nn.Module) -> Tuple[int, int]:
        """A 4:3 image as SmolVLM's processor resizes it (longest edge 4 crops): 3 x 4 crops and the global view."""
        side = model.config.vision_config.image_size
        return 3 * side, 4 * side

    @classmethod
    def example_inputs(cls, model: nn.Module, image_size: Tuple[int, int], text: torch.Tensor,
                       generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """One random image of image_size (resized: its views are the crops and the global view) before text (1, T)
        ids: each view's placeholder run after two text tokens (where the processor writes
        <fake_token_around_image> and the view's row / column token)."""
        side, seq = model.config.vision_config.image_size, model.model.image_seq_len
        V = cls.views(model, image_size)
        marks = text[:, :2]
        run = torch.full((1, seq), model.config.image_token_id)
        ids = torch.cat([torch.cat([marks, run], dim=1)] * V + [text], dim=1)
        return dict(input_ids=ids, pixel_values=torch.randn(1, V, 3, side, side, generator=generator),
                    pixel_attention_mask=torch.ones(1, V, side, side, dtype=torch.bool))


ReducingViews.adapter = Idefics3Adapter

__all__ = ["Idefics3Adapter", "ReducingIdefics3ForConditionalGeneration", "ReducingSmolVLMForConditionalGeneration",
           "shuffle_groups"]
