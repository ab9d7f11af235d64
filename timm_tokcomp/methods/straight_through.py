"""Straight-through estimators the learned methods share: a value in the forward pass, another's gradient in the
backward pass."""
import torch


def hard_through(hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """hard's values (a 0 / 1 decision) with soft's gradient."""
    return hard.to(soft.dtype) + soft - soft.detach()


def ceil_through(value: torch.Tensor) -> torch.Tensor:
    """ceil(value) in the forward pass (a 1e-4 slack against rounding), the identity's gradient in the backward."""
    return value + (torch.ceil(value.detach() - 1e-4) - value.detach())


def clamp_through(value: torch.Tensor, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    """value clamped to [low, high] in the forward pass, the identity's gradient in the backward."""
    return value + (value.detach().clamp(low, high) - value.detach())
