"""The kernels as torch.library custom ops (`torch.ops.cute_flash.*`), for torch.compile.

Each op's real implementation is the launcher (`cute_flash.launch`); its fake implementation
gives the outputs' shapes, dtypes and strides without running anything, so Dynamo traces a model
that calls attention into one graph. `fwd_kvcache` declares that it writes the caches
(`mutates_args`), since it appends k/v in place. `fwd` and `fwd_varlen` have their gradients
registered (`register_autograd`): the `bwd` / `bwd_varlen` ops, which a compiled training step
traces into its backward graph, and a learnable sink's gradient beside them (`cute_flash.sinks`;
the forward ops fold the sink into their outputs). (`deterministic` and dropout's `dropout_p` /
`rng_state` ride along in the forward ops for them; the caller draws rng_state before the op, so
the compiled graph holds the draw.)

Python-written mods ride along too: an op schema holds no callables, so the interface files a
call's (score_mod, mask_mod, score_mod_bwd) here under a key made of their digests
(`remember_mods`, run once while Dynamo traces: the key is a constant of the graph), and the
ops take the key (`mods`) and the aux tensors (`aux_tensors`, graph inputs). A mod that is the
same code with the same captures has the same key, so a retrace finds the same kernels. A
FlexAttention BlockMask travels as its lists (`block_mask`, graph inputs) and its block sizes and
lengths (`block_mask_sizes`), rebuilt in the op (`launch/block_sparse.BlockLists`).

Eager calls do not go through the dispatcher: the public functions call the launchers directly
when not compiling (`torch.compiler.is_compiling()`), so decode host time does not grow by the
op's dispatch. Op outputs are fresh contiguous tensors (a head dim padded to a multiple of 8 is
sliced and copied back to contiguous, as custom ops may not return views of internal buffers).
While compiling, the block-table capacity check of `flash_attn_with_kvcache` (a device sync)
is skipped, as under CUDA-graph capture: the kernels' clamping is the guard.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from cute_flash import sinks


def _launch():
    from cute_flash import launch

    return launch


def _dropout(dropout_p: float, rng_state: Optional[Tensor]):
    from cute_flash.launch.rng import DropoutArgs

    return None if dropout_p == 0.0 else DropoutArgs(dropout_p, rng_state)


def _fresh(out: Tensor) -> Tensor:
    return out if out.is_contiguous() else out.contiguous()


_MODS: dict = {}  # key -> (score_mod, mask_mod, score_mod_bwd) of the calls traced in this process


@torch._dynamo.assume_constant_result
def remember_mods(score_mod, mask_mod, score_mod_bwd) -> str:
    """The ops' `mods` key of these mods (`launch/mods.mods_key`), filed for the ops to find;
    "" without mods (and without importing the DSL)."""
    if score_mod is None and mask_mod is None:
        return ""
    from cute_flash.launch.mods import mods_key

    key = mods_key(score_mod, mask_mod, score_mod_bwd)
    _MODS[key] = (score_mod, mask_mod, score_mod_bwd)
    return key


def _block_mask(tensors: list, sizes: list):
    from cute_flash.launch.block_sparse import BlockLists

    return BlockLists.of_op(tensors, sizes)


def _mods(key: str, aux_tensors: list, backward: bool = False):
    """The launchers' `mods` argument of an op's key and aux tensors (`launch/mods.ModArgs.of`)."""
    if not key:
        return None
    score_mod, mask_mod, score_mod_bwd = _MODS[key]
    return (score_mod, mask_mod, aux_tensors or None) + ((score_mod_bwd,) if backward else ())


@torch.library.custom_op("cute_flash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int, window_right: int,
        softcap: float, alibi_slopes: Optional[Tensor], aux_tensors: list[Tensor], block_mask: list[Tensor],
        block_mask_sizes: list[int], deterministic: bool = False, dropout_p: float = 0.0,
        rng_state: Optional[Tensor] = None, learnable_sink: Optional[Tensor] = None,
        mods: str = "") -> tuple[Tensor, Tensor]:
    """Dense forward: q (b, sq, h, d), k/v (b, sk, hk, d) -> out like q, lse (b, h, sq) fp32."""
    out, lse = _launch().flash_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                   window_size=(window_left, window_right), softcap=softcap,
                                   alibi_slopes=alibi_slopes, dropout=_dropout(dropout_p, rng_state),
                                   mods=_mods(mods, aux_tensors), block_mask=_block_mask(block_mask, block_mask_sizes),
                                   learnable_sink=learnable_sink)
    return _fresh(out), lse


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, aux_tensors,
              block_mask, block_mask_sizes, deterministic=False, dropout_p=0.0, rng_state=None, learnable_sink=None,
              mods=""):
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, v.shape[-1])), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("cute_flash::fwd_varlen", mutates_args=())
def fwd_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
               softcap: float, alibi_slopes: Optional[Tensor], block_table: Optional[Tensor],
               seqused_k: Optional[Tensor], aux_tensors: list[Tensor], deterministic: bool = False,
               dropout_p: float = 0.0, rng_state: Optional[Tensor] = None, learnable_sink: Optional[Tensor] = None,
               mods: str = "") -> tuple[Tensor, Tensor]:
    """Packed forward: q (total_q, h, d) -> out like q, lse (h, total_q) fp32."""
    out, lse = _launch().flash_fwd_varlen(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        block_table=block_table, seqused_k=seqused_k, dropout=_dropout(dropout_p, rng_state),
        mods=_mods(mods, aux_tensors), learnable_sink=learnable_sink)
    return _fresh(out), lse


@fwd_varlen.register_fake
def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left, window_right, softcap, alibi_slopes, block_table, seqused_k, aux_tensors,
                     deterministic=False, dropout_p=0.0, rng_state=None, learnable_sink=None, mods=""):
    total_q, h, _ = q.shape
    return q.new_empty((total_q, h, v.shape[-1])), q.new_empty((h, total_q), dtype=torch.float32)


@torch.library.custom_op("cute_flash::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                cache_seqlens_int: Optional[int], cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                block_table: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int,
                window_right: int, softcap: float, rotary_interleaved: bool, alibi_slopes: Optional[Tensor],
                num_splits: int, learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """`flash_attn_with_kvcache`: appends k/v into the caches (in place), then attention; out
    like q, lse (b, h, sq) fp32. cache_seqlens is a tensor or, as `cache_seqlens_int`, an int."""
    out, lse = _launch().flash_fwd_kvcache(
        q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        cache_seqlens=cache_seqlens if cache_seqlens is not None else cache_seqlens_int,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right), softcap=softcap,
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, num_splits=num_splits,
        return_lse=True, learnable_sink=learnable_sink)
    return _fresh(out), lse


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int,
                      cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left, window_right,
                      softcap, rotary_interleaved, alibi_slopes, num_splits, learnable_sink=None):
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, v_cache.shape[-1])), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("cute_flash::pack_kvcache_queries", mutates_args=("q_pad", "lengths", "k_cache", "v_cache"))
def pack_kvcache_queries(q: Tensor, q_pad: Tensor, lengths: Tensor, k_cache: Tensor, v_cache: Tensor,
                         k: Optional[Tensor], v: Optional[Tensor], cu_seqlens_q: Tensor,
                         cu_seqlens_k_new: Optional[Tensor], cache_seqlens: Tensor, block_table: Optional[Tensor],
                         rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], rotary_interleaved: bool,
                         per_row: bool) -> Tensor:
    """Packed queries' setup in the KV-cache call (`launch.kvcache.pack_kvcache_queries`): the
    appends into the caches, q into q_pad, `lengths` written (all in place); returns each packed
    query's flat row of q_pad (int64)."""
    rotary = None if rotary_cos is None else (rotary_cos, rotary_sin, rotary_interleaved)
    return _launch().pack_kvcache_queries(q, q_pad, lengths, k_cache, v_cache, k, v, cu_seqlens_q, cu_seqlens_k_new,
                                          cache_seqlens, block_table, rotary, per_row)


