"""Public API: a drop-in for `flash_attn.flash_attn_interface` (v2.8.3).

Each function validates its arguments (`cute_flash._validate`, the CUDA check last), answers
empty problems without a launch, normalises the mask options as flash-attn's `mha_fwd` does,
and hands the tensors, never copied (packed inputs become views), to `cute_flash.launch`.
With grad mode on and an input requiring grad, the six attention functions are differentiable
(`cute_flash.autograd`; packed inputs get one packed gradient); `deterministic=True` makes
their backward bitwise repeatable. `flash_attn_with_kvcache` and paged varlen calls have no
backward (as in flash-attn): they run with inputs that require grad, and asking for that
gradient raises at backward(), naming the call and the inputs. `dropout_p > 0` drops
attention probabilities with a mask drawn from torch's CUDA generator (`launch/rng.py`); the
backward regenerates it. On `meta` tensors every function returns `meta` outputs of the
shapes and dtypes a CUDA call would (shape inference, FLOP counters, models built on the meta
device), launching nothing. `return_attn_probs=True` returns `(out, softmax_lse, S_dmask)`:
with dropout flash-attn's representation of the probabilities, dropped entries negated
(`cute_flash.dropout`), without it an empty tensor, as flash-attn's. flash-attn's private forwards and backwards live in
`cute_flash.flash_attn_interface`.
"""

import importlib
import math
import sys
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from cute_flash import _validate, kvcache_varlen, sinks
from cute_flash.autograd import AttnOptions, FlashAttnFunction, Packing, Varlen, no_backward
from cute_flash.dropout import s_dmask, s_dmask_shape, s_dmask_varlen
from cute_flash.launch import block_sparse, value_dim
from cute_flash.launch.rng import DropoutArgs
from cute_flash import ops  # registers torch.ops.cute_flash.*, used while compiling

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]

WindowSize = Union[Sequence[int], Tensor]  # (left, right), each -1 for unbounded; items int-like

_Q_DIMS = ("batch", "seqlen_q", "nheads", "headdim")
_KV_DIMS = ("batch", "seqlen_k", "nheads_k", "headdim")
_VARLEN_Q_DIMS = ("total_q", "nheads", "headdim")
_VARLEN_KV_DIMS = ("total_k", "nheads_k", "headdim")
_PAGED_KV_DIMS = ("num_blocks", "page_size", "nheads_k", "headdim")


_KERNELS = "cute_flash.launch"


def _kernels():
    """`cute_flash.launch`, imported at the first launch so that this module imports
    without the CuTe DSL; importlib takes a module already in sys.modules as it stands."""
    return sys.modules.get(_KERNELS) or importlib.import_module(_KERNELS)


def _scale(softmax_scale, headdim):
    return headdim ** -0.5 if softmax_scale is None else float(softmax_scale)


def _mask(causal, window_size, seqlen_q, seqlen_k):
    """Mask options in one canonical form, as flash-attn's mha_fwd makes them: a window edge
    that excludes no key is unbounded (-1), causal with one query row masks nothing, and causal
    sets the window's right edge to 0, keeping its left edge. flash-attn drops a right edge
    >= seqlen_k; that excludes no key only if it is also >= seqlen_q - 1 (row 0 sees up to key
    seqlen_k - seqlen_q + right), so both are required and the window formula of docs/semantics.md holds for
    seqlen_q > seqlen_k + 1 too."""
    left, right = (int(w) for w in window_size)
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k and right >= seqlen_q - 1:
        right = -1
    causal = bool(causal) and seqlen_q != 1
    if causal:
        right = 0
    return causal, (left, right)


def _empty(q, lse_shape, d_v=None):
    """No query rows: nothing to compute (the output d_v wide, default q's head dim)."""
    out = q.new_empty((*q.shape[:-1], d_v or q.shape[-1]))
    return out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)


def _no_keys(q, lse_shape, d_v=None):
    """Rows that see no key: output 0 and LSE +inf, as the kernels write for a fully masked row."""
    lse = torch.full(lse_shape, math.inf, dtype=torch.float32, device=q.device)
    return q.new_zeros((*q.shape[:-1], d_v or q.shape[-1])), lse


def _check_qkv(q, k, v, names, q_dims, kv_dims, value_dim=False):
    """The inputs' checks; `value_dim`: v may have a head dim of its own (the public functions)."""
    named = list(zip(names, (q, k, v)))
    _validate.check_dtypes(named)
    _validate.check_shapes(q, k, v, names, q_dims, kv_dims)
    _validate.check_head_dim(named[:2] if value_dim else named)
    if value_dim:
        _validate.check_head_dim(named[2:])
    _validate.check_gqa(q, k, names[0], names[1])
    return named


