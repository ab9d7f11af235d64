"""Rotary positions that travel with reduced tokens (timm's Eva class): each patch token keeps grid coordinates
in its rope module's own units, reduced with the tokens, and its rope rows are recomputed from them with the
module's own frequencies. timm's three 2-D rope types ('cat', 'dinov3', 'mixed') are linear in the coordinates,
so the coordinates of a merged token (its destination's, or the size-weighted centroid of its patches) define
its angles; the sin / cos values are never averaged.

Pure tensor math on the rope module's buffers; the model surgery lives in timm_tokcomp/families/eva.py."""
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import timm
import torch
from torch import nn
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat, RotaryEmbeddingDinoV3, RotaryEmbeddingMixed

try:  # timm >= 1.0.31 builds its rope grids and sin / cos rows with these; before, a rope model is refused, by name
    from timm.layers.pos_embed_sincos import _build_grid, _rope_layout
except ImportError:
    _build_grid = _rope_layout = None

from ..plans import Plan
from ..utils.checks import check_choice

ROPE_MERGES = ("dst", "centroid")  # how a merged token's rotary position is chosen (the rope_merge parameter)
SERVED_ROPES = (RotaryEmbeddingCat, RotaryEmbeddingDinoV3, RotaryEmbeddingMixed)
PATCH_DROP_REFUSAL = ("patch dropout (patch_drop_rate > 0) in training is not supported on a rope model while tokens "
                      "are reduced: timm keeps the kept patches' indices to itself, so their rotary positions cannot "
                      "travel with them; set patch_drop_rate=0 or train without a method")


def check_rope_merge(value: Any) -> str:
    """value, if one of ROPE_MERGES; else ValueError naming them."""
    return check_choice("rope_merge", value, ROPE_MERGES, "(a merged token's rotary position: its destination "
                        "token's, or the size-weighted centroid of its patches)")