@pack_kvcache_queries.register_fake
def _pack_kvcache_queries_fake(q, q_pad, lengths, k_cache, v_cache, k, v, cu_seqlens_q, cu_seqlens_k_new,
                               cache_seqlens, block_table, rotary_cos, rotary_sin, rotary_interleaved, per_row):
    return q.new_empty(q.shape[0], dtype=torch.int64)


@torch.library.custom_op("cute_flash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float, causal: bool,
        window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
        aux_tensors: list[Tensor], block_mask: list[Tensor], block_mask_sizes: list[int], deterministic: bool,
        dropout_p: float = 0.0, rng_state: Optional[Tensor] = None, mods: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `fwd`: (dq, dk, dv) shaped like q, k, v."""
    grads = _launch().backward.flash_bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                         window_size=(window_left, window_right), softcap=softcap,
                                         alibi_slopes=alibi_slopes, deterministic=deterministic,
                                         dropout=_dropout(dropout_p, rng_state),
                                         mods=_mods(mods, aux_tensors, backward=True),
                                         block_mask=_block_mask(block_mask, block_mask_sizes))
    return tuple(_fresh(g) for g in grads[:3])


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
              aux_tensors, block_mask, block_mask_sizes, deterministic, dropout_p=0.0, rng_state=None, mods=""):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("cute_flash::bwd_varlen", mutates_args=())
def bwd_varlen(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
               window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
               seqused_k: Optional[Tensor], aux_tensors: list[Tensor], deterministic: bool, dropout_p: float = 0.0,
               rng_state: Optional[Tensor] = None, mods: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `fwd_varlen` (unpaged): (dq, dk, dv) shaped like q, k, v."""
    grads = _launch().backward.flash_bwd_varlen(
        dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes, seqused_k=seqused_k,
        deterministic=deterministic, dropout=_dropout(dropout_p, rng_state),
        mods=_mods(mods, aux_tensors, backward=True))
    return tuple(_fresh(g) for g in grads[:3])


@bwd_varlen.register_fake
def _bwd_varlen_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, window_left, window_right, softcap, alibi_slopes, seqused_k, aux_tensors, deterministic,
                     dropout_p=0.0, rng_state=None, mods=""):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output, names):
    """setup_context of a forward op: the tensors backward needs, and the named options."""
    out, lse = output
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2], out, lse)
    ctx.options = dict(zip(names, inputs[3:]))
    ctx.set_materialize_grads(True)