def _check_options(dropout_p, window_size, softcap, softmax_scale):
    """The options' checks; returns dropout_p as a float and the window as a pair of Python ints."""
    dropout_p = _validate.check_dropout(dropout_p)
    window_size = _validate.check_window(window_size)
    _validate.check_softcap(softcap)
    _validate.check_softmax_scale(softmax_scale)
    return dropout_p, window_size


def _no_probs(q):
    """flash-attn's S_dmask when there is no dropout: an empty tensor of q's dtype."""
    return torch.empty((0,), dtype=q.dtype, device=q.device)


def _result(out, lse, probs, return_attn_probs):
    return (out, lse, probs) if return_attn_probs else out


def _s_dmask(q, p, return_probs, dropout, shape, build):
    """The S_dmask a call returns: empty unless asked for with dropout (flash-attn's value), zeros
    of `shape` (b, h, sq, sk) rounded up to 128 when nothing was drawn (no rows or keys), else
    `build(dropout)`, outside autograd: it has no gradient (flash-attn's has none), and under
    torch.compile a differentiable S_dmask joins the traced backward, where its masked blocks'
    zero cotangents met infinite local derivatives and put NaN into dq."""
    if not (return_probs and p > 0):
        return _no_probs(q)
    if dropout is None or q.is_meta:
        return q.new_zeros(s_dmask_shape(*shape))
    with torch.no_grad():
        return build(dropout)


def _draw(p, q, has_work):
    """The call's dropout state, drawn only when there is dropout and work to drop from."""
    return DropoutArgs.draw(p, q.device) if p > 0 and has_work else None


def _grad_inputs(q, k, v, packed):
    """The differentiable inputs and their packing: `packed` is (Packing, inputs) for the packed
    functions, None for q, k, v apart."""
    return packed if packed is not None else (Packing(), (q, k, v))


def _flash_attn(q, k, v, names, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, caller=None, deterministic=False, packed=None, return_probs=False,
                learnable_sink=None, mods=(None, None, None, None), block_mask=None):
    """Shared body of the fixed-length functions: (out, lse, S_dmask, dropout), S_dmask empty
    unless `return_probs` with dropout, dropout the call's DropoutArgs or None. `names` are the
    caller's argument names; `caller` is the public function's name, None for the private
    forward, which has no autograd in flash-attn either. With grad mode on and an input
    requiring grad, eager calls go through `FlashAttnFunction` (compiled ones through the op's
    registered gradient). `learnable_sink` goes to the launchers, whose output has it folded in
    (`cute_flash.sinks`).
    `mods`: (score_mod, mask_mod, aux_tensors, score_mod_bwd), Python-written (`_user_mods`);
    `block_mask` a FlexAttention BlockMask of the mask_mod (`_validate.check_block_mask`)."""
    named = _check_qkv(q, k, v, names, _Q_DIMS, _KV_DIMS, value_dim=caller is not None)
    p, window_size = _check_options(dropout_p, window_size, softcap, softmax_scale)
    batch, seqlen_q, nheads, headdim = q.shape
    _validate.check_alibi(alibi_slopes, batch, nheads)
    _check_sink(learnable_sink, nheads, p, return_probs)
    _validate.check_mods(*mods, softcap, alibi_slopes, return_probs and p > 0)
    _validate.check_block_mask(block_mask, mods[1], batch, nheads, seqlen_q, k.shape[1])
    _validate.check_cuda(named + [("alibi_slopes", alibi_slopes), ("learnable_sink", learnable_sink)]
                         + _aux_named(mods[2]) + _validate.block_mask_named(block_mask))

    seqlen_k = k.shape[1]
    lse_shape = (batch, nheads, seqlen_q)
    causal, window = _mask(causal, window_size, seqlen_q, seqlen_k)
    scale, softcap, deterministic = _scale(softmax_scale, headdim), float(softcap), bool(deterministic)
    dropout = _draw(p, q, batch and seqlen_q and seqlen_k)
    d_v = v.shape[-1]
    packing, inputs = _grad_inputs(q, k, v, packed)
    wants_grad = caller is not None and _validate.needs_grad(inputs, learnable_sink)
    # v's head dim of its own: the launchers take it as it is (`launch/value_dim.py`); S_dmask,
    # flash-attn's representation at the kernels' one head dim, is built from padded tensors,
    # which are then the autograd inputs
    if d_v != headdim and return_probs and p > 0:
        q, k, v = value_dim.one_head_dim(q, k, v)
        packing, inputs = _grad_inputs(q, k, v, packed)

    def run(q, k, v):
        if batch == 0 or seqlen_q == 0 or q.is_meta:
            return _empty(q, lse_shape, v.shape[-1])
        if seqlen_k == 0:
            return sinks.fold(*_no_keys(q, lse_shape, v.shape[-1]), learnable_sink)
        if torch.compiler.is_compiling():  # one graph node (cute_flash/ops.py), gradient registered
            return torch.ops.cute_flash.fwd(q, k, v, scale, causal, window[0], window[1], softcap, alibi_slopes,
                                            list(mods[2] or ()), *block_sparse.op_arguments(block_mask),
                                            deterministic, *_op_dropout(dropout), learnable_sink,
                                            ops.remember_mods(mods[0], mods[1], mods[3]))
        return _kernels().flash_fwd(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                    softcap=softcap, alibi_slopes=alibi_slopes, dropout=dropout,
                                    mods=_user_mods(mods), block_mask=block_mask, learnable_sink=learnable_sink)

    if wants_grad:
        _refuse_mod_grads(mods, caller)
    if wants_grad and not torch.compiler.is_compiling():
        options = AttnOptions(scale, causal, window, softcap, deterministic, packing, dropout=dropout,
                              mods=_user_mods(mods), block_mask=block_mask)
        out, lse = FlashAttnFunction.apply(options, run, alibi_slopes, learnable_sink, *inputs)
    else:
        out, lse = run(q, k, v)
    probs = _s_dmask(q, p, return_probs, dropout, (batch, nheads, seqlen_q, seqlen_k), lambda drop: s_dmask(
        q, k, v, drop, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
        alibi_slopes=alibi_slopes))
    return value_dim.value_cols(out, d_v), lse, probs, dropout


