"""DTEM, Decoupled Token Embedding for Merging (Lee & Hong, NeurIPS 2024): ToMe whose matching reads a small learned
embedding instead of the keys. Each reducing block has a linear map from its attention's input (after norm1) to d_e
dimensions (d_e = head_dim below width 1024, else 2 head_dim), used only to decide merges; in eval mode the block
merges its r most similar token pairs on that embedding exactly as ToMe does (alternate split, prefix tokens apart,
size-weighted mean, proportional attention). The extra cost is one (N, C) x (C, d_e) product per reducing block.

Training (the embeddings alone, "modular": `tokcomp finetune --distill --lora-rank 0`; the embedding's input is
detached, so no gradient reaches the ViT through it) relaxes ToMe's grouping and merging. Nothing is removed: the
block holds an active prefix of tokens (all at first, r fewer after each reducing block) and, over the active
non-prefix tokens,
  1. splits them alternately and scores every A token against every B token (cosine of the embeddings), keeping
     each A token's k2 = 3 best candidates, divided by tau1 = 0.1;
  2. selects r edges softly in r sequential rounds: each round adds softmax((scores + log(1 - the mass its A token
     already gave, clamped at 1e-6)) / tau2) over all the image's candidate edges, tau2 = 0.1; rows that gave more
     than 1 are scaled back to 1;
  3. merges softly: each B token becomes the size-weighted mean of itself and the shares of A tokens assigned to
     it, its size grows by those shares, and each A token's size shrinks by the share it gave (a token with size
     near 0 is almost ignored: proportional attention weighs it by its size);
  4. sorts the active tokens by size, largest first, so that the next block's active prefix holds the tokens that
     eval mode would keep.
"""
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.matching import bipartite_soft_matching, max_merges
from ..plans import Plan, Reduced, gather_tokens
from ..utils.checks import MAX_BLOCKS, int_list, integer
from .schedules import BlockCost
from .base import LearnedParams, ScheduledReducer, prop_attn_unless_avg_pool
from .params import COMMON, REQUIRED, SCHEDULE, FromConfig, Param
from .straight_through import clamp_through
from .register import register_method

CANDIDATES = 3  # k2: each A token's best B tokens the soft selection chooses among
TAU_SCORE = 0.1  # tau1
TAU_SELECT = 0.1  # tau2
EPS = 1e-6


class MergeSetting(NamedTuple):
    """A reducing block: its index, the merges it makes, the patch tokens active when it starts (training), and its
    merge embedding (None until bind makes them; LearnedParams.settings_for)."""

    block: int
    r: int
    active: int
    weights: Optional[nn.Linear] = None


class DTEMParams(FromConfig, nn.Module):
    """The merge embeddings of a model of width dim: layers[str(block)], Linear(dim, embed_dim), per reducing block."""

    CONFIG = (Param("dim", REQUIRED, integer("dim", 1)), Param("embed_dim", REQUIRED, integer("embed_dim", 1)),
              Param("blocks", REQUIRED, int_list("blocks", 0, "block indices", MAX_BLOCKS - 1, MAX_BLOCKS)))

    def __init__(self, dim: int, embed_dim: int, blocks: Sequence[int]) -> None:
        super().__init__()
        self.dim, self.embed_dim, self.blocks = dim, embed_dim, [int(b) for b in blocks]
        self.layers = nn.ModuleDict({str(b): nn.Linear(dim, embed_dim) for b in self.blocks})


def soft_selection(scores: torch.Tensor, r: int) -> torch.Tensor:
    """scores: (B, na, k) the A tokens' candidate similarities -> (B, na, k) the soft selection of r edges (each row
    summing to at most 1), by r rounds of softmax over every candidate edge (see the module docstring)."""
    B, na, k = scores.shape
    logits = (scores / TAU_SCORE).reshape(B, na * k)
    chosen = scores.new_zeros(B, na * k)
    for _ in range(r):
        given = chosen.view(B, na, k).sum(dim=-1, keepdim=True)  # (B, na, 1)
        penalty = (1 - given).clamp_min(EPS).log().expand(B, na, k).reshape(B, na * k)
        chosen = chosen + ((logits + penalty) / TAU_SELECT).softmax(dim=-1)
    chosen = chosen.view(B, na, k)
    return chosen / chosen.sum(dim=-1, keepdim=True).clamp_min(1.0)


