"""VisionZip (Yang et al., 2025), training-free, at one block: keep the `dominant` patch tokens that receive the most
attention (the class token's attention row where the model has one; without one, as SigLIP, the attention each
token receives, averaged over the queries) and merge the others into `contextual` tokens: evenly spaced targets
among them, every other token joining the target its key is most similar to (cosine), each contextual token the
unweighted mean of its group. The count is fixed: dominant + contextual patch tokens leave the block (fewer only
where fewer enter), so it is known from the image size before the model runs.

Made for the vision tower of a vision-language model, where the block is the feature layer the projector reads
(timm_tokcomp.vlm applies it there); on a ViT it reduces at its last block (block=-1) or the one named."""
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..plans import KeepMergePlan, gather_tokens

from ..utils.checks import MAX_BLOCKS, Param, check_int, integer
from .base import TokenReducer
from .params import COMMON
from .places import ReducesAt
from .register import register_method
from .schedules import BlockCost
from .tags import BARE_TAG


class AttentionAndKeys(NamedTuple):
    """What VisionZip reads from its block's attention: probs (B, N, N) softmax attention averaged over heads (float32),
    keys (B, N, d) the keys averaged over heads."""

    probs: torch.Tensor
    keys: torch.Tensor


def _block(value) -> int:
    check_int("block", value, -MAX_BLOCKS, "(the reducing block: 0-based, negative from the end)", MAX_BLOCKS - 1)
    return int(value)


def visionzip_plan(metric: AttentionAndKeys, dominant: int, contextual: int, num_prefix: int) -> KeepMergePlan:
    """The step: prefix tokens, the `dominant` most attended patch tokens in their order, then `contextual` merged ones
    (at most as many as the tokens left over)."""
    probs, keys = metric
    p = num_prefix
    importance = probs[:, 0, p:] if p else probs[:, :, p:].mean(dim=1)  # (B, n)
    return dominant_contextual_plan(importance, keys, dominant, contextual, p)


def dominant_contextual_plan(importance: torch.Tensor, keys: torch.Tensor, dominant: int, contextual: int,
                             num_prefix: int) -> KeepMergePlan:
    """importance (B, n) of the patch tokens, keys (B, num_prefix + n, d) -> the plan that keeps the prefix, the
    `dominant` most important patch tokens in index order, then `contextual` merged ones: evenly spaced targets among
    the others, every other token joining the target its key is most similar to. keep_idx[:, :dominant +
    contextual] are the outputs' representatives."""
    p = num_prefix
    n = importance.shape[1]
    order = importance.argsort(dim=-1, descending=True, stable=True)
    dom = order[:, :dominant].sort(dim=-1).values  # (B, D)
    rest = order[:, dominant:].sort(dim=-1).values  # (B, R) in index order
    R = rest.shape[1]
    c = min(contextual, R)
    at = torch.linspace(0, R - 1, c, device=rest.device).round().long()  # evenly spaced targets
    marked = torch.zeros(R, device=rest.device).scatter(0, at, 1.0)
    others = marked.argsort(stable=True)[:R - c]  # the other positions, in order (static shapes, no host sync)
    k = F.normalize(gather_tokens(keys[:, p:].float(), rest), dim=-1)  # (B, R, d)
    join = (k[:, others] @ k[:, at].transpose(1, 2)).argmax(dim=-1)  # (B, R - c): each other token's target
    B, D = dom.shape
    arange = torch.arange(D + c, device=dom.device).expand(B, -1)
    return KeepMergePlan(p, torch.cat([dom, rest[:, at], rest[:, others]], dim=1),
                         torch.cat([arange, D + join], dim=1), importance.new_ones(B, n, 1),
                         D + c)


@register_method
class VisionZip(TokenReducer):
    """Metric: the block's softmax attention averaged over heads, and its keys, computed beside attention (one block
    only, O(N^2) there). Proportional attention is off unless asked (the merged tokens reach no later block in a
    vision-language model)."""

    spec = TokenReducer.spec.but(
        name="visionzip",
        params=(Param("dominant", 54, integer("dominant", 1, "(patch tokens kept by attention)", 1 << 20),
                      "patch tokens kept by the attention they receive"),
                Param("contextual", 10, integer("contextual", 1, "(merged tokens)", 1 << 20),
                      "tokens the other patch tokens merge into, by key similarity"),
                Param("block", -1, _block, "the block that reduces, 0-based (negative: from the end)"),
                *COMMON),
        tags=(BARE_TAG,),
        tag_legend="visionzip: 54 dominant + 10 contextual tokens at the last block",
        place=ReducesAt.AFTER_MLP,
        listed_tags=("visionzip",),
        tune_space=(),
    )

    def check_depth(self, num_blocks: int) -> None:
        if not -num_blocks <= self.block < num_blocks:
            raise ValueError(f"block must name one of the model's {num_blocks} blocks (0..{num_blocks - 1}, or -1..-"
                             f"{num_blocks} from the end), got {self.block}")

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int,
                       cost: BlockCost) -> List[Optional[Tuple[int, int]]]:
        """(dominant, contextual) at the reducing block where more tokens enter than leave; None elsewhere."""
        settings: List[Optional[Tuple[int, int]]] = [None] * num_blocks
        if num_tokens - num_prefix > self.dominant + self.contextual:
            settings[self.block % num_blocks] = (self.dominant, self.contextual)
        return settings

    def tokens_left(self, patches: int) -> int:
        """The patch tokens that leave the model of `patches` patch tokens: a count known before it runs."""
        return min(patches, self.dominant + self.contextual)

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor],
               scale: float) -> AttentionAndKeys:
        scores = (q.float() * scale) @ k.float().transpose(-2, -1)  # (B, H, N, N)
        if attn_bias is not None:
            scores = scores + attn_bias.float()
        return AttentionAndKeys(scores.softmax(dim=-1).mean(dim=1), k.mean(dim=1))

    def plan(self, metric: AttentionAndKeys, setting: Optional[Tuple[int, int]], num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[KeepMergePlan]:
        if setting is None:
            return None
        with torch.no_grad():
            return visionzip_plan(metric, *setting, num_prefix)