def _aux_named(aux_tensors) -> list:
    return [(f"aux_tensors[{i}]", t) for i, t in enumerate(aux_tensors or ())]


def _user_mods(mods):
    """(score_mod, mask_mod, aux_tensors, score_mod_bwd) for the launchers (`launch/mods.ModArgs.of`),
    or None."""
    return None if mods[0] is None and mods[1] is None else mods


def _refuse_mod_grads(mods, caller):
    """A gradient through a score_mod needs its derivative, which the caller writes (score_mod_bwd)."""
    if mods[0] is not None and mods[3] is None:
        raise ValueError(f"{caller}: a gradient through a score_mod needs its score_mod_bwd (the mod's "
                         "derivative, flash-attn-4's convention); pass it, or call on tensors that do not require grad")


def _check_sink(learnable_sink, nheads, dropout_p, return_probs):
    """A learnable sink's checks. With dropout, S_dmask holds the kernels' representation of the
    key probabilities, which the sink's share is not in: the two are refused together."""
    _validate.check_learnable_sink(learnable_sink, nheads)
    if learnable_sink is not None and return_probs and dropout_p > 0:
        raise ValueError("return_attn_probs with dropout and learnable_sink: S_dmask has no column for the sink")


def _op_dropout(dropout):
    """The custom ops' (dropout_p, rng_state) arguments."""
    return (0.0, None) if dropout is None else (dropout.p, dropout.rng_state)


