"""Proportional attention (softmax(q k^T * scale + log(size of each key))) in four implementations that give the
same result, so that the fastest one for a device can be chosen (`tokcomp tune`):

- 'mask': the log-size bias as SDPA's float mask, (B, 1, 1, N). Exact, but a float mask keeps SDPA off its flash /
  cuDNN kernels on a GPU.
- 'fold': the bias folded into extra head dimensions, q' = [q * scale, 1, 0...], k' = [k, log s, 0...], v padded,
  the head dimension padded to a multiple of 8, and SDPA called with scale=1 and no mask (q' . k' = q . k * scale +
  log s), so it keeps its fused kernels.
- 'fold_qkv': the same, in one copy: the qkv projection's output (the module called as timm calls it) padded once
  per head, q' = [q, 1, 0...], k' = [k, log s / scale, 0...], and SDPA called with the attention's own scale; no
  concatenation copies q and k apart, and nothing is cached. Needs an attention without q / k norm.
- 'flex': FlexAttention with a score_mod adding log s; fast only under torch.compile on a GPU (one fused kernel).
  Where it cannot run the float mask serves: with dropout, for a backward on the CPU, and compiled on the CPU
  (Inductor's CPU FlexAttention cannot read the bias tensor).

'auto' resolves per device class and dtype from the measured table (timm_tokcomp.measure.device_table), 'mask' where it
has no entry; the table may name another choice for compiled blocks of models without rope. The pure tensor math
lives here, and `attend` dispatches the implementation for every model family."""
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

PROP_ATTN_IMPLS = ("mask", "fold", "fold_qkv", "flex")


def check_prop_attn(value: Any) -> Any:
    """value, if None, True, False, 'auto' or one of PROP_ATTN_IMPLS; else ValueError naming them."""
    if value is None or isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return value
    if not isinstance(value, str) or value not in PROP_ATTN_IMPLS:
        raise ValueError(f"prop_attn must be True, False, None (the method's default) or one of 'auto', "
                         f"{', '.join(repr(v) for v in PROP_ATTN_IMPLS)} (an implementation of it), got {value!r}")
    return value


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


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: int, dropout_p: float, scale: float = 1.0
                     ) -> torch.Tensor:
    """SDPA of folded q', k', v' (B, H, N, d') with `scale` (1 after fold_qk, attn.scale after folded_qkv) ->
    (B, H, N, d): the padding columns dropped."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)[..., :d]


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_size: torch.Tensor, scale: float
                   ) -> torch.Tensor:
    """q, k, v: (B, H, N, d), log_size: (B, 1, 1, N) -> (B, H, N, d) through FlexAttention, log s added by score_mod."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    bias = log_size.reshape(log_size.shape[0], -1).to(q.dtype)

    def add_log_size(score, b, h, q_idx, kv_idx):
        return score + bias[b, kv_idx]

    return flex(q, k, v, score_mod=add_log_size, scale=scale)


def folded_qkv(attn: nn.Module, x: torch.Tensor, log_size: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: (B, N, C), log_size: (B, 1, 1, N) -> q', k', v': (B, H, N, padded_head_dim(d)) views of one padded copy of
    attn.qkv(x), q' = [q, 1, 0...], k' = [k, log s / scale, 0...], v' = [v, 0...], so that SDPA with attn.scale gives
    q . k * scale + log s. The projection is the module itself, called as timm calls it: its hooks, an unmerged
    adapter, a quantised Linear and weights changed in any way are what runs."""
    B, N, _ = x.shape
    H, d = attn.num_heads, attn.head_dim
    qkv = F.pad(attn.qkv(x).reshape(B, N, 3, H, d), (0, padded_head_dim(d) - d))  # (B, N, 3, H, d'), zeros padded
    qkv[:, :, 0, :, d].fill_(1.0)  # fill_, not item assignment: no tensor from Python data, no host wait
    qkv[:, :, 1, :, d].copy_(log_size.reshape(B, N, 1).mul(1.0 / attn.scale))
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def check_fold_qkv(attn: nn.Module, where: str) -> None:
    """Raise ValueError if 'fold_qkv' cannot serve this attention (q / k norm act on the unpadded heads)."""
    norms = [f"{name} {type(norm).__name__}" for name, norm in (("q_norm", attn.q_norm), ("k_norm", attn.k_norm))
             if not isinstance(norm, nn.Identity)]
    if norms:
        raise ValueError(f"prop_attn='fold_qkv' needs attention without q / k norm ({where} has "
                         f"{', '.join(norms)}); use prop_attn='fold'")


def _flex_runs(q: torch.Tensor, dropout_p: float) -> bool:
    """FlexAttention has no dropout, and on the CPU no backward and no compiled form that reads a captured tensor:
    the float mask serves there."""
    if q.is_cuda:
        return dropout_p == 0
    return dropout_p == 0 and not (torch.is_grad_enabled() and q.requires_grad) and not torch.compiler.is_compiling()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor], impl: str, scale: float,
           dropout: nn.Module, fused: bool) -> torch.Tensor:
    """Attention of q, k, v: (B, H, N, d) with an additive log-size bias (B, 1, 1, N) or None -> (B, H, N, d).
    impl: 'mask', 'fold' or 'flex' (PROP_ATTN_IMPLS; 'fold_qkv' is dispatched before q, k, v exist); fused: SDPA
    (else the explicit softmax with `dropout` on the weights, as timm's non-fused path); dropout: the attention's
    dropout module (its p applies while it trains)."""
    if not fused:
        attn = (q * scale) @ k.transpose(-2, -1)
        if bias is not None:
            attn = attn + bias
        return dropout(attn.softmax(dim=-1)) @ v
    dropout_p = dropout.p if dropout.training else 0.0
    if bias is None or impl == "mask" or (impl == "flex" and not _flex_runs(q, dropout_p)):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)
    if impl == "flex":
        return flex_attention(q, k, v, bias, scale)
    return padded_attention(*fold_qk(q, k, v, bias, scale), q.shape[-1], dropout_p)
