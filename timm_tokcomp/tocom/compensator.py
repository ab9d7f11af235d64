"""ToCom (Jie et al., ECCV 2024) compensator math and runtime switching, in pure torch.

A compensator holds plugins P_{i->i+1}, i = 0..S-1 (S = 16: ToMe r = 0..16). Plugin i is, in every
block, a rank-h LoRA on the query and on the value projection of timm's fused qkv (rows [0, attn_dim)
and [2 attn_dim, 3 attn_dim); the key rows are never touched, so the merge metric does not change).
Running a model trained at degree m at degree n uses
    W_q/v(n) = W_q/v + s * sign(n - m) * sum_{i in [min(m, n), max(m, n))} B_i A_i.

Switching rewrites the q / v rows from a pristine copy of the source weights (never by adding and
subtracting), in fp32, so any sequence of switches returns bit-identical weights for the same n.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..core import apply, get_reducer, is_reduced, remove, set_params
from ..models.timm_names import architecture_of
from ..utils.checks import check_real, is_int

QUERY, VALUE = 0, 1  # index of the projection in the plugin tensors


@dataclass(repr=False)
class Compensator:
    """lora_a: (S, L, 2, h, D) and lora_b: (S, L, 2, attn_dim, h) for [query, value] of every block;
    scale: s; base_model: the timm architecture it was trained for ('' when unknown)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float = 0.1
    base_model: str = ""

    def __post_init__(self) -> None:
        a, b = self.lora_a, self.lora_b
        if a.dim() != 5 or b.dim() != 5 or a.shape[:3] != b.shape[:3] or a.shape[2] != 2 or a.shape[3] != b.shape[4]:
            raise ValueError(f"lora_a must be (S, L, 2, h, D) and lora_b (S, L, 2, attn_dim, h) with matching S, L, h; "
                             f"got {tuple(a.shape)} and {tuple(b.shape)}")

    @classmethod
    def init(cls, steps: int, depth: int, dim: int, attn_dim: int, rank: int = 2, scale: float = 0.1,
             generator: Optional[torch.Generator] = None) -> "Compensator":
        """Fresh plugins for training: A as nn.Linear's default (Kaiming uniform), B zero."""
        bound = 1.0 / dim ** 0.5
        a = (torch.rand(steps, depth, 2, rank, dim, generator=generator) * 2 - 1) * bound
        return cls(a, torch.zeros(steps, depth, 2, attn_dim, rank), scale)

    def __repr__(self) -> str:
        """The shapes and settings, not the tensors: 'Compensator(steps=16, depth=12, rank=2, ...)'."""
        return (f"Compensator(steps={self.steps}, depth={self.depth}, rank={self.rank}, dim={self.dim}, "
                f"attn_dim={self.attn_dim}, scale={self.scale:g}, base_model={self.base_model!r}, "
                f"dtype={self.lora_a.dtype})")

    @property
    def steps(self) -> int:
        return self.lora_a.shape[0]

    @property
    def depth(self) -> int:
        return self.lora_a.shape[1]

    @property
    def rank(self) -> int:
        return self.lora_a.shape[3]

    @property
    def dim(self) -> int:
        return self.lora_a.shape[4]

    @property
    def attn_dim(self) -> int:
        return self.lora_b.shape[3]

    def check_degree(self, name: str, r: int) -> int:
        """r as a Python int in [0, steps] (any integer type, numpy's too)."""
        if not is_int(r) or not 0 <= r <= self.steps:
            raise ValueError(f"{name} must be an int in [0, {self.steps}] (the compensator has {self.steps} steps), got {r!r}")
        return int(r)

    def delta(self, source_r: int, target_r: int, scale: Optional[float] = None) -> torch.Tensor:
        """s * sign(n - m) * sum of B_i A_i between m = source_r and n = target_r, in fp32:
        (L, 2, attn_dim, D) for [query, value] of every block; zeros when n == m."""
        self.check_degree("source_r", source_r)
        self.check_degree("target_r", target_r)
        s = self.scale if scale is None else scale
        lo, hi = sorted((source_r, target_r))
        sign = 1.0 if target_r > source_r else -1.0
        a = self.lora_a[lo:hi].float()  # (k, L, 2, h, D)
        b = self.lora_b[lo:hi].float()  # (k, L, 2, attn_dim, h)
        # one GEMM per block and projection: concatenate the k steps along the rank
        b_cat = b.permute(1, 2, 3, 0, 4).reshape(self.depth, 2, self.attn_dim, -1)
        a_cat = a.permute(1, 2, 0, 3, 4).reshape(self.depth, 2, -1, self.dim)
        return (s * sign) * (b_cat @ a_cat)


