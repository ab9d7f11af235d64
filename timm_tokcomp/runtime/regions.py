"""The three compiled regions of a reduced forward, and the state that says which model runs them: its embedding
(patch embedding, position embedding or rope table, prefix tokens), its blocks' shared forward_reduce, and its end
(final norm, pooling with the token sizes, head). Each region is compiled once per model on its own copy of the code,
the batch and the token count dynamic, so one graph serves every block, batch size and r. runtime/compile.py builds
the user's forms on it (timm_tokcomp.compile); torch.compile(model) reaches it through runtime/handoff.py, which the
model families' forwards call.

    regions = compile_regions(model)          # model: a reduced model (reducing.ReducingModel)
    with running(model, regions):
        logits = model(images)                # every forward of model in this thread runs the compiled regions
"""
import contextlib
import contextvars
import types
from typing import Any, Callable, NamedTuple, Optional, Tuple

import torch
import torch.fx.experimental._config as fx_config
from torch import nn


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
