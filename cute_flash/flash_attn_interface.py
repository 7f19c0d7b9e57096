"""`flash_attn.flash_attn_interface` (v2.8.3) by another name: code that imports flash-attn's
public functions, or the private forwards that ring-attention and sequence-parallel wrappers
build on, works by changing that one import.

`_flash_attn_forward` and `_flash_attn_varlen_forward` keep flash-attn 2.8.3's argument names,
order and defaults and return `(out, softmax_lse, S_dmask, rng_state)`; `_flash_attn_backward`
and `_flash_attn_varlen_backward` likewise write the gradients into the given dq, dk, dv and
return `softmax_d` (D = rowsum(dO * O), fp32, shaped like softmax_lse, where flash-attn's rounds
seqlen_q up to 128; on `meta` tensors only its shape, nothing written). In the forwards,
`rng_state` is the call's dropout state, (seed, offset) int64 on the device (two zeros without
dropout: nothing drawn), and `S_dmask` with `return_softmax` and dropout flash-attn's
representation of the probabilities, dropped entries negated (`cute_flash.dropout`, decoded
with `_get_block_size_n`; empty without dropout). A backward with `dropout_p > 0` needs the
forward's `rng_state` to regenerate its mask. Like flash-attn's, they have no autograd (their
callers wrap them in their own `torch.autograd.Function`), so they do not refuse inputs that
require grad; the output is not differentiable. Unlike flash-attn's they take any head dim up
to 256 and any strides with a unit last dim (no caller padding needed).
`_flash_attn_varlen_forward` also takes the newest flash-attn's `num_splits` (0 or 1: this
forward picks its own schedule; above 1 refused over a paged cache, as flash-attn refuses it)
and `leftpad_k` (batch,) int32: sequence b's keys start `leftpad_k[b]` rows after
`cu_seqlens_k[b]`, and that many fewer are used (not with a block table, as in flash-attn).
`zero_tensors` is accepted and has no effect, since every output row is written.
"""
from typing import Optional, Tuple

import torch

from cute_flash import _validate, interface
from cute_flash.dropout import s_dmask_block_n
from cute_flash.launch.rng import DropoutArgs
from cute_flash.interface import *  # noqa: F401,F403 (the public functions)
from cute_flash.interface import _flash_attn, _flash_attn_varlen, _kernels, _mask

__all__ = interface.__all__ + ["_flash_attn_forward", "_flash_attn_varlen_forward", "_flash_attn_backward",
                               "_flash_attn_varlen_backward", "_get_block_size_n"]


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-block width of S_dmask's representation (`cute_flash.dropout`), what flash-attn's
    test helpers split its rows by; the same for any mask and dropout."""
    return s_dmask_block_n(device, head_dim)


def _rng_state(q, dropout):
    """flash-attn's (seed, offset) of the call's dropout; zeros when nothing was drawn."""
    return torch.zeros((2,), dtype=torch.int64, device=q.device) if dropout is None else dropout.rng_state


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (batch, seqlen_q, nheads, d), k, v (batch, seqlen_k, nheads_k, d) ->
    (out, softmax_lse (batch, nheads, seqlen_q), S_dmask, rng_state)."""
    out, lse, probs, dropout = _flash_attn(q, k, v, ("q", "k", "v"), dropout_p, softmax_scale, causal,
                                           (window_size_left, window_size_right), softcap, alibi_slopes,
                                           return_probs=return_softmax)
    return out, lse, probs, _rng_state(q, dropout)


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
    num_splits: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (total_q, nheads, d), k, v (total_k, nheads_k, d) or pages with block_table ->
    (out, softmax_lse (nheads, total_q), S_dmask, rng_state)."""
    _validate.check_varlen_num_splits(num_splits, block_table is not None)
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    out, lse, probs, dropout = _flash_attn_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, names, dropout_p, softmax_scale, causal,
        (window_size_left, window_size_right), softcap, alibi_slopes, block_table, seqused_k,
        return_probs=return_softmax, leftpad_k=leftpad_k)
    return out, lse, probs, _rng_state(q, dropout)


def _check_backward(dropout_p, rng_state, tensors):
    """The backward's checks; returns its DropoutArgs (None without dropout)."""
    p = _validate.check_dropout(dropout_p)
    if p > 0 and rng_state is None:
        raise ValueError("dropout_p > 0 needs the forward's rng_state to regenerate its dropout mask")
    _validate.check_cuda(tensors + ([("rng_state", rng_state)] if p > 0 else []))
    return DropoutArgs(p, rng_state) if p > 0 else None


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gradients of `_flash_attn_forward` written into dq, dk, dv (allocated when None);
    returns softmax_d (batch, nheads, seqlen_q)."""
    dropout = _check_backward(dropout_p, rng_state, [("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out),
                                                     ("softmax_lse", softmax_lse)])
    if q.is_meta:
        return softmax_lse.new_empty(softmax_lse.shape)
    causal, window = _mask(causal, (window_size_left, window_size_right), q.shape[1], k.shape[1])
    *_, softmax_d = _kernels().flash_bwd(dout, q, k, v, out, softmax_lse, softmax_scale=softmax_scale,
                                         causal=causal, window_size=window, softcap=float(softcap),
                                         alibi_slopes=alibi_slopes, deterministic=bool(deterministic),
                                         dropout=dropout, dq=dq, dk=dk, dv=dv)
    return softmax_d


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    """Gradients of `_flash_attn_varlen_forward` (unpaged) written into dq, dk, dv; returns
    softmax_d (nheads, total_q). `zero_tensors` has no effect: every gradient row is written."""
    dropout = _check_backward(dropout_p, rng_state, [
        ("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("softmax_lse", softmax_lse),
        ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)])
    if q.is_meta:
        return softmax_lse.new_empty(softmax_lse.shape)
    causal, window = _mask(causal, (window_size_left, window_size_right), max_seqlen_q, max_seqlen_k)
    *_, softmax_d = _kernels().flash_bwd_varlen(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=window, softcap=float(softcap), alibi_slopes=alibi_slopes, deterministic=bool(deterministic),
        dropout=dropout, dq=dq, dk=dk, dv=dv)
    return softmax_d