class RotaryEmbeddingDinoV3Once(RotaryEmbeddingDinoV3):
    """timm's DINOv3 rope (same buffers) whose table for a grid is made once (dinov3_table) where no coordinate
    augmentation draws it anew: what a patched model's DINOv3 rope module becomes (families' other_classes)."""

    def get_embed(self, shape: Optional[List[int]] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if shape is None or (self.training and self.aug_active):
            return super().get_embed(shape=shape, dtype=dtype)
        table = dinov3_table(self, tuple(shape))
        return table if dtype is None else table.to(dtype=dtype)


ROPE_CLASSES = {RotaryEmbeddingDinoV3: RotaryEmbeddingDinoV3Once}  # plain timm rope class -> a patched model's


def check_rope(rope: Optional[nn.Module]) -> None:
    """Raise TypeError for a rope module whose positions cannot travel with tokens."""
    if rope is not None and _build_grid is None:
        raise TypeError(f"the model has rotary position embeddings, which timm_tokcomp reduces with timm >= 1.0.31 "
                        f"(it builds their grids as timm.layers.pos_embed_sincos does there); this is timm "
                        f"{timm.__version__}: upgrade timm, or reduce a model without rope")
    if rope is not None and type(rope) not in SERVED_ROPES + tuple(ROPE_CLASSES.values()):
        raise TypeError(f"the model's rotary embedding is of class {type(rope).__name__}; timm_tokcomp serves the 2-D "
                        f"types {', '.join(c.__name__ for c in SERVED_ROPES)} (rope_type 'cat', 'dinov3', 'mixed')")


# rope module -> {(kind, feat_shape, device, settings): its grid coordinates or (DINOv3) its table on that device}:
# made once, so an eager forward copies nothing from the host (a CUDA graph cannot capture such a copy; outside one
# it is a host-to-device transfer)
_GRIDS: "weakref.WeakKeyDictionary[nn.Module, Dict[Any, torch.Tensor]]" = weakref.WeakKeyDictionary()


def grid_coords(rope: nn.Module, feat_shape: Tuple[int, int], device: torch.device) -> torch.Tensor:
    """(H * W, 2) float32 coordinates of the patch grid in the rope module's own units (row-major, as its table);
    outside torch.compile made once per rope module, grid and device (treat it as read-only); under torch.compile
    built on the device itself, so a compiled graph holds no host tensor and no copy to the device."""
    if torch.compiler.is_compiling():
        return _grid_coords(rope, feat_shape, device, on_device=True)
    return _made_once(rope, "coords", feat_shape, device, lambda: _grid_coords(rope, feat_shape, device))


def dinov3_table(rope: RotaryEmbeddingDinoV3, feat_shape: Tuple[int, int]) -> torch.Tensor:
    """timm's DINOv3 rope table for the grid, (H * W, 2 * dim) sin || cos as its get_embed(shape) gives it without
    coordinate augmentation. timm builds the grid on the host and copies it to the device in every forward (a copy
    a CUDA graph cannot capture); here it is made once per rope module, grid and device (treat it as read-only), and
    under torch.compile computed from a grid built on the device."""
    device = rope.periods.device
    if torch.compiler.is_compiling():
        return torch.cat(rope._get_pos_embed_from_coords(_grid_coords(rope, feat_shape, device, on_device=True)), -1)
    # the table follows the periods' dtype and any change made to them in place
    return _made_once(rope, ("table", rope.periods.dtype, rope.periods._version), feat_shape, device,
                      lambda: RotaryEmbeddingDinoV3.get_embed(rope, shape=list(feat_shape)))


def _made_once(rope: nn.Module, kind: Any, feat_shape: Tuple[int, int], device: torch.device, make) -> torch.Tensor:
    """make()'s tensor, kept per rope module, kind, grid, device and the rope's grid settings."""
    cache = _GRIDS.setdefault(rope, {})
    # the rope module's grid settings are part of the key: one changed after a forward never meets a stale grid
    settings = tuple(_hashable(getattr(rope, name, None)) for name in _GRID_SETTINGS)
    key = (kind, tuple(feat_shape), torch.device(device), settings)
    if key not in cache:
        with torch.inference_mode(False):  # a normal tensor, usable later with autograd too
            cache[key] = make()
    return cache[key]


_GRID_SETTINGS = ("grid_type", "ref_feat_shape", "grid_offset", "grid_indexing", "normalize_coords")


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _grid_coords(rope: nn.Module, feat_shape: Tuple[int, int], device: torch.device, on_device: bool = False
                 ) -> torch.Tensor:
    """The grid built on the host, as timm builds it, and moved to device; on_device: built on device itself."""
    built_on = device if on_device else None
    if isinstance(rope, RotaryEmbeddingMixed):
        grid = _build_grid(list(feat_shape), grid_indexing=rope.grid_indexing, device=built_on, ndim=2)
    elif isinstance(rope, RotaryEmbeddingDinoV3):
        grid = _build_grid(list(feat_shape), grid_type="centered", grid_offset=rope.grid_offset,
                           grid_indexing=rope.grid_indexing, normalize_coords=rope.normalize_coords, device=built_on,
                           ndim=2)
    else:
        grid = _build_grid(list(feat_shape), grid_type=rope.grid_type, ref_feat_shape=rope.ref_feat_shape,
                           grid_offset=rope.grid_offset, grid_indexing=rope.grid_indexing,
                           normalize_coords=rope.normalize_coords, device=built_on)
    return grid.reshape(-1, 2).to(device)


def rope_rows(rope: nn.Module, coords: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Rope rows (sin || cos) of tokens at coords: (B, n, 2) -> (B, 1, n, 2 * head_dim), or (B, heads, n, 2 *
    head_dim) for 'mixed' (block `block`'s frequencies), in `dtype`; computed in float32 as timm computes them."""
    coords = coords.float()
    if isinstance(rope, RotaryEmbeddingMixed):
        # (2, heads, head_dim // 2); a slice, which a trace with a symbolic block does not specialise as an index
        freqs = rope.freqs[:, block:block + 1].squeeze(1).float()
        t_x, t_y = coords[..., 0].unsqueeze(1), coords[..., 1].unsqueeze(1)  # (B, 1, n)
        angles = t_x.unsqueeze(-1) * freqs[0].unsqueeze(-2) + t_y.unsqueeze(-1) * freqs[1].unsqueeze(-2)
        return torch.cat([_rope_layout(angles.sin()), _rope_layout(angles.cos())], dim=-1).to(dtype)
    if isinstance(rope, RotaryEmbeddingDinoV3):
        angles = 2 * math.pi * coords.unsqueeze(-1) / rope.periods.float()  # (B, n, 2, dim // 4)
    else:
        angles = coords.unsqueeze(-1) * rope.bands.float()
    angles = angles.flatten(-2)  # (B, n, head_dim // 2)
    rows = torch.cat([_rope_layout(angles.sin(), rope.rotate_half), _rope_layout(angles.cos(), rope.rotate_half)], -1)
    return rows.unsqueeze(1).to(dtype)


def with_prefix_rows(coords: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """The patch tokens' coords (B, n, 2) -> (B, num_prefix + n, 2) float32 with zero rows for the prefix tokens, so
    that a plan over all N tokens moves them as it moves x (the prefix rows are dropped after)."""
    return torch.cat([coords.new_zeros(coords.shape[0], num_prefix, 2), coords], dim=1).float()


def moved_coords(plan: Plan, coords: torch.Tensor, size: Optional[torch.Tensor], num_prefix: int, merge: str
                 ) -> torch.Tensor:
    """coords (B, n, 2) of the non-prefix tokens, size (B, N, 1) or None before the plan -> (B, n', 2) after it:
    under 'dst' each output at its destination's position where the plan has destinations (Plan.at_destinations),
    else (and under 'centroid') at the size-weighted centroid of what it holds."""
    moved = plan.at_destinations(coords) if merge == "dst" else None
    if moved is None:
        moved = plan.apply(with_prefix_rows(coords, num_prefix), size, None)[0][:, num_prefix:]
    return moved


@dataclass
class TokenPositions:
    """Where a forward's patch tokens sit. coords: (B, n, 2) float32 in the rope module's units, one row per
    non-prefix token; table: timm's own rope tensor while nothing is reduced (used as it is, so an unreduced model
    is timm's bit for bit), else None; merge: 'dst' or 'centroid'."""

    rope: nn.Module
    coords: torch.Tensor
    table: Optional[torch.Tensor]
    merge: str
    _rows: List[torch.Tensor] = field(default_factory=list)  # the rows of a rope without per-block frequencies

    def rows(self, block: int) -> torch.Tensor:
        """The rope rows block `block` rotates q and k with."""
        mixed = isinstance(self.rope, RotaryEmbeddingMixed)
        if self.table is not None:
            return self.table[block] if mixed else self.table
        if mixed:  # each block its own frequencies: nothing to share (and no lookup by block for a trace to guard)
            return rope_rows(self.rope, self.coords, block, self.rope.freqs.dtype)
        if not self._rows:  # every block the same rows: made once
            self._rows.append(rope_rows(self.rope, self.coords, block, self._dtype))
        return self._rows[0]

    @property
    def _dtype(self) -> torch.dtype:
        cached = getattr(self.rope, "pos_embed", None)
        if cached is None:
            cached = getattr(self.rope, "pos_embed_cached", None)
        return torch.float32 if cached is None else cached.dtype

    def reduced(self, plan: Plan, size: Optional[torch.Tensor], num_prefix: int) -> "TokenPositions":
        """The positions after `plan` (size: (B, N, 1) the tokens' sizes before it, or None). Under 'dst' every
        output of a plan with destinations (plan.at_destinations: a merge's destination, DiffRate's keeper, LTMP's
        group lead, a kept token) keeps its destination's position; under 'centroid', and for an output that has no
        destination (a cluster, a soft mix, a resampled token, EViT's fused token), it sits at the size- (or
        attention-) weighted centroid of what it holds. A training step that moves no token (keeps_positions:
        DynamicViT's masks) leaves the positions as they are; one that keeps the tokens in place and mixes them softly
        is refused: its positions are not defined."""
        if plan.keeps_positions:
            return self
        if not plan.defines_positions:
            raise NotImplementedError(
                "this method's training step keeps every token in place with soft sizes, which defines no rotary "
                "position for a merged token: train it on a model without rotary embeddings; its eval model "
                "(model.eval()) runs here")
        coords = moved_coords(plan, self.coords, size, num_prefix, self.merge)
        return TokenPositions(self.rope, coords, None, self.merge)

    def moved(self, coords: torch.Tensor) -> "TokenPositions":
        """These positions after a fused reduction step that moved their coords (B, n', 2) itself."""
        return TokenPositions(self.rope, coords, None, self.merge)

    def as_carried(self) -> "TokenPositions":
        """These positions as compiled blocks hand them on: the coords contiguous (B, n, 2) (not one grid expanded
        over the batch, nor a view of a plan's wider output) and every block's rope rows computed from them, timm's
        table aside, so that the first block runs the later blocks' graph."""
        if self.table is None and self.coords.is_contiguous():
            return self
        return TokenPositions(self.rope, self.coords.contiguous(), None, self.merge)

    def prefix_only(self) -> "TokenPositions":
        return TokenPositions(self.rope, self.coords[:, :0], None, self.merge)

    def settled(self) -> "TokenPositions":
        """These positions without the rope rows computed for the blocks: what a forward's stats keep after it (the
        rows, (B, heads, n, 2 * head_dim) a block for 'mixed', would stay on the device until the next forward)."""
        return TokenPositions(self.rope, self.coords, self.table, self.merge)
