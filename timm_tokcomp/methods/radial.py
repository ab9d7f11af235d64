"""Fixed radial patterns ("Which Tokens to Use?"): each reducing block keeps the patch tokens nearest the
image centre under the l1, l2 or l-infinity norm and drops the others. The pattern ignores the image, so
the kept set only depends on the token counts (ties: the lower patch index is kept)."""
import functools
from typing import List, Optional, Tuple

import torch

from ..ops.matching import built_once
from ..plans import PrunePlan
from .schedules import BlockCost
from .base import GridSettings, ScheduledReducer
from .register import register_method


@functools.lru_cache(maxsize=64)
def centre_order(grid: Tuple[int, int], norm: float) -> Tuple[int, ...]:
    """Patch indices of a rows x cols raster grid, nearest the centre first (stable: ties by index). Plain Python,
    so tracers (torch.compile, torch.export) never see it."""
    rows, cols = grid
    offsets = [(abs(i - (rows - 1) / 2), abs(j - (cols - 1) / 2)) for i in range(rows) for j in range(cols)]
    if norm == float("inf"):
        dist = [max(dy, dx) for dy, dx in offsets]
    else:
        dist = [(dy ** norm + dx ** norm) ** (1 / norm) for dy, dx in offsets]
    return tuple(sorted(range(rows * cols), key=dist.__getitem__))


@torch.compiler.assume_constant_result  # torch.compile runs it while tracing instead of tracing it: no graph break
def _keep_positions(grid: Tuple[int, int], norm: float, n: int, keep: int) -> Tuple[int, ...]:
    """Among the n current tokens (the n patches of grid nearest the centre, in patch order), the indices of the keep
    nearest ones."""
    return _find_keep_positions(grid, norm, n, keep)


@functools.lru_cache(maxsize=256)
def _find_keep_positions(grid: Tuple[int, int], norm: float, n: int, keep: int) -> Tuple[int, ...]:
    order = centre_order(grid, norm)
    current = sorted(order[:n])
    kept = set(order[:keep])
    return tuple(i for i, patch in enumerate(current) if patch in kept)


def _index_tensor(keep: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """keep as a (K,) int64 tensor on device: under torch.compile a constant of the graph, in eager made once per
    device and pattern (built_once; on a GPU, a tensor built from host data is a blocking copy: a host
    synchronisation)."""
    return torch.tensor(keep, device=device)


class Radial(GridSettings, ScheduledReducer):
    """Keeps the tokens nearest the centre of the model's patch grid (no metric is read). Needs a model whose every
    reduction is radial (the tokens present are always the n patches nearest the centre)."""

    spec = ScheduledReducer.spec.but(
        holds_patches="dropped",
        compiles_by_region=False,  # the kept positions are a host-side list per token count
        export_refusal=None,
        reads_grid=True,
    )
    ord: float

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k  # unused: the pattern depends on the token count only

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost,
                       grid: Optional[Tuple[int, int]] = None) -> List[Optional[Tuple[int, Tuple[int, int]]]]:
        """(r, the input's patch grid (rows, cols)) per reducing block."""
        if grid is None or grid[0] * grid[1] != num_tokens - num_prefix:
            raise ValueError(f"radial patterns need the model's patch grid; this input has {num_tokens - num_prefix} "
                             f"patch tokens and the grid {grid}")
        return [None if r is None else (r, tuple(grid))
                for r in super().block_settings(num_blocks, num_tokens, num_prefix, cost)]

    def plan(self, metric: torch.Tensor, setting: Tuple[int, int], num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[PrunePlan]:
        r, grid = setting
        n = metric.shape[2] - num_prefix  # metric is k: (B, H, N, d)
        r = max(min(r, n - 1), 0)
        if r == 0:
            return None
        keep = built_once(_index_tensor, _keep_positions(grid, self.ord, n, n - r), device=metric.device)
        return PrunePlan(num_prefix, keep.expand(metric.shape[0], -1))


@register_method
class RadialL1(Radial):
    spec = Radial.spec.but(name="l1")
    ord = 1.0


@register_method
class RadialL2(Radial):
    spec = Radial.spec.but(name="l2", tune_space=({"keep_rate": 0.9},))
    ord = 2.0


@register_method
class RadialLInf(Radial):
    spec = Radial.spec.but(name="linf")
    ord = float("inf")
