"""DiffRate (Chen et al., ICCV 2023): every reducing block prunes and then merges its patch tokens, ranked by the
class token's attention (averaged over heads). It keeps the P most attended and, of those, merges the P - M least
attended into their most similar of the first M (cosine on the block's tokens after attention); a keeper becomes the
unweighted mean of itself and what merged into it, and its size grows by each merged token's size times that
similarity (taken >= 0). Block 0 never reduces. The per-block counts (P, M) are a schedule, given (`schedule`) or
searched with the ViT frozen (`rate_params`): per block two logit vectors over the candidate counts n, n - g,
n - 2g, ... (g = granularity, n the patch tokens), each count the ceiling of its expectation under their softmax.

The search is training mode: nothing is removed. Tokens are ranked as in eval mode; one beyond the kept count stays
in place with size 1e-6 (the log-size attention bias keeps it out of every other token's attention), one merged
away is added into its keeper as in eval mode and then does the same. The decisions are hard in the forward pass;
their gradient reaches the logits through the soft keep probabilities (straight-through), and the MACs penalty's
through the expected counts (ceiling straight-through). `method_loss()` gives
macs_weight * (MACs share - macs_target)^2, the share of the block stack's unreduced MACs computed from the counts;
`tokcomp finetune` adds it to its distillation loss. `rate_params.schedule()` is the searched schedule, which any
model with as many blocks and patches can carry as `schedule=`.
"""
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.matching import class_attention
from ..plans import KeepMergePlan, Plan, Reduced, gather_tokens
from ..utils.checks import MAX_BLOCKS, check_int, integer, is_int, real
from .schedules import BlockCost
from .base import LearnedParams, TokenReducer
from .tags import BARE_TAG, MACS_TARGET_TAG
from .params import COMMON, MACS_TARGET, REQUIRED, FromConfig, Param, optional
from .straight_through import ceil_through, hard_through
from .register import register_method

EPS = 1e-6  # the size a token dropped in the search keeps (log-size bias log(EPS) ~ -13.8)


def check_granularity(value: Any) -> int:
    return check_int("granularity", value, 1, "(the step between candidate counts)")


def check_schedule(value: Any) -> Dict[str, List[int]]:
    """{'prune': [P per block], 'merge': [M per block]}: patch tokens kept after pruning and after merging."""
    if not isinstance(value, dict) or set(value) != {"prune", "merge"}:
        raise ValueError(f"schedule must be a dict {{'prune': [...], 'merge': [...]}} of patch tokens kept per block, "
                         f"got {value!r}")
    lists = {key: value[key] for key in ("prune", "merge")}
    for key, counts in lists.items():
        if not isinstance(counts, (list, tuple)) or not counts or not all(is_int(c) and c >= 1 for c in counts):
            raise ValueError(f"schedule[{key!r}] must be a non-empty list of integers >= 1, got {counts!r}")
    if len(lists["prune"]) != len(lists["merge"]):
        raise ValueError(f"schedule's 'prune' and 'merge' lists must have one entry per block each, got "
                         f"{len(lists['prune'])} and {len(lists['merge'])}")
    return {key: [int(c) for c in counts] for key, counts in lists.items()}


class RateSetting(NamedTuple):
    """A block DiffRate may reduce: the model's shape its MACs penalty needs, and what the block reads, filled each
    forward by DiffRate.settings_for: in eval mode its counts (P, M) as integers, in the search its rows of the rate
    logits (prune, merge), (K,) each. Carried in the setting, not looked up by the block's number, so that a
    compiled block graph serves every block."""

    block: int
    num_blocks: int
    num_patches: int
    num_prefix: int
    cost: BlockCost
    counts: Optional[Tuple[int, int]] = None
    logits: Optional[Tuple[torch.Tensor, torch.Tensor]] = None


