"""The one reducing loop every model family shares: embed -> blocks (attention, reduction, MLP) -> norm -> pool with
token sizes -> head, and the per-call state (sizes, source maps, rotary positions, stats) that travels with it.
A family (timm_tokcomp.families) gives what differs: how its model embeds (`_embed`), how its blocks' attention
takes the log-size bias and the rotary rows (`_attn_branch`), its MLP branch (`_mlp_branch`), and whether its
attention-pool head reads the prefix tokens."""
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from timm.models._features import feature_take_indices
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..measure.device_table import measured
from ..ops.rope import TokenPositions
from ..plans import gather_tokens
from .handoff import compiled_whole, forward_by_region
from .regions import Regions, UnitSizes, compiled_regions
from ..methods.base import TokenReducer
from ..methods.places import ReducesAt
from .state import ModelState, ReductionStats, feature_stats, remember_last

NOT_SCRIPTABLE = (
    "TorchScript is not supported on a timm_tokcomp model: its blocks call the method's Python objects (plans, "
    "schedules) that TorchScript cannot compile. Use torch.compile, or torch.export for a graph to deploy; "
    "or call timm_tokcomp.remove(model) first")
_NOT_FX_TRACEABLE = (
    "torch.fx symbolic tracing is not supported on a timm_tokcomp model: which tokens merge is decided from "
    "the data (sort / gather on the values) and the token count changes per block, which symbolic proxies "
    "cannot follow. Use torch.compile or torch.export (both trace with real shapes); for feature maps use "
    "features_only=True (feature_cls='getter') or forward_intermediates")


def refuse_fx_tracing() -> None:
    if torch.fx._symbolic_trace.is_fx_symbolic_tracing():  # torch.fx.symbolic_trace, not torch.export / compile
        raise RuntimeError(_NOT_FX_TRACEABLE)


def resolve_prop_attn(prop_attn: Union[bool, str], x: torch.Tensor, compiled: bool = False, rope: bool = False
                      ) -> Union[bool, str]:
    """False, or the implementation that runs on x's device and precision ('auto': the measured table's, else
    'mask'). compiled: the blocks run under torch.compile, where the table may name another choice for models
    without rope (its 'prop_attn_compiled')."""
    if prop_attn != "auto":
        return prop_attn
    chosen = measured("prop_attn_compiled", x) if compiled and not rope else None
    return chosen or measured("prop_attn", x) or "mask"


def patch_grid(model: nn.Module, image_size: Optional[Tuple[int, int]] = None) -> Tuple[int, int]:
    """(rows, cols) of the patch tokens for an input of image_size (H, W) (None: the model's default size)."""
    embed = model.patch_embed
    if image_size is not None and getattr(model, "dynamic_img_size", False):
        return tuple(embed.dynamic_feat_size(tuple(image_size)))
    return tuple(embed.grid_size)


def prefix_only_last(model: nn.Module, reducer: TokenReducer) -> bool:
    """Whether the last block keeps only the prefix tokens (TokenReducer.keeps_prefix_only_last). Checked at every
    forward: the head may have been reset since the method was applied."""
    exact = model.global_pool == "token" and model.num_prefix_tokens > 0
    return reducer.keeps_prefix_only_last(
        exact, f"this model has global_pool={model.global_pool!r} and {model.num_prefix_tokens} prefix tokens")


SIZED_POOLS = ("avg", "avgmax", "max")  # the pool types that read the token sizes


def spread_tokens(tokens: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """tokens (B, N, C) with their source map (B, N, N0) -> (B, N0, C): at each original position the token holding
    it (a merged token at every position it holds), zeros where a dropping pruner removed the position."""
    holder = source.argmax(dim=1)  # (B, N0): the token holding each original position
    held = source.sum(dim=1).unsqueeze(-1)  # (B, N0, 1): 0 where a dropping pruner removed the patch
    return gather_tokens(tokens, holder) * held


# what one block hands the next: tokens x (B, N, C), their sizes (B, N, 1) or None, the source map (B, N, N0) or None,
# the rotary positions or None, and the sizes' log (B, N, 1) where attention is proportional and the step wrote it
# (compiled, the block writes it otherwise: _handed_on), else None (the next block takes size.log() itself)
Carried = Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[TokenPositions],
                Optional[torch.Tensor]]


