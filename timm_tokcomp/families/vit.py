"""timm's VisionTransformer (DeiT, augreg, CLIP, DINOv2, SigLIP with its 'map' head, register models) and
VisionTransformerDistilled: the reducing and dense subclasses of their Attention, Block and model classes."""
from typing import Optional, Tuple

import torch
from timm.layers import Attention, LayerScale
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..ops import attention
from ..runtime.dense import DenseBlockMixin, DenseModel
from ..methods.base import TokenReducer
from ..runtime.loop import BlockBranches, ReducingBlockMixin, ReducingModel
from .base import Family, project_heads, reducer_metric, vit_block_refusal


class ReducingAttention(Attention):
    """timm Attention that also returns the reducer's metric and takes an additive score bias."""

    def forward_reduce(
        self, x: torch.Tensor, attn_bias: Optional[torch.Tensor], reducer: Optional[TokenReducer],
        prop_impl: str = "mask",
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x: (B, N, C); attn_bias: (B, 1, 1, N) log sizes or None; prop_impl: how the bias enters SDPA
        (attention.PROP_ATTN_IMPLS, resolved). Returns (out (B, N, C_out), metric or None)."""
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        d = self.head_dim
        if attn_bias is not None and self.fused_attn and prop_impl == "fold_qkv":
            q, k, v = attention.folded_qkv(self, x, attn_bias)  # (B, H, N, d') views of one padded copy
            attn_bias = attn_bias.to(q.dtype)
            metric = reducer_metric(reducer, q[..., :d], k[..., :d], v[..., :d], attn_bias, self.scale, x)
            dropout_p = self.attn_drop.p if self.training else 0.0
            x = attention.padded_attention(q, k, v, d, dropout_p, self.scale)
        else:
            qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, d).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            q, k = self.q_norm(q), self.k_norm(k)
            if attn_bias is not None:
                attn_bias = attn_bias.to(q.dtype)
            metric = reducer_metric(reducer, q, k, v, attn_bias, self.scale, x)
            x = attention.attend(q, k, v, attn_bias, prop_impl, self.scale, self.attn_drop, self.fused_attn)
        return project_heads(self, x, gate), metric


class BlockBranchesVit(BlockBranches):
    """timm Block's branches: pre-norm, LayerScale modules ls1 / ls2, drop path."""

    def _attn_branch(self, x, attn_bias, rope, reducer, prop_impl):
        h, metric = self.attn.forward_reduce(self.norm1(x), attn_bias, reducer, prop_impl)
        return self.drop_path1(self.ls1(h)), metric

    def _mlp_branch(self, x):
        return self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def _mlp_scale(self):
        """An in-place LayerScale (a module applied to its input) is not fused."""
        if isinstance(self.ls2, LayerScale):
            return not self.ls2.inplace, self.ls2.gamma
        return isinstance(self.ls2, nn.Identity), None

    def _mlp_out(self, h):
        return self.drop_path2(self.ls2(h))


class ReducingBlock(ReducingBlockMixin, BlockBranchesVit, Block):
    """timm Block that reduces tokens between attention and MLP. Run only by the patched model."""

    def _lookahead_branch(self, x, size, source, attn_bias, setting, reducer, num_prefix):
        """This block's attention probabilities (B, H, N, N), softmax in fp32, on the tokens entering it; the
        reducer merges the tokens and those probabilities; they are applied to the merged tokens' values (the v
        projection of norm1 of the merged tokens) -> (x, attention's branch, size, source), M tokens."""
        attn = self.attn
        B, N, _ = x.shape
        q, k, v = attn.qkv(self.norm1(x)).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k = attn.q_norm(q), attn.k_norm(k)
        scores = (q * attn.scale) @ k.transpose(-2, -1)
        if attn_bias is not None:
            scores = scores + attn_bias.to(scores.dtype)
        probs = attn.attn_drop(scores.float().softmax(dim=-1))
        reduced = reducer.lookahead(x, probs, size, source, setting, num_prefix)
        if reduced is not None:
            x, probs, size, source = reduced
            v = value_heads(attn, self.norm1(x))
        gate = attn.gate(self.norm1(x)).sigmoid() if getattr(attn, "gate", None) is not None else None
        return x, self.drop_path1(self.ls1(project_heads(attn, probs.to(v.dtype) @ v, gate))), size, source


def value_heads(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """The values alone of x (B, M, C) -> (B, H, M, d): the v rows of a plain nn.Linear qkv (a third of its MACs);
    a wrapped qkv (an adapter, a quantized module) is called whole, as timm calls it."""
    B, M, _ = x.shape
    width = attn.num_heads * attn.head_dim
    if type(attn.qkv) is nn.Linear:
        bias = None if attn.qkv.bias is None else attn.qkv.bias[2 * width:]
        v = nn.functional.linear(x, attn.qkv.weight[2 * width:], bias)
    else:
        v = attn.qkv(x)[..., 2 * width:]
    return v.reshape(B, M, attn.num_heads, attn.head_dim).transpose(1, 2)


class ReducingVisionTransformer(ReducingModel, VisionTransformer):
    def _embed(self, x):
        return self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x)))), None


class ReducingVisionTransformerDistilled(ReducingModel, VisionTransformerDistilled):
    def _embed(self, x):
        return self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x)))), None


class DenseBlock(DenseBlockMixin, BlockBranchesVit, Block):
    """timm Block for dense prediction (dense.DenseBlockMixin)."""


class DenseVisionTransformer(DenseModel, VisionTransformer):
    pass


class DenseVisionTransformerDistilled(DenseModel, VisionTransformerDistilled):
    pass


VIT = Family(
    name="VisionTransformer",
    timm_modules=("vision_transformer", "deit"),
    models={VisionTransformer: ReducingVisionTransformer,
            VisionTransformerDistilled: ReducingVisionTransformerDistilled},
    dense_models={VisionTransformer: DenseVisionTransformer,
                  VisionTransformerDistilled: DenseVisionTransformerDistilled},
    blocks={Block: ReducingBlock},
    dense_blocks={Block: DenseBlock},
    attentions={Attention: ReducingAttention},
    fused_qkv_attentions=(Attention,),
    attn_dim=lambda attn: attn.qkv.out_features // 3,
    arch_refusal=vit_block_refusal,
)
