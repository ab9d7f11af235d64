"""FPET, Faster Parameter-Efficient Tuning (Kim et al., CVPR 2025): one block (by default the middle one: block 6 of
12), between attention and MLP, merges half of the patch tokens at once, for a model fine-tuned with a
parameter-efficient method (here `tokcomp finetune`'s LoRA).

  1. split: a 2 x 2 checkerboard on the model's patch grid; A = the cells with an even row + column (top-left and
     bottom-right of every 2 x 2 block), B = the others; prefix tokens are never merged;
  2. metric: the keys averaged over heads (detached), refined by a small adapter, k + A(k): head_dim -> head_dim / 2
     -> head_dim, ReLU, dropout 0.1, with 1-bit weights (each weight matrix standardised, binarised by its sign and
     rescaled by its std and mean; straight-through gradient); the up-projection starts near zero;
  3. every A token merges into the B token of highest cosine similarity (size-weighted mean, sizes summed). In
     training the match is hard in the forward pass and soft in the backward pass, sigmoid(score - the mean of the
     row's two best scores) (straight-through), which is how the adapter learns.

Proportional attention is on by default. `refine=False` (tag `fpet_norefine`) leaves the adapter out: one-shot
checkerboard ToMe, training-free. The patch tokens must lie on the model's patch grid (rows x cols, any aspect ratio)
in raster order."""
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.matching import merge_top_r
from ..plans import MergePlan, Reduced
from ..utils.checks import boolean, integer, is_int
from .schedules import BlockCost
from .base import GridSettings, LearnedParams, TokenReducer
from .params import COMMON, REQUIRED, FromConfig, Param, optional
from .register import register_method
from .tags import exact_tag

DROPOUT = 0.1


def check_layer(value: Any) -> int:
    if not is_int(value) or value < 0:
        raise ValueError(f"layer must be a block index >= 0, got {value!r}")
    return int(value)


class BinaryLinear(nn.Linear):
    """A Linear whose weight is used as sign((w - mean) / std) * std + mean (1 bit per weight), with the gradient of
    the standardised weight passed straight through the sign."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        mean, std = w.mean(), w.std().clamp_min(1e-12)
        unit = (w - mean) / std
        binary = unit + (torch.where(unit >= 0, 1.0, -1.0).to(w.dtype) - unit).detach()
        return F.linear(x, binary * std + mean, self.bias)


class FPETParams(FromConfig, nn.Module):
    """The refinement adapter on head_dim-wide key means: (B, n, d) -> (B, n, d), added to its input."""

    CONFIG = (Param("head_dim", REQUIRED, integer("head_dim", 1)),)

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.down = BinaryLinear(head_dim, max(head_dim // 2, 1))
        self.up = BinaryLinear(max(head_dim // 2, 1), head_dim)
        nn.init.normal_(self.up.weight, std=1e-3)
        nn.init.zeros_(self.up.bias)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        return keys + self.up(self.dropout(F.relu(self.down(keys))))


class GridSetting(NamedTuple):
    """The reducing block's patch grid (patch tokens = rows * cols, in raster order)."""

    rows: int
    cols: int


@dataclass
class SoftMatchPlan(MergePlan):
    """A MergePlan (the hard matches) with its matches as a (B, Na, Nb) matrix: one-hot in the forward pass, the soft
    matches' gradient in the backward pass (training)."""

    soft: Optional[torch.Tensor] = None

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        """The hard merge; its B tokens also carry the gradient of the matches (the hard ones in the forward pass, the
        soft ones in the backward pass), not a second gradient of x."""
        x_out, size_out, source_out = super().apply(x, size, source)
        p = self.num_prefix
        sizes = x.new_ones(x.shape[0], x.shape[1], 1) if size is None else size
        rest, rest_size = x[:, p:].detach(), sizes[:, p:].detach()
        a, b = rest[:, self.a_idx[0]], rest[:, self.b_idx[0]]
        a_size, b_size = rest_size[:, self.a_idx[0]], rest_size[:, self.b_idx[0]]
        soft = self.soft.to(x.dtype).transpose(1, 2)  # (B, Nb, Na)
        mean = (b_size * b + soft @ (a_size * a)) / (b_size + soft @ a_size)
        n_b = mean.shape[1]
        x_out = torch.cat([x_out[:, :-n_b], x_out[:, -n_b:] + mean - mean.detach()], dim=1)
        return x_out, size_out, source_out


