"""The dense variant every family shares (dense_tome: each block keeps every token): the model marker, and the block
mixin that runs attention on all tokens, merges k tokens before the MLP and unmerges after it, so a block's output
has its input's shape and timm's own forward (features, intermediates, any input size) runs unchanged."""
from typing import Any, Optional, Tuple

import torch
from torch import nn

from .. import kernels
from ..ops.matching import max_merges
from ..methods.base import TokenReducer
from ..methods.tome import HeadKeys
from ..ops.dense_merge import unmerge
from ..plans.merge import group_index
from .loop import NOT_SCRIPTABLE, refuse_fx_tracing
from .state import BlockState, ModelState


def dense_groups(x: torch.Tensor, metric: Any, reducer: TokenReducer, setting: Any, num_prefix: int):
    """(group (B, N), number of groups, members for the merge kernel or None), or None when nothing merges.
    kernel='triton' matches and lists the groups in one launch (four on large images) on the keys (metric: HeadKeys,
    DenseToMe.attention_metric); otherwise torch plans, then indexes ('auto' too: its matching in fp32 CUDA-core dots
    is not yet timed against torch's)."""
    if isinstance(metric, HeadKeys):
        r = min(setting, max_merges(x.shape[1], num_prefix))
        if r <= 0:
            return None
        group, *members = kernels.tome_groups(metric.k, r, num_prefix)
        return group, x.shape[1] - r, tuple(members)
    plan = reducer.plan(metric, setting, num_prefix, None)
    return None if plan is None else (*group_index(plan, x.shape[1]), None)


def merged_mlp(x: torch.Tensor, norm: nn.Module, mlp: nn.Module, groups, reducer: TokenReducer
               ) -> Tuple[torch.Tensor, str]:
    """mlp(norm(x)) on the group means: x (B, N, C) -> (y (B, M, C), the kernel backend that merged).
    groups: dense_groups' answer (not None)."""
    group, num_groups, members = groups
    backend = kernels.resolve_backend(reducer.kernel, x)
    return mlp(kernels.merge_normed(x, norm, group, num_groups, backend, members)), backend


class DenseModel:
    """Marks a model whose blocks are dense blocks; the timm forward is unchanged."""

    _tokcomp: ModelState  # its reducer (runtime.state)

    def __prepare_scriptable__(self):
        raise RuntimeError(NOT_SCRIPTABLE)


class DenseBlockMixin:
    """A block for dense prediction, run inside the unmodified model forward. Its family's class gives the branches
    (reducing.BlockBranches): _attn_branch, _mlp_branch, and the MLP's layer scale for the unmerged output."""

    _tokcomp: BlockState  # reducer, this block's setting (None: plain block), num_prefix (runtime.state)

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None, attn_mask=None,
                is_causal: bool = False) -> torch.Tensor:
        """x: (B, N, C) -> (B, N, C); rope: timm's rope rows where the family has them."""
        refuse_fx_tracing()
        if attn_mask is not None or is_causal:
            raise ValueError("attn_mask / is_causal are not supported by the dense token-merging blocks")
        reducer, setting, num_prefix = self._tokcomp.reducer, self._tokcomp.setting, self._tokcomp.num_prefix
        h, metric = self._attn_branch(x, None, rope, reducer if setting is not None else None, "mask")
        x = x + h
        groups = None if metric is None else dense_groups(x, metric, reducer, setting, num_prefix)
        if groups is None:
            return x + self._mlp_branch(x)
        y, backend = merged_mlp(x, self.norm2, self.mlp, groups, reducer)
        fusable, gamma = self._mlp_scale()
        if fusable and (isinstance(self.drop_path2, nn.Identity) or not self.training):
            return kernels.unmerge_add(x, y, groups[0], gamma, backend)
        return x + self._mlp_out(unmerge(y, groups[0]))
