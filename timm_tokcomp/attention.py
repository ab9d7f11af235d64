"""Proportional attention (softmax(q k^T * scale + log(size of each key))) in four implementations that give the
same result, so that the fastest one for a device can be chosen (`tokcomp tune`):

- 'mask': the log-size bias as SDPA's float mask, (B, 1, 1, N). Exact, but a float mask keeps SDPA off its flash /
  cuDNN kernels on a GPU.
- 'fold': the bias folded into extra head dimensions, q' = [q * scale, 1, 0...], k' = [k, log s, 0...], v padded,
  the head dimension padded to a multiple of 8, and SDPA called with scale=1 and no mask (q' . k' = q . k * scale +
  log s), so it keeps its fused kernels.
- 'fold_qkv': the same, with the qkv projection's output laid out padded at the source (a padded copy of its
  weights, q rows pre-scaled, a 1 in the q bias): only log s is written into the projection's output, no
  concatenation copies q, k and v. Needs an attention without q / k norm.
- 'flex': FlexAttention with a score_mod adding log s (torch >= 2.5); fast only under torch.compile.

'auto' resolves per device class and dtype from the measured table (timm_tokcomp.device_table), 'mask' where it
has no entry. The pure tensor math lives here; patch.ReducingAttention calls it."""
import weakref
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

PROP_ATTN_IMPLS = ("mask", "fold", "fold_qkv", "flex")


def flex_available() -> bool:
    """Whether the installed torch has FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def check_prop_attn(value) -> None:
    """Raise ValueError unless value is None, True, False, 'auto' or one of PROP_ATTN_IMPLS ('flex' only where the
    installed torch has FlexAttention)."""
    if value is None or isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return
    if not isinstance(value, str) or value not in PROP_ATTN_IMPLS:
        raise ValueError(f"prop_attn must be True, False, None (the method's default) or one of 'auto', "
                         f"{', '.join(repr(v) for v in PROP_ATTN_IMPLS)} (an implementation of it), got {value!r}")
    if value == "flex" and not flex_available():
        raise ValueError(f"prop_attn='flex' needs FlexAttention (torch >= 2.5); this torch is {torch.__version__}")


def padded_head_dim(d: int) -> int:
    """The smallest multiple of 8 above d: room for the log-size dimension, aligned for the fused kernels."""
    return (d // 8 + 1) * 8


def fold_qk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_size: torch.Tensor, scale: float
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v: (B, H, N, d), log_size: (B, 1, 1, N) -> q', k', v': (B, H, N, padded_head_dim(d)) with
    q' . k' = q . k * scale + log_size (call SDPA with scale=1, no mask)."""
    B, H, N, d = q.shape
    pad = padded_head_dim(d) - d
    ones = q.new_ones(B, H, N, 1)
    zeros = q.new_zeros(B, H, N, pad - 1)
    log_k = log_size.to(k.dtype).reshape(B, 1, N, 1).expand(B, H, N, 1)
    return (torch.cat([q * scale, ones, zeros], dim=-1), torch.cat([k, log_k, zeros], dim=-1),
            F.pad(v, (0, pad)))


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: int, dropout_p: float) -> torch.Tensor:
    """SDPA of folded q', k', v' (B, H, N, d') with scale 1 -> (B, H, N, d): the padding columns dropped."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=1.0)[..., :d]


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_size: torch.Tensor, scale: float
                   ) -> torch.Tensor:
    """q, k, v: (B, H, N, d), log_size: (B, 1, 1, N) -> (B, H, N, d) through FlexAttention, log s added by score_mod."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    bias = log_size.reshape(log_size.shape[0], -1).to(q.dtype)

    def add_log_size(score, b, h, q_idx, kv_idx):
        return score + bias[b, kv_idx]

    return flex(q, k, v, score_mod=add_log_size, scale=scale)


# attention module -> (key, padded weight, padded bias): outside the module, so state_dict, deepcopy and pickling
# never meet it; the key holds the weights' versions, so weights changed in place are read again
_PADDED_QKV: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def padded_qkv_params(attn: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """The qkv projection of timm Attention `attn` laid out per head as [q * scale, 1, 0...], [k, 0, 0...],
    [v, 0...] with head dimension padded_head_dim(d): weight (3 H d', C), bias (3 H d'). Built with autograd
    when a gradient is needed (gradients reach qkv's own weights), cached otherwise."""
    weight, bias = attn.qkv.weight, attn.qkv.bias
    grad = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    key = (weight._version, weight.data_ptr(), weight.dtype, weight.device,
           None if bias is None else (bias._version, bias.data_ptr()))
    cached = None if grad else _PADDED_QKV.get(attn)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    H, d = attn.num_heads, attn.head_dim
    dp = padded_head_dim(d)
    C = weight.shape[1]
    w = weight.reshape(3, H, d, C)
    b = (bias if bias is not None else weight.new_zeros(3 * H * d)).reshape(3, H, d)
    w = torch.cat([w[:1] * attn.scale, w[1:]])  # no tensor from Python data: no host wait on a first call
    b = torch.cat([b[:1] * attn.scale, b[1:]])
    w_padded = torch.cat([w, weight.new_zeros(3, H, dp - d, C)], dim=2).reshape(3 * H * dp, C)
    extra = weight.new_zeros(3, H, dp - d)
    extra[0, :, 0] = 1.0  # q's extra dimension is 1, so q' . k' picks up k's log size
    b_padded = torch.cat([b, extra], dim=2).reshape(3 * H * dp)
    if not grad:
        _PADDED_QKV[attn] = (key, w_padded, b_padded)
    return w_padded, b_padded


def folded_qkv(attn: nn.Module, x: torch.Tensor, log_size: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: (B, N, C), log_size: (B, 1, 1, N) -> q', k', v': (B, H, N, d') views of one padded projection, log s
    written into k's extra dimension in place (scale already in q')."""
    B, N, _ = x.shape
    weight, bias = padded_qkv_params(attn)
    dp = padded_head_dim(attn.head_dim)
    qkv = F.linear(x, weight, bias).reshape(B, N, 3, attn.num_heads, dp)
    qkv[:, :, 1, :, attn.head_dim] = log_size.reshape(B, N, 1).to(qkv.dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def check_fold_qkv(attn: nn.Module, where: str) -> None:
    """Raise ValueError if 'fold_qkv' cannot serve this attention (q / k norm act on the unpadded heads)."""
    norms = [f"{name} {type(norm).__name__}" for name, norm in (("q_norm", attn.q_norm), ("k_norm", attn.k_norm))
             if not isinstance(norm, nn.Identity)]
    if norms:
        raise ValueError(f"prop_attn='fold_qkv' needs attention without q / k norm ({where} has "
                         f"{', '.join(norms)}); use prop_attn='fold'")

