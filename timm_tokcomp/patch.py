"""Make a timm model reduce tokens, and back: swaps the model's, its blocks' and their attention's classes for the
static subclasses its family gives (timm_tokcomp.families), so parameters and buffers are never touched and
state_dict keys and weights stay exactly those of the timm model. It is handed the model's family, found and checked
once (families.resolve); a patched model's classes name it (families.patched_family)."""
from typing import Any, Callable, Optional

import torch
from torch import nn

from .families import Family, family_of, patched_family, resolve
from .methods.base import TokenReducer
from .methods.places import ReducesAt
from .runtime.loop import patch_grid, prefix_only_last
from .runtime.state import (BlockState, ModelState, ReductionStats, drop_state, feature_stats, forget_last, last_of,
                            set_state, state_of)



def is_patched(model: nn.Module) -> bool:
    return patched_family(model) is not None


def model_depth(model: nn.Module, view: Any) -> int:
    """The blocks a method's schedule is laid over: the model's blocks, or, for a model timm pruned to its
    first blocks (prune_intermediate_layers, as features_only does) before or after the method was applied,
    the depth it was built with (ModelState.depth), so each kept block does what it does in the full model.
    view: the model's facade (Family.facade)."""
    state = state_of(model)
    depth = None if state is None else state.depth
    return len(view.blocks) if depth is None else depth


def patch(model: nn.Module, reducer: TokenReducer, family: Optional[Family] = None) -> None:
    """Make `model` reduce tokens with `reducer` (or switch the reducer of a patched model); family: the one serving
    it, checked (families.resolve; found here when not given, as by scripts that call patch alone, e.g. the shared
    GPU kit's limit model)."""
    if family is None:
        family = resolve(model)
    refusal = family.method_refusal(type(reducer))
    if refusal is not None:
        raise ValueError(refusal)
    view = family.facade(model)
    depth = model_depth(model, view)
    reducer.check_depth(depth)
    if reducer.spec.dense:
        _patch_dense(model, reducer, family, view)
        return
    if reducer.spec.needs_class_token and not family.has_class_token(model):
        raise ValueError(f"{reducer.name} ranks tokens by class-token attention and needs a model with a class token")
    if reducer.reduces_at == ReducesAt.BEFORE_ATTENTION:
        refusal = family.lookahead_refusal(model)
        if refusal is not None:
            raise ValueError(refusal)
    prefix_only_last(view, reducer)  # raises if asked for where it is not exact
    block_cost = family.block_cost(view.blocks[0])
    # settings for the model's default input: a budget out of reach (flops_ratio) fails here, not in a forward
    settings = reducer.settings_for(depth, view.patch_embed.num_patches + view.num_prefix_tokens,
                                    view.num_prefix_tokens, block_cost, patch_grid(view))
    # a learned method's parameters are made or checked here
    reducer.bind(view.embed_dim, settings, view.blocks[0].attn.head_dim)
    reducer.mark_made()
    prop_attn = reducer.prop_attn if reducer.prop_attn is not None else reducer.default_prop_attn(view.global_pool)
    prop_attn = "auto" if prop_attn is True else prop_attn  # on: the implementation measured for the device
    if prop_attn == "fold_qkv":
        refusal = family.fold_qkv_refusal(model)
        if refusal is not None:
            raise ValueError(refusal)
    _swap_classes(model, family, dense=False)
    state = state_of(model, create=True)
    state.unpatched()  # a method switched: nothing of the previous one stays
    state.reducer, state.prop_attn, state.block_cost, state.depth = reducer, prop_attn, block_cost, depth
    forget_last(model)
    _attach_learned(model, reducer.learned_module(), reducer.name)


def adapter_skip(model: nn.Module) -> Optional[str]:
    """Why an adapter on the blocks' qkv (peft LoRA) would be skipped by this model's forward, or None: a plain
    (unreduced) model whose timm forward reads the qkv weight itself. A reduced model runs timm_tokcomp's attention,
    which calls the module."""
    family = family_of(type(model))
    if family is None or is_patched(model) or not family.plain_skips_qkv_module(model):
        return None
    return (f"timm's {type(model).__name__} computes qkv with F.linear on qkv.weight (its q / v biases apart), which "
            f"skips a LoRA adapter on qkv: nothing would train or apply there. Run it through timm_tokcomp's attention "
            f"instead: a method, or tome_r0 for the unreduced model (bit for bit the same outputs)")