@register_method
class DTEM(LearnedParams, ScheduledReducer):
    """See the module docstring. embed_params: trained embeddings (a learned folder), or None: untrained ones made at
    apply (a random projection). Tags: 'dtem_r<k>', 'dtem_k<pct>'."""

    spec = ScheduledReducer.spec.but(
        name="dtem",
        export_refusal=None,
        learned_class=DTEMParams,
        learned_param="embed_params",
        params=(*SCHEDULE, Param("embed_params", None, help="DTEM's trained merge embeddings (a learned folder)"),
                *COMMON),
    )
    min_keep_rate = 0.5

    default_prop_attn = prop_attn_unless_avg_pool

    @classmethod
    def trains_in_place(cls, params: Dict[str, Any]) -> bool:
        return True

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost
                       ) -> List[Optional[MergeSetting]]:
        settings, active = [], num_tokens - num_prefix
        for block, r in enumerate(super().block_settings(num_blocks, num_tokens, num_prefix, cost)):
            settings.append(None if r is None else MergeSetting(block, r, active))
            if r is not None:
                active -= min(r, max_merges(active + num_prefix, num_prefix))
        return settings

    def bind(self, dim: int, settings: List[Any], head_dim: int) -> None:
        blocks = [s.block for s in settings if s is not None]
        if self.embed_params is None:
            self.embed_params = DTEMParams(dim, head_dim if dim < 1024 else 2 * head_dim, blocks)
        elif (self.embed_params.dim, self.embed_params.blocks) != (dim, blocks):
            raise ValueError(f"these DTEM embeddings are for width {self.embed_params.dim}, blocks "
                             f"{self.embed_params.blocks}; the model has width {dim} and the schedule reduces in blocks "
                             f"{blocks}")

    def block_weights(self, setting: MergeSetting) -> nn.Linear:
        return self.embed_params.layers[str(setting.block)]

    def attention_metric(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: Optional[torch.Tensor],
                         scale: float, inputs: torch.Tensor) -> torch.Tensor:
        """The attention's input (B, N, C), detached: the embedding reads it."""
        return inputs.detach()

    def plan(self, inputs: torch.Tensor, setting: MergeSetting, num_prefix: int, size: Optional[torch.Tensor]):
        embedding = setting.weights(inputs)
        if self.embed_params.training:
            return SoftMergeStepPlan(num_prefix, setting, embedding)
        if max_merges(inputs.shape[1], num_prefix) == 0:
            return None
        plan = bipartite_soft_matching(embedding.detach(), setting.r, num_prefix)
        return plan if plan.r > 0 else None


@dataclass
class SoftMergeStepPlan(Plan):
    """Training: the relaxed merge of the block's embedding (B, N, d_e), with its gradient; every token in place."""

    num_prefix: int
    setting: MergeSetting
    embedding: torch.Tensor
    defines_positions = False  # tokens mix in place: no rotary position for a merged token

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        """x: (B, N, C), size: (B, N, 1) or None, source: (B, N, N0) or None -> the same after the relaxed merge,
        every token in place (see the module docstring)."""
        p, setting = self.num_prefix, self.setting
        B, N, _ = x.shape
        active = min(setting.active, N - p)
        sizes = x.new_ones(B, N, 1) if size is None else size
        a_pos = torch.arange(p + p % 2, p + active, 2, device=x.device)
        b_pos = torch.arange(p + 1 - p % 2, p + active, 2, device=x.device)
        r = min(setting.r, len(a_pos))
        if r <= 0 or len(b_pos) == 0:
            return x, size, source
        unit = F.normalize(self.embedding.float(), dim=-1)
        scores = unit[:, a_pos] @ unit[:, b_pos].transpose(1, 2)  # (B, na, nb)
        top, idx = scores.topk(min(CANDIDATES, len(b_pos)), dim=-1)
        share = scores.new_zeros(scores.shape).scatter(2, idx, soft_selection(top, r))  # (B, na, nb)
        a_size, b_size = sizes[:, a_pos].float(), sizes[:, b_pos].float()
        moved = share.transpose(1, 2) @ a_size  # (B, nb, 1): the size B tokens take in
        b_x = (b_size * x[:, b_pos].float() + share.transpose(1, 2) @ (a_size * x[:, a_pos].float())) / (b_size + moved)
        given = clamp_through(share.sum(dim=-1, keepdim=True))  # clipped to [0, 1], gradient straight through
        x, sizes = x.clone(), sizes.float().clone()
        x[:, b_pos] = b_x.to(x.dtype)
        sizes[:, b_pos] = b_size + moved
        sizes[:, a_pos] = (a_size * (1 - given)).clamp_min(EPS)
        if source is not None:
            source = source.clone()
            source[:, b_pos] = source[:, b_pos] + share.transpose(1, 2).to(source.dtype) @ source[:, a_pos]
            source[:, a_pos] = source[:, a_pos] * (1 - given.detach()).to(source.dtype)
        order = sizes[:, p:p + active, 0].detach().argsort(dim=-1, descending=True, stable=True)  # (B, active)
        keep = torch.arange(p, device=x.device).expand(B, -1)
        rest = torch.arange(p + active, N, device=x.device).expand(B, -1)
        index = torch.cat([keep, p + order, rest], dim=1)
        x, sizes = gather_tokens(x, index), gather_tokens(sizes, index).to(x.dtype)
        return x, sizes, None if source is None else gather_tokens(source, index)
