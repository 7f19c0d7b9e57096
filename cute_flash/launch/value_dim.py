"""A value head dim of its own (MLA's 192 / 128) for the kernels that take one head dim (the
SM80 forward and backward, the Hopper backward but for MLA's pair): zero columns make the dims
equal, and the extra columns of the results are cut off after. The Hopper forward takes V's
head dim as it is (`HopperTileTraits.head_dim_v`), and the Hopper backward MLA's pair
(`BwdTraits.head_dim_v`, `policy.takes_hopper_bwd_value_dim`)."""
import torch


def one_head_dim(q, k, v):
    """q, k, v with one head dim: v padded with zero columns when it is narrower (the output's
    extra columns are zeros), q and k when it is wider (the scores do not change).
    Differentiable pads, so gradients taken through them are the unpadded tensors'."""
    d, d_v = q.shape[-1], v.shape[-1]
    if d_v < d:
        return q, k, torch.nn.functional.pad(v, (0, d - d_v))
    return torch.nn.functional.pad(q, (0, d_v - d)), torch.nn.functional.pad(k, (0, d_v - d)), v


def value_cols(out, d_v: int):
    """The output's columns of v's head dim (a view, as a padded head dim's are)."""
    return out if out.shape[-1] == d_v else out[..., :d_v]


def padded_backward(bwd, dout, q, k, v, out, lse, dq=None, dk=None, dv=None):
    """`bwd(dout, q, k, v, out, lse)` (a backward launcher, its options bound) on a call whose v
    has a head dim of its own: q and k, or v, out and dout, padded with zero columns to the
    wider dim (the scores, D = rowsum(dO * O) and dS do not change), the gradients cut back to
    their tensors' dims, written into dq / dk / dv where given. Returns (dq, dk, dv, softmax_d)."""
    d, d_v = q.shape[-1], v.shape[-1]
    wide = max(d, d_v)

    def pad(x):  # a tensor already `wide` as it is (a zero-width pad would copy it)
        return x if x.shape[-1] == wide else torch.nn.functional.pad(x, (0, wide - x.shape[-1]))

    gq, gk, gv, dot = bwd(pad(dout), pad(q), pad(k), pad(v), pad(out), lse)
    grads = [grad if given is None else given.copy_(grad)
             for given, grad in zip((dq, dk, dv), (gq[..., :d], gk[..., :d], gv[..., :d_v]))]
    return (*grads, dot)
