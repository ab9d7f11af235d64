"""LTMP, Learned Thresholds token Merging and Pruning (Bonnaerens & Dambre, TMLR 2023): every block, between attention
and MLP, merges and prunes by two thresholds of its own, so images keep different counts.

  1. importance of token j: the attention it receives, averaged over heads and over the (real) queries; prefix tokens
     are never pruned;
  2. ToMe's alternate split on the keys averaged over heads (prefix tokens apart): each A token whose best cosine
     similarity to a B token exceeds the merge threshold merges into it (size-weighted mean, sizes summed), and the
     merged token's importance is the largest of its members';
  3. every token whose importance is below the prune threshold is dropped.

The batch keeps its largest count and pads the other images with size-0 tokens (proportional attention, always on,
keeps them out). The importance needs the attention probabilities, computed beside the fused attention: one more
(B, H, N, N) product and softmax per block.

Training (the thresholds alone, `tokcomp finetune --distill --lora-rank 0`): nothing is removed. The decisions are
those of eval mode, hard in the forward pass, with the gradient of sigmoid((value - threshold) / tau) (straight-
through); a merged or pruned token stays in place with size 1e-6. `method_loss()` gives
macs_weight * (macs_target - share)^2, share the MACs kept, per block from the mean kept fractions, averaged over
blocks (the authors' r_FLOPs). The thresholds start at 0.9 (merge) and 0 (prune) and are clamped to [0, 1] where they
are used (the gradient passes the clamp). The prune threshold is stored in thousandths, so one learning rate gives
the authors' two (5e-3 for the merge threshold, 5e-6 for the prune threshold).
"""
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..ops.matching import alternate_matches, keep_best
from ..plans import GroupPlan, Plan, Reduced
from ..utils.checks import MAX_BLOCKS, check_real, integer, is_real, real
from .schedules import BlockCost
from .base import BlockSetting, LearnedParams, TokenReducer, warn_if_compiling
from .tags import BARE_TAG, MACS_TARGET_TAG
from .params import COMMON, MACS_TARGET, REQUIRED, FromConfig, Param, optional
from .straight_through import clamp_through, hard_through
from .register import register_method

EPS = 1e-6  # the size a token merged or pruned in training keeps
PRUNE_UNIT = 1e-3  # the prune threshold is stored in thousandths


def check_thresholds(value: Any) -> Dict[str, List[float]]:
    """{'merge': [per block], 'prune': [per block]}: fixed thresholds in [0, 1]."""
    if not isinstance(value, dict) or set(value) != {"merge", "prune"}:
        raise ValueError(f"thresholds must be a dict {{'merge': [...], 'prune': [...]}} with one threshold per block, "
                         f"got {value!r}")
    for key in ("merge", "prune"):
        values = value[key]
        if not isinstance(values, (list, tuple)) or not values or \
                not all(is_real(v) and math.isfinite(v) and 0 <= v <= 1 for v in values):
            raise ValueError(f"thresholds[{key!r}] must be a non-empty list of numbers in [0, 1], got {values!r}")
    if len(value["merge"]) != len(value["prune"]):
        raise ValueError(f"thresholds' 'merge' and 'prune' lists must have one entry per block each, got "
                         f"{len(value['merge'])} and {len(value['prune'])}")
    return {key: [float(v) for v in value[key]] for key in ("merge", "prune")}


def check_tau(value: Any) -> float:
    return check_real("tau", value, note="(the temperature of the soft thresholds)")