def _qkv_layers(model: nn.Module) -> List[nn.Linear]:
    """Each block's fused qkv projection; ValueError for a model with split q / k / v projections."""
    for i, blk in enumerate(model.blocks):
        if not isinstance(getattr(blk.attn, "qkv", None), nn.Linear):
            raise ValueError(f"ToCom compensators sit on a fused qkv projection; blocks[{i}].attn "
                             f"({type(blk.attn).__name__}) has split q / k / v projections")
    return [blk.attn.qkv for blk in model.blocks]


def qv_rows(weight: torch.Tensor, attn_dim: int) -> List[slice]:
    """Row slices of the query and value projections in a fused (3 attn_dim, D) qkv weight."""
    if weight.shape[0] != 3 * attn_dim:
        raise ValueError(f"qkv weight has {weight.shape[0]} rows, expected 3 * attn_dim = {3 * attn_dim}")
    return [slice(0, attn_dim), slice(2 * attn_dim, 3 * attn_dim)]


@dataclass
class _Attached:
    compensator: Compensator
    source_r: int
    pristine: List[torch.Tensor]  # per block: (2, attn_dim, D) query / value rows of the source weights
    target_r: int
    scale: float
    method: Optional[Tuple[str, Dict[str, Any]]]  # the model's method and parameters at attach (None: none)
    # per block: (qkv weight, its _version, a fingerprint of its values); the fingerprint survives what identity and
    # version do not (torch.save / load, deepcopy)
    written: List[Tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=list)

    def record(self, layers: List[nn.Linear]) -> None:
        """Remember the weights as this compensator left them."""
        self.written = [(qkv.weight, qkv.weight._version, _fingerprint(qkv.weight)) for qkv in layers]

    def check_unchanged(self, layers: List[nn.Linear], action: str) -> None:
        """Raise ValueError when a qkv weight's values changed since the compensator last set it (load_state_dict,
        training): restoring the pristine rows would silently discard those weights."""
        for i, (qkv, (weight, version, *values)) in enumerate(zip(layers, self.written)):
            same_tensor = qkv.weight is weight and qkv.weight._version == version
            if not same_tensor and not (values and torch.equal(_fingerprint(qkv.weight), values[0].to(qkv.weight.device))):
                raise ValueError(
                    f"blocks[{i}].attn.qkv.weight changed since the compensator set it (load_state_dict or training?); "
                    f"{action} would restore the query / value rows saved at attach and discard that change. Call "
                    "detach(model, restore=False) to keep the current weights and drop the compensator, then attach again")


def _fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """(3,) float64 sums of the values (plain, absolute, and weighted by position) that any edit changes."""
    flat = weight.detach().double().flatten()
    ramp = torch.linspace(-1.0, 1.0, flat.numel(), dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(), flat.abs().sum(), (flat * ramp).sum()])


MAX_SCALE = 1000.0  # |s|: trained scales are about 0.1; far above this the compensated weights overflow a forward


def check_scale(scale: Any) -> float:
    """The scale s as a float; ValueError unless it is a finite number with |s| <= MAX_SCALE."""
    return check_real("scale", scale, -MAX_SCALE, strict=False, high=MAX_SCALE,
                      note="(trained scales are about 0.1)")


def check_fits(model: nn.Module, compensator: Compensator) -> None:
    """Raise ValueError naming what differs when the plugins do not fit the model's blocks."""
    layers = _qkv_layers(model)
    if len(layers) != compensator.depth:
        raise ValueError(f"compensator depth {compensator.depth} does not match the model's {len(layers)} blocks")
    qkv = layers[0]
    if qkv.in_features != compensator.dim or qkv.out_features != 3 * compensator.attn_dim:
        raise ValueError(f"compensator width {compensator.dim} (attn_dim {compensator.attn_dim}) does not match the "
                         f"model's qkv ({qkv.in_features} -> {qkv.out_features})")


