"""What timm_tokcomp keeps on a model, in one place: a reduced model's state (ModelState, as model._tokcomp, read by
state_of) and each reducing block's (BlockState, as block._tokcomp); the per-forward token bookkeeping, created fresh
by every forward of the block stack (ReductionStats), and where a model's calls keep it: per returned feature tensor
(feature_stats) and per thread (remember_last / last_of)."""
import threading
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


STATE = "_tokcomp"  # the one state attribute on a model or block (learned parameters: modules under model.tokcomp)


@dataclass
class ModelState:
    """A model's timm_tokcomp state (model._tokcomp). What patch sets (PATCHED, reset by unpatched(): remove takes off
    exactly what patch put on):
      reducer: the TokenReducer the blocks run; prop_attn: False, or the proportional-attention implementation ('auto'
      or one of PROP_ATTN_IMPLS); block_cost: the per-token cost model of one block; depth: the blocks the schedule is
      laid over (a model timm pruned to its first blocks keeps the depth it was built with, set before patch);
      pool_sizes: (this call's sizes,) while a traced forward runs its head, else None.
    Kept across patch and remove: eval_transform, the image transform of a transformers folder (models.build)."""

    reducer: Any = None
    prop_attn: Union[bool, str] = False
    block_cost: Any = None
    depth: Optional[int] = None
    pool_sizes: Optional[Tuple[Optional[torch.Tensor]]] = None
    eval_transform: Any = None

    PATCHED = ("reducer", "prop_attn", "block_cost", "depth", "pool_sizes")

    def unpatched(self) -> None:
        """Every field patch sets back to its default."""
        defaults = {f.name: f.default for f in fields(self)}
        for name in self.PATCHED:
            setattr(self, name, defaults[name])


@dataclass
class BlockState:
    """A dense reducing block's state (block._tokcomp): the reducer, this block's setting (None: a plain block), and
    the prefix tokens at the front."""

    reducer: Any
    setting: Any
    num_prefix: int


def state_of(module: nn.Module, create: bool = False) -> Optional[Any]:
    """The module's timm_tokcomp state (ModelState on a model, BlockState on a block), or None; create: make an empty
    ModelState where there is none."""
    state = module.__dict__.get(STATE)
    if state is None and create:
        state = ModelState()
        module.__dict__[STATE] = state
    return state


def set_state(module: nn.Module, state: Any) -> None:
    module.__dict__[STATE] = state


def drop_state(module: nn.Module) -> None:
    module.__dict__.pop(STATE, None)


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