class LTMPParams(FromConfig, nn.Module):
    """The thresholds of a model of depth blocks: merge (depth,), prune (depth,) in thousandths."""

    CONFIG = (Param("depth", REQUIRED, integer("depth", 1, high=MAX_BLOCKS)),)

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.merge = nn.Parameter(torch.full((depth,), 0.9))
        self.prune = nn.Parameter(torch.zeros(depth))
        self._record: List[Tuple[BlockSetting, torch.Tensor]] = []  # this training forward's kept fractions

    def thresholds(self, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Block's (merge, prune) thresholds in [0, 1], with their gradient."""
        return clamp_through(self.merge[block]), clamp_through(self.prune[block] * PRUNE_UNIT)

    def values(self) -> Dict[str, List[float]]:
        """The thresholds in use, as LTMP's `thresholds` parameter takes them (a preset)."""
        with torch.no_grad():
            merge, prune = zip(*(self.thresholds(b) for b in range(self.depth)))
            return {"merge": torch.stack(merge).tolist(), "prune": torch.stack(prune).tolist()}

    @classmethod
    def fixed(cls, thresholds: Dict[str, List[float]]) -> "LTMPParams":
        """Parameters holding given thresholds (LTMP's `thresholds` parameter)."""
        params = cls(len(thresholds["merge"]))
        with torch.no_grad():
            params.merge.copy_(torch.tensor(thresholds["merge"]))
            params.prune.copy_(torch.tensor(thresholds["prune"]) / PRUNE_UNIT)
        return params


@register_method
class LTMP(LearnedParams, TokenReducer):
    """See the module docstring. threshold_params: trained thresholds (a learned folder); thresholds: fixed ones as
    numbers (a preset: `threshold_params.values()`); neither: the start (merge above 0.9, prune nothing). Tags: 'ltmp', 'ltmp_m<pct>' (macs_target = pct / 100, the training's target)."""

    spec = TokenReducer.spec.but(
        name="ltmp",
        data_dependent=True,
        export_refusal="the number of tokens it keeps is counted from the data in every forward",
        masks_by_size=True,
        learned_class=LTMPParams,
        learned_param="threshold_params",
        params=(MACS_TARGET,
                Param("tau", 0.1, check_tau, "LTMP: the temperature of the soft thresholds in training"),
                Param("macs_weight", 10.0, real("macs_weight"),
                      "LTMP: the weight of the training's MACs penalty, macs_weight * (macs_target - share)^2"),
                Param("thresholds", None, optional(check_thresholds),
                      "LTMP: fixed thresholds {'merge': [...], 'prune': [...]}, one per block "
                      "(instead of threshold_params)"),
                Param("threshold_params", None, help="LTMP's trained thresholds (a learned folder)"),
                *COMMON),
        tags=(BARE_TAG, MACS_TARGET_TAG),
        tag_legend="ltmp: LTMP at its thresholds' start or, with threshold_params=, trained ones; ltmp_m<pct>: the "
                   "same, its training aiming at pct % of the unreduced blocks' MACs",
    )

    @classmethod
    def trains_in_place(cls, params: Dict[str, Any]) -> bool:
        return True  # fixed thresholds too: they make the training step in training mode

    @classmethod
    def learns(cls, params: Dict[str, Any]) -> bool:
        return params.get("thresholds") is None

    def default_prop_attn(self, global_pool: str) -> bool:
        return True

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost) -> List[BlockSetting]:
        return [BlockSetting(b, num_blocks, num_tokens - num_prefix, num_prefix, cost) for b in range(num_blocks)]

    def validate(self) -> None:
        if self.thresholds is not None and self.threshold_params is not None:
            raise ValueError("give thresholds or threshold_params, not both")
        super().validate()

    def bind(self, dim: int, settings: List[Any], head_dim: int) -> None:
        if self.thresholds is not None:
            if len(self.thresholds["merge"]) != len(settings):
                raise ValueError(f"thresholds needs one entry per block ({len(settings)}), got "
                                 f"{len(self.thresholds['merge'])}")
            self.threshold_params = LTMPParams.fixed(self.thresholds).requires_grad_(False)
        elif self.threshold_params is None:
            self.threshold_params = LTMPParams(len(settings))
        elif self.threshold_params.depth != len(settings):
            raise ValueError(f"these LTMP thresholds are for {self.threshold_params.depth} blocks; the model has "
                             f"{len(settings)}")

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(keys averaged over heads (B, N, d), importance (B, N): the attention each token receives, averaged over
        heads and over the real queries (size >= 0.5))."""
        scores = (q.float() * scale) @ k.float().transpose(-2, -1)
        if attn_bias is not None:
            scores = scores + attn_bias.float()
        probs = scores.softmax(dim=-1).mean(dim=1)  # (B, N, N)
        real = probs.new_ones(probs.shape[:2]) if attn_bias is None else \
            (attn_bias.view(attn_bias.shape[0], -1) >= math.log(0.5)).to(probs.dtype)
        importance = (real.unsqueeze(-1) * probs).sum(dim=1) / real.sum(dim=1, keepdim=True)
        return k.mean(dim=1), importance

    def plan(self, metric: Tuple[torch.Tensor, torch.Tensor], setting: BlockSetting, num_prefix: int,
             size: Optional[torch.Tensor]):
        keys, importance = metric
        p, n = num_prefix, keys.shape[1] - num_prefix
        if n < 2:
            return None
        if self.threshold_params.training:
            return ThresholdStepPlan(p, setting, keys.detach(), importance.detach(), self.threshold_params,
                                     self.tau)
        with torch.no_grad():
            merge_at, prune_at = self.threshold_params.thresholds(setting.block)
            real = torch.ones_like(importance[:, p:], dtype=torch.bool) if size is None else size[:, p:, 0] > 0
            slot, _, best = alternate_matches(keys, real, p)
            slot = torch.where(best > merge_at, slot, torch.arange(n, device=slot.device))  # (B, n) own index or dst
            slot = torch.where(real, slot, n)  # padding goes to a slot past the end
            imp = importance[:, p:].float().masked_fill(~real, float("-inf"))
            held = imp.new_full((imp.shape[0], n + 1), float("-inf")).scatter_reduce(1, slot, imp, "amax")[:, :n]
            keep = keep_best(held >= prune_at, held)  # (B, n): the slots that stay (an empty one holds -inf)
            index = keep.cumsum(dim=1) - 1
            at = slot.clamp_max(n - 1)
            group = torch.where((slot < n) & keep.gather(1, at), index.gather(1, at), -1)  # (B, n), -1: dropped
            unchanged = (group == torch.arange(n, device=group.device)).all()
            warn_if_compiling(self.name)
            count, unchanged = divmod(int((keep.sum(dim=1).max() * 2 + unchanged.long()).item()), 2)  # one host read
        if unchanged and count == n:
            return None
        return GroupPlan(p, group, count, leads=keep)  # a slot that stays is its group's lead

    def method_loss(self) -> Optional[torch.Tensor]:
        """macs_weight * (macs_target - share)^2 of the last training forward (None without a target or a training
        forward since the last call); share: per block, the MACs at the mean kept fractions entering and leaving it
        over its unreduced MACs, averaged over blocks."""
        params = self.threshold_params
        if params is None or not params._record or self.macs_target is None:
            return None
        record, params._record = params._record, []
        shape = record[0][0]
        p, n, cost = shape.num_prefix, shape.num_patches, shape.cost
        before = record[0][1].new_ones(())
        shares = []
        for _, after in record:
            shares.append(cost.macs(p + before * n, p + after * n) / cost.macs(p + n, p + n))
            before = after
        return self.macs_weight * (self.macs_target - torch.stack(shares).mean()) ** 2


@dataclass
class ThresholdStepPlan(Plan):
    """Training: the block's soft merge and prune decisions against the learned thresholds, every token in place.

    keys: (B, N, d) averaged over heads; importance: (B, N); params: the thresholds (their record grows); tau: the
    sigmoid's temperature."""

    num_prefix: int
    setting: BlockSetting
    keys: torch.Tensor
    importance: torch.Tensor
    params: "LTMPParams"
    tau: float
    defines_positions = False  # tokens mix in place: no rotary position for a merged token

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        """x: (B, N, C), size: (B, N, 1) or None -> (x, size) after the block's decisions, every token in place (see
        the module docstring); source unchanged."""
        params, p, tau = self.params, self.num_prefix, self.tau
        B, N, _ = x.shape
        n = N - p
        merge_at, prune_at = params.thresholds(self.setting.block)
        sizes = (x.new_ones(B, N, 1) if size is None else size).float()
        patch_size = sizes[:, p:]  # (B, n, 1)
        alive = patch_size[..., 0] >= 0.5
        slot, a_pos, best = alternate_matches(self.keys, alive, p)
        a_alive = alive[:, a_pos]
        a_best = best[:, a_pos]
        merged = hard_through((a_best > merge_at.detach()) & a_alive, torch.sigmoid((a_best - merge_at) / tau))
        merged = merged * a_alive  # (B, na): 1 for an A token merged into its best B token
        receive = merged.new_zeros(B, n, len(a_pos)).scatter(1, slot[:, a_pos].unsqueeze(1), merged.unsqueeze(1))
        a_size = patch_size[:, a_pos]  # (B, na, 1)
        xp = x[:, p:].float()
        gained = receive @ (a_size * xp[:, a_pos])  # (B, n, C): nonzero on B tokens only
        grown = patch_size + receive @ a_size
        xp = (patch_size * xp + gained) / grown
        left = grown.clone()
        left[:, a_pos] = a_size * (1 - merged).unsqueeze(-1)
        imp = self.importance[:, p:].float()
        held = torch.maximum(imp, (receive.detach() * imp[:, a_pos].unsqueeze(1)).amax(dim=-1))
        kept = hard_through(held >= prune_at.detach(), torch.sigmoid((held - prune_at) / tau))  # (B, n)
        stays = alive.float() * kept
        stays[:, a_pos] = stays[:, a_pos] * (1 - merged)
        if self.setting.block == 0:
            params._record = []
        params._record.append((self.setting, stays.mean()))
        patch_size = left * kept.unsqueeze(-1) * (1 - EPS) + EPS
        x = torch.cat([x[:, :p], xp.to(x.dtype)], dim=1)
        return x, torch.cat([sizes[:, :p], patch_size], dim=1).to(x.dtype), source