@torch.no_grad()
def attach(model: nn.Module, compensator: Compensator, source_r: int = 0, scale: Optional[float] = None) -> nn.Module:
    """Give a model trained at ToMe degree source_r the compensator; it keeps a pristine copy of its
    query / value rows. Weights are unchanged until set_compression. Re-attaching restores first."""
    check_fits(model, compensator)
    source_r = compensator.check_degree("source_r", source_r)
    scale = compensator.scale if scale is None else check_scale(scale)
    architecture = getattr(model, "pretrained_cfg", {}).get("architecture")
    if compensator.base_model and architecture and \
            architecture_of(compensator.base_model) != architecture_of(architecture):  # names timm resolves alike
        raise ValueError(f"this compensator was trained for {compensator.base_model!r}; its plugins fit those weights "
                         f"only, not this {architecture!r}: train one for it (tokcomp train-tocom {architecture})")
    if getattr(model, "_tocom", None) is not None:
        detach(model)
    pristine = []
    for qkv in _qkv_layers(model):
        rows = qv_rows(qkv.weight, compensator.attn_dim)
        pristine.append(torch.stack([qkv.weight[s].detach().clone() for s in rows]))
    method = (get_reducer(model).name, get_reducer(model).params) if is_reduced(model) else None
    model._tocom = _Attached(compensator, source_r, pristine, source_r, scale, method)
    model._tocom.record(_qkv_layers(model))
    return model


def _attached(model: nn.Module) -> _Attached:
    state = getattr(model, "_tocom", None)
    if state is None:
        raise ValueError("model has no compensator; call timm_tokcomp.tocom.attach(model, compensator) first")
    return state


@torch.no_grad()
def compensate(model: nn.Module, target_r: int, scale: Optional[float] = None) -> None:
    """Rewrite the query / value rows for running at degree target_r: pristine + delta(source_r, target_r),
    computed in fp32 and cast once to the weight's dtype."""
    state = _attached(model)
    scale = state.scale if scale is None else check_scale(scale)
    layers = _qkv_layers(model)
    state.check_unchanged(layers, "switching")
    delta = state.compensator.delta(state.source_r, target_r, scale)
    for qkv, pristine, d in zip(layers, state.pristine, delta):
        pristine, d = pristine.to(qkv.weight.device), d.to(qkv.weight.device)
        for j, rows in enumerate(qv_rows(qkv.weight, state.compensator.attn_dim)):
            qkv.weight[rows] = pristine[j] if target_r == state.source_r else (pristine[j].float() + d[j]).to(qkv.weight.dtype)
    state.scale, state.target_r = scale, target_r
    state.record(layers)


def set_compression(model: nn.Module, r: int, scale: Optional[float] = None) -> nn.Module:
    """Run the model at ToMe / EViT degree r with the compensator for (source_r -> r): sets the
    method's r (timm_tokcomp.set_params; a model without a method gets ToMe) and rewrites the query /
    value rows. Reversible and exact."""
    state = _attached(model)
    r = state.compensator.check_degree("r", r)
    if scale is not None:
        check_scale(scale)
    state.check_unchanged(_qkv_layers(model), "switching")  # everything checked before the method's r changes
    if is_reduced(model):
        reducer = get_reducer(model)
        if "r" not in reducer.param_names():
            raise ValueError(f"set_compression sets an integer degree r; this model runs {reducer.name!r}, which has "
                             f"none (use tome, evit or dense_tome, or timm_tokcomp.apply(model, 'tome', r=...))")
        set_params(model, r=r)
    else:
        apply(model, "tome", r=r)
    compensate(model, r, scale)
    return model


@torch.no_grad()
def detach(model: nn.Module, restore: bool = True) -> nn.Module:
    """Drop the compensator. restore=True: the model as it was at attach, its source weights and its method (or
    none, where set_compression applied ToMe); refused with ValueError when the weights were changed since the
    compensator set them. restore=False: the current weights and method stay."""
    state = _attached(model)
    if restore:
        layers = _qkv_layers(model)
        state.check_unchanged(layers, "detach")
        for qkv, pristine in zip(layers, state.pristine):
            for j, rows in enumerate(qv_rows(qkv.weight, state.compensator.attn_dim)):
                qkv.weight[rows] = pristine[j].to(qkv.weight.device)
        if state.method is not None:
            apply(model, state.method[0], **state.method[1])
        elif is_reduced(model):
            remove(model)
    del model._tocom
    return model
