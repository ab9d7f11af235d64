"""DyMU's dynamic token merging, DToMe (Wang et al., NeurIPS 2025): ToMe whose per-block r is replaced by a threshold,
so each image keeps its own count. In every block with a threshold, between attention and MLP: ToMe's alternate split
on the keys averaged over heads, and every A token whose best cosine similarity to a B token exceeds the block's
threshold merges into it (size-weighted mean, sizes summed; at most half the tokens, as the split allows). The batch
keeps its largest count and pads the other images with size-0 tokens that proportional attention (always on) keeps
out of attention and pooling. Simpler images merge more.

The thresholds are calibrated per model on unlabelled images (`tokcomp calibrate --method dymu`, calibrate.calibrate_dymu):
block l's target r_l merges, over a batch, the B * r_l best A-token edges of all its images together; the batch's
threshold is the best edge not taken (at least 0), and each block's threshold the mean over the batches.
Training-free. Implemented from the paper's description and an account of its code; no code copied."""
import math
from typing import Any, List, NamedTuple, Optional

import torch

from ..ops.matching import alternate_matches
from ..plans import GroupPlan
from .schedules import BlockCost
from .base import TokenReducer, warn_if_compiling
from .params import COMMON, REQUIRED, Param
from ..utils.checks import is_real
from .register import register_method


def check_thresholds(value: Any) -> List[Optional[float]]:
    """A list, one entry per block: a threshold in [0, 1], or None where the block merges nothing."""
    if not isinstance(value, (list, tuple)) or not value or \
            not all(v is None or (is_real(v) and math.isfinite(v) and 0 <= v <= 1) for v in value):
        raise ValueError(f"thresholds must be a non-empty list with one entry per block, each a number in [0, 1] or "
                         f"None (no merging there); `tokcomp calibrate --method dymu` writes them; got {value!r}")
    return [None if v is None else float(v) for v in value]


class BlockThreshold(NamedTuple):
    block: int
    threshold: float


class Calibration:
    """Calibration state (calibrate.calibrate_dymu): per block the target merges per image r_l, and the sum and count
    of the batch thresholds seen."""

    def __init__(self, r: List[int]) -> None:
        self.r = r
        self.sums = [0.0] * len(r)
        self.batches = [0] * len(r)

    def thresholds(self) -> List[Optional[float]]:
        """Each block's mean batch threshold (None where r_l = 0 or no batch was seen)."""
        return [s / n if n and r else None for s, n, r in zip(self.sums, self.batches, self.r)]


@register_method
class DyMU(TokenReducer):
    """thresholds: one per block (None: that block merges nothing), from `tokcomp calibrate --method dymu` (a preset
    file: `--methods dymu.json`). Data-dependent counts: eager in `speed` / `tune`, no ONNX, no CUDA graph."""

    spec = TokenReducer.spec.but(
        name="dymu",
        masks_by_size=True,
        data_dependent=True,
        export_refusal="its token counts come from the data in every forward, which a static graph cannot hold",
        params=(Param("thresholds", REQUIRED, check_thresholds,
                      "DyMU: per block, merge every A token whose best cosine exceeds it (None: none there); from "
                      "`tokcomp calibrate --method dymu`"),
                *COMMON),
        tag_legend="dymu has no tag: its thresholds belong to one model; `tokcomp calibrate MODEL --method dymu --r R` "
                   "writes them as a preset file, which every --methods takes",
    )
    calibration: Optional[Calibration] = None  # set only while calibrate.calibrate_dymu runs

    def default_prop_attn(self, global_pool: str) -> bool:
        return True

    def check_depth(self, num_blocks: int) -> None:
        if len(self.thresholds) != num_blocks:
            raise ValueError(f"thresholds must have one entry per block ({num_blocks}), got {len(self.thresholds)}")

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost
                       ) -> List[Optional[BlockThreshold]]:
        return [None if t is None else BlockThreshold(block, t) for block, t in enumerate(self.thresholds)]

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k.mean(dim=1)

    def plan(self, keys: torch.Tensor, setting: BlockThreshold, num_prefix: int, size: Optional[torch.Tensor]
             ) -> Optional[GroupPlan]:
        p, n = num_prefix, keys.shape[1] - num_prefix
        with torch.no_grad():
            real = torch.ones(keys.shape[0], n, dtype=torch.bool, device=keys.device) if size is None else \
                size[:, p:, 0] > 0
            slot, _, best = alternate_matches(keys, real, p)
            best = best.masked_fill(~real, float("-inf"))  # padding never merges
            threshold = self._threshold(best, setting)
            merged = best > threshold
            own = torch.arange(n, device=keys.device)
            slot = torch.where(real, torch.where(merged, slot, own), n)  # padding goes to a slot past the end
            keep = real & ~merged  # every real token that merged nowhere leads its group
            group = torch.where(slot < n, (keep.cumsum(dim=1) - 1).gather(1, slot.clamp_max(n - 1)), -1)
            warn_if_compiling(self.name)
            count, nothing = divmod(int((keep.sum(dim=1).max() * 2 + (~merged.any()).long()).item()), 2)  # one read
        if nothing and count == n:
            return None
        return GroupPlan(p, group, count, leads=keep)

    def _threshold(self, best: torch.Tensor, setting: BlockThreshold) -> Any:
        """The block's threshold; while calibrating, the batch's: the best edge not among its B * r_l best (its
        images' A tokens together), recorded at least 0 (so merging here equals merging above the recorded one)."""
        if self.calibration is None:
            return setting.threshold
        edges = best.flatten()
        take = min(best.shape[0] * self.calibration.r[setting.block], edges.numel() - 1)
        if take <= 0:
            return math.inf
        not_taken = edges.topk(take + 1).values[-1].clamp_min(0.0)
        self.calibration.sums[setting.block] += float(not_taken)
        self.calibration.batches[setting.block] += 1
        return not_taken
