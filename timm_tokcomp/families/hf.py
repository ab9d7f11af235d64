"""Hugging Face transformers' vision encoders: ViTModel and ViTForImageClassification, Dinov2Model and
Dinov2WithRegistersModel (its registers are prefix tokens), CLIPVisionModel and SiglipVisionModel (its
attention-pool head takes the token sizes, as timm's 'map' head does).

Their layers become reducing blocks (BlockBranches over transformers' own modules; attention through the model's
own attention function, 'eager' or 'sdpa', with the log-size bias as its additive mask), their models run the shared
loop (ReducingModel._reduce_blocks) and return transformers' output types. Imported on first use (families.family_of),
so transformers stays an optional dependency.

    model = transformers.ViTForImageClassification.from_pretrained(folder)
    timm_tokcomp.apply(model, "tome", r=8)          # model(pixel_values).logits, with 8 merges per layer
"""
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple

import torch
import transformers
from torch import nn

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"timm_tokcomp serves the vision encoders of transformers >= 5 (their q_proj / k_proj / v_proj "
                      f"attention), found transformers {transformers.__version__}: pip install 'transformers>=5'")

from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.clip.modeling_clip import CLIPEncoderLayer, CLIPVisionModel
from transformers.models.dinov2.modeling_dinov2 import Dinov2Layer, Dinov2Model
from transformers.models.dinov2_with_registers.modeling_dinov2_with_registers import (
    Dinov2WithRegistersLayer, Dinov2WithRegistersModel)
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer, SiglipVisionModel
from transformers.models.vit.modeling_vit import ViTForImageClassification, ViTLayer, ViTModel

from ..methods.base import TokenReducer
from ..runtime.loop import BlockBranches, ReducingBlockMixin, ReducingModel, patch_grid
from ..runtime.handoff import compiled_whole, forward_by_region
from ..runtime.regions import compiled_regions
from .base import BlockView, Facade, Family, PatchGrid, reducer_metric
from .hf_call import bind_call

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")  # transformers' attention functions that take an additive float mask


def check_attn_implementation(config: Any) -> None:
    """ValueError unless the model's attention implementation takes the log-size bias as an additive mask."""
    impl = config._attn_implementation
    if impl not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation {impl!r} cannot take the token sizes (an additive float mask); reduce "
                         f"tokens with attn_implementation 'sdpa' or 'eager' (model.set_attn_implementation('sdpa'))")