def checkerboard(rows: int, cols: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(A, B) positions of a rows x cols raster grid: A where row + column is even."""
    cells = torch.arange(rows * cols, device=device)
    order = ((cells // cols + cells % cols) % 2).argsort(stable=True)  # fixed shapes: no host read, compiles whole
    return order[:(rows * cols + 1) // 2], order[(rows * cols + 1) // 2:]


@register_method
class FPET(GridSettings, LearnedParams, TokenReducer):
    """See the module docstring. layer: the reducing block (None: num_blocks // 2); refine: learn the adapter
    (adapter_params: a trained one, from a learned folder; None: made untrained at apply)."""

    spec = TokenReducer.spec.but(
        name="fpet",
        export_refusal=None,
        learned_class=FPETParams,
        learned_param="adapter_params",
        params=(Param("layer", None, optional(check_layer), "FPET: the block that merges half the patches (None: the "
                                                             "middle block, num_blocks // 2)"),
                Param("refine", True, optional(boolean("refine")),
                      "FPET: learn the 1-bit adapter that refines the matching metric"),
                Param("adapter_params", None, help="FPET's trained adapter (a learned folder)"),
                *COMMON),
        tags=(exact_tag("fpet", {}), exact_tag("fpet_norefine", {"refine": False})),
        reads_grid=True,
        tag_legend="fpet: FPET with its learned metric adapter; fpet_norefine: without it (training-free)",
    )

    def validate(self) -> None:
        if not self.refine and self.adapter_params is not None:
            raise ValueError("adapter_params needs refine=True")
        super().validate()

    @classmethod
    def learns(cls, params: Dict[str, Any]) -> bool:
        return params.get("refine", True) is not False

    def default_prop_attn(self, global_pool: str) -> bool:
        return True

    def check_depth(self, num_blocks: int) -> None:
        if self.layer is not None and self.layer >= num_blocks:
            raise ValueError(f"layer must be a block of this model, 0..{num_blocks - 1}, got {self.layer}")

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost,
                       grid: Optional[Tuple[int, int]] = None) -> List[Optional[GridSetting]]:
        """grid: the model's (rows, cols) of patch tokens (reducing.patch_grid); FPET needs one to split."""
        if grid is None or grid[0] * grid[1] != num_tokens - num_prefix:
            raise ValueError(f"fpet splits the patch grid of the model; this input has {num_tokens - num_prefix} "
                             f"patch tokens and the grid {grid} (a model without a patch grid is not served)")
        layer = num_blocks // 2 if self.layer is None else self.layer
        return [GridSetting(*grid) if block == layer else None for block in range(num_blocks)]

    def bind(self, dim: int, settings: List[Any], head_dim: int) -> None:
        if not self.refine:
            return
        if self.adapter_params is None:
            self.adapter_params = FPETParams(head_dim)
        elif self.adapter_params.head_dim != head_dim:
            raise ValueError(f"this FPET adapter is for keys {self.adapter_params.head_dim} wide; the model's heads are "
                             f"{head_dim} wide")

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k.mean(dim=1).detach()

    def plan(self, metric: torch.Tensor, setting: GridSetting, num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[MergePlan]:
        p = num_prefix
        if metric.shape[1] - p != setting.rows * setting.cols:
            return None  # the tokens no longer form the grid (reduced before this block): nothing to split
        if self.refine:
            weight = self.adapter_params.down.weight  # the adapter in its own precision (a bf16 / fp16 model's too)
            metric = self.adapter_params(metric.to(weight.dtype)).float()
        a_pos, b_pos = checkerboard(setting.rows, setting.cols, metric.device)
        unit = F.normalize(metric[:, p:].float(), dim=-1)
        scores = unit[:, a_pos] @ unit[:, b_pos].transpose(1, 2)  # (B, Na, Nb)
        best, dst = scores.detach().max(dim=-1)
        B = metric.shape[0]
        split = (a_pos.expand(B, -1), b_pos.expand(B, -1))
        hard = merge_top_r(best, dst, len(a_pos), p, split)
        if not (self.refine and torch.is_grad_enabled() and scores.requires_grad):
            return hard
        soft = torch.sigmoid(scores - scores.topk(2, dim=-1).values.mean(dim=-1, keepdim=True))
        onehot = F.one_hot(dst, scores.shape[-1]).to(soft.dtype)
        return SoftMatchPlan.of(hard, soft=onehot + soft - soft.detach())
