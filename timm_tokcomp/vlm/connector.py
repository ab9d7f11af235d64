"""Reduction after a VLM's connector, shared by the families whose connector needs every token (Qwen2-VL's 2x2
merger, Gemma 3's average pool): `visionzip` over the connector's output tokens. A token's importance is the
attention its patches receive at one tower block; the dominant tokens stay, the rest merge into contextual ones, and
the kept tokens stay in raster order. ConnectorAdapter holds what such an adapter does the same way (the reducer in
the inner model's state, the class swap); a family gives its classes and counts."""
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Sequence, Tuple

import torch
from torch import nn

from ..methods import make_reducer
from ..methods.visionzip import dominant_contextual_plan
from ..runtime.state import drop_state, state_of

PARAMS = ("dominant", "contextual", "block")  # visionzip's parameters that mean something after the connector
PROBS_PER_CHUNK = 1 << 25  # attention probabilities held at once while the importance is counted (128 MiB float32)


def received(q: torch.Tensor, k: torch.Tensor, scale: float, bounds: Sequence[int]) -> torch.Tensor:
    """q, k (N, H, d) of one attention (positions applied), bounds: the segments [bounds[i], bounds[i + 1]) that
    attend within themselves -> (N,) float32, the attention each token receives (softmax within its segment, mean
    over the segment's queries and the heads). Queries go in chunks: at most PROBS_PER_CHUNK probabilities held."""
    N, H = q.shape[:2]
    out = torch.zeros(N, dtype=torch.float32, device=q.device)
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks = q[start:end].transpose(0, 1).float(), k[start:end].transpose(0, 1).float()  # (H, n, d)
        n = end - start
        chunk = max(1, PROBS_PER_CHUNK // (H * n))
        for c in range(0, n, chunk):
            probs = ((qs[:, c:c + chunk] * scale) @ ks.transpose(1, 2)).softmax(dim=-1)  # (H, c, n)
            out[start:end] += probs.sum(dim=(0, 1))
        out[start:end] /= H * n
    return out


def tower_layers(tower: nn.Module) -> nn.ModuleList:
    """A CLIP or SigLIP tower's encoder layers (transformers 5 keeps SigLIP's on the model; others under
    vision_model)."""
    return getattr(tower, "vision_model", tower).encoder.layers


@contextmanager
def block_input(attn: nn.Module) -> Iterator[Dict[str, torch.Tensor]]:
    """While open, seen["x"] is the input (B, N, C) of attn's latest forward (the normed hidden states)."""
    seen: Dict[str, torch.Tensor] = {}

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["x"] = args[0] if args else kwargs["hidden_states"]

    handle = attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def queries_keys(attn: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x (B, N, C) into a CLIP / SigLIP attention (q_proj, k_proj) -> q, k (B, N, H, d)."""
    B, N, _ = x.shape
    return (attn.q_proj(x).view(B, N, attn.num_heads, attn.head_dim),
            attn.k_proj(x).view(B, N, attn.num_heads, attn.head_dim))


def select(features: torch.Tensor, importance: torch.Tensor, keys: torch.Tensor, dominant: int,
           contextual: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """One image's connector output features (G, D), importance (G,) and keys (G, d) -> (the features the language
    model reads (K, D), kept (K,): the token (raster index) each stands at), K = min(G, dominant + contextual). An
    image of at most dominant + contextual tokens keeps them all, unchanged."""
    G = features.shape[0]
    if G <= dominant + contextual:
        return features, torch.arange(G, device=features.device)
    with torch.no_grad():
        plan = dominant_contextual_plan(importance[None], keys[None], dominant, contextual, 0)
    at = plan.keep_idx[0, :plan.num_keepers]
    order = at.argsort()
    return plan.apply(features[None], None, None)[0][0][order], at[order]


class ConnectorAdapter:
    """What vlm reads and changes of a family reduced after its connector: the visionzip reducer (in the inner
    model's state) and the classes. CLASSES: plain class -> (its reducing class, the plain inner model's class, its
    reducing class); CONNECTOR: what needs every token, in words. A family adds tower_depth, plain_tokens,
    example_inputs and default_image_size."""

    CLASSES: Dict[type, Tuple[type, type, type]] = {}
    CONNECTOR = ""

    @classmethod
    def plain_of(cls, model: nn.Module) -> type:
        return next((plain for plain, (reducing, _, _) in cls.CLASSES.items() if type(model) is reducing),
                    type(model))

    @classmethod
    def serves(cls, model: nn.Module) -> bool:
        """The plain classes or their reducing ones, not a subclass (remove restores the plain class)."""
        return cls.plain_of(model) in cls.CLASSES

    @classmethod
    def is_reduced(cls, model: nn.Module) -> bool:
        return cls.plain_of(model) is not type(model)

    @staticmethod
    def check(model: nn.Module) -> None:
        """Nothing to check of the config: every model of the family reduces after its connector."""

    @classmethod
    def apply(cls, model: nn.Module, method: str, params: Dict[str, Any]) -> None:
        if method != "visionzip":
            raise ValueError(f"method {method!r} on {type(model).__name__}: its connector needs every token of its "
                             f"tower ({cls.CONNECTOR}), so it reduces after the connector with "
                             f"'visionzip' ({', '.join(PARAMS)}) only")
        others = sorted(set(params) - set(PARAMS))
        if others:
            raise ValueError(f"parameters {others}: visionzip after {type(model).__name__}'s connector takes "
                             f"{', '.join(PARAMS)}")
        zip_ = make_reducer("visionzip", **params)
        zip_.check_depth(cls.tower_depth(model))
        cls.swap(model, zip_)

    @classmethod
    def set_params(cls, model: nn.Module, params: Dict[str, Any]) -> None:
        zip_ = state_of(model.model).reducer
        cls.apply(model, "visionzip", {**{name: getattr(zip_, name) for name in PARAMS}, **params})

    @classmethod
    def remove(cls, model: nn.Module) -> None:
        cls.restore(model)

    @classmethod
    def swap(cls, model: nn.Module, zip_: Any) -> None:
        reducing, _, reducing_inner = cls.CLASSES[cls.plain_of(model)]
        model.__class__, model.model.__class__ = reducing, reducing_inner
        state_of(model.model, create=True).reducer = zip_

    @classmethod
    def restore(cls, model: nn.Module) -> None:
        plain = cls.plain_of(model)
        model.__class__, model.model.__class__ = plain, cls.CLASSES[plain][1]
        drop_state(model.model)

    @classmethod
    def tokens_for(cls, model: nn.Module, image_size: Tuple[int, int]) -> int:
        zip_ = state_of(model.model).reducer
        return min(cls.plain_tokens(model, image_size), zip_.dominant + zip_.contextual)


class SavesPlain:
    """Mixed into a reducing ForConditionalGeneration class: save_pretrained names the plain classes, so the
    folder loads as the plain model. `adapter`: the family's ConnectorAdapter."""

    adapter: type = ConnectorAdapter

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        zip_ = state_of(self.model).reducer
        adapter = self.adapter
        adapter.restore(self)
        try:
            return self.save_pretrained(*args, **kwargs)
        finally:
            adapter.swap(self, zip_)


__all__ = ["ConnectorAdapter", "PARAMS", "SavesPlain", "block_input", "queries_keys", "received", "select",
           "tower_layers"]