def _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, names,
                       dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       block_table, seqused_k, caller=None, deterministic=False, packed=None, return_probs=False,
                       leftpad_k=None, learnable_sink=None, mods=(None, None, None, None)):
    """Shared body of the variable-length functions: (out, lse, S_dmask, dropout) as
    _flash_attn's. `names` name q, k, v, the two cu_seqlens and the two max_seqlen as the caller
    spelled them; `caller` and autograd as in _flash_attn. A paged cache (block_table) has no
    gradient, as in flash-attn. `leftpad_k`: the private forward's (`_skip_left_pad`)."""
    paged = block_table is not None
    kv_dims = _PAGED_KV_DIMS if paged else _VARLEN_KV_DIMS
    named = _check_qkv(q, k, v, names[:3], _VARLEN_Q_DIMS, kv_dims, value_dim=caller is not None)
    packing, inputs = _grad_inputs(q, k, v, packed)
    wants_grad = caller is not None and _validate.needs_grad(inputs, learnable_sink)
    p, window_size = _check_options(dropout_p, window_size, softcap, softmax_scale)
    _validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, names[3:])
    batch = cu_seqlens_q.shape[0] - 1
    if seqused_k is not None:
        _validate.check_int32_vector(seqused_k, "seqused_k", batch)
    if leftpad_k is not None:
        _validate.check_leftpad_k(leftpad_k, batch, paged)
    if paged:
        _validate.check_block_table(block_table, batch, k, names[1])
    total_q, nheads, headdim = q.shape
    _validate.check_alibi(alibi_slopes, batch, nheads)
    _check_sink(learnable_sink, nheads, p, return_probs)
    _validate.check_mods(*mods, softcap, alibi_slopes, return_probs and p > 0)
    _validate.check_cuda(named + [
        (names[3], cu_seqlens_q), (names[4], cu_seqlens_k), ("seqused_k", seqused_k), ("leftpad_k", leftpad_k),
        ("block_table", block_table), ("alibi_slopes", alibi_slopes), ("learnable_sink", learnable_sink),
    ] + _aux_named(mods[2]))
    if leftpad_k is not None:
        cu_seqlens_k, seqused_k = _skip_left_pad(cu_seqlens_k, seqused_k, leftpad_k)

    lse_shape = (nheads, total_q)
    causal, window = _mask(causal, window_size, max_seqlen_q, max_seqlen_k)
    scale, softcap, deterministic = _scale(softmax_scale, headdim), float(softcap), bool(deterministic)
    # max_seqlen_k 0: no keys, as flash-attn 2 reads it. max_seqlen_q 0: no sequence has a query
    # row, so every row lies outside them (0 / +inf); the kernels' grids would be empty.
    no_keys = (k.shape[0] == 0 or max_seqlen_k == 0 or max_seqlen_q == 0
               or (paged and block_table.shape[1] == 0))
    dropout = _draw(p, q, batch and total_q and not no_keys)
    d_v = v.shape[-1]
    # v's head dim of its own (v apart: packed inputs share one): as in _flash_attn
    if d_v != headdim and return_probs and p > 0:
        q, k, v = value_dim.one_head_dim(q, k, v)
        inputs = (q, k, v)

    def run(q, k, v):
        if batch == 0 or total_q == 0 or q.is_meta:
            return _empty(q, lse_shape, v.shape[-1])
        if no_keys:
            return sinks.fold(*_no_keys(q, lse_shape, v.shape[-1]), learnable_sink)
        if torch.compiler.is_compiling():
            return torch.ops.cute_flash.fwd_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window[0],
                window[1], softcap, alibi_slopes, block_table, seqused_k, list(mods[2] or ()), deterministic,
                *_op_dropout(dropout), learnable_sink, ops.remember_mods(mods[0], mods[1], mods[3]))
        return _kernels().flash_fwd_varlen(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
            alibi_slopes=alibi_slopes, block_table=block_table, seqused_k=seqused_k, dropout=dropout,
            mods=_user_mods(mods), learnable_sink=learnable_sink)

    if wants_grad and paged:
        out, lse = run(q, k, v)
        out = no_backward(caller, "there is no gradient through a paged KV cache (block_table), as in flash-attn",
                          out, [*zip(names[:3], (q, k, v)), ("learnable_sink", learnable_sink)])
    elif wants_grad and not torch.compiler.is_compiling():
        _refuse_mod_grads(mods, caller)
        varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
        options = AttnOptions(scale, causal, window, softcap, deterministic, packing, varlen, dropout,
                              _user_mods(mods))
        out, lse = FlashAttnFunction.apply(options, run, alibi_slopes, learnable_sink, *inputs)
    else:
        if wants_grad:  # compiled: the op's registered gradient
            _refuse_mod_grads(mods, caller)
        out, lse = run(q, k, v)
    probs = _s_dmask(q, p, return_probs, dropout, (batch, nheads, max_seqlen_q, max_seqlen_k), lambda drop: (
        s_dmask_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, drop, seqused_k=seqused_k,
                       block_table=block_table, softmax_scale=scale, causal=causal, window_size=window,
                       softcap=softcap, alibi_slopes=alibi_slopes)))
    return value_dim.value_cols(out, d_v), lse, probs, dropout