class DiffRateParams(FromConfig, nn.Module):
    """The rate logits of a model of depth blocks and num_patches patch tokens: prune[l - 1] and merge[l - 1]
    (K,) over the candidate counts (num_patches, num_patches - g, ... > 0) of block l >= 1, starting at zero."""

    CONFIG = (Param("depth", REQUIRED, integer("depth", 2, high=MAX_BLOCKS)),
              Param("num_patches", REQUIRED, integer("num_patches", 1)),
              Param("granularity", REQUIRED, integer("granularity", 1)))

    def __init__(self, depth: int, num_patches: int, granularity: int) -> None:
        super().__init__()
        self.depth, self.num_patches, self.granularity = depth, num_patches, granularity
        candidates = torch.arange(num_patches, 0, -granularity, dtype=torch.float32)
        self.register_buffer("candidates", candidates, persistent=False)
        self.prune = nn.Parameter(torch.zeros(depth - 1, len(candidates)))
        self.merge = nn.Parameter(torch.zeros(depth - 1, len(candidates)))
        self._record: List[RateSetting] = []  # the reducing blocks of the last search forward (settings_for)
        self._counts: Optional[List[Tuple[int, int]]] = None  # counts(), read in eval mode
        self.register_load_state_dict_post_hook(_reread_counts)  # a module-level function: the model pickles
        self._read_counts()

    def logits(self, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Block's rows of the prune and merge logits, (K,) each."""
        return self.prune[block - 1], self.merge[block - 1]

    def expected(self, logits: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """A block's (P, M) from its logits rows: the ceilings of the expected candidate counts, with their
        gradient."""
        c = self.candidates.to(self.prune.dtype)
        return tuple(ceil_through(row.softmax(-1) @ c) for row in logits)

    def survival(self, logits: torch.Tensor, n: int) -> torch.Tensor:
        """(n,) the probability that a count drawn from softmax(logits) exceeds rank t = 0..n - 1."""
        ranks = torch.arange(n, device=logits.device, dtype=self.candidates.dtype)
        return (self.candidates.unsqueeze(0) > ranks.unsqueeze(1)).to(logits.dtype) @ logits.softmax(-1)

    def counts(self) -> List[Tuple[int, int]]:
        """[(P, M)] of blocks 1..depth - 1 as integers. Read from the logits (one host read) when the module is made,
        loads weights or enters eval mode, so that an eval forward (compiled or exported too) never reads them."""
        if self._counts is None:
            self._read_counts()
        return self._counts

    def _read_counts(self) -> None:
        if self.prune.is_meta:  # built on the meta device for its shapes alone (learned.load_learned): no values
            return
        with torch.no_grad():
            self._counts = [tuple(int(v) for v in torch.stack(self.expected(self.logits(b))).tolist())
                            for b in range(1, self.depth)]

    def train(self, mode: bool = True) -> "DiffRateParams":
        super().train(mode)
        if not mode:
            self._read_counts()
        return self

    def schedule(self) -> Dict[str, List[int]]:
        """The searched schedule as DiffRate's `schedule` parameter takes it (block 0 keeps every patch)."""
        counts = [(self.num_patches, self.num_patches)] + self.counts()
        return {"prune": [p for p, _ in counts], "merge": [m for _, m in counts]}


def _reread_counts(module: DiffRateParams, incompatible_keys) -> None:
    module._read_counts()


def check_fits(params: DiffRateParams, settings: Sequence[Optional[RateSetting]]) -> None:
    shape = next((s for s in settings if s is not None), None)
    if shape is not None and (params.depth, params.num_patches) != (shape.num_blocks, shape.num_patches):
        raise ValueError(f"these DiffRate rates are for {params.depth} blocks of {params.num_patches} patch tokens; the "
                         f"model has {shape.num_blocks} blocks of {shape.num_patches}")


@register_method
class DiffRate(LearnedParams, TokenReducer):
    """See the module docstring. Give `schedule` (a fixed schedule, e.g. one searched before), or the searched
    `rate_params` (a learned folder), or neither: untrained rates (every candidate count equally likely), the start
    of a search aiming at `macs_target`. Proportional attention is always on (DiffRate adds log size in every block;
    the search's dropped tokens rely on it). Tags: 'diffrate', 'diffrate_m<pct>' (macs_target = pct / 100)."""

    spec = TokenReducer.spec.but(
        name="diffrate",
        holds_patches="similarity",
        export_refusal=None,
        needs_class_token=True,
        masks_by_size=True,
        learned_class=DiffRateParams,
        learned_param="rate_params",
        params=(MACS_TARGET,
                Param("granularity", 4, check_granularity, "DiffRate: the step between the candidate kept counts"),
                Param("macs_weight", 50.0, real("macs_weight"),
                      "DiffRate: the weight of the search's MACs penalty, macs_weight * (share - macs_target)^2"),
                Param("schedule", None, optional(check_schedule),
                      "DiffRate: {'prune': [...], 'merge': [...]}, patch tokens kept per block (instead of rates)"),
                Param("rate_params", None, help="DiffRate's searched rates (a learned folder)"),
                *COMMON),
        tags=(BARE_TAG, MACS_TARGET_TAG),
        tag_legend="diffrate: DiffRate with untrained rates (or, with schedule= / rate_params=, a searched schedule); "
                   "diffrate_m<pct>: the same, its search aiming at pct % of the unreduced blocks' MACs",
    )

    @classmethod
    def trains_in_place(cls, params: Dict[str, Any]) -> bool:
        return cls.learns(params)  # a fixed schedule trains nothing and runs its eval steps

    def validate(self) -> None:
        if self.schedule is not None and self.rate_params is not None:
            raise ValueError("give schedule or rate_params, not both")
        super().validate()

    @classmethod
    def learns(cls, params: Dict[str, Any]) -> bool:
        return params.get("schedule") is None

    def default_prop_attn(self, global_pool: str) -> bool:
        return True

    def check_depth(self, num_blocks: int) -> None:
        if self.schedule is not None and len(self.schedule["prune"]) != num_blocks:
            raise ValueError(f"schedule needs one entry per block ({num_blocks}), got {len(self.schedule['prune'])}")

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost
                       ) -> List[Optional[RateSetting]]:
        """A RateSetting where the block may reduce: with a schedule where it reduces the count its predecessor
        leaves, with rates every block but the first."""
        n = num_tokens - num_prefix
        settings: List[Optional[RateSetting]] = []
        for block in range(num_blocks):
            reduces = block > 0
            if self.schedule is not None:
                left = min(self.schedule["prune"][block], self.schedule["merge"][block], n)
                if block == 0 and left < n:
                    raise ValueError(f"schedule's first entries (prune {self.schedule['prune'][0]}, merge "
                                     f"{self.schedule['merge'][0]}) reduce in block 0, which DiffRate never does; "
                                     f"give this model's {n} patch tokens (or more) there")
                reduces, n = left < n, left
            settings.append(RateSetting(block, num_blocks, num_tokens - num_prefix, num_prefix, cost)
                            if reduces else None)
        return settings

    def settings_for(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost,
                     grid: Tuple[int, int]) -> List[Optional[RateSetting]]:
        """block_settings with what each block reads this forward (RateSetting); in the search, recorded for its
        MACs penalty (not appended to by the blocks: under torch.compile a list that grows by block would be guarded
        on its length, a graph per block)."""
        settings = super().settings_for(num_blocks, num_tokens, num_prefix, cost, grid)
        params = self.rate_params
        if self.schedule is None and params is None:
            return settings  # before bind
        if params is not None and params.depth != num_blocks:
            check_fits(params, settings)  # raises, before a block's counts are looked up
        if params is not None and params.training:  # the search: its MACs penalty reads these (method_loss)
            settings = [None if s is None else s._replace(logits=params.logits(s.block)) for s in settings]
            params._record = [s for s in settings if s is not None]
            return settings
        return [None if s is None else s._replace(counts=self._counts(s.block)) for s in settings]

    def bind(self, dim: int, settings: List[Any], head_dim: int) -> None:
        if self.schedule is not None:
            return
        if self.rate_params is None:
            shape = next((s for s in settings if s is not None), None)
            if shape is not None:
                self.rate_params = DiffRateParams(shape.num_blocks, shape.num_patches, self.granularity)
        else:
            check_fits(self.rate_params, settings)

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        """(B, N) the class token's attention, averaged over heads."""
        return class_attention(q, k, attn_bias, scale).mean(dim=1)

    def plan_input(self, metric: torch.Tensor, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the metric (B, N), the block's tokens (B, N, C) detached): it ranks by the metric, matches on the tokens."""
        return metric, x.detach()

    def _counts(self, block: int) -> Tuple[int, int]:
        if self.schedule is not None:
            return self.schedule["prune"][block], self.schedule["merge"][block]
        return self.rate_params.counts()[block - 1]

    def plan(self, metric: Tuple[torch.Tensor, torch.Tensor], setting: RateSetting, num_prefix: int,
             size: Optional[torch.Tensor]):
        importance, tokens = metric
        if setting.logits is not None:
            return SearchStepPlan(num_prefix, setting, importance.detach(), tokens, self.rate_params)
        p, n = num_prefix, tokens.shape[1] - num_prefix
        prune, merge = setting.counts
        kept = min(prune, n)
        keepers = min(merge, kept)
        if keepers >= n:
            return None
        with torch.no_grad():
            keep_idx = importance[:, p:].argsort(dim=-1, descending=True, stable=True)[:, :kept]
            unit = F.normalize(gather_tokens(tokens[:, p:], keep_idx).float(), dim=-1)
            sim, dst = (unit[:, keepers:] @ unit[:, :keepers].transpose(1, 2)).max(dim=-1)  # (B, P - M)
            own = torch.arange(keepers, device=dst.device).expand(dst.shape[0], -1)
            weight = torch.cat([sim.new_ones(sim.shape[0], keepers), sim.clamp_min(0)], dim=1).unsqueeze(-1)
        return KeepMergePlan(p, keep_idx, torch.cat([own, dst], dim=1), weight, keepers)

    def method_loss(self) -> Optional[torch.Tensor]:
        """macs_weight * (share - macs_target)^2 of the last search forward (None without a target or a search
        forward since the last call); the share is of the block stack's unreduced MACs, from the counts."""
        params = self.rate_params
        if params is None or not params._record or self.macs_target is None:
            return None
        share = macs_share(params, params._record)
        params._record = []
        return self.macs_weight * (share - self.macs_target) ** 2


def macs_share(params: DiffRateParams, settings: Sequence[RateSetting]) -> torch.Tensor:
    """The block stack's MACs at the expected counts (P, M) of the search's block settings (with their logits) over
    its unreduced MACs, with their gradient: block l's attention runs on the count block l - 1 leaves, its MLP on
    min(that, P, M)."""
    shape = settings[0]
    counts = {setting.block: params.expected(setting.logits) for setting in settings}
    p, cost = shape.num_prefix, shape.cost
    before = params.prune.new_tensor(float(shape.num_patches))
    total = before.new_zeros(())
    for block in range(shape.num_blocks):
        after = before
        if block in counts:
            after = torch.minimum(before, torch.minimum(*counts[block]))
        total = total + cost.macs(p + before, p + after)
        before = after
    n = p + shape.num_patches
    return total / (shape.num_blocks * cost.macs(n, n))


@dataclass
class SearchStepPlan(Plan):
    """Training (the search): the block's soft prune and merge at the learned rates, every token in place.

    importance: (B, N) the ranking; tokens: (B, N, C) what the matching reads; params: the rates (the setting
    carries the block's rows of their logits)."""

    num_prefix: int
    setting: RateSetting
    importance: torch.Tensor
    tokens: torch.Tensor
    params: DiffRateParams
    defines_positions = False  # tokens mix in place: no rotary position for a merged token

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        """x: (B, N, C), size: (B, N, 1) or None -> (x, size) after the block's decisions, every token in place (see
        the module docstring); source unchanged."""
        params, p = self.params, self.num_prefix
        B, N, _ = x.shape
        n = N - p
        sizes = (x.new_ones(B, N, 1) if size is None else size).float()
        patch_size = sizes[:, p:, 0]
        alive = patch_size >= 0.5  # (B, n): not dropped or merged away before
        importance = self.importance[:, p:].float().masked_fill(~alive, float("-inf"))
        rank = importance.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # (B, n)
        prune_logits, merge_logits = self.setting.logits
        prune, merge = params.expected(self.setting.logits)
        keepers = (rank < torch.minimum(prune, merge).detach()) & alive
        keep = hard_through(rank < prune.detach(), params.survival(prune_logits, n)[rank])
        stay = hard_through(keepers, params.survival(merge_logits, n)[rank])
        merged = keep * (1 - stay) * alive  # (B, n): 1 for a token merged away, with the gradient of both
        unit = F.normalize(self.tokens[:, p:].float(), dim=-1)
        sim, dst = (unit @ unit.transpose(1, 2)).masked_fill(~keepers.unsqueeze(1), float("-inf")).max(dim=-1)
        receive = merged.new_zeros(B, n, n).scatter(2, dst.unsqueeze(-1), merged.unsqueeze(-1)).transpose(1, 2)
        xp = x[:, p:]
        mean = (xp + receive.to(x.dtype) @ xp) / (1 + receive.sum(-1, keepdim=True)).to(x.dtype)
        xp = torch.where(keepers.unsqueeze(-1), mean, xp)
        grown = (patch_size.unsqueeze(-1) + receive @ (sim.clamp_min(0) * patch_size).unsqueeze(-1)).clamp_min(1)
        held = torch.where(keepers.unsqueeze(-1), grown, patch_size.unsqueeze(-1))
        patch_size = (keep * stay).unsqueeze(-1) * held * (1 - EPS) + EPS
        return torch.cat([x[:, :p], xp], dim=1), torch.cat([sizes[:, :p], patch_size], dim=1).to(x.dtype), source
