"""Per-forward token bookkeeping, created fresh by every forward of the block stack, and where a model's calls keep
it: per returned feature tensor (feature_stats) and per thread (remember_last / last_of)."""
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


@dataclass
class ReductionStats:
    """What one forward of a patched model did.

    tokens_per_block: tokens entering each block (prefix tokens included), length L.
    tokens_out: tokens leaving the last block.
    size: (B, N, 1) original tokens each output token stands for; None when nothing was reduced.
    source: (B, N, N0) 0/1 map of the original tokens each output token holds; only when tracing.
    num_prefix: class / distillation / register tokens at the front, never reduced.
    real_tokens_per_block: where images keep different counts (methods that mask by size, such as ATS; a NaFlex
        batch of several grids), the (B,) count of real tokens entering each block; the batch runs (or is padded
        back to) tokens_per_block, the rest size-0 tokens that attention and pooling ignore. Empty otherwise.
    rope_merge: on a model with rotary positions, where a merged token's rope sits ('dst': its destination
        token's; 'centroid': the size-weighted centroid of its patches); None on a model without rope.
    positions: where the output tokens sit, as the model's family carries it (rope.TokenPositions; a SAM encoder's
        grid, families.sam.GridPositions); None for a family that carries none.
    """

    tokens_per_block: List[int] = field(default_factory=list)
    tokens_out: int = 0
    size: Optional[torch.Tensor] = None
    source: Optional[torch.Tensor] = None
    num_prefix: int = 0
    real_tokens_per_block: List[torch.Tensor] = field(default_factory=list)
    rope_merge: Optional[str] = None
    positions: Any = None


# model -> (forward_features output -> the stats of the call that returned it); outside the model, so that
# pickling and deepcopy never meet the weak references, and both die with what they describe
_FEATURE_STATS: "weakref.WeakKeyDictionary[nn.Module, WeakIdKeyDictionary]" = weakref.WeakKeyDictionary()
_FEATURE_STATS_LOCK = threading.Lock()
# each thread's last forward per model (last_stats): a call never sees the stats of another thread's call
_LAST_STATS = threading.local()


def feature_stats(model: nn.Module) -> WeakIdKeyDictionary:
    with _FEATURE_STATS_LOCK:  # two threads' first calls must not each make a registry and lose one
        if model not in _FEATURE_STATS:
            _FEATURE_STATS[model] = WeakIdKeyDictionary()
        return _FEATURE_STATS[model]


def remember_last(model: nn.Module, stats: ReductionStats) -> None:
    """Keep stats as this thread's last forward of model (eager calls: a compiled graph keeps no Python state)."""
    if torch.compiler.is_compiling():
        return
    if not hasattr(_LAST_STATS, "by_model"):
        _LAST_STATS.by_model = weakref.WeakKeyDictionary()
    _LAST_STATS.by_model[model] = stats


def last_of(model: nn.Module) -> Optional[ReductionStats]:
    return getattr(_LAST_STATS, "by_model", {}).get(model)


def forget_last(model: nn.Module) -> None:
    getattr(_LAST_STATS, "by_model", {}).pop(model, None)
