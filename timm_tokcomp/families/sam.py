"""timm's VisionTransformerSAM (Segment Anything's image encoders, samvit_*): windowed blocks with global blocks
between them, decomposed relative-position biases, tokens as a (B, H, W, C) grid and a convolutional neck reading it.

Only methods whose plans keep the patch tokens a complete row-major grid serve it (CubistMerge; the dense variant,
which keeps every token): every block runs timm's own windowing, padding and relative positions on the grid it gets
(a smaller one after a merge: windows re-cut, tables interpolated by timm's get_rel_pos), and before the neck every
patch position takes the cell holding it, so the neck and whatever reads its output get the full grid. The log-size
bias, when on, is added to the relative-position bias; a window's padding has size 1 (timm attends it)."""
from dataclasses import dataclass
from typing import List, Optional, Tuple, Type, Union

import torch
from timm.models.vision_transformer_sam import Attention as SamAttention, Block as SamBlock
from timm.models.vision_transformer_sam import (VisionTransformerSAM, get_decomposed_rel_pos_bias, window_partition,
                                                window_unpartition)
from timm.layers import resample_abs_pos_embed_nhwc
from torch import nn

from ..runtime.dense import DenseBlockMixin, DenseModel
from ..methods.base import TokenReducer
from ..plans import Plan, gather_tokens
from ..runtime.loop import ReducingBlockMixin, ReducingModel
from ..runtime.state import ReductionStats
from .base import BuildArgs, Facade, Family, reducer_metric
from .vit import BlockBranchesVit

GRID_REFUSAL = ("does not keep the patch tokens a complete grid, which the windowed blocks and the neck of timm's "
                "VisionTransformerSAM read: on this model use cubist (grid-preserving merging) or a dense method "
                "(dense_tome)")
PATCH_DROP_REFUSAL = ("patch dropout keeps a random subset of a SAM encoder's patches, which breaks the grid its "
                      "windowed blocks read; train with patch_drop_rate=0 (evaluation is unaffected)")


@dataclass(frozen=True)
class GridPositions:
    """Where a SAM forward's tokens sit (what the reducing loop carries as positions): a complete height x width grid,
    row-major, made from the input's input_grid (rows, cols) of patches; holder: (B, rows * cols) int64, the cell
    holding each input patch, None while nothing merged."""

    height: int
    width: int
    input_grid: Tuple[int, int]
    holder: Optional[torch.Tensor] = None
    merge = None  # no rotary positions (ReductionStats.rope_merge)

    def rows(self, block: int) -> Tuple[int, int]:
        """What a block's attention branch reads: the grid (H, W) of its tokens."""
        return self.height, self.width

    def reduced(self, plan: Plan, size: Optional[torch.Tensor], num_prefix: int) -> "GridPositions":
        cells = plan.grid_cells()
        if cells is None:
            raise ValueError(f"{type(plan).__name__} {GRID_REFUSAL}")
        holder = cells.cell if self.holder is None else cells.cell.gather(1, self.holder)
        return GridPositions(*cells.shape, self.input_grid, holder)

    def prefix_only(self) -> "GridPositions":
        return self

    def settled(self) -> "GridPositions":
        return self

    def as_carried(self) -> "GridPositions":
        """As compiled blocks hand it on (rope.TokenPositions.as_carried): itself, a grid of Python ints."""
        return self

    def spread(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, height * width, C) -> (B, rows, cols, C) on the input's grid, each patch the cell holding it."""
        if self.holder is not None:
            tokens = gather_tokens(tokens, self.holder)
        return tokens.reshape(tokens.shape[0], *self.input_grid, tokens.shape[-1])


def unwindow(metric: Optional[torch.Tensor], window: int, grid: Tuple[int, int], padded: Tuple[int, int]
             ) -> Optional[torch.Tensor]:
    """A metric of windows (B * nW, window * window, D) -> (B, H * W, D) on the grid (padding dropped); None stays."""
    if metric is None:
        return None
    windows = metric.reshape(metric.shape[0], window, window, -1)
    whole = window_unpartition(windows, window, grid, padded)
    return whole.reshape(whole.shape[0], grid[0] * grid[1], -1)