def attention(attn: nn.Module, x: torch.Tensor, attn_bias: Optional[torch.Tensor],
              reducer: Optional[TokenReducer]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A transformers attention module (q_proj, k_proj, v_proj, o_proj or out_proj) on x: (B, N, C) with the additive
    bias attn_bias (B, 1, 1, N) or None -> (out (B, N, C), the reducer's metric or None). The model's own attention
    function ('eager': that model file's, or 'sdpa') runs it, as transformers' forward does. The proportional-attention
    implementations compute one result; transformers' functions take it as the mask, so the layers ignore prop_impl."""
    check_attn_implementation(attn.config)
    B, N, _ = x.shape
    heads = (B, N, -1, attn.head_dim)
    q = attn.q_proj(x).view(heads).transpose(1, 2)
    k = attn.k_proj(x).view(heads).transpose(1, 2)
    v = attn.v_proj(x).view(heads).transpose(1, 2)
    scale = attn.scaling if hasattr(attn, "scaling") else attn.scale
    if attn_bias is not None:
        attn_bias = attn_bias.to(q.dtype)
    metric = reducer_metric(reducer, q, k, v, attn_bias, scale, x)
    eager = sys.modules[type(attn).__module__].eager_attention_forward
    run = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
    dropout = getattr(attn, "attention_dropout", getattr(attn, "dropout", 0.0))
    out, _ = run(attn, q, k, v, attn_bias, scaling=scale, dropout=dropout if attn.training else 0.0)
    out = out.reshape(B, N, -1).contiguous()
    return (attn.o_proj if hasattr(attn, "o_proj") else attn.out_proj)(out), metric


class ViTLayerBranches(BlockBranches):
    """transformers' ViTLayer: layernorm_before / layernorm_after, dropout on each branch."""

    def _attn_branch(self, x, attn_bias, rope, reducer, prop_impl):
        h, metric = attention(self.attention, self.layernorm_before(x), attn_bias, reducer)
        return self.dropout(h), metric

    def _mlp_branch(self, x):
        return self.dropout(self.mlp(self.layernorm_after(x)))

    def _mlp_scale(self):
        return True, None

    def _mlp_out(self, h):
        return self.dropout(h)


class Dinov2LayerBranches(BlockBranches):
    """transformers' Dinov2Layer (and with registers): norm1 / norm2, layer scales, one drop path."""

    def _attn_branch(self, x, attn_bias, rope, reducer, prop_impl):
        h, metric = attention(self.attention, self.norm1(x), attn_bias, reducer)
        return self.drop_path(self.layer_scale1(h)), metric

    def _mlp_branch(self, x):
        return self.drop_path(self.layer_scale2(self.mlp(self.norm2(x))))

    def _mlp_scale(self):
        return False, None

    def _mlp_out(self, h):
        return self.drop_path(self.layer_scale2(h))


class EncoderLayerBranches(BlockBranches):
    """transformers' CLIPEncoderLayer and SiglipEncoderLayer: layer_norm1 / layer_norm2, self_attn, mlp."""

    def _attn_branch(self, x, attn_bias, rope, reducer, prop_impl):
        return attention(self.self_attn, self.layer_norm1(x), attn_bias, reducer)

    def _mlp_branch(self, x):
        return self.mlp(self.layer_norm2(x))

    def _mlp_scale(self):
        return True, None

    def _mlp_out(self, h):
        return h


class ReducingViTLayer(ReducingBlockMixin, ViTLayerBranches, ViTLayer):
    pass


class ReducingDinov2Layer(ReducingBlockMixin, Dinov2LayerBranches, Dinov2Layer):
    pass


class ReducingDinov2WithRegistersLayer(ReducingBlockMixin, Dinov2LayerBranches, Dinov2WithRegistersLayer):
    pass


class ReducingCLIPEncoderLayer(ReducingBlockMixin, EncoderLayerBranches, CLIPEncoderLayer):
    pass


class ReducingSiglipEncoderLayer(ReducingBlockMixin, EncoderLayerBranches, SiglipEncoderLayer):
    pass


def layer_attention(layer: nn.Module) -> nn.Module:
    return layer.attention if hasattr(layer, "attention") else layer.self_attn


class HFReducingModel(ReducingModel):
    """Mixin over a transformers vision model running the shared reducing loop. A class gives layers_at (the dotted
    path of its layer list), embeddings_at, norm_at (its final norm, '' for none), global_pool (timm's sense: 'token'
    where the output reads only the class token, 'map' for an attention-pool head, '' where every token is returned),
    prefix_tokens(config) and _finish."""

    layers_at: ClassVar[str]
    embeddings_at: ClassVar[str] = "embeddings"
    norm_at: ClassVar[str] = "layernorm"
    global_pool: ClassVar[str] = ""
    dynamic_img_size: ClassVar[bool] = True

    @staticmethod
    def prefix_tokens(config: Any) -> int:
        return 1

    @property
    def blocks(self) -> nn.ModuleList:
        return self.get_submodule(self.layers_at)

    @property
    def num_prefix_tokens(self) -> int:
        return self.prefix_tokens(self.config)

    @property
    def embed_dim(self) -> int:
        return self.config.hidden_size

    @property
    def patch_embed(self) -> PatchGrid:
        return PatchGrid.of(self.config)

    @property
    def grad_checkpointing(self) -> bool:
        return self.is_activation_checkpointing

    @property
    def norm(self) -> nn.Module:
        """The norm on the last layer's tokens (Identity where the model returns them unnormed)."""
        return self.get_submodule(self.norm_at) if self.norm_at else nn.Identity()

    def _embed(self, pixel_values: torch.Tensor, interpolate_pos_encoding: Optional[bool] = None):
        embeddings, pixel_values = self.get_submodule(self.embeddings_at), self._input(pixel_values)
        if interpolate_pos_encoding is None:
            return embeddings(pixel_values), None
        return embeddings(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding), None

    def plain_class(self) -> type:
        """The transformers class this model was (its forward's signature, the class save_pretrained names)."""
        return next(PLAIN[c] for c in type(self).__mro__ if c in PLAIN)

    def forward(self, *args: Any, **kwargs: Any):
        """The plain class's forward arguments (pixel_values (B, 3, H, W) first; hf_call.bind_call) -> transformers'
        output of this model class, or its tuple where return_dict (in the call, else the config) is False."""
        if compiled_whole(self):
            return forward_by_region(self, *args, **kwargs)
        call = bind_call(self.plain_class(), self, args, kwargs)
        regions = compiled_regions(self)
        tokens, positions, unit = self._embedded(regions, call.pixel_values, call.interpolate_pos_encoding)
        x, stats = self._reduce_blocks(tokens, positions, unit_sizes=unit,
                                       grid=patch_grid(self, call.pixel_values.shape[-2:]))
        finish = type(self)._finish if regions is None else regions.finish
        out = finish(self, x, stats.size, call.labels)
        return out if call.return_dict else out.to_tuple()

    def _input(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The images as this class's embeddings take them (_embed)."""
        return pixel_values

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' save_pretrained, its config naming the plain class (transformers writes the model's class
        name there): the folder loads as the plain model, the method applied again after loading."""
        patched = type(self)
        self.__class__ = self.plain_class()
        try:
            return self.save_pretrained(*args, **kwargs)
        finally:
            self.__class__ = patched

    def _finish(self, x: torch.Tensor, size: Optional[torch.Tensor], labels: Optional[torch.Tensor]):
        """The last layer's tokens x: (B, N', C) with their sizes (B, N', 1) or None -> the model's output."""
        raise NotImplementedError


class ReducingHFViTModel(HFReducingModel, ViTModel):
    layers_at = "layers"

    def _input(self, pixel_values):
        return pixel_values.to(self.embeddings.patch_embeddings.projection.weight.dtype)

    def _finish(self, x, size, labels):
        x = self.layernorm(x)
        return BaseModelOutputWithPooling(last_hidden_state=x,
                                          pooler_output=self.pooler(x) if self.pooler is not None else None)


class ReducingHFViTForImageClassification(HFReducingModel, ViTForImageClassification):
    layers_at = "vit.layers"
    embeddings_at = "vit.embeddings"
    norm_at = "vit.layernorm"
    global_pool = "token"

    def _input(self, pixel_values):
        return pixel_values.to(self.vit.embeddings.patch_embeddings.projection.weight.dtype)

    def _finish(self, x, size, labels):
        logits = self.classifier(self.vit.layernorm(x)[:, 0, :])
        loss = None if labels is None else self.loss_function(labels, logits, self.config)
        return ImageClassifierOutput(loss=loss, logits=logits)


class ReducingHFDinov2Model(HFReducingModel, Dinov2Model):
    layers_at = "encoder.layer"

    def _embed(self, pixel_values, interpolate_pos_encoding=None):
        return self.embeddings(pixel_values), None  # Dinov2 always interpolates its position embedding

    def _finish(self, x, size, labels):
        x = self.layernorm(x)
        return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=x[:, 0, :])


class ReducingHFDinov2WithRegistersModel(ReducingHFDinov2Model, Dinov2WithRegistersModel):
    @staticmethod
    def prefix_tokens(config):
        return 1 + config.num_register_tokens


class ReducingHFCLIPVisionModel(HFReducingModel, CLIPVisionModel):
    layers_at = "encoder.layers"
    norm_at = ""  # CLIP returns the last layer's tokens unnormed; post_layernorm serves the pooled class token

    def _embed(self, pixel_values, interpolate_pos_encoding=None):
        tokens = self.embeddings(pixel_values, interpolate_pos_encoding=bool(interpolate_pos_encoding))
        return self.pre_layrnorm(tokens), None

    def _finish(self, x, size, labels):
        return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=self.post_layernorm(x[:, 0, :]))


class ReducingHFSiglipVisionModel(HFReducingModel, SiglipVisionModel):
    layers_at = "encoder.layers"
    norm_at = "post_layernorm"
    global_pool = "map"

    @staticmethod
    def prefix_tokens(config):
        return 0

    def _embed(self, pixel_values, interpolate_pos_encoding=None):
        return self.embeddings(pixel_values, interpolate_pos_encoding=bool(interpolate_pos_encoding)), None

    def _finish(self, x, size, labels):
        x = self.post_layernorm(x)
        pooled = None
        if self.use_head:
            pooled = self.head(x) if size is None else attention_pool(self.head, x, size)
        return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=pooled)


def attention_pool(head: nn.Module, x: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """SigLIP's attention-pool head on x: (B, N, C) with each token's size (B, N, 1) added to its attention logits as
    log size, as the blocks do -> (B, C)."""
    B, N, _ = x.shape
    heads = head.attention.num_heads
    bias = size[:, :, 0].log().to(x.dtype).view(B, 1, 1, N).expand(B, heads, 1, N).reshape(B * heads, 1, N)
    h = head.attention(head.probe.repeat(B, 1, 1), x, x, attn_mask=bias)[0]
    return (h + head.mlp(head.layernorm(h)))[:, 0]


MODELS: Dict[type, type] = {
    ViTModel: ReducingHFViTModel,
    ViTForImageClassification: ReducingHFViTForImageClassification,
    Dinov2Model: ReducingHFDinov2Model,
    Dinov2WithRegistersModel: ReducingHFDinov2WithRegistersModel,
    CLIPVisionModel: ReducingHFCLIPVisionModel,
    SiglipVisionModel: ReducingHFSiglipVisionModel,
}
PLAIN: Dict[type, type] = {reducing: plain for plain, reducing in MODELS.items()}
LAYERS: Dict[type, type] = {
    ViTLayer: ReducingViTLayer,
    Dinov2Layer: ReducingDinov2Layer,
    Dinov2WithRegistersLayer: ReducingDinov2WithRegistersLayer,
    CLIPEncoderLayer: ReducingCLIPEncoderLayer,
    SiglipEncoderLayer: ReducingSiglipEncoderLayer,
}


@dataclass(frozen=True)
class HFFamily(Family):
    """transformers' vision encoders: the model and its layers swap classes (their attention modules stay)."""

    def _patched_class(self, model: nn.Module) -> type:
        return type(model) if type(model) in self.plain_models() else self.models[type(model)]

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self._patched_class(model).layers_at)

    def facade(self, model: nn.Module) -> Facade:
        cls = self._patched_class(model)
        return Facade(blocks=[BlockView(layer_attention(layer), layer.mlp) for layer in self.layers(model)],
                      embed_dim=model.config.hidden_size, num_prefix_tokens=cls.prefix_tokens(model.config),
                      global_pool=cls.global_pool, patch_embed=PatchGrid.of(model.config))

    def check_blocks(self, model: nn.Module) -> None:
        for i, layer in enumerate(self.layers(model)):
            if self.plain_block(type(layer)) is None:
                raise TypeError(f"layer {i} is of class {type(layer).__name__}; timm_tokcomp serves "
                                f"{', '.join(c.__name__ for c in self.blocks)}")
        check_attn_implementation(model.config)

    def has_class_token(self, model: nn.Module) -> bool:
        return self._patched_class(model).prefix_tokens(model.config) > 0  # the class token comes first

    def lookahead_refusal(self, model: nn.Module) -> Optional[str]:
        return ("the methods that reduce before attention (mctf) serve timm's VisionTransformer blocks, not "
                "transformers' layers")

    def fold_qkv_refusal(self, model: nn.Module) -> Optional[str]:
        return "prop_attn='fold_qkv' pads timm's fused qkv Attention; transformers' layers take the size bias as a mask"

    def dense_refusal(self, model: nn.Module) -> Optional[str]:
        return "the dense methods serve timm's models, not transformers' (use a token-reducing method)"


HF = HFFamily(
    name="transformers",
    timm_modules=(),
    models=MODELS,
    dense_models={},
    blocks=LAYERS,
    dense_blocks={},
    attentions={},
    attn_dim=lambda attn: attn.q_proj.out_features,
)