_FWD_OPTIONS = ("softmax_scale", "causal", "window_left", "window_right", "softcap", "alibi_slopes", "aux_tensors",
                "block_mask", "block_mask_sizes", "deterministic", "dropout_p", "rng_state", "learnable_sink", "mods")
_VARLEN_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
                   "window_left", "window_right", "softcap", "alibi_slopes", "block_table", "seqused_k",
                   "aux_tensors", "deterministic", "dropout_p", "rng_state", "learnable_sink", "mods")


def _sink_grad(dout, out, lse, sink):
    """The learnable sink's gradient (`cute_flash.sinks.grad`), D from dout and the folded out."""
    return None if sink is None else sinks.grad(lse, sinks.softmax_d(dout, out, lse), sink)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    o = dict(ctx.options)
    sink = o.pop("learnable_sink")
    grads = torch.ops.cute_flash.bwd(dout, q, k, v, out, lse, **o)
    return _input_grads(ctx, grads, _FWD_OPTIONS, _sink_grad(dout, out, lse, sink))


def _fwd_varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    o = dict(ctx.options)
    sink = o.pop("learnable_sink")
    if o.pop("block_table") is not None:
        raise NotImplementedError("no gradient through a paged KV cache (block_table), as in flash-attn")
    grads = torch.ops.cute_flash.bwd_varlen(dout, q, k, v, out, lse, **o)
    return _input_grads(ctx, grads, _VARLEN_OPTIONS, _sink_grad(dout, out, lse, sink))


def _input_grads(ctx, qkv_grads, names, sink_grad):
    """A gradient per input the op was called with: q, k, v's, the learnable sink's, a list of
    Nones for a list of tensors (an empty list counts as one), None for the other options. A
    traced call leaves out trailing arguments at their defaults, and an op with a list input
    takes exactly one gradient per argument given: `needs_input_grad` has one entry per argument
    given."""
    def none_for(value):
        tensors = isinstance(value, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in value)
        return [None] * len(value) if tensors else None

    grads = (*qkv_grads,) + tuple(sink_grad if name == "learnable_sink" else none_for(ctx.options[name])
                                  for name in names)
    return grads[:len(ctx.needs_input_grad)]


torch.library.register_autograd("cute_flash::fwd", _fwd_backward,
                                setup_context=lambda ctx, inputs, output: _save(ctx, inputs, output, _FWD_OPTIONS))
torch.library.register_autograd("cute_flash::fwd_varlen", _fwd_varlen_backward,
                                setup_context=lambda ctx, inputs, output: _save(ctx, inputs, output, _VARLEN_OPTIONS))