class ReducingSamAttention(SamAttention):
    """SAM's Attention taking an additive log-size bias beside its relative-position bias and returning the reducer's
    metric."""

    def forward_reduce(self, x: torch.Tensor, attn_bias: Optional[torch.Tensor], reducer: Optional[TokenReducer],
                       prop_impl: str = "mask") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x: (B', h, w, C), a window or the whole grid; attn_bias: (B', 1, 1, h * w) log sizes or None (it enters as
        an additive mask whatever prop_impl says). Returns (out (B', h, w, C), metric (B', h * w, ...) or None)."""
        B, H, W, _ = x.shape
        N = H * W
        x = x.reshape(B, N, -1)
        heads = self.num_heads
        qkv = self.qkv(x).view(B, N, 3, heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * heads, N, -1).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        metric = reducer_metric(reducer, *(t.view(B, heads, N, -1) for t in (q, k, v)), attn_bias, self.scale, x)
        bias = get_decomposed_rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, (H, W), (H, W)) \
            if self.use_rel_pos else None
        if attn_bias is not None:
            sizes = attn_bias.to(q.dtype).expand(B, heads, 1, N).reshape(B * heads, 1, N)
            bias = sizes if bias is None else bias + sizes
        if self.fused_attn:
            x = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                           dropout_p=self.attn_drop.p if self.training else 0.)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            if bias is not None:
                attn = attn + bias
            x = self.attn_drop(attn.softmax(dim=-1)) @ v
        x = x.view(B, heads, N, -1).transpose(1, 2).reshape(B, N, -1)
        return self.proj_drop(self.proj(x)).view(B, H, W, -1), metric


class BlockBranchesSam(BlockBranchesVit):
    """SAM Block's branches on tokens (B, H * W, C) of a grid: attention windowed as timm windows it (ls1 and drop
    path per window, as timm applies them); the MLP side is timm's ViT Block's (same modules)."""

    def _attn_branch(self, x, attn_bias, grid, reducer, prop_impl):
        B, N, C = x.shape
        if B == 0:  # timm's windows and attention infer a width from the batch (-1), which an empty one lacks
            return x.new_zeros(x.shape), None
        H, W = grid
        h = self.norm1(x).reshape(B, H, W, C)
        bias = None if attn_bias is None else attn_bias.reshape(B, H, W, 1)
        padded = None
        if self.window_size > 0:
            h, padded = window_partition(h, self.window_size)
            if bias is not None:  # padding gets log size 0: timm attends its zero padding
                bias = window_partition(bias, self.window_size)[0]
        if bias is not None:
            bias = bias.reshape(h.shape[0], 1, 1, -1)
        h, metric = self.attn.forward_reduce(h, bias, reducer, prop_impl)
        h = self.drop_path1(self.ls1(h))
        if self.window_size > 0:
            h = window_unpartition(h, self.window_size, (H, W), padded)
            metric = unwindow(metric, self.window_size, (H, W), padded)
        return h.reshape(B, N, C), metric


class ReducingSamBlock(ReducingBlockMixin, BlockBranchesSam, SamBlock):
    """SAM Block reducing its tokens' grid. Run only by the patched model."""