def _skip_left_pad(cu_seqlens_k, seqused_k, leftpad_k):
    """flash-attn's leftpad_k as the starts and lengths the kernels take: sequence b's keys from
    cu_seqlens_k[b] + leftpad_k[b], (seqused_k[b] or its length) - leftpad_k[b] of them. Device
    arithmetic only (no sync); the kernels clamp whatever it gives into the tensors."""
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1] if seqused_k is None else seqused_k
    starts = cu_seqlens_k.clone()
    starts[:-1] += leftpad_k
    return starts, (lengths - leftpad_k).clamp_(min=0).to(torch.int32)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: WindowSize = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
) -> Union[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Attention over qkv (batch, seqlen, 3, nheads, headdim); q, k, v are views of it.
    Returns out (batch, seqlen, nheads, headdim), or (out, softmax_lse, S_dmask)."""
    _validate.check_packed(qkv, "qkv", 2, 3, ("batch", "seqlen", "3", "nheads", "headdim"))
    q, k, v = qkv.unbind(dim=2)
    out, lse, probs, _ = _flash_attn(q, k, v, ("qkv",) * 3, dropout_p, softmax_scale, causal, window_size,
                                     softcap, alibi_slopes, "flash_attn_qkvpacked_func", deterministic,
                                     (Packing("qkv", 2), (qkv,)), return_probs=return_attn_probs,
                                     learnable_sink=learnable_sink)
    return _result(out, lse, probs, return_attn_probs)


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: WindowSize = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
) -> Union[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Attention of q (batch, seqlen_q, nheads, headdim) over kv (batch, seqlen_k, 2, nheads_k,
    headdim); k, v are views of kv. Returns out, or (out, softmax_lse, S_dmask)."""
    _validate.check_packed(kv, "kv", 2, 2, ("batch", "seqlen_k", "2", "nheads_k", "headdim"))
    k, v = kv.unbind(dim=2)
    out, lse, probs, _ = _flash_attn(q, k, v, ("q", "kv", "kv"), dropout_p, softmax_scale, causal,
                                     window_size, softcap, alibi_slopes, "flash_attn_kvpacked_func", deterministic,
                                     (Packing("q,kv", 2), (q, kv)), return_probs=return_attn_probs,
                                     learnable_sink=learnable_sink)
    return _result(out, lse, probs, return_attn_probs)


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: WindowSize = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    aux_tensors: Optional[Sequence[Tensor]] = None,
    score_mod_bwd: Optional[Callable] = None,
    block_mask=None,
) -> Union[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Attention of q (batch, seqlen_q, nheads, headdim) over k, v (batch, seqlen_k, nheads_k,
    headdim). Returns out like q, or (out, softmax_lse (batch, nheads, seqlen_q), S_dmask): with
    dropout (batch, nheads, seqlen_q and seqlen_k rounded up to 128) in flash-attn's
    representation, dropped entries negated (`cute_flash.dropout`); without it empty
    (flash-attn's value). `learnable_sink` (nheads,), keyword-only (flash-attn-4's): a logit per
    head in every row's softmax, with no value, differentiable (docs/semantics.md, Sinks); the
    other attention functions take it too. `score_mod`, `mask_mod`, `aux_tensors`, `score_mod_bwd`,
    keyword-only (flash-attn-4's conventions): Python-written modifiers compiled into the kernels,
    forward and backward (docs/semantics.md, Score and mask mods); `block_mask`, keyword-only,
    a FlexAttention `BlockMask` of the mask_mod (from `create_block_mask`), whose empty blocks
    the kernels skip and whose full ones they run without the mask_mod (docs/semantics.md, Block
    sparsity)."""
    out, lse, probs, _ = _flash_attn(q, k, v, ("q", "k", "v"), dropout_p, softmax_scale, causal, window_size,
                                     softcap, alibi_slopes, "flash_attn_func", deterministic,
                                     return_probs=return_attn_probs,
                                     learnable_sink=learnable_sink,
                                     mods=(score_mod, mask_mod, aux_tensors, score_mod_bwd), block_mask=block_mask)
    return _result(out, lse, probs, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: WindowSize = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
) -> Union[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Variable-length attention over qkv (total, 3, nheads, headdim), sequences delimited by
    cu_seqlens; q, k, v are views of qkv. Returns out, or (out, softmax_lse, S_dmask)."""
    _validate.check_packed(qkv, "qkv", 1, 3, ("total", "3", "nheads", "headdim"))
    q, k, v = qkv.unbind(dim=1)
    names = ("qkv", "qkv", "qkv", "cu_seqlens", "cu_seqlens", "max_seqlen", "max_seqlen")
    out, lse, probs, _ = _flash_attn_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, names,
                                            dropout_p, softmax_scale, causal, window_size, softcap,
                                            alibi_slopes, None, None, "flash_attn_varlen_qkvpacked_func", deterministic,
                                            (Packing("qkv", 1), (qkv,)), return_probs=return_attn_probs,
                                            learnable_sink=learnable_sink)
    return _result(out, lse, probs, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: WindowSize = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
) -> Union[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Variable-length attention of q (total_q, nheads, headdim) over kv (total_k, 2, nheads_k,
    headdim); k, v are views of kv. Returns out, or (out, softmax_lse, S_dmask)."""
    _validate.check_packed(kv, "kv", 1, 2, ("total_k", "2", "nheads_k", "headdim"))
    k, v = kv.unbind(dim=1)
    names = ("q", "kv", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    out, lse, probs, _ = _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            names, dropout_p, softmax_scale, causal, window_size, softcap,
                                            alibi_slopes, None, None, "flash_attn_varlen_kvpacked_func", deterministic,
                                            (Packing("q,kv", 1), (q, kv)), return_probs=return_attn_probs,
                                            learnable_sink=learnable_sink)
    return _result(out, lse, probs, return_attn_probs)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: WindowSize = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[Tensor] = None,
    *,
    seqused_k: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    aux_tensors: Optional[Sequence[Tensor]] = None,
    score_mod_bwd: Optional[Callable] = None,
) -> Union[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Variable-length attention of q (total_q, nheads, headdim) over k, v (total_k, nheads_k,
    headdim), or over a paged cache (num_blocks, page_size, nheads_k, headdim) with block_table.
    seqused_k (batch,) int32, keyword-only (not in flash-attn 2.8.3's Python API), caps the keys
    used per sequence; score_mod / mask_mod / aux_tensors / score_mod_bwd as in `flash_attn_func`
    (q_idx and kv_idx count from each sequence's start). Returns out, or (out, softmax_lse (nheads, total_q),
    S_dmask)."""
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    out, lse, probs, _ = _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            names, dropout_p, softmax_scale, causal, window_size, softcap,
                                            alibi_slopes, block_table, seqused_k, "flash_attn_varlen_func",
                                            deterministic, return_probs=return_attn_probs,
                                            learnable_sink=learnable_sink,
                                            mods=(score_mod, mask_mod, aux_tensors, score_mod_bwd))
    return _result(out, lse, probs, return_attn_probs)


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens: Union[int, Tensor, None] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: WindowSize = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k_new: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Attention of q (batch, seqlen_q, nheads, headdim) over a KV cache, after the kernel
    appends k, v (rotated when rotary_cos/sin are given) at cache_seqlens. All checks run
    before the launch, so a refused call leaves the caches untouched. With a block table,
    max(cache_seqlens) + seqlen_new must fit in the pages it addresses: checked on the host as
    flash-attn does (RuntimeError; a device sync), except while a CUDA graph is being captured,
    where the kernels' own clamping is the guard. `learnable_sink` (nheads,), keyword-only: as
    in `flash_attn_func`. Returns out, or (out, softmax_lse (batch, nheads, seqlen_q)).
    `cu_seqlens_q` / `max_seqlen_q` (FA3's, keyword-only): each sequence its own query count,
    q packed (total_q, nheads, headdim), k / v packed (total_new, nheads_k, headdim) with
    `cu_seqlens_k_new`; then out is (total_q, nheads, headdim) and softmax_lse (nheads, total_q)
    (`cute_flash.kvcache_varlen`). MLA decode (sm_90): q and k_cache 576 wide with
    `v_cache = k_cache[..., :512]`, out 512 wide (docs/semantics.md)."""
    if cu_seqlens_q is not None:
        return _kvcache_varlen(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                               cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                               rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, learnable_sink,
                               cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q)
    if cu_seqlens_k_new is not None or max_seqlen_q is not None:
        raise ValueError("cu_seqlens_k_new and max_seqlen_q go with cu_seqlens_q (queries of their own count)")
    return _kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                    num_splits, return_softmax_lse, learnable_sink)


def _kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
             return_softmax_lse, learnable_sink, fold=1):
    """The fixed-length `flash_attn_with_kvcache`. `fold` > 1 (the packed call's, from
    `_kvcache_fold`): q's rows hold their heads in the order of the launch's query fold by
    `fold`, and out (batch, fold x seqlen_q, nheads / fold, headdim) and softmax_lse (batch,
    nheads / fold, fold x seqlen_q) come back so folded."""
    window_size = _validate.check_window(window_size)
    paged = block_table is not None
    compiling = torch.compiler.is_compiling()
    key = _check_kvcache_once(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                              cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                              rotary_interleaved, alibi_slopes, num_splits, learnable_sink)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = _cache_keys(k_cache, block_table)

    lse_shape = (batch, nheads, seqlen_q)
    skipped = _kvcache_skips(q, seqlen_k)
    if skipped == "empty":
        out, lse = _empty(q, lse_shape, v_cache.shape[-1])
    elif skipped == "no keys":
        out, lse = sinks.fold(*_no_keys(q, lse_shape, v_cache.shape[-1]), learnable_sink)
    else:
        if paged and isinstance(cache_seqlens, torch.Tensor) and not compiling and not (
                cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
            _validate.check_block_table_capacity(cache_seqlens, 0 if k is None else k.shape[1], block_table,
                                                 k_cache.shape[1])
        causal, window = _mask(causal, window_size, seqlen_q, seqlen_k)
        if compiling:
            tensor_lens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
            out, lse = torch.ops.cute_flash.fwd_kvcache(
                q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, tensor_lens,
                None if tensor_lens is not None or cache_seqlens is None else int(cache_seqlens), cache_batch_idx,
                cache_leftpad, block_table, _scale(softmax_scale, headdim), causal, window[0], window[1],
                float(softcap), bool(rotary_interleaved), alibi_slopes, int(num_splits), learnable_sink)
            return (out, lse) if return_softmax_lse else out
        out, lse = _kernels().flash_fwd_kvcache(
            q, k_cache, v_cache,
            k=k,
            v=v,
            rotary_cos=rotary_cos,
            rotary_sin=rotary_sin,
            cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad,
            block_table=block_table,
            softmax_scale=_scale(softmax_scale, headdim),
            causal=causal,
            window_size=window,
            softcap=float(softcap),
            rotary_interleaved=bool(rotary_interleaved),
            alibi_slopes=alibi_slopes,
            num_splits=num_splits,
            return_lse=return_softmax_lse,
            learnable_sink=learnable_sink,
            signature=key,
            folded_q=fold > 1,
        )
    out = no_backward("flash_attn_with_kvcache", "it is inference-only and has no backward pass (as in flash-attn)",
                      out, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                            ("learnable_sink", learnable_sink)))
    return (out, lse) if return_softmax_lse else out


def _kvcache_varlen(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                    cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                    alibi_slopes, num_splits, return_softmax_lse, learnable_sink, cu_seqlens_q, cu_seqlens_k_new,
                    max_seqlen_q):
    """`flash_attn_with_kvcache` over packed queries (`cute_flash.kvcache_varlen`): the appends
    and rotary here, then the fixed-length call on the queries laid out (batch, max_seqlen_q),
    which checks the caches and the options."""
    if q.dim() != 3:
        raise ValueError(f"with cu_seqlens_q, q must be 3-D (total_q, nheads, headdim), got shape {tuple(q.shape)}")
    _validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_q if cu_seqlens_k_new is None else cu_seqlens_k_new,
                               max_seqlen_q, 0, ("cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q", "max_seqlen_q"))
    if not isinstance(cache_seqlens, torch.Tensor):
        raise ValueError("with cu_seqlens_q, cache_seqlens must be an int32 tensor (batch,): each sequence's rows "
                         "in the cache before the appended ones")
    batch = cu_seqlens_q.shape[0] - 1
    _validate.check_int32_vector(cache_seqlens, "cache_seqlens", batch)
    if cache_batch_idx is not None or cache_leftpad is not None:
        raise ValueError("cache_batch_idx and cache_leftpad are not taken with cu_seqlens_q")
    if (k is None) != (v is None) or (k is None) != (cu_seqlens_k_new is None):
        raise ValueError("k, v and cu_seqlens_k_new go together (each sequence's new rows, packed)")
    if k is not None and (k.dim() != 3 or v.shape[:-1] != k.shape[:-1] or k.shape[1:] != k_cache.shape[2:]):
        raise ValueError(f"k and v must be (total_new, nheads_k, headdim) like the caches' rows, got shapes "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin go together")
    _validate.check_cuda([("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                          ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k_new", cu_seqlens_k_new),
                          ("cache_seqlens", cache_seqlens), ("block_table", block_table),
                          ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)])
    window = _validate.check_window(window_size)
    scale = _scale(softmax_scale, q.shape[-1])
    _validate.check_dtypes([("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)],
                           optional=("k", "v"))
    if _validate.is_latent(q, k_cache, v_cache):
        raise ValueError("MLA decode (q / k_cache 576, v_cache 512) is not built with cu_seqlens_q")
    rotary = None if rotary_cos is None else (rotary_cos, rotary_sin, bool(rotary_interleaved))
    q_pad = q.new_empty(batch, max(int(max_seqlen_q), 1), *q.shape[1:])  # every row written by the packing launch
    lengths = torch.empty_like(cache_seqlens)  # cache_seqlens + the new keys, written by the packing launch
    # the fixed-length call's checks, before the appends (a refused call leaves the caches as they were), under the
    # signature of that call's arguments below, which then finds them done
    key = _check_kvcache_once(q_pad, k_cache, v_cache, None, None, None, None, lengths, None, None, block_table,
                              scale, causal, window, softcap, True, alibi_slopes, num_splits, learnable_sink)
    per_row = bool(causal) or window[0] >= 0 or window[1] >= 0
    if torch.compiler.is_compiling():  # one graph node (cute_flash/ops.py), its writes declared
        fold = 1
        flat = torch.ops.cute_flash.pack_kvcache_queries(
            q, q_pad, lengths, k_cache, v_cache, k, v, cu_seqlens_q, cu_seqlens_k_new, cache_seqlens, block_table,
            rotary_cos, rotary_sin, bool(rotary_interleaved), per_row)
    else:
        fold = _kvcache_fold(q_pad, k_cache, v_cache, lengths, block_table, scale, causal, window, softcap,
                             alibi_slopes, num_splits, learnable_sink, key)
        flat = _kernels().pack_kvcache_queries(q, q_pad, lengths, k_cache, v_cache, k, v, cu_seqlens_q,
                                               cu_seqlens_k_new, cache_seqlens, block_table, rotary, per_row, fold)
    out, lse = _kvcache(q_pad, k_cache, v_cache, None, None, None, None, lengths, None, None, block_table, scale,
                        causal, window, softcap, True, alibi_slopes, num_splits, True, learnable_sink, fold)
    out, lse = kvcache_varlen.unpad(out, lse, flat, fold)
    return (out, lse) if return_softmax_lse else out


def _kvcache_fold(q_pad, k_cache, v_cache, lengths, block_table, scale, causal, window, softcap, alibi_slopes,
                  num_splits, learnable_sink, key):
    """The query fold the packed call's fixed-length launch takes on q_pad
    (`launch.kvcache.kvcache_query_group`), so that the packing launch writes its queries in
    that order; 1 where `_kvcache` launches nothing (`_kvcache_skips`)."""
    seqlen_k = _cache_keys(k_cache, block_table)
    if _kvcache_skips(q_pad, seqlen_k) is not None:
        return 1
    causal, window = _mask(causal, window, q_pad.shape[1], seqlen_k)
    return _kernels().kvcache_query_group(
        q_pad, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table, softmax_scale=scale, causal=causal,
        window_size=window, softcap=float(softcap), alibi_slopes=alibi_slopes, num_splits=num_splits,
        learnable_sink=learnable_sink, signature=key)


def _kvcache_skips(q, seqlen_k: int):
    """Why the fixed-length KV-cache call launches no kernel for q (batch, seqlen_q, nheads,
    headdim): "empty" (no query row, or a meta q), "no keys" (every row sees none); None where
    it launches one. `_kvcache` and the packed call's fold (`_kvcache_fold`) both ask here."""
    if q.shape[0] == 0 or q.shape[1] == 0 or q.is_meta:
        return "empty"
    return "no keys" if seqlen_k == 0 else None


def _cache_keys(k_cache, block_table) -> int:
    """The keys a KV cache holds a sequence: its rows, or those of the block table's pages."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


# Signatures of flash_attn_with_kvcache calls that passed every check: a decode loop repeats one
# call shape, and its checks cost more host time than the launch.
_kvcache_checked: set = set()
_CHECKED_MAX = 4096


def _check_kvcache_once(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                        alibi_slopes, num_splits, learnable_sink):
    """Every check of a `flash_attn_with_kvcache` call, run once per signature of its arguments
    (while compiling, every time); returns the signature, None while compiling."""
    key = None if torch.compiler.is_compiling() else _validate.signature(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
        learnable_sink)
    if key is None or key not in _kvcache_checked:
        _check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       cache_leftpad, block_table, window_size, softcap, softmax_scale, alibi_slopes, num_splits,
                       learnable_sink)
        if key is not None:
            if len(_kvcache_checked) >= _CHECKED_MAX:
                _kvcache_checked.clear()
            _kvcache_checked.add(key)
    return key


def _check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                   cache_leftpad, block_table, window_size, softcap, softmax_scale, alibi_slopes, num_splits,
                   learnable_sink):
    paged = block_table is not None
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)]
    _validate.check_dtypes(named, optional=("k", "v"))
    _validate.check_kvcache_shapes(q, k_cache, v_cache, k, v, paged)
    if _validate.is_latent(q, k_cache, v_cache):  # MLA decode: v_cache is k_cache's first columns
        _validate.check_latent_cache(k_cache, v_cache, k, rotary_cos, cache_batch_idx, cache_leftpad, num_splits)
    else:
        _validate.check_head_dim(named)
    _validate.check_gqa(q, k_cache, "q", "k_cache")
    _validate.check_last_dim_contiguous([("k_cache", k_cache), ("v_cache", v_cache)])
    _validate.check_softcap(softcap)
    _validate.check_softmax_scale(softmax_scale)
    batch, seqlen_q, nheads, headdim = q.shape
    _validate.check_alibi(alibi_slopes, batch, nheads)
    _validate.check_learnable_sink(learnable_sink, nheads)
    if paged:
        _validate.check_block_table(block_table, batch, k_cache, "k_cache")
    seqlen_k = _cache_keys(k_cache, block_table)
    _validate.check_kvcache_args(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad,
                                 block_table, num_splits, seqlen_k)
    _validate.check_rotary(rotary_cos, rotary_sin, q, k, seqlen_k)
    _validate.check_cuda(named + [
        ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_seqlens", cache_seqlens),
        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
        ("block_table", block_table), ("alibi_slopes", alibi_slopes), ("learnable_sink", learnable_sink),
    ])
