"""open_clip's image towers: its VisionTransformer (`model.visual` of open_clip's CLIP / CoCa models) with
ResidualAttentionBlock layers, whose attention is an nn.MultiheadAttention.

The layers become reducing blocks: their attention runs through the MultiheadAttention's own in_proj / out_proj
weights and SDPA, with the log-size bias as SDPA's additive mask (the same result as nn.MultiheadAttention where
nothing is reduced, within float rounding); LayerScale, the class token, the 'tok' / 'avg' / 'none' pools (the mean
weighted by size), the attentional pooler (log size added to its logits, as the blocks do) and output_tokens (the
reduced tokens) are kept. Patch dropout runs in training, except for a method that reads the patch grid. Imported on
first use (families.family_of), so open_clip stays an optional dependency.

    model, _, preprocess = open_clip.create_model_and_transforms("ViT-B-32", pretrained=...)
    timm_tokcomp.apply(model.visual, "tome", r=8)   # model.encode_image(images), 8 merges per layer
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from open_clip.transformer import LayerScale as OpenClipLayerScale, ResidualAttentionBlock, VisionTransformer
from torch import nn

from ..methods.base import TokenReducer
from ..runtime.loop import BlockBranches, ReducingBlockMixin, ReducingModel, patch_grid
from ..methods.schedules import BlockCost
from ..runtime.state import ReductionStats
from .base import BlockView, Facade, Family, PatchGrid, linear_macs, reducer_metric

POOLS = {"tok": "token", "avg": "avg", "none": ""}  # open_clip's pool_type -> timm's global_pool


def pool_of(model: nn.Module) -> str:
    """What open_clip's VisionTransformer reads of its last tokens, in timm's global_pool terms: 'token' (the class
    token alone, where no tokens are returned), 'avg', 'map' (an attentional pooler) or '' (every token)."""
    if model.attn_pool is not None:
        return "map"
    return "" if model.output_tokens else POOLS[model.pool_type]


def mha_attention(attn: nn.MultiheadAttention, x: torch.Tensor, attn_bias: Optional[torch.Tensor],
                  reducer: Optional[TokenReducer]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A batch-first nn.MultiheadAttention's self-attention on x: (B, N, C) with the additive bias attn_bias
    (B, 1, 1, N) or None, through its in_proj / out_proj and SDPA (explicitly where attn.fused_attn is set False)
    -> (out (B, N, C), the reducer's metric or None)."""
    B, N, C = x.shape
    heads = attn.num_heads
    q, k, v = (t.view(B, N, heads, C // heads).transpose(1, 2)
               for t in F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1))
    if attn_bias is not None:
        attn_bias = attn_bias.to(q.dtype)
    scale = (C // heads) ** -0.5
    metric = reducer_metric(reducer, q, k, v, attn_bias, scale, x)
    if getattr(attn, "fused_attn", True):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias,
                                             dropout_p=attn.dropout if attn.training else 0.0)
    else:  # explicit, as timm's fused_attn=False (export.export_onnx sets it: ONNX opset 18 has no fused attention)
        scores = (q * scale) @ k.transpose(-2, -1)
        if attn_bias is not None:
            scores = scores + attn_bias
        out = F.dropout(scores.softmax(dim=-1), attn.dropout, attn.training) @ v
    return attn.out_proj(out.transpose(1, 2).reshape(B, N, C)), metric


class ResidualAttentionBranches(BlockBranches):
    """open_clip ResidualAttentionBlock's branches: pre-norm ln_1 / ln_2, LayerScale ls_1 / ls_2 (or Identity)."""

    def _attn_branch(self, x, attn_bias, rope, reducer, prop_impl):
        h, metric = mha_attention(self.attn, self.ln_1(x), attn_bias, reducer)
        return self.ls_1(h), metric

    def _mlp_branch(self, x):
        return self.ls_2(self.mlp(self.ln_2(x)))

    def _mlp_scale(self):
        if isinstance(self.ls_2, OpenClipLayerScale):
            return not self.ls_2.inplace, self.ls_2.gamma
        return isinstance(self.ls_2, nn.Identity), None

    def _mlp_out(self, h):
        return self.ls_2(h)