LEARNED_KEY = "tokcomp"  # a learned method's parameters: model.tokcomp[<method>], state_dict keys 'tokcomp.<method>.*'


def _attach_learned(model: nn.Module, module: Optional[nn.Module], method: str) -> None:
    """Put the method's parameters (or none) under model.tokcomp, on the model's device and dtype, in the model's
    train / eval mode."""
    model._modules.pop(LEARNED_KEY, None)
    if module is not None:
        ref = next(model.parameters(), None)
        if ref is not None:
            module.to(device=ref.device, dtype=ref.dtype)
        model.add_module(LEARNED_KEY, nn.ModuleDict({method: module}).train(model.training))


def _swap_classes(model: nn.Module, family: Family, dense: bool) -> None:
    """Give the model, its blocks and their attention the family's patched classes of one kind (token-reducing
    or dense), first restoring the plain classes if it is patched with the other kind."""
    models = family.dense_models if dense else family.models
    if is_patched(model) and type(model) not in models.values():
        unpatch(model)
    if not is_patched(model):
        family.swap(model, dense)


def _patch_dense(model: nn.Module, reducer: TokenReducer, family: Family, view: Any) -> None:
    refusal = family.dense_refusal(model)
    if refusal is not None:
        raise TypeError(refusal)
    # a dense method's settings may not depend on the token count: any input size runs the same blocks
    num_prefix = view.num_prefix_tokens
    settings = reducer.settings_for(len(view.blocks), view.patch_embed.num_patches + num_prefix, num_prefix,
                                    family.block_cost(view.blocks[0]), patch_grid(view))
    _swap_classes(model, family, dense=True)
    for blk, setting in zip(view.blocks, settings):
        set_state(blk, BlockState(reducer, setting, num_prefix))
    state = state_of(model, create=True)
    state.unpatched()
    state.reducer = reducer
    forget_last(model)


def unpatch(model: nn.Module) -> None:
    """Restore the plain timm classes. Raises ValueError if the model is not patched."""
    family = patched_family(model)
    if family is None:
        raise ValueError("model is not patched by timm_tokcomp")
    for blk in family.facade(model).blocks:
        drop_state(blk)
    family.restore(model)
    state = state_of(model)
    if state is not None:
        state.unpatched()
        if state == ModelState():
            drop_state(model)  # nothing else kept on it: the plain model has no state at all
    model._modules.pop(LEARNED_KEY, None)


def trace_blocks(model: nn.Module, x: torch.Tensor,
                 on_block: Callable[[int, torch.Tensor, torch.Tensor, Any], None]) -> torch.Tensor:
    """Run a token-reducing model's features on x: (B, 3, H, W) with the source map traced, calling
    on_block(i, tokens (B, N_i, C), source (B, N_i, N0), positions) after every block i. Returns what
    forward_features returns, registered so that forward_head / pool on it use its token sizes."""
    reducer_of(model)  # raises if not patched
    if state_of(model).reducer.spec.dense:
        raise ValueError("dense methods keep every token (nothing to trace); trace a token-reducing method")
    tokens, stats = model._reduce_blocks(*model._embed(x), for_intermediates=True, on_block=on_block,
                                         grid=patch_grid(model, x.shape[-2:]))
    return model._register_features(model._features_from(tokens, stats), stats)


def reducer_of(model: nn.Module) -> TokenReducer:
    if not is_patched(model):
        raise ValueError("model is not patched by timm_tokcomp; call timm_tokcomp.apply first")
    return state_of(model).reducer


def stats_of(model: nn.Module, features: Optional[torch.Tensor] = None) -> Optional[ReductionStats]:
    """The stats of this thread's last eager forward of the model, or of the forward_features call that returned
    `features`."""
    reducer_of(model)  # raises if not patched
    if features is None:
        return last_of(model)
    known = feature_stats(model)
    if features not in known:
        raise ValueError("features is not a tensor returned by this model's forward_features")
    return known[features]
