"""Autograd for the six public attention functions in eager mode (under torch.compile the custom
ops carry their own registered gradients: `cute_flash/ops.py`).

One `torch.autograd.Function` serves all six: the differentiable inputs are q, k, v apart, q and
a packed kv, or one packed qkv (`Packing`), so packed inputs get their gradient as one packed
tensor, written through views as flash-attn's `dqkv` is. Only q, k, v, out and lse are saved;
the options travel in a frozen `AttnOptions`, with dropout's p and rng_state (the backward
regenerates the forward's mask from them).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from cute_flash import sinks
from cute_flash.launch.rng import DropoutArgs


@dataclass(frozen=True)
class Packing:
    """How the differentiable inputs hold q, k, v: "q,k,v" apart, "q,kv" or "qkv" stacked
    along `dim` of the packed tensor."""
    kind: str = "q,k,v"
    dim: int = 2

    def unpack(self, inputs):
        if self.kind == "qkv":
            return inputs[0].unbind(self.dim)
        if self.kind == "q,kv":
            return (inputs[0], *inputs[1].unbind(self.dim))
        return tuple(inputs)

    def grad_buffers(self, inputs):
        """(one gradient per input, the dq / dk / dv destinations): a packed input's gradient
        is one tensor like it, written through its views; apart, the launcher allocates."""
        if self.kind == "qkv":
            dqkv = torch.empty_like(inputs[0])
            return (dqkv,), dqkv.unbind(self.dim)
        if self.kind == "q,kv":
            dq, dkv = torch.empty_like(inputs[0]), torch.empty_like(inputs[1])
            return (dq, dkv), (dq, *dkv.unbind(self.dim))
        return None, (None, None, None)


@dataclass(frozen=True)
class Varlen:
    """The packed-batch metadata of a varlen call (not differentiable)."""
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: Optional[Tensor]


@dataclass(frozen=True)
class AttnOptions:
    """The forward's options in the canonical form the kernels take (`interface._mask`)."""
    softmax_scale: float
    causal: bool
    window: tuple
    softcap: float
    deterministic: bool
    packing: Packing
    varlen: Optional[Varlen] = None
    dropout: Optional[DropoutArgs] = None
    mods: Optional[tuple] = None  # (score_mod, mask_mod, aux_tensors, score_mod_bwd): Python-written mods
    block_mask: Optional[object] = None  # the mask_mod's FlexAttention BlockMask (dense calls)


def _launch():
    return importlib.import_module("cute_flash.launch")


class FlashAttnFunction(torch.autograd.Function):
    """forward(options, run, alibi_slopes, learnable_sink, *inputs): `run(q, k, v)` is the
    caller's forward on validated tensors, returning (out, lse) with the sink, if any, folded in
    (`cute_flash.sinks`); the backward gives the sink its gradient."""

    @staticmethod
    def forward(ctx, options: AttnOptions, run: Callable, alibi_slopes: Optional[Tensor],
                learnable_sink: Optional[Tensor], *inputs: Tensor):
        q, k, v = options.packing.unpack(inputs)
        out, lse = run(q, k, v)
        ctx.save_for_backward(*inputs, out, lse, *(() if learnable_sink is None else (learnable_sink,)))
        ctx.options, ctx.alibi_slopes, ctx.has_sink = options, alibi_slopes, learnable_sink is not None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor):
        o: AttnOptions = ctx.options
        saved = ctx.saved_tensors
        sink = saved[-1] if ctx.has_sink else None
        *inputs, out, lse = saved[:-1] if ctx.has_sink else saved
        q, k, v = o.packing.unpack(inputs)
        grads, (dq, dk, dv) = o.packing.grad_buffers(inputs)
        wants_dsink = sink is not None and ctx.needs_input_grad[3]
        dsink = torch.zeros_like(sink) if wants_dsink else None  # no rows or no keys: the sink took no share
        if q.numel() == 0 or k.numel() == 0 or q.is_meta:  # no query rows or no keys (or shapes only)
            grads = tuple(torch.zeros_like(x) for x in inputs)
        else:
            common = dict(softmax_scale=o.softmax_scale, causal=o.causal, window_size=o.window, softcap=o.softcap,
                          alibi_slopes=ctx.alibi_slopes, deterministic=o.deterministic, dropout=o.dropout,
                          dq=dq, dk=dk, dv=dv, **({} if o.mods is None else dict(mods=o.mods)))
            if o.varlen is None:
                sparse = {} if o.block_mask is None else dict(block_mask=o.block_mask)
                qkv_grads = _launch().flash_bwd(dout, q, k, v, out, lse, **common, **sparse)
            else:
                vl = o.varlen
                qkv_grads = _launch().flash_bwd_varlen(
                    dout, q, k, v, out, lse, cu_seqlens_q=vl.cu_seqlens_q, cu_seqlens_k=vl.cu_seqlens_k,
                    max_seqlen_q=vl.max_seqlen_q, max_seqlen_k=vl.max_seqlen_k, seqused_k=vl.seqused_k, **common)
            if grads is None:
                grads = qkv_grads[:3]
            if wants_dsink:
                dsink = sinks.grad(lse, qkv_grads[3], sink)
        needs = ctx.needs_input_grad[4:]
        return (None, None, None, dsink) + tuple(g if need else None for g, need in zip(grads, needs))


class NoBackward(torch.autograd.Function):
    """forward(message, out, *inputs): `out` as it is, joined to inputs that require grad for
    a call that has no backward (flash_attn_with_kvcache, a paged KV cache), as in flash-attn:
    the forward runs with grad mode on, and asking for the gradient raises at backward() with
    `message`, so no gradient is dropped in silence."""

    @staticmethod
    def forward(ctx, message: str, out: Tensor, *inputs: Tensor):
        ctx.message = message
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(ctx.message)


def no_backward(fn_name: str, why: str, out: Tensor, named) -> Tensor:
    """`out`, whose backward raises naming `fn_name`, `why` and the inputs that require grad
    (`named`: (name, tensor or None) pairs); `out` itself where none requires grad."""
    wanting = [(name, t) for name, t in named if isinstance(t, Tensor) and t.requires_grad]
    if not torch.is_grad_enabled() or not wanting:
        return out
    names = list(dict.fromkeys(name for name, _ in wanting))
    message = (f"{fn_name} has no gradient: {why}, and {', '.join(names)} require{'s' if len(names) == 1 else ''} "
               "grad. The forward ran; call it under torch.no_grad() or pass detached tensors where no gradient "
               "is wanted.")
    return NoBackward.apply(message, out, *(t for _, t in wanting))
