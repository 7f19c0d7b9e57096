"""Learnable attention sinks (flash-attn-4's `learnable_sink`; gpt-oss): one logit per query head
that joins every row's softmax denominator and has no value.

With the sink, row i's probabilities are exp(s_ij - L'_i) for its keys j and exp(sink_h - L'_i)
for the sink, where L'_i = log(sum_j exp(s_ij) + exp(sink_h)) = logaddexp(L_i, sink_h) and L_i
is the row's LSE over its keys (natural log, scores already scaled; the sink is not scaled).
So the sink can be folded in after a kernel, exactly:

    L' = logaddexp(L, sink)        O' = O * exp(L - L')

(a row that sees no key has L = +inf from the kernels, O = 0: there L' = sink, O' = 0). Every
forward kernel does the same in its epilogue (`OnlineSoftmax.finalize`); `fold` gives calls
that launch none (no key at all) their output. The
backward of attention with a sink is the kernels' backward given O' and L': they recompute
P_ij = exp(s_ij - L'_i), which are the rows' key probabilities with the sink, and use
D_i = rowsum(dO_i * O'_i); the sink's own column has no value, so it adds nothing to dQ, dK,
dV. Its gradient is that column's dS summed over rows: dsink_h = -sum_i exp(sink_h - L'_i) D_i.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def _per_head(sink: Tensor, lse: Tensor) -> Tensor:
    """The sink as fp32 broadcast over an LSE laid out (batch, heads, rows) or (heads, rows)."""
    return sink.float().view((1, -1, 1) if lse.dim() == 3 else (-1, 1))


def _rows_last(factor: Tensor, out: Tensor) -> Tensor:
    """An LSE-shaped factor in the output's layout: (batch, heads, rows) -> (batch, rows, heads,
    1), (heads, rows) -> (rows, heads, 1)."""
    return (factor.permute(0, 2, 1) if factor.dim() == 3 else factor.t()).unsqueeze(-1)


def fold(out: Tensor, lse: Tensor, sink: Tensor | None) -> tuple[Tensor, Tensor]:
    """(O', L') of attention with `sink` from the kernels' (O, L): out (batch, rows, heads, d) with
    lse (batch, heads, rows), or packed out (total, heads, d) with lse (heads, total). Without a
    sink, (out, lse) as they are."""
    if sink is None:
        return out, lse
    keys_lse = lse.masked_fill(lse == math.inf, -math.inf)  # +inf marks a row that sees no key
    lse_sink = torch.logaddexp(keys_lse, _per_head(sink, lse))
    factor = _rows_last(torch.exp(keys_lse - lse_sink), out)
    # one pass over O: torch multiplies fp16 / bf16 by the fp32 factor in fp32 and rounds into
    # `out=` once (equal bit for bit to widening O first, which wrote and read an fp32 copy)
    return torch.mul(out, factor, out=torch.empty_like(out)), lse_sink


def grad(lse_sink: Tensor, softmax_d: Tensor, sink: Tensor) -> Tensor:
    """dsink (heads,) in the sink's dtype: -sum over rows of exp(sink - L') * D, from the folded
    LSE and D = rowsum(dO * O') (the backward's softmax_d), both laid out as the LSE is."""
    weight = torch.exp(_per_head(sink, lse_sink) - lse_sink) * softmax_d.float()
    return -(weight.sum(dim=(0, 2)) if weight.dim() == 3 else weight.sum(dim=1)).to(sink.dtype)


def softmax_d(dout: Tensor, out: Tensor, lse: Tensor) -> Tensor:
    """D = rowsum(dO * O) in fp32, laid out as `lse`: what the kernels' backward computes, for a
    caller that does not get it back (the custom ops' registered gradient)."""
    d = (dout.float() * out.float()).sum(dim=-1)  # (batch, rows, heads) or (rows, heads)
    return d.permute(0, 2, 1) if lse.dim() == 3 else d.t()