class DenseSamBlock(DenseBlockMixin, BlockBranchesSam, SamBlock):
    """SAM Block for dense prediction (dense.DenseBlockMixin), run by timm's own forward on (B, H, W, C)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        return DenseBlockMixin.forward(self, x.reshape(B, H * W, C), (H, W)).reshape(B, H, W, C)


class ReducingSam(ReducingModel, VisionTransformerSAM):
    """VisionTransformerSAM running the shared reducing loop on its grid; forward_features returns timm's output (the
    neck's, on the input's full grid)."""

    num_prefix_tokens = 0
    dynamic_img_size = True  # timm's SAM embeds any input size (its absolute positions resampled)
    # timm's windows and relative positions read the grid as Python ints, so a block region would be traced again for
    # every grid and block kind: timm_tokcomp.compile and torch.compile compile the forward whole, static shapes
    compiles_by_region = False

    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, GridPositions]:
        x = self.patch_embed(x)
        if self.pos_embed is not None:
            x = x + resample_abs_pos_embed_nhwc(self.pos_embed, x.shape[1:3])
        x = self.pos_drop(x)
        if self.training and not isinstance(self.patch_drop, nn.Identity):
            raise ValueError(PATCH_DROP_REFUSAL)
        x = self.norm_pre(self.patch_drop(x))
        B, H, W, C = x.shape
        return x.reshape(B, H * W, C), GridPositions(H, W, (H, W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, H, W) -> timm's head on the neck's output (ReducingModel.forward_features); traced whole by
        torch.compile."""
        return self.forward_head(self.forward_features(x))

    def _features_from(self, x: torch.Tensor, stats: ReductionStats) -> torch.Tensor:
        """The last block's tokens (B, N', C) -> the neck's output (B, C', rows, cols) on the input's patch grid."""
        return self.neck(stats.positions.spread(x).permute(0, 3, 1, 2))

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = "NCHW",
                              intermediates_only: bool = False):
        """timm's forward_intermediates: each chosen block's output (B, C, rows, cols) on the input's full grid (a
        merged cell at every patch it holds; through the neck where norm), and the neck's output."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW' for timm's VisionTransformerSAM, got {output_fmt!r}")
        def on_grid(tokens: torch.Tensor, source: None, positions: GridPositions) -> torch.Tensor:
            full = positions.spread(tokens).permute(0, 3, 1, 2)
            return self.neck(full) if norm else full

        tokens, stats, grids = self._traced_blocks(x, indices, stop_early, True, on_grid, trace_source=False)
        return grids if intermediates_only else (self._features_from(tokens, stats), grids)


class DenseSam(DenseModel, VisionTransformerSAM):
    pass


def _arch_refusal(args: BuildArgs) -> Optional[str]:
    if args.arg("use_rope", False):
        return ("rotary positions (use_rope=True), whose tables timm's SAM builds for one grid only (a reduced grid "
                "has none)")
    block = args.arg("block_fn", SamBlock)
    if block is not SamBlock:
        return f"blocks of class {block.__name__} (timm_tokcomp serves timm's SAM Block)"
    return None


def _check(model: nn.Module) -> None:
    if getattr(model, "rope_global", None) is not None:
        raise TypeError("this VisionTransformerSAM uses rotary positions (use_rope=True), whose tables timm's SAM "
                        "builds for one grid only: timm_tokcomp serves its relative-position models")


@dataclass(frozen=True)
class SamFamily(Family):
    """timm's SAM encoders: no prefix tokens, average-pooled head (what patch reads, under timm's ViT names)."""

    def facade(self, model: nn.Module) -> Facade:
        return Facade(blocks=model.blocks, embed_dim=model.embed_dim, num_prefix_tokens=0,
                      global_pool=model.global_pool, patch_embed=model.patch_embed, dynamic_img_size=True)

    @staticmethod
    def has_class_token(model: nn.Module) -> bool:
        return False

    @staticmethod
    def builds_class_token(args: BuildArgs) -> bool:
        return False

    def method_refusal(self, method: Type[TokenReducer]) -> Optional[str]:
        return None if method.spec.keeps_grid or method.spec.dense else f"{method.name} {GRID_REFUSAL}"


SAM = SamFamily(
    name="VisionTransformerSAM",
    timm_modules=("vision_transformer_sam",),
    models={VisionTransformerSAM: ReducingSam},
    dense_models={VisionTransformerSAM: DenseSam},
    blocks={SamBlock: ReducingSamBlock},
    dense_blocks={SamBlock: DenseSamBlock},
    attentions={SamAttention: ReducingSamAttention},
    attn_dim=lambda attn: attn.qkv.out_features // 3,
    check=_check,
    arch_refusal=_arch_refusal,
)