def _handed_on(x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor],
               positions: Optional[TokenPositions], log_size: Optional[torch.Tensor], prop_attn: Union[bool, str]
               ) -> Carried:
    """What a block hands the next: the step's log of the sizes (B, N, 1) where attention is proportional, else None;
    and while compiling, so that every block takes the same kind of inputs (one graph for all, the first among them:
    regions.UnitSizes), the log also where the step wrote none (size.log(); eager, the next block takes it) and the
    sizes and rotary coordinates contiguous (a torch plan may return views of a wider tensor)."""
    if not prop_attn or size is None:
        log_size = None
    if torch.compiler.is_compiling():
        size = None if size is None else size.contiguous()
        log_size = size.log() if log_size is None and prop_attn and size is not None else log_size
        positions = None if positions is None else positions.as_carried()
    return x, size, source, positions, log_size


class BlockBranches:
    """The residual branches of a family's block, which its reducing and dense blocks both run."""

    def _attn_branch(self, x: torch.Tensor, attn_bias: Optional[torch.Tensor], rope: Optional[torch.Tensor],
                     reducer: Optional[TokenReducer], prop_impl: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x: (B, N, C) -> (what the block adds to x (B, N, C), the reducer's metric or None)."""
        raise NotImplementedError

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, N, C) -> what the block's MLP adds to x (B, N, C)."""
        raise NotImplementedError

    def _mlp_scale(self) -> Tuple[bool, Optional[torch.Tensor]]:
        """(whether a fused kernel may apply the MLP's layer scale, that scale (C,) or None for none)."""
        raise NotImplementedError

    def _mlp_out(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP's output h (B, N, C) -> what the block adds to x: its layer scale and drop path."""
        raise NotImplementedError


class ReducingBlockMixin:
    """A block that reduces tokens between attention and MLP (or after the MLP). Its family's class gives the
    branches (BlockBranches: _attn_branch with its metric, _mlp_branch)."""

    def forward(self, *args: Any, **kwargs: Any):
        raise RuntimeError(
            "this block is patched by timm_tokcomp and changes the token count; run it through the model's "
            "forward / forward_features, or call timm_tokcomp.remove(model) first"
        )

    def _lookahead_branch(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor],
                          attn_bias: Optional[torch.Tensor], setting: Any, reducer: TokenReducer, num_prefix: int):
        """For a reducer that reduces_at "before_attention": x (B, N, C) -> (x reduced (B, M, C), what attention adds to
        it (B, M, C), size, source), the attention's probabilities computed at N and reduced by reducer.lookahead."""
        raise NotImplementedError(f"{type(self).__name__} has no lookahead attention")

    def forward_reduce(
        self,
        x: torch.Tensor,
        size: Optional[torch.Tensor],
        source: Optional[torch.Tensor],
        positions: Optional[TokenPositions],
        setting: Any,
        reducer: TokenReducer,
        prop_attn: Union[bool, str],
        num_prefix: int,
        block: int,
        prefix_only: bool = False,
        log_size: Optional[torch.Tensor] = None,
    ) -> Carried:
        """x: (B, N, C), size: (B, N, 1) or None, source: (B, N, N0) or None, positions: the rotary positions of the
        patch tokens or None, log_size: size.log() (B, N, 1) where the previous step wrote it, or None -> the same
        (Carried), N' <= N tokens.

        setting: the reducer's setting for this block (None: no reduction); prop_attn: False, or how the log-size
        bias enters attention (attention.PROP_ATTN_IMPLS, resolved); block: this block's index; prefix_only: keep
        only the num_prefix leading tokens after attention (the last block of a class-token head). The reduction
        runs where reducer.reduces_at says: between attention and MLP, after the MLP (the study protocol's 'before
        the next block'; the metric is this block's either way), or before attention (lookahead)."""
        attn_bias = None
        if prop_attn and size is not None:
            attn_bias = (size.log() if log_size is None else log_size).view(x.shape[0], 1, 1, x.shape[1])
        # one guard for every method: an empty batch, or fewer than two patch tokens, has nothing to reduce
        active = setting is not None and not prefix_only and x.shape[0] > 0 and x.shape[1] - num_prefix >= 2
        rope = None if positions is None else positions.rows(block)
        where = reducer.reduces_at
        if active and where == ReducesAt.BEFORE_ATTENTION:  # no rope here: patch refuses such models
            x, h, size, source = self._lookahead_branch(x, size, source, attn_bias, setting, reducer, num_prefix)
            x = x + h
            return _handed_on(x + self._mlp_branch(x), size, source, positions, None, prop_attn)
        branches = active and reducer.spec.reads_branches  # the metric from the branch outputs, attention untouched
        h, metric = self._attn_branch(x, attn_bias, rope, reducer if active and not branches else None,
                                      prop_attn or "mask")
        x = x + h
        if branches and where == "after_attention":
            metric = reducer.branch_metric(h, None)
        if prefix_only:
            x = x[:, :num_prefix]
            size = None if size is None else size[:, :num_prefix]
            source = None if source is None else source[:, :num_prefix]
            positions = None if positions is None else positions.prefix_only()
            log_size = None if log_size is None else log_size[:, :num_prefix]
        elif metric is not None and where == "after_attention":
            x, size, source, positions, log_size = self._reduce(x, size, source, positions, log_size, metric,
                                                                setting, reducer, num_prefix)
        m = self._mlp_branch(x)
        x = x + m
        if branches and where == "after_mlp":
            metric = reducer.branch_metric(h, m)
        if metric is not None and where == "after_mlp":
            x, size, source, positions, log_size = self._reduce(x, size, source, positions, log_size, metric,
                                                                setting, reducer, num_prefix)
        return _handed_on(x, size, source, positions, log_size, prop_attn)

    @staticmethod
    def _reduce(x, size, source, positions: Optional[TokenPositions], log_size, metric, setting,
                reducer: TokenReducer, num_prefix: int) -> Carried:
        metric = reducer.plan_input(metric, x)
        fused = reducer.reduce_fused(metric, x, size, source, setting, num_prefix, positions)
        if fused is not None:
            return fused
        plan = reducer.plan(metric, setting, num_prefix, size)
        if plan is None:
            return x, size, source, positions, log_size
        moved = None if positions is None else positions.reduced(plan, size, num_prefix)
        return (*plan.apply(x, size, source), moved, None)


class ReducingModel:
    """Mixin over a family's timm model class running the reducing blocks. The family's class gives _embed."""

    _tokcomp: ModelState  # what patch set (runtime.state): reducer, prop_attn, block_cost, depth, pool_sizes
    map_pool_reads_prefix: bool = False  # the attention-pool head ('map') reads the prefix tokens too
    compiles_by_region: bool = True  # False: timm_tokcomp.compile compiles it whole, static shapes (families.sam)

    # Per-call state (token sizes, stats, source maps) is never kept where another call of the same model could
    # read it: it travels with the call's own feature tensor (_register_features), so calls from several threads
    # at once each pool with their own sizes. Under torch.compile the head reads the sizes from a module attribute
    # that dynamo traces as a value of this call's graph (_finish).

    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[TokenPositions]]:
        """x: (B, 3, H, W) -> (tokens (B, N, C) entering the first block, as timm's forward_features makes them,
        and their rotary positions, or None for a model without rotary embeddings)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, H, W) -> logits, pooled with this call's token sizes (torch.compile: by regions, handoff)."""
        if compiled_whole(self):
            return forward_by_region(self, x)
        regions = compiled_regions(self)
        if regions is None and not torch.compiler.is_compiling():
            x, stats = self._features(x)
            return self.forward_head(self._register_features(x, stats))
        x, stats = self._through_blocks(x, regions)
        return self._finish(x, stats.size) if regions is None else regions.finish(self, x, stats.size)

    def _finish(self, x: torch.Tensor, size: Optional[torch.Tensor]) -> torch.Tensor:
        """A traced forward's end: the last block's tokens x (B, N', C) with their sizes (B, N', 1) or None ->
        logits (final norm, the head pooling with size)."""
        self._tokcomp.pool_sizes = (size,)
        try:
            return self.forward_head(self.norm(x))
        finally:
            self._tokcomp.pool_sizes = None

    def forward_features(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        """x: (B, 3, H, W) -> (B, N', C) with N' <= N tokens (prefix tokens first). The token sizes travel
        with the returned tensor: forward_head / pool on it use them, whatever ran in between."""
        if attn_mask is not None or is_causal:
            raise ValueError("attn_mask / is_causal are not supported while tokens are reduced (token count changes)")
        return self._register_features(*self._features(x))

    def _features(self, x: torch.Tensor) -> Tuple[torch.Tensor, ReductionStats]:
        x, stats = self._through_blocks(x, compiled_regions(self))
        return self._features_from(x, stats), stats

    def _features_from(self, x: torch.Tensor, stats: ReductionStats) -> torch.Tensor:
        """The last block's tokens x (B, N', C) -> what forward_features returns: the final norm of them."""
        return self.norm(x)

    def _through_blocks(self, x: torch.Tensor, regions: Optional[Regions]) -> Tuple[torch.Tensor, ReductionStats]:
        """images x (B, 3, H, W) -> (the last block's tokens (B, N', C), this call's stats); regions: the compiled
        ones to run (None: eager)."""
        tokens, positions, unit = self._embedded(regions, x)
        return self._reduce_blocks(tokens, positions, unit_sizes=unit, grid=patch_grid(self, x.shape[-2:]))

    def _embedded(self, regions: Optional[Regions], *args: Any
                  ) -> Tuple[torch.Tensor, Optional[TokenPositions], Optional[UnitSizes]]:
        """_embed(*args) (eager: regions None) or the compiled embedding region -> (tokens (B, N, C), their
        positions, and from the region the sizes of one that the first compiled block takes (regions.UnitSizes))."""
        return (*self._embed(*args), None) if regions is None else regions.embed(self, *args)

    def _reduce_blocks(self, x: torch.Tensor, positions: Optional[TokenPositions], for_intermediates: bool = False,
                       num_blocks: Optional[int] = None,
                       on_block: Optional[Callable[[int, torch.Tensor, Optional[torch.Tensor], Any], None]] = None,
                       final: bool = True, *, grid: Tuple[int, int], unit_sizes: Optional[UnitSizes] = None
                       ) -> Tuple[torch.Tensor, ReductionStats]:
        """x: (B, N, C) -> (B, N', C) through the first num_blocks blocks (all: None), with this call's stats.
        positions: where the tokens sit as the family carries it (rope.TokenPositions, SAM's grid; None without).
        for_intermediates: trace the source map; on_block(i, x, source, positions) sees each block's output, every
        token of it. final: the returned tokens are the final features, computed as forward_features computes them (a
        last block that keeps only the prefix tokens runs its MLP on those alone; for on_block it runs once more on
        every token); False: every block keeps its tokens to the end. grid: (rows, cols) of the patch tokens
        (patch_grid). unit_sizes: the compiled embedding region's sizes of one (None: the first block takes no
        sizes)."""
        refuse_fx_tracing()
        reducer, num_prefix = self._tokcomp.reducer, self.num_prefix_tokens
        settings = reducer.settings_for(self._tokcomp.depth, x.shape[1], num_prefix, self._tokcomp.block_cost, grid)
        prefix_only_last_block = prefix_only_last(self, reducer) and final
        source = None
        if reducer.trace_source or for_intermediates:
            source = torch.eye(x.shape[1], device=x.device, dtype=x.dtype).expand(x.shape[0], -1, -1)
        stats = ReductionStats(num_prefix=num_prefix, rope_merge=None if positions is None else positions.merge)
        use_checkpoint = self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting()
        last = self._tokcomp.depth - 1
        blocks = self.blocks if num_blocks is None else self.blocks[:num_blocks]
        regions = None if use_checkpoint else compiled_regions(self)
        compiled = None if regions is None else regions.block
        prop_attn = resolve_prop_attn(self._tokcomp.prop_attn, x, compiled=compiled is not None or
                                      torch.compiler.is_compiling(), rope=positions is not None)
        size, log_size = (None, None) if unit_sizes is None else (unit_sizes.size,
                                                                  unit_sizes.log_size if prop_attn else None)
        for i, (blk, setting) in enumerate(zip(blocks, settings)):
            stats.tokens_per_block.append(x.shape[1])
            reducer.record_block(stats, x, size)
            args = (x, size, source, positions, setting, reducer, prop_attn, num_prefix, i)

            def run(prefix_only: bool) -> Carried:
                if use_checkpoint:
                    return checkpoint(blk.forward_reduce, *args, prefix_only, log_size, use_reentrant=False)
                if compiled is not None:
                    return compiled(blk, *args, prefix_only, log_size)
                return blk.forward_reduce(*args, prefix_only, log_size)

            prefix_only = prefix_only_last_block and i == last
            if on_block is not None and prefix_only:
                every, _, every_source, every_positions, _ = run(False)
                on_block(i, every, every_source, every_positions)
            x, size, source, positions, log_size = run(prefix_only)
            if on_block is not None and not prefix_only:
                on_block(i, x, source, positions)
        stats.tokens_out = x.shape[1]
        stats.size = size.detach() if size is not None and size.requires_grad else size  # no op when no gradient
        stats.source = source.detach() if reducer.trace_source else None
        stats.positions = None if positions is None else positions.settled()
        remember_last(self, stats)
        return x, stats

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None) -> torch.Tensor:
        """Like timm's pool, with each token weighted by its size (the sizes of the forward_features call that
        returned x, or of the running forward): 'avg' / 'avgmax' as a size-weighted mean, 'max' / 'avgmax' over the
        tokens of size > 0, the attention-pool head ('map') with log size added to its attention logits, as in the
        blocks."""
        if getattr(self, "attn_pool", None) is not None:
            size = self._token_sizes(x)
            start = 0 if self.map_pool_reads_prefix or getattr(self, "pool_include_prefix", False) \
                else self.num_prefix_tokens
            xs = x[:, start:]
            if size is None:
                return self.attn_pool(xs)
            bias = size[:, start:, 0].log().to(x.dtype).view(x.shape[0], 1, 1, xs.shape[1])
            return self.attn_pool(xs, attn_mask=bias)
        pool_type = self.global_pool if pool_type is None else pool_type
        if pool_type not in SIZED_POOLS:
            return super().pool(x, pool_type)
        size = self._token_sizes(x)
        if size is None:
            return super().pool(x, pool_type)
        start = 0 if getattr(self, "pool_include_prefix", False) else self.num_prefix_tokens
        xs, s = x[:, start:], size[:, start:].to(x.dtype)
        if pool_type != "avg":  # a padding token (size 0) is never the maximum
            peak = xs.masked_fill(s == 0, torch.finfo(xs.dtype).min).amax(dim=1)
            if pool_type == "max":
                return peak
        mean = (xs * s).sum(dim=1) / s.sum(dim=1).clamp_min(torch.finfo(s.dtype).tiny)  # never 0 / 0
        return mean if pool_type == "avg" else 0.5 * (peak + mean)

    def _token_sizes(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """(B, N, 1) sizes of the tokens x: (B, N, C); None when every token has size 1."""
        pooled = self._tokcomp.pool_sizes  # set while a traced forward runs its head (_finish)
        stats = feature_stats(self).get(x) if pooled is None else None
        if pooled is not None:
            size = pooled[0]
        elif stats is not None:
            size = stats.size
        elif x.shape[1] == self.patch_embed.num_patches + self.num_prefix_tokens:
            return None  # nothing was reduced: every token stands for one patch
        else:
            raise RuntimeError(
                f"pool got {x.shape[1]} reduced tokens that are not a tensor returned by forward_features, so their "
                "sizes are unknown; pass forward_features' output itself (not a copy) to forward_head / pool")
        if size is not None and size.shape[:2] != x.shape[:2]:
            raise RuntimeError(f"pool got tokens {tuple(x.shape[:2])} whose sizes are {tuple(size.shape[:2])}")
        return size

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False, output_dict: bool = False,
                              attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False):
        """timm's forward_intermediates (same arguments and return forms) on the full patch grid: each chosen
        block's output tokens are mapped back through the source map, so every patch position carries the
        features of the token that holds it after that block (a merged token at every patch it holds; a
        patch EViT pruned, the fused token that absorbed it; a patch a dropping pruner removed (Top-K, ATS,
        radial): zeros). Prefix tokens are never reduced. Intermediates:
        (B, C, H, W) for 'NCHW', (B, H * W, C) for 'NLC'; the final features are the reduced tokens
        (B, N', C), as forward_features returns them (only the prefix tokens where its last block keeps only those),
        with every block keeping its tokens to the end."""
        if attn_mask is not None or is_causal:
            raise ValueError("attn_mask / is_causal are not supported while tokens are reduced (token count changes)")
        x, stats, prefix, spatial = self._grid_intermediates(x, indices, stop_early, intermediates_only, output_fmt,
                                                             self.norm if norm else None)
        prefix = prefix if self.num_prefix_tokens else None
        final = None if intermediates_only else self._register_features(self.norm(x), stats)
        if output_dict:
            out: Dict[str, Any] = {"image_intermediates": spatial}
            if prefix is not None and return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix
            if final is not None:
                out["image_features"] = final
            return out
        if return_prefix_tokens and prefix is not None:
            spatial = list(zip(spatial, prefix))
        return spatial if intermediates_only else (final, spatial)

    def _grid_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]], stop_early: bool,
                            intermediates_only: bool, output_fmt: str, norm: Optional[nn.Module]
                            ) -> Tuple[torch.Tensor, ReductionStats, List[torch.Tensor], List[torch.Tensor]]:
        """forward_intermediates' run (_traced_blocks; final features unless intermediates_only) -> (last tokens,
        stats, per chosen block its prefix tokens (B, p, C) and its patch tokens spread onto the full grid through
        norm where given: (B, C, H, W) for output_fmt 'NCHW', (B, H * W, C) for 'NLC')."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        grid = patch_grid(self, x.shape[-2:])
        tokens, stats, grids = self._traced_blocks(
            x, indices, stop_early, not intermediates_only,
            lambda out, source, positions: spread_tokens(norm(out) if norm is not None else out, source))
        p = self.num_prefix_tokens
        spatial = [g[:, p:] for g in grids]
        if output_fmt == "NCHW":
            spatial = [g.reshape(len(x), *grid, -1).permute(0, 3, 1, 2).contiguous() for g in spatial]
        return tokens, stats, [g[:, :p] for g in grids], spatial

    def _traced_blocks(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]], stop_early: bool,
                       final: bool, keep: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor],
                       trace_source: bool = True) -> Tuple[torch.Tensor, ReductionStats, List[torch.Tensor]]:
        """x (B, 3, H, W) through the blocks (to the last one indices choose where stop_early) -> (last tokens,
        stats, keep(tokens (B, N_i, C), source (B, N_i, N0) or None without trace_source, positions) of each
        chosen block i)."""
        take, max_index = feature_take_indices(len(self.blocks), indices)
        kept: List[torch.Tensor] = []

        def on_block(i: int, tokens: torch.Tensor, source: torch.Tensor, positions: Any) -> None:
            if i in take:
                kept.append(keep(tokens, source, positions))

        tokens, stats = self._reduce_blocks(*self._embed(x), for_intermediates=trace_source, on_block=on_block,
                                            num_blocks=max_index + 1 if stop_early else None, final=final,
                                            grid=patch_grid(self, x.shape[-2:]))
        return tokens, stats, kept

    def _register_features(self, x: torch.Tensor, stats: ReductionStats) -> torch.Tensor:
        """Remember the stats of the call that made x: (B, N', C), so that pool / forward_head on x use its sizes."""
        feature_stats(self)[x] = stats
        return x

    def __prepare_scriptable__(self):
        raise RuntimeError(NOT_SCRIPTABLE)
