"""CubistMerge (Gong & Lis, arXiv 2509.21764): one grid-preserving merge, so the patch tokens stay a complete
row-major grid, smaller, and whatever reads the grid (windows, relative positions, a neck) still can. At the input of
block `layer` (after the previous block's MLP), on the tokens themselves (cosine):

1. rows: in every row the odd positions are sources, each matched to the more similar of its even neighbours (ties:
   the left); the r_cols best matched of each row merge, so every row loses exactly r_cols tokens;
2. columns: the same step on the new grid's columns, r_rows per column;
3. each cell of the (rows - r_rows) x (cols - r_cols) grid takes, per channel, the member value of largest magnitude
   (the paper's max-magnitude-per-dimension); sizes and source maps are summed (kept for pooling and the source-map
   unmerge; proportional attention is off by default, as in the paper).
Training-free. Implemented from the paper's description; no code copied."""
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..utils.checks import check_int, integer
from ..plans import GridMergePlan
from ..plans.grid import max_magnitude
from .schedules import BlockCost
from .places import ReducesAt
from .base import GridSettings, PlansOnTokens, TokenReducer
from .params import COMMON, Param
from .register import register_method
from .tags import TagForm, parse_r_tag


class CubistSetting(NamedTuple):
    """The merging block's patch grid and how many rows and columns it removes (clamped to half of each)."""

    rows: int
    cols: int
    r_rows: int
    r_cols: int


def line_merge(tokens: torch.Tensor, r: int) -> torch.Tensor:
    """One CubistMerge step along the last grid axis: tokens (B, L, W, C), each of the L lines of W tokens loses r
    (0 <= r <= W // 2; r = 0 leaves every token in place) -> (B, L, W) int64, each token's position in its line after the merge, in [0, W - r)."""
    B, L, W, _ = tokens.shape
    unit = F.normalize(tokens.float(), dim=-1)
    n_src, n_right = W // 2, (W - 1) // 2  # sources at 1, 3, ...; those with a right neighbour
    src = unit[:, :, 1::2]
    left = (src * unit[:, :, 0:2 * n_src:2]).sum(dim=-1)
    right = torch.cat([(src[:, :, :n_right] * unit[:, :, 2:2 + 2 * n_right:2]).sum(dim=-1),
                       left.new_full((B, L, n_src - n_right), float("-inf"))], dim=-1)
    go_right = right > left
    best = torch.maximum(left, right)
    chosen = best.argsort(dim=-1, descending=True, stable=True)[..., :r]
    odd = torch.arange(1, W, 2, device=tokens.device).expand(B, L, -1)
    merged_src = torch.zeros(B, L, n_src, dtype=torch.bool, device=tokens.device).scatter(-1, chosen, True)
    merged = torch.zeros(B, L, W, dtype=torch.bool, device=tokens.device).scatter(-1, odd, merged_src)
    position = torch.arange(W, device=tokens.device).expand(B, L, -1)
    kept_position = position - (merged.cumsum(dim=-1) - merged.long())
    target = position.scatter(-1, odd, odd + torch.where(go_right, 1, -1))  # a source's destination
    return kept_position.gather(-1, torch.where(merged, target, position))


def grid_merge(tokens: torch.Tensor, setting: CubistSetting, num_prefix: int) -> GridMergePlan:
    """Rows, then columns (see the module docstring), on tokens (B, N, C) whose patch tokens form setting's grid."""
    B, _, C = tokens.shape
    rows, cols = setting.rows, setting.cols
    grid = tokens[:, num_prefix:].reshape(B, rows, cols, C)
    new_cols, new_rows = cols - setting.r_cols, rows - setting.r_rows
    in_row = line_merge(grid, setting.r_cols)  # (B, rows, cols): each token's column after step 1
    row_cells = in_row + torch.arange(rows, device=tokens.device).view(1, rows, 1) * new_cols
    narrowed = max_magnitude(grid.reshape(B, rows * cols, C), row_cells.reshape(B, -1), rows * new_cols)
    columns = narrowed.reshape(B, rows, new_cols, C).transpose(1, 2)  # (B, new_cols, rows, C)
    in_col = line_merge(columns, setting.r_rows)  # (B, new_cols, rows): each row's place after step 2
    new_row = in_col.transpose(1, 2).gather(-1, in_row)  # (B, rows, cols)
    return GridMergePlan(num_prefix, (new_row * new_cols + in_row).reshape(B, rows * cols), (new_rows, new_cols))



def parse_cubist_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'cubist_r<k>' -> {'r_rows': k, 'r_cols': k}; None for any other tag."""
    r = parse_r_tag(name, tag)
    return None if r is None else {"r_rows": r["r"], "r_cols": r["r"]}

@register_method
class CubistMerge(GridSettings, PlansOnTokens, TokenReducer):
    """r_rows, r_cols: rows and columns the one merge removes (each clamped to half of the grid's); layer: the block
    whose input is merged (default 1, the paper's choice for DeiT). Needs the patch tokens on the model's grid at that
    block (any aspect ratio). Tags: 'cubist_r<k>' (k rows and k columns)."""

    spec = TokenReducer.spec.but(
        name="cubist",
        export_refusal=None,
        place=ReducesAt.AFTER_MLP,  # of block layer - 1: the input of block layer
        reads_branches=True,  # nothing from attention (it runs untouched): the plan reads the block's tokens
        keeps_grid=True,
        params=(Param("r_rows", 1, integer("r_rows"),
                      "CubistMerge: grid rows the merge removes (each column loses that many tokens)"),
                Param("r_cols", 1, integer("r_cols"), "CubistMerge: grid columns the merge removes"),
                Param("layer", 1, lambda v: check_int("layer", v, 1), "CubistMerge: the block whose input is merged "
                                                                      "(>= 1)"),
                *COMMON),
        tune_space=({"r_rows": 1, "r_cols": 1}, {"r_rows": 2, "r_cols": 2}),
        tags=(TagForm(("{name}_r<k>",), parse_cubist_tag),),
        reads_grid=True,
        tag_legend="cubist_r<k>: CubistMerge removing k grid rows and k grid columns at the input of block 1",
    )

    def check_depth(self, num_blocks: int) -> None:
        if self.layer >= num_blocks:
            raise ValueError(f"layer must be a block of this model after the first, 1..{num_blocks - 1}, got "
                             f"{self.layer}")

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost,
                       grid: Optional[Tuple[int, int]] = None) -> List[Optional[CubistSetting]]:
        if grid is None or grid[0] * grid[1] != num_tokens - num_prefix:
            raise ValueError(f"cubist merges the patch grid of the model; this input has {num_tokens - num_prefix} "
                             f"patch tokens and the grid {grid} (a model without a patch grid is not served)")
        rows, cols = grid
        setting = CubistSetting(rows, cols, min(self.r_rows, rows // 2), min(self.r_cols, cols // 2))
        active = setting.r_rows > 0 or setting.r_cols > 0
        return [setting if active and block == self.layer - 1 else None for block in range(num_blocks)]

    def branch_metric(self, attn_out: torch.Tensor, mlp_out: Optional[torch.Tensor]) -> torch.Tensor:
        return attn_out  # unused: the plan reads the block's tokens (plan_input)

    def plan(self, tokens: torch.Tensor, setting: CubistSetting, num_prefix: int, size: Optional[torch.Tensor]
             ) -> Optional[GridMergePlan]:
        if tokens.shape[1] - num_prefix != setting.rows * setting.cols:
            return None  # the tokens no longer form the grid (reduced before this block)
        return grid_merge(tokens, setting, num_prefix)