class ReducingResidualAttentionBlock(ReducingBlockMixin, ResidualAttentionBranches, ResidualAttentionBlock):
    """open_clip's ResidualAttentionBlock reducing tokens. Run only by the patched model."""


def pooler_with_sizes(pooler: nn.Module, x: torch.Tensor, size: Optional[torch.Tensor]) -> torch.Tensor:
    """open_clip's AttentionalPooler on x: (B, N, C) with each token's size (B, N, 1) or None added to its attention
    logits as log size -> (B, n_queries, output_dim)."""
    B, N, _ = x.shape
    x = pooler.ln_k(x)
    q = pooler.ln_q(pooler.query).unsqueeze(0).expand(B, -1, -1)
    bias = None
    if size is not None:
        heads, queries = pooler.attn.num_heads, q.shape[1]
        bias = size[:, :, 0].log().to(x.dtype).view(B, 1, 1, N).expand(B, heads, queries, N)
        bias = bias.reshape(B * heads, queries, N)
    return pooler.attn(q, x, x, need_weights=False, attn_mask=bias)[0]


class ReducingOpenClipVisual(ReducingModel, VisionTransformer):
    """open_clip's VisionTransformer running the shared reducing loop; forward returns what open_clip's does."""

    dynamic_img_size = False  # open_clip's position embedding has one grid

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.resblocks

    @property
    def num_prefix_tokens(self) -> int:
        return 1

    @property
    def embed_dim(self) -> int:
        return self.transformer.width

    @property
    def patch_embed(self) -> PatchGrid:
        return PatchGrid(tuple(self.image_size), int(self.patch_size[0]))

    @property
    def global_pool(self) -> str:
        return pool_of(self)

    @property
    def grad_checkpointing(self) -> bool:
        return self.transformer.grad_checkpointing

    def _features_from(self, x: torch.Tensor, stats: ReductionStats) -> torch.Tensor:
        return self.ln_post(x)

    def _embed(self, x: torch.Tensor):
        if self.training and not isinstance(self.patch_dropout, nn.Identity) and self._tokcomp.reducer.spec.reads_grid:
            raise ValueError(f"{self._tokcomp.reducer.name} reads the patch grid, which patch dropout (training) "
                             f"breaks: train it with patch_dropout=0, or train another method")
        x = self.conv1(x).flatten(2).transpose(1, 2)  # open_clip's _embeds, with no width inferred (an empty batch)
        cls = self.class_embedding.to(x.dtype).view(1, 1, -1).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        return self.ln_pre(self.patch_dropout(x)), None

    def _blocks(self, x: torch.Tensor, **kwargs: Any):
        tokens, positions = self._embed(x)
        return self._reduce_blocks(tokens, positions, grid=patch_grid(self, x.shape[-2:]), **kwargs)

    def forward(self, x: torch.Tensor):
        """x: (B, 3, H, W) -> open_clip's output: the pooled, projected features (B, output_dim), and with
        output_tokens the reduced tokens too (B, N', width), as its _pool returns them."""
        tokens, stats = self._blocks(x)
        pooled, tokens = self._sized_pool(tokens, stats.size)
        if self.proj is not None:
            pooled = pooled @ self.proj
        return (pooled, tokens) if self.output_tokens else pooled

    def _sized_pool(self, x: torch.Tensor, size: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """open_clip's _pool with each token weighted by its size (B, N, 1) (None: all 1)."""
        if self.attn_pool is not None:
            if self.attn_pool_contrastive is not None:
                x = self.ln_post(x)
                tokens = pooler_with_sizes(self.attn_pool, x, size)
                if self.attn_pool_type == "parallel":
                    return pooler_with_sizes(self.attn_pool_contrastive, x, size), tokens
                return self.attn_pool_contrastive(tokens), tokens  # 'cascade': it pools the query outputs
            return self._global_pool(self.ln_post(pooler_with_sizes(self.attn_pool, x, size)))
        if self.final_ln_after_pool:
            pooled, tokens = self._sized_global_pool(x, size)
            return self.ln_post(pooled), tokens
        return self._sized_global_pool(self.ln_post(x), size)

    def _sized_global_pool(self, x: torch.Tensor, size: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.pool_type != "avg" or size is None:
            return self._global_pool(x)
        s = size[:, 1:].to(x.dtype)
        return (x[:, 1:] * s).sum(dim=1) / s.sum(dim=1).clamp_min(torch.finfo(s.dtype).tiny), x[:, 1:]

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              stop_early: bool = False, normalize_intermediates: bool = False,
                              intermediates_only: bool = False, output_fmt: str = "NCHW",
                              output_extra_tokens: bool = False) -> Dict[str, Any]:
        """open_clip's forward_intermediates on the full patch grid: each chosen block's tokens mapped back through the
        source map (a merged token at every patch it holds; zeros where a dropping pruner removed the patch)."""
        tokens, stats, prefix, spatial = self._grid_intermediates(
            x, indices, stop_early, intermediates_only, output_fmt, self.ln_post if normalize_intermediates else None)
        out: Dict[str, Any] = {"image_intermediates": spatial}
        if output_extra_tokens:
            out["image_intermediates_prefix"] = prefix
        if not intermediates_only:
            pooled, _ = self._sized_pool(tokens, stats.size)
            out["image_features"] = pooled if self.proj is None else pooled @ self.proj
        return out


@dataclass(frozen=True)
class OpenClipFamily(Family):
    """open_clip's VisionTransformer: the model and its ResidualAttentionBlocks swap classes (their
    nn.MultiheadAttention stays)."""

    def facade(self, model: nn.Module) -> Facade:
        return Facade(blocks=[BlockView(blk.attn, blk.mlp) for blk in self.layers(model)],
                      embed_dim=model.transformer.width, num_prefix_tokens=1,
                      global_pool=pool_of(model),
                      patch_embed=PatchGrid(tuple(model.image_size), int(model.patch_size[0])))

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.transformer.resblocks

    def check_blocks(self, model: nn.Module) -> None:
        for i, blk in enumerate(self.layers(model)):
            if self.plain_block(type(blk)) is None:
                raise TypeError(f"transformer.resblocks[{i}] is of class {type(blk).__name__}; timm_tokcomp serves "
                                f"open_clip's ResidualAttentionBlock (qk_norm / scaled attention blocks are "
                                f"CustomResidualAttentionBlock, not served)")
            attn = blk.attn
            if not attn.batch_first or not attn._qkv_same_embed_dim:
                raise TypeError(f"transformer.resblocks[{i}].attn is a MultiheadAttention with batch_first="
                                f"{attn.batch_first}; timm_tokcomp serves batch-first self-attention (open_clip "
                                f">= 2.26)")
        if model.patch_size[0] != model.patch_size[1]:
            raise TypeError(f"patch_size {tuple(model.patch_size)}: timm_tokcomp serves square patches")

    @staticmethod
    def has_class_token(model: nn.Module) -> bool:
        return True

    def block_cost(self, block: nn.Module) -> BlockCost:
        width = block.attn.embed_dim
        return BlockCost(attn_linear=4 * width * width, attn_dim=width, mlp_linear=linear_macs(block.mlp))

    def lookahead_refusal(self, model: nn.Module) -> Optional[str]:
        return ("the methods that reduce before attention (mctf) serve timm's VisionTransformer blocks, not "
                "open_clip's")

    def fold_qkv_refusal(self, model: nn.Module) -> Optional[str]:
        return "prop_attn='fold_qkv' pads timm's fused qkv Attention; open_clip's blocks take the size bias as a mask"

    def dense_refusal(self, model: nn.Module) -> Optional[str]:
        return "the dense methods serve timm's models, not open_clip's (use a token-reducing method)"


OPEN_CLIP = OpenClipFamily(
    name="open_clip",
    timm_modules=(),
    models={VisionTransformer: ReducingOpenClipVisual},
    dense_models={},
    blocks={ResidualAttentionBlock: ReducingResidualAttentionBlock},
    dense_blocks={},
    attentions={},
    attn_dim=lambda attn: attn.embed_dim,
)
