"""The three compiled regions of a reduced forward, and the state that says which model runs them: its embedding
(patch embedding, position embedding or rope table, prefix tokens), its blocks' shared forward_reduce, and its end
(final norm, pooling with the token sizes, head). Each region is compiled once per model on its own copy of the code,
the batch and the token count dynamic, so one graph serves every block, batch size and r. timm_tokcomp.compiling
builds the user's forms on it (timm_tokcomp.compile); torch.compile(model) reaches it through compiled_whole /
forward_by_region, which the model families' forwards call.

    regions = compile_regions(model)          # model: a reduced model (reducing.ReducingModel)
    with running(model, regions):
        logits = model(images)                # every forward of model in this thread runs the compiled regions
"""
import contextlib
import contextvars
import types
import warnings
import weakref
from typing import Any, Callable, NamedTuple, Optional, Tuple

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

TORCH_COMPILE_NOTE = (
    "torch.compile(model) on a model reduced by timm_tokcomp runs it compiled by regions, as "
    "timm_tokcomp.compile(model) does (Inductor, each region compiled once for every block, batch size and r); "
    "torch.compile's mode and backend do not reach the regions: for CUDA graphs call "
    "timm_tokcomp.compile(model, mode='cudagraph'), for another backend timm_tokcomp.compile(model, backend=...)")


class Regions(NamedTuple):
    """A reduced forward's three parts, each compiled on its own: each takes the module it runs first, so one
    compiled function serves every block and every call of a model (the eager forward calls the methods instead)."""

    embed: Callable[..., Any]  # (model, images, ...) -> (tokens (B, N, C), rope.TokenPositions or None, UnitSizes)
    block: Callable[..., Any]  # (block, *ReducingBlockMixin.forward_reduce's arguments) -> its output
    finish: Callable[..., Any]  # (model, last tokens (B, N', C), sizes (B, N', 1) or None, ...) -> forward's output


# (model, its compiled Regions) while a regionally compiled call of model runs in this thread; the model's other
# callers run eagerly
COMPILED_REGIONS: contextvars.ContextVar = contextvars.ContextVar("timm_tokcomp_compiled_regions", default=None)


def compiled_regions(model: nn.Module) -> Optional[Regions]:
    """model's compiled regions while a regionally compiled call of it runs in this thread, else None. None in a
    traced forward: the regions run from an eager forward (and torch 2.11's dynamo cannot trace ContextVar.get)."""
    if torch.compiler.is_compiling():
        return None
    current = COMPILED_REGIONS.get()
    return current[1] if current is not None and current[0] is model else None


class UnitSizes(NamedTuple):
    """The sizes of the tokens a compiled embedding makes, for the first block: every token one patch. Given from
    the start, they make the first compiled block the graph of the later ones (which take sizes), not a graph of its
    own (sizes None); by the contract of every step, sizes of one are sizes None."""

    size: torch.Tensor  # (B, N, 1), ones in the tokens' dtype
    log_size: torch.Tensor  # (B, N, 1), zeros: size.log(), the proportional-attention bias


def _as_first_block_takes(embed: Callable) -> Callable:
    """A family's _embed (model, images, ...) -> (tokens, positions) as the embedding region, which hands the first
    block what the later ones take: -> (tokens, positions as blocks carry them (rope.TokenPositions.as_carried) or
    None, UnitSizes of the tokens)."""
    def embed_region(model: nn.Module, *args: Any) -> Tuple[torch.Tensor, Any, UnitSizes]:
        tokens, positions = embed(model, *args)
        ones = tokens.new_ones(*tokens.shape[:2], 1)
        return tokens, None if positions is None else positions.as_carried(), UnitSizes(ones, torch.zeros_like(ones))

    return embed_region


def _own_copy(fn: Callable) -> Callable:
    """fn with a code object of its own: the compiler keeps its graphs and their limit per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_regions(model: nn.Module, **compile_kwargs: Any) -> Regions:
    """model's _embed, its blocks' forward_reduce and its _finish compiled by torch.compile(**compile_kwargs), each on
    its own copy of the code, the batch and the token count dynamic. Holds no reference to model."""
    def compiled(fn: Callable) -> Callable:
        return torch.compile(_own_copy(fn), dynamic=True, **compile_kwargs)

    cls = type(model)
    return Regions(compiled(_as_first_block_takes(cls._embed)), compiled(type(model.blocks[0]).forward_reduce),
                   compiled(cls._finish))


@contextlib.contextmanager
def running(model: nn.Module, regions: Regions):
    """Within it, every forward of model in this thread (forward_features, forward_intermediates too) runs
    regions."""
    token = COMPILED_REGIONS.set((model, regions))
    try:  # no duck sizing: a batch of 2 is not the 2 of a rope model's (x, y) coordinates; a float (a scale, a rope
        # temperature) is a constant of the graph, not an input that each call would wrap in a tensor first
        with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(specialize_float=True):
            yield
    finally:
        COMPILED_REGIONS.reset(token)


_TRACED_WHOLE = False  # set by traced_whole(); dynamo reads it as a constant of the trace and guards on it


@contextlib.contextmanager
def traced_whole():
    """Within it (while torch.compile traces), a reduced model's forward is traced whole, as it is: one graph with a
    static count per block, what fullgraph=True, torch._dynamo.explain or an ahead-of-time compile need."""
    global _TRACED_WHOLE
    previous, _TRACED_WHOLE = _TRACED_WHOLE, True
    try:
        yield
    finally:
        _TRACED_WHOLE = previous


def compiled_whole(model: nn.Module) -> bool:
    """Whether torch.compile is tracing model's forward whole (torch.compile(model), model.compile()) where its
    method compiles by region: the forward then hands itself to its regions (forward_by_region). Never while
    exporting (torch.export traces the whole forward as it is) or within traced_whole()."""
    return (torch.compiler.is_compiling() and not _exporting() and not _TRACED_WHOLE
            and model._tokcomp_reducer.compiles_by_region)


def _exporting() -> bool:
    """Whether torch.export is tracing. Read from its flag: torch 2.11's dynamo answers torch.compiler.is_exporting()
    True in every trace (torch.compile's too); later versions read this flag (is_exporting() where it is gone)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else flag


# model -> its regions compiled for torch.compile(model) (forward_by_region); the regions hold no reference to it
_BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, Regions]" = weakref.WeakKeyDictionary()


@torch.compiler.disable
def forward_by_region(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """model.forward(*args, **kwargs) with its regions compiled, outside the caller's trace (one graph break, at the
    forward's start): what torch.compile(model) runs for a reduced model. The regions are compiled on model's first
    such call, which says so once."""
    if model not in _BY_MODEL:
        warnings.warn(TORCH_COMPILE_NOTE, stacklevel=2)
        _BY_MODEL[model] = compile_regions(model)
    with running(model, _BY_MODEL[model]):
        return model.forward(*args, **kwargs)
