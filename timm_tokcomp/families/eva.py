"""timm's Eva class (EVA02, DINOv3, PE-Core / PE-Spatial, NAVER RoPE-ViT, timm's vit_*_rope_* models): rotary
positions travel with the tokens (timm_tokcomp.ops.rope), fused or split qkv, q / k norm, SwiGLU / GLU MLPs,
LayerScale, register tokens, an attention-pool head. Reducing and dense subclasses of EvaAttention, EvaBlock /
EvaBlockPostNorm and Eva."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers.attention import AttentionRope
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from timm.models.eva import Eva, EvaAttention, EvaBlock, EvaBlockPostNorm
from torch import nn

from ..ops import attention
from ..runtime.dense import DenseBlockMixin, DenseModel
from ..methods.base import TokenReducer
from ..runtime.loop import BlockBranches, ReducingBlockMixin, ReducingModel
from ..ops.rope import PATCH_DROP_REFUSAL, ROPE_CLASSES, TokenPositions, check_rope, grid_coords
from .base import Family, eva_skips_qkv_module, project_heads, reducer_metric


def _qkv(attn: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H(kv), N, d) as EvaAttention / AttentionRope project them (fused qkv with Eva's q / v biases and
    zero k bias, or split projections)."""
    B, N, _ = x.shape
    if attn.qkv is not None:
        if getattr(attn, "q_bias", None) is None:
            qkv = attn.qkv(x)
        else:
            qkv_bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
            if attn.qkv_bias_separate or type(attn.qkv) is not nn.Linear:
                # the module itself runs where it is not a plain Linear (a peft LoRA layer, a quantised Linear):
                # timm's F.linear on its weight would silently skip the adapter
                qkv = attn.qkv(x) + qkv_bias
            else:
                qkv = F.linear(x, weight=attn.qkv.weight, bias=qkv_bias)
        return qkv.reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    kv_heads = getattr(attn, "num_kv_heads", attn.num_heads)
    return (attn.q_proj(x).reshape(B, N, attn.num_heads, attn.head_dim).transpose(1, 2),
            attn.k_proj(x).reshape(B, N, kv_heads, attn.head_dim).transpose(1, 2),
            attn.v_proj(x).reshape(B, N, kv_heads, attn.head_dim).transpose(1, 2))


def _forward_reduce(
    self: nn.Module, x: torch.Tensor, attn_bias: Optional[torch.Tensor], reducer: Optional[TokenReducer],
    prop_impl: str = "mask", rope: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x: (B, N, C); attn_bias: (B, 1, 1, N) log sizes or None; prop_impl: 'mask', 'fold' or 'flex';
    rope: the patch tokens' rope rows ((N - prefix, 2 * head_dim) or batched, as timm's) or None. The metric
    reads q and k as attention uses them (rotated). Returns (out (B, N, C), metric or None)."""
    gate = self.gate(x).sigmoid() if self.gate is not None else None
    q, k, v = _qkv(self, x)
    q, k = self.q_norm(q), self.k_norm(k)
    if rope is not None:
        p, half = self.num_prefix_tokens, self.rotate_half
        q = torch.cat([q[:, :, :p, :], apply_rot_embed_cat(q[:, :, p:, :], rope, half=half)], dim=2).type_as(v)
        k = torch.cat([k[:, :, :p, :], apply_rot_embed_cat(k[:, :, p:, :], rope, half=half)], dim=2).type_as(v)
    groups = getattr(self, "num_kv_groups", 1)
    if groups > 1:  # grouped-query attention (AttentionRope): each kv head serves `groups` query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if attn_bias is not None:
        attn_bias = attn_bias.to(q.dtype)
    metric = reducer_metric(reducer, q, k, v, attn_bias, self.scale, x)
    x = attention.attend(q, k, v, attn_bias, prop_impl, self.scale, self.attn_drop, self.fused_attn)
    return project_heads(self, x, gate), metric


class ReducingEvaAttention(EvaAttention):
    """EvaAttention that also returns the reducer's metric and takes an additive score bias and per-token rope."""

    forward_reduce = _forward_reduce


class ReducingAttentionRope(AttentionRope):
    """timm's AttentionRope (PE, attn_type='rope'; grouped-query heads too), reducing as ReducingEvaAttention."""

    forward_reduce = _forward_reduce


class BlockBranchesEva(BlockBranches):
    """EvaBlock's branches: pre-norm, optional LayerScale gammas (tensors), drop path."""

    def _attn_branch(self, x, attn_bias, rope, reducer, prop_impl):
        h, metric = self.attn.forward_reduce(self.norm1(x), attn_bias, reducer, prop_impl, rope)
        if self.gamma_1 is not None:
            h = self.gamma_1 * h
        return self.drop_path1(h), metric

    def _mlp_branch(self, x):
        return self._mlp_out(self.mlp(self.norm2(x)))

    def _mlp_scale(self):
        return True, self.gamma_2

    def _mlp_out(self, h):
        return self.drop_path2(h if self.gamma_2 is None else self.gamma_2 * h)


class ReducingEvaBlock(ReducingBlockMixin, BlockBranchesEva, EvaBlock):
    """EvaBlock that reduces tokens. Run only by the patched model."""


class ReducingEvaBlockPostNorm(ReducingBlockMixin, EvaBlockPostNorm):
    """EvaBlockPostNorm (norm after each branch) that reduces tokens. Run only by the patched model."""

    def _attn_branch(self, x, attn_bias, rope, reducer, prop_impl):
        h, metric = self.attn.forward_reduce(x, attn_bias, reducer, prop_impl, rope)
        return self.drop_path1(self.norm1(h)), metric

    def _mlp_branch(self, x):
        return self.drop_path2(self.norm2(self.mlp(x)))


class DenseEvaBlock(DenseBlockMixin, BlockBranchesEva, EvaBlock):
    """EvaBlock for dense prediction (dense.DenseBlockMixin; timm's rope unchanged)."""


class ReducingEva(ReducingModel, Eva):
    map_pool_reads_prefix = True  # Eva.pool hands every token to its attention pool

    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[TokenPositions]]:
        x = self.patch_embed(x)
        feat_shape = tuple(x.shape[1:3]) if self.dynamic_img_size else tuple(self.patch_embed.grid_size)
        if self.rope is not None and self.patch_drop is not None and self.training:
            raise ValueError(PATCH_DROP_REFUSAL)
        x, table = self._pos_embed(x)
        x = self.norm_pre(x)
        if table is None:
            return x, None
        coords = grid_coords(self.rope, feat_shape, x.device).expand(x.shape[0], -1, -1)
        return x, TokenPositions(self.rope, coords, table, self._tokcomp.reducer.rope_merge)


class DenseEva(DenseModel, Eva):
    pass


def _check(model: nn.Module) -> None:
    check_rope(model.rope)


def _attn_dim(attn: nn.Module) -> int:
    return attn.num_heads * attn.head_dim


EVA = Family(
    name="Eva",
    timm_modules=("eva",),
    models={Eva: ReducingEva},
    dense_models={Eva: DenseEva},
    blocks={EvaBlock: ReducingEvaBlock, EvaBlockPostNorm: ReducingEvaBlockPostNorm},
    dense_blocks={EvaBlock: DenseEvaBlock},
    attentions={EvaAttention: ReducingEvaAttention, AttentionRope: ReducingAttentionRope},
    check=_check,
    attn_dim=_attn_dim,
    plain_skips_qkv_module=eva_skips_qkv_module,
    other_classes=ROPE_CLASSES,
)
